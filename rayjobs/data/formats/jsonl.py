"""JSON Lines: one record per ``\\n``-terminated line; a line that is not JSON is one bad row."""

from __future__ import annotations

import json
from collections.abc import Iterator

from rayjobs.data.formats.json_list import _undecodable, _utf8_json
from rayjobs.data.formats.limits import TooLarge, load_row, size_problem
from rayjobs.data.formats.lines import _decode_line, _line_parts
from rayjobs.data.formats.registry import FileOptions, Parsed, Readable, register_format


@register_format("jsonl", (".jsonl",))
def _jsonl(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    for lines in _line_parts(file, chunk_bytes, options.max_row_bytes):
        parsed = Parsed()
        for number, offset, line in lines:
            if isinstance(line, TooLarge):
                problem = size_problem(line, options.max_row_bytes)
                parsed.add_bad(number, "too_large", f"line {number} is {problem}")
                continue
            if not line.strip():
                continue
            text, problem = _decode_line(line, offset)
            if text is None:
                parsed.add_bad(number, "invalid_utf8", f"line {number} is {problem}")
                continue
            try:
                record, reason, problem = load_row(text, options.max_depth)
            except json.JSONDecodeError as error:
                parsed.add_bad(
                    number,
                    "invalid_json",
                    f"line {number} is not valid JSON: {error.msg} (column {error.colno})",
                )
                continue
            if reason is not None:
                parsed.add_bad(number, reason, f"line {number} is {problem}")
                continue
            if ("\\ud" in text or "\\uD" in text) and _utf8_json(record) is None:
                # an escaped lone surrogate ("\ud800"): valid JSON, but no UTF-8 text a
                # tokenizer takes (a .json list's records are refused the same way)
                where = _undecodable(record)
                parsed.add_bad(number, "invalid_utf8", f"line {number}: {where}not valid UTF-8")
                continue
            parsed.rows.append(number)
            parsed.records.append(text)
        yield parsed
