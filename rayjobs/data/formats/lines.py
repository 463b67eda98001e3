"""Lines of a file read in parts: cut at ``\\n`` only, carried across parts, decoded strictly.

JSONL and text files are read ``chunk_bytes`` at a time and cut after the last ``\\n``; the rest of
the line is carried into the next part with its line number and byte offset, so a line may
straddle any number of parts.
"""

from __future__ import annotations

from collections.abc import Iterator

from rayjobs.data.formats.registry import BOM, Readable, _chunks


def _line_parts(file: Readable, chunk_bytes: int) -> Iterator[list[tuple[int, int, bytes]]]:
    """Per chunk of ``file``, the lines it ends: (1-based line number, byte offset in the file,
    line), split at ``\\n`` only, a trailing ``\\r`` dropped, a leading byte order mark skipped. A
    line is carried into the next chunks until its ``\\n``; the last one (maybe empty) ends with
    the file."""
    number, offset = 1, 0  # of the next line
    carried: list[bytes] = []  # the start of the next line

    def numbered(lines: list[bytes]) -> list[tuple[int, int, bytes]]:
        nonlocal number, offset
        out = []
        for line in lines:
            if number == 1 and line.startswith(BOM):
                line = line[len(BOM) :]
                offset += len(BOM)
            out.append((number, offset, line.removesuffix(b"\r")))
            number += 1
            offset += len(line) + 1
        return out

    for chunk in _chunks(file, chunk_bytes):
        if b"\n" not in chunk:
            carried.append(chunk)
            continue
        lines = (b"".join([*carried, chunk]) if carried else chunk).split(b"\n")
        carried = [lines.pop()]  # after the last newline
        yield numbered(lines)
    yield numbered([b"".join(carried)])


def _decode_line(line: bytes, offset: int) -> tuple[str | None, str]:
    """(text, "") or (None, why it is not UTF-8)."""
    try:
        return line.decode("utf-8"), ""
    except UnicodeDecodeError as error:
        return None, f"not valid UTF-8 (byte {offset + error.start} of the file)"
