"""Plain text: one document per line, per blank-line separated paragraph, or per file
(``text_split``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from rayjobs.data.formats.limits import TooLarge, size_problem
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
    limit = options.max_row_bytes
    if options.text_split == "file":  # one record: the file is held whole, up to the limit
        held, size = [], 0
        for chunk in _chunks(file, chunk_bytes):
            size += len(chunk)
            if size > limit:
                held.clear()
            else:
                held.append(chunk)
        if size > limit:
            yield _documents([(1, [], ("too_large", f"the file is {size_problem(size, limit)}"))])
            return
        data = b"".join(held)
        body = data.removeprefix(BOM)
        text, problem = _decode_line(body, len(data) - len(body))
        bad = ("invalid_utf8", f"the file is {problem}") if text is None else None
        yield _documents([(1, [text or ""], bad)])
        return
    # the document being read (it may go on in the next chunk): start line, lines, its bytes,
    # the first bad line's (reason, problem)
    current: list[str] = []
    start, size, bad = 1, 0, None
    for lines in _line_parts(file, chunk_bytes, limit):
        documents: list[tuple[int, list[str], tuple[str, str] | None]] = []
        for number, offset, line in lines:
            large = isinstance(line, TooLarge)
            text, line_problem = (None, "") if large else _decode_line(line, offset)
            if text is not None and not text.strip():
                if current or bad:
                    documents.append((start, current, bad))
                    current, size, bad = [], 0, None
                continue
            if not current and not bad:
                start = number
            size += (int(line) if large else len(line)) + 1
            if bad is None and size - 1 > limit:
                bad = ("too_large", f"the document from line {start} is over max_row_bytes "
                       f"({limit})")  # fmt: skip
            elif bad is None and text is None:
                bad = ("invalid_utf8", f"line {number} is {line_problem}")
            if bad:
                current.clear()
            else:
                current.append(text)
            if options.text_split == "line":
                documents.append((start, current, bad))
                current, size, bad = [], 0, None
        yield _documents(documents)
    yield _documents([(start, current, bad)] if current or bad else [])


def _documents(documents: list[tuple[int, list[str], tuple[str, str] | None]]) -> Parsed:
    """Text documents (start line, lines, and the (reason, problem) of a bad one) as rows."""
    parsed = Parsed()
    for start, lines, bad in documents:
        if bad:
            parsed.add_bad(start, *bad)
        else:
            parsed.rows.append(start)
            parsed.records.append(json.dumps({"text": "\n".join(lines)}, ensure_ascii=False))
    return parsed
