"""Plain text: one document per line, per blank-line separated paragraph, or per file
(``text_split``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from rayjobs.data.formats.lines import _decode_line, _line_parts
from rayjobs.data.formats.registry import (
    BOM,
    FileOptions,
    Parsed,
    Readable,
    _chunks,
    register_format,
)


@register_format("text", (".txt", ".text", ".md"))
def _text(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    if options.text_split == "file":  # one record: the file is held whole
        parsed = Parsed()
        data = b"".join(_chunks(file, chunk_bytes))
        body = data.removeprefix(BOM)
        text, problem = _decode_line(body, len(data) - len(body))
        if text is None:
            parsed.add_bad(1, "invalid_utf8", f"the file is {problem}")
        else:
            parsed.rows.append(1)
            parsed.records.append(json.dumps({"text": text}, ensure_ascii=False))
        yield parsed
        return
    # the document being read (it may go on in the next chunk): start line, lines, the first
    # undecodable line's problem
    current: list[str] = []
    start, problem = 1, ""
    for lines in _line_parts(file, chunk_bytes):
        documents: list[tuple[int, list[str], str]] = []
        for number, offset, line in lines:
            text, line_problem = _decode_line(line, offset)
            if text is not None and not text.strip():
                if current:
                    documents.append((start, current, problem))
                    current, problem = [], ""
                continue
            if not current:
                start = number
            current.append(text or "")
            problem = problem or (f"line {number} is {line_problem}" if text is None else "")
            if options.text_split == "line":
                documents.append((start, current, problem))
                current, problem = [], ""
        yield _documents(documents)
    yield _documents([(start, current, problem)] if current else [])


def _documents(documents: list[tuple[int, list[str], str]]) -> Parsed:
    """Text documents (start line, lines, the first undecodable line's problem) as rows."""
    parsed = Parsed()
    for start, lines, problem in documents:
        if problem:
            parsed.add_bad(start, "invalid_utf8", problem)
        else:
            parsed.rows.append(start)
            parsed.records.append(json.dumps({"text": "\n".join(lines)}, ensure_ascii=False))
    return parsed
