"""CSV files through pyarrow's streaming reader; every cell is text exactly as written.

Nothing is guessed (``007`` stays "007", ``NA`` stays "NA"): type and null guessing turns answers
into numbers or NaN, which a text template cannot tell from the data. The header is read with
Python's ``csv`` (blank lines before it passed over); pyarrow reads from the byte where it ends. A
row must fit in about one block of the reader (pyarrow's limit).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from rayjobs.data.formats.registry import BOM, FileOptions, Parsed, Readable, register_format

CSV_BLOCK_BYTES = 1 << 20
"""Block of pyarrow's streaming CSV reader: ``pyarrow.csv.ReadOptions``' default, the block the
whole-file reader used, so the longest row accepted is unchanged (a row must fit in about a block).
Tests lower it."""


@register_format("csv", (".csv",), late_file_errors=True)
def _csv(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rest, names = _csv_head(file, chunk_bytes)
    if names is None:
        return
    if not rest and not (rest := file.read(chunk_bytes)):
        return  # a header and no rows (pyarrow calls an empty input an error)
    ragged: dict[int, str] = {}

    def on_ragged(row) -> str:
        if row.number is None:  # not known with threaded parsing, which is off below
            raise ValueError(f"a CSV row has {row.actual_columns} fields: {row.text!r:.80}")
        ragged[row.number - 1] = (  # number counts the first row after the header as 1
            f"{row.actual_columns} fields where the header has {row.expected_columns}: "
            f"{row.text!r:.80}"
        )
        return "skip"

    reader = pacsv.open_csv(
        pa.PythonFile(_Joined(rest, file), mode="r"),
        read_options=pacsv.ReadOptions(
            use_threads=False, column_names=names, block_size=CSV_BLOCK_BYTES
        ),
        parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_ragged),
        convert_options=pacsv.ConvertOptions(
            column_types={name: pa.binary() for name in names},  # decoded below, cell by cell
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
            null_values=[],
        ),
    )
    index = 0
    while (batch := _csv_batch(reader, index)) is not None:
        parsed = Parsed()
        columns = [batch.column(name).to_pylist() for name in names]
        for cells in zip(*columns, strict=True):
            while index in ragged:
                parsed.add_bad(index, "ragged_csv_row", ragged.pop(index))
                index += 1
            record = {}
            for name, cell in zip(names, cells, strict=True):
                try:
                    record[name] = cell.decode("utf-8")
                except UnicodeDecodeError as error:
                    problem = f"{error.reason} at byte {error.start} of the value"
                    parsed.add_bad(index, "invalid_utf8", f"field {name!r}: not UTF-8 ({problem})")
                    break
            else:
                parsed.rows.append(index)
                parsed.records.append(json.dumps(record, ensure_ascii=False))
            index += 1
        yield parsed
    parsed = Parsed()
    for row, detail in sorted(ragged.items()):  # ragged rows after the last good one
        parsed.add_bad(row, "ragged_csv_row", detail)
    yield parsed


def _csv_batch(reader, row: int) -> Any:
    """pyarrow's next CSV record batch (None at the end; ``row`` is the next row's number), its
    error for a row longer than a block put into words: pyarrow cannot go on past such a row, so
    the file is refused even under ``skip``."""
    import pyarrow as pa

    try:
        return reader.read_next_batch()
    except StopIteration:
        return None
    except pa.ArrowInvalid as error:
        if "straddl" not in str(error):
            raise
        raise ValueError(
            f"a CSV row (row {row} or a later one) is longer than the CSV reader's block "
            f"({CSV_BLOCK_BYTES:,} bytes; pyarrow needs a row to fit in a block), so the file "
            f"cannot be read past it; store such long values as JSONL or Parquet"
        ) from None


def _csv_head(file: Readable, chunk_bytes: int) -> tuple[bytes, list[str] | None]:
    """(the bytes of a CSV file after its header record, read so far; its column names, None for
    a file with no header: empty or blank lines only): chunks are read until the header record is
    whole. Blank lines before the header are passed over, as pyarrow and pandas do."""
    head, ended = b"", False
    while True:
        chunk = file.read(chunk_bytes)
        ended = not chunk
        head += chunk
        if len(head) < len(BOM) and not ended:
            continue
        data = head.removeprefix(BOM)
        header, end = _csv_header(data, ended)
        if end is not None:
            return data[end:], header


def _csv_header(data: bytes, ended: bool = True) -> tuple[list[str] | None, int | None]:
    """(the column names of a CSV file starting with ``data``, None: no header, the file is empty
    or blank; the offset in ``data`` where the header record ends, None: ``data`` may not hold the
    whole record, which goes on in the next chunk; ``ended`` says ``data`` is the whole file).
    The header's end is a byte offset so that pyarrow reads the rows after it however many lines
    the header spans (a quoted name may hold a newline)."""
    lines = io.BytesIO(data)
    last, end = b"", 0
    past_end = False

    def decoded() -> Iterator[str]:
        nonlocal last, end, past_end
        for line in lines:
            last = line
            end += len(line)
            yield line.decode("utf-8", "surrogateescape")
        past_end = True

    header = next((record for record in csv.reader(decoded()) if record), None)
    if not ended and (past_end or not last.endswith(b"\n")):
        return None, None  # the record may go on in the next chunk
    if header is None:
        return None, end
    try:
        "".join(header).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the header row is not valid UTF-8") from None
    if len(set(header)) != len(header):
        raise ValueError(f"the header row repeats a column name: {header}")
    return header, end


class _Joined(io.RawIOBase):
    """A file read as ``head`` followed by the rest of ``file``; reads return the bytes asked for
    (less only at the end), as a whole-file buffer does, so pyarrow's blocks fall where they did."""

    def __init__(self, head: bytes, file: Readable):
        super().__init__()
        self.head, self.file = head, file

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1, /) -> bytes:
        if size is None or size < 0:
            data, self.head = self.head + self.file.read(), b""
            return data
        parts, self.head = [self.head[:size]], self.head[size:]
        got = len(parts[0])
        while got < size and (part := self.file.read(size - got)):
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
