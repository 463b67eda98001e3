"""Lines of a file read in parts: cut at ``\\n`` only, carried across parts, decoded strictly.

JSONL and text files are read ``chunk_bytes`` at a time and cut after the last ``\\n``; the rest of
the line is carried into the next part with its line number and byte offset, so a line may
straddle any number of parts.
"""

from __future__ import annotations

from collections.abc import Iterator

from rayjobs.data.formats.limits import TooLarge
from rayjobs.data.formats.registry import BOM, Readable, _chunks


def _line_parts(
    file: Readable, chunk_bytes: int, max_bytes: int | None = None
) -> Iterator[list[tuple[int, int, bytes]]]:
    """Per chunk of ``file``, the lines it ends: (1-based line number, byte offset in the file,
    line), split at ``\\n`` only, a trailing ``\\r`` dropped, a leading byte order mark skipped. A
    line is carried into the next chunks until its ``\\n``; the last one (maybe empty) ends with
    the file. A line over ``max_bytes`` is given as its size (``limits.TooLarge``), its bytes
    dropped as they come: a file with no newline is never held whole."""
    number, offset = 1, 0  # of the next line
    carried: list[bytes] = []  # the start of the next line
    held = 0  # its bytes so far (kept or not)
    limit = max_bytes if max_bytes is not None else -1

    def numbered(lines: list[bytes]) -> list[tuple[int, int, bytes]]:
        nonlocal number, offset
        out = []
        for line in lines:
            if number == 1 and not isinstance(line, TooLarge) and line.startswith(BOM):
                line = line[len(BOM) :]
                offset += len(BOM)
            large = isinstance(line, TooLarge)
            out.append((number, offset, line if large else line.removesuffix(b"\r")))
            number += 1
            offset += (int(line) if large else len(line)) + 1
        return out

    def sized(line: bytes, size: int) -> bytes:
        return TooLarge(size) if 0 <= limit < size else line

    for chunk in _chunks(file, chunk_bytes):
        if b"\n" not in chunk:
            held += len(chunk)
            if 0 <= limit < held:
                carried.clear()
            else:
                carried.append(chunk)
            continue
        lines = chunk.split(b"\n")
        first = lines[0]
        size = held + len(first)
        lines[0] = sized(b"".join([*carried, first]) if size <= limit or limit < 0 else b"", size)
        lines = [lines[0], *(sized(line, len(line)) for line in lines[1:])]
        last = lines.pop()  # after the last newline
        held = int(last) if isinstance(last, TooLarge) else len(last)
        carried = [] if isinstance(last, TooLarge) else [last]
        yield numbered(lines)
    yield numbered([sized(b"".join(carried), held)])


def _decode_line(line: bytes, offset: int) -> tuple[str | None, str]:
    """(text, "") or (None, why it is not UTF-8)."""
    try:
        return line.decode("utf-8"), ""
    except UnicodeDecodeError as error:
        return None, f"not valid UTF-8 (byte {offset + error.start} of the file)"
