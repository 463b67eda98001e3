"""File formats: one file → (row numbers, records as JSON object strings), part by part. No Ray.

Each format is a parser in the :data:`FORMATS` registry with the file extensions it claims;
``config`` infers a dataset's format from its files' extensions through it and validates
``datasets[].format`` against it, and ``sources`` (the Ray side) calls :func:`read_rows` once per
file. Row numbers are what an error message shows: the 0-based record index in a JSON list, Parquet
or CSV file; the 1-based line number in JSONL and text files (a paragraph's first line).
``format: hf`` (Hugging Face datasets) is not a file format and is read by ``sources``.

Bad rows. A parser never stops at a bad row: it returns it as a :class:`BadRow` (row, reason,
detail) next to the good ones, and :func:`read_rows` (:func:`parse_rows` for bytes in memory)
applies the dataset's ``on_bad_row``: ``error`` raises :class:`SourceError` naming dataset, file,
row and reason; ``skip`` hands the bad rows on, so that the read task emits them as rows with a
``_skip`` reason and the Tokenize actor, which reports to the run's ledger, counts them (read tasks
have no ledger: every count has one home). The reasons a row can be skipped for are
:data:`SKIP_REASONS`.

Design note: what is a bad row, and why (what HF datasets / TRL / Axolotl users expect).

- Bytes are decoded explicitly, UTF-8, strict, never with replacement characters: a U+FFFD
  silently trained on is worse than a counted skip. JSONL and text are decoded line by line, so
  one bad byte makes one bad row (``invalid_utf8``), not a failed file. A UTF-8 byte order mark at
  the start of a file is dropped.
- JSONL lines end at ``\\n`` only (a trailing ``\\r`` is dropped), as the JSON Lines format says:
  ``str.splitlines`` would also split at U+2028, U+0085 and other characters that are valid inside
  a JSON string. A line that is not valid JSON (a torn write, a truncated file) is
  ``invalid_json``; blank lines are not rows.
- CSV cells are text exactly as written: every column is read as a string, nothing is guessed
  (``007`` stays "007", ``NA``/``null``/an empty cell stay "NA"/"null"/""). Type and null guessing
  (pandas, and so HF datasets' csv loader) turns answers into numbers or NaN, which a text template
  cannot tell from the data. Values may span lines inside quotes. A row whose field count differs
  from the header's is ``ragged_csv_row`` (its row index counts it, so later rows keep theirs).
- Parquet (and HF) ``binary`` columns are refused unless the dataset sets ``binary: utf8``:
  ``str(b"...")`` would train on the text ``b'...'``; bytes are either text in an unknown
  encoding or not text at all, which only the user knows. With ``utf8`` a value that does not
  decode is ``invalid_utf8``.
- A JSON list file is one JSON value: if it is not valid JSON the file is an error under either
  policy (its rows cannot be told apart; JSONL can skip one line).

Design note: bounded memory. A file is read a part at a time, never whole (:func:`read_rows`, the
read task's path): a parser takes an open file and yields one :class:`Parsed` per part, in row
order, so a read task holds a part (about :data:`CHUNK_BYTES` of file, what it parses to and its
tables), not the file, whatever the file's size. Every parser gives the same rows, row numbers,
records, skip reasons and messages however the file is cut (``tests/test_chunked_read.py`` reads
each format in parts of a few bytes against whole files); :func:`parse_rows` is the same parsers
over bytes already in memory, the parts merged.

- JSONL and text files are read :data:`CHUNK_BYTES` at a time and cut after the last ``\\n``; the
  rest of the line is carried into the next part, with its line number and byte offset, so a line
  (or a text paragraph, whose state is carried too) may straddle any number of parts. A line
  longer than :data:`CHUNK_BYTES` is held whole.
- A JSON list is parsed element by element (the ``json`` module's own scanner, the one
  ``json.loads`` uses, over a sliding window of the decoded text; see :func:`_json`), so its
  records, and where a syntax error is reported (line and column), are those of ``json.loads`` on
  the whole text. A top-level object (one record) is held whole, and so is the rest of a file
  whose next element is not valid JSON (it may only be cut by the window) before its error.
- Parquet files are read in record batches of about :data:`CHUNK_BYTES` (rows estimated from the
  row groups' sizes, at most :data:`PARQUET_BATCH_ROWS`); this needs a seekable file
  (``sources`` opens Parquet files for random access; a stream that cannot seek is read whole).
- CSV files go through pyarrow's streaming CSV reader in blocks of :data:`CSV_BLOCK_BYTES`, the
  block ``pyarrow.csv.read_csv`` uses by default and so the one whole-file reading used: a row must
  fit in about a block (pyarrow's limit), as before. The header is read with Python's ``csv``
  from the first part (as many parts as it spans; blank lines before it are passed over), and
  pyarrow reads from the byte where it ends (a quoted name may span lines).
- Under ``on_bad_row: error`` the first bad row stops the read, as before. Where the whole file can
  still be refused after a bad row (a JSON list's syntax, a CSV block or Parquet page pyarrow
  cannot read: :attr:`Format.late_file_errors`) the rest of the file is read first (nothing more is
  handed on), so that the error is the one whole-file parsing gave. Either way the rows of earlier
  parts have been handed on by then (whole-file parsing handed on none): the read fails all the
  same. So does a file error after some parts under ``skip`` (a JSON list torn at its end).
- A text file with ``text_split: file`` is one record, so it is held whole.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

SKIP_REASONS = (
    "invalid_json",  # formats: a JSONL line that is not valid JSON
    "invalid_utf8",  # formats: a line, cell or binary value that is not UTF-8
    "ragged_csv_row",  # formats: a CSV row with more or fewer fields than the header
    "wrong_type",  # templates: a field (or the row) of the wrong type, e.g. a number for text
    "missing_field",  # templates: a required field absent or null
    "empty_field",  # templates: a required text field empty or whitespace
    "template_error",  # tokenize: a template or the chat template raised on the row
)
"""Why a row was skipped under ``on_bad_row: skip``: the keys of ``skipped_by_reason``."""

BOM = b"\xef\xbb\xbf"


class SourceError(ValueError):
    """A file or row that cannot be parsed; names dataset, file and (where known) row."""


@dataclass(frozen=True)
class BadRow:
    """A row a parser could not turn into a record."""

    row: int
    reason: str
    """One of :data:`SKIP_REASONS`."""
    detail: str
    """What is wrong, for a person (the field where known); one line."""


CHUNK_BYTES = 16 << 20
"""Bytes of a file read and parsed at a time (JSON, JSONL and text files; Parquet batches are sized
to about as many bytes): what bounds a read task's memory, whatever the file's size (module note).
Tests lower it; :func:`read_rows` takes another per call."""

CSV_BLOCK_BYTES = 1 << 20
"""Block of pyarrow's streaming CSV reader: ``pyarrow.csv.ReadOptions``' default, the block the
whole-file reader used, so the longest row accepted is unchanged (a row must fit in about a block).
Tests lower it."""

PARQUET_BATCH_ROWS = 16384
"""Most rows of a Parquet record batch (batches are otherwise sized to :data:`CHUNK_BYTES`)."""


class Readable(Protocol):
    """A file open for reading: a ``pyarrow.NativeFile`` (what Ray's read tasks get) or a Python
    binary file. Parquet needs it seekable (else it is read whole)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def seekable(self) -> bool: ...


@dataclass
class Parsed:
    """One file, or one part of it, parsed: its good rows (numbers and records as JSON object
    strings) and its bad rows."""

    rows: list[int] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)

    def add_bad(self, row: int, reason: str, detail: str) -> None:
        self.bad.append(BadRow(row, reason, detail.replace("\n", "\\n")))

    def extend(self, other: Parsed) -> None:
        self.rows += other.rows
        self.records += other.records
        self.bad += other.bad


@dataclass(frozen=True)
class FileOptions:
    """A dataset's settings that a parser reads (``DatasetConfig`` fields of the same names)."""

    text_split: str = "paragraph"
    binary: str = "error"


Parser = Callable[[Readable, FileOptions, int], Iterator[Parsed]]
"""(open file, options, chunk bytes) → the file's good and bad rows, one :class:`Parsed` per part,
in row order; raises ValueError when the whole file is bad."""


@dataclass(frozen=True)
class Format:
    """A registered file format."""

    name: str
    extensions: tuple[str, ...]
    """File suffixes (with the dot) that mean this format when ``format`` is not set."""
    read: Parser
    late_file_errors: bool = False
    """Whether the whole file can still be refused (ValueError) after a part with a bad row."""

    def parse(self, data: bytes, options: FileOptions) -> Parsed:
        """(file bytes, options) → good and bad rows: every part merged."""
        import pyarrow as pa

        parsed = Parsed()
        for part in self.read(pa.BufferReader(data), options, CHUNK_BYTES):
            parsed.extend(part)
        return parsed


FORMATS: dict[str, Format] = {}
"""File formats by name; config validation and extension inference read this registry."""

HF = "hf"
"""The ``format`` of a Hugging Face dataset (a Hub name or a ``save_to_disk`` folder)."""


def hf_label(source: object, split: str) -> str:
    """What a Hugging Face dataset's rows carry as their ``_path`` (and bad-row messages name):
    its source and split."""
    return f"{source}[{split}]"


HF_PLACE = "hf"
"""A Hugging Face dataset's place in its dataset, for sample uids and subsamples: its rows'
``_path`` (``hf_label``) holds its source, an absolute folder for a saved dataset, and the same
data elsewhere must get the same uids and subsample, as a file dataset's do."""


def register_format(name: str, extensions: tuple[str, ...] = (), *, late_file_errors: bool = False):
    """Decorator: register ``read(file, options, chunk_bytes) -> Iterator[Parsed]`` (a
    :data:`Parser`) as file format ``name``."""

    def register(read: Parser):
        if name in FORMATS or name == HF:
            raise ValueError(f"file format {name!r} is already registered")
        claimed = {ext for fmt in FORMATS.values() for ext in fmt.extensions} & set(extensions)
        if claimed:
            raise ValueError(f"extensions {sorted(claimed)} already belong to another format")
        FORMATS[name] = Format(name, tuple(extensions), read, late_file_errors)
        return read

    return register


COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")
"""Extensions of compressed files: those pyarrow's ``Codec.detect`` names a codec for, which
``sources.open_row_file`` decompresses (``rows.jsonl.gz`` is a JSONL file)."""


def without_compression(path: str) -> str:
    """``path`` less its compression suffix, if any (``rows.jsonl.gz`` → ``rows.jsonl``)."""
    compressed = next((suffix for suffix in COMPRESSED_SUFFIXES if path.endswith(suffix)), "")
    return path.removesuffix(compressed)


def format_of(path: str) -> str | None:
    """The registered format that claims ``path``'s extension (under a compression suffix), if
    any."""
    path = without_compression(path)
    for fmt in FORMATS.values():
        if any(path.endswith(ext) for ext in fmt.extensions):
            return fmt.name
    return None


def bad_row_place(dataset: str, path: str, row: int, detail: str) -> str:
    """Where a bad row is and what is wrong with it: the start of every bad-row message and
    ``skipped_examples`` entry."""
    return f"dataset {dataset!r}, file {path}, row {row}: {detail}"


def bad_row_error(place: str, reason: str, fix: str = "Fix the data") -> str:
    """The message of a bad row under ``on_bad_row: error``."""
    return f"{place} [{reason}]. {fix}, or set on_bad_row: skip to skip and count such rows."


def read_rows(
    file: Readable,
    path: str,
    *,
    format: str,
    dataset: str,
    text_split: str = "paragraph",
    binary: str = "error",
    on_bad_row: str = "error",
    chunk_bytes: int | None = None,
) -> Iterator[Parsed]:
    """One open file → its good rows and (under ``on_bad_row: skip``) bad rows, a part at a time
    (about ``chunk_bytes``, default :data:`CHUNK_BYTES`, of file each): what a read task runs.

    Raises:
        SourceError: under ``on_bad_row: error``, for the file's first bad row, naming dataset,
            file, row and reason; under either policy, for a file that cannot be parsed at all
            (see module note for when rows were handed on before).
    """
    fmt = FORMATS[format]
    options = FileOptions(text_split=text_split, binary=binary)
    parts = _named(fmt.read(file, options, chunk_bytes or CHUNK_BYTES), dataset, path)
    for part in parts:
        if part.bad and on_bad_row == "error":
            if fmt.late_file_errors:
                for _ in parts:  # a file that cannot be parsed is reported as such, as before
                    pass
            apply_policy(part, dataset=dataset, path=path, on_bad_row=on_bad_row)
        if part.rows or part.bad:
            yield part


def _named(parts: Iterator[Parsed], dataset: str, path: str) -> Iterator[Parsed]:
    """``parts``, with a file's ValueError as a SourceError naming dataset and file."""
    try:
        yield from parts
    except ValueError as error:
        raise SourceError(f"dataset {dataset!r}, file {path}: {error}") from None


def parse_rows(
    data: bytes,
    path: str,
    *,
    format: str,
    dataset: str,
    text_split: str = "paragraph",
    binary: str = "error",
    on_bad_row: str = "error",
) -> Parsed:
    """One file's bytes → good rows and (under ``on_bad_row: skip``) bad rows; see module note.

    Raises:
        SourceError: under ``on_bad_row: error``, for the file's first bad row, naming dataset,
            file, row and reason; under either policy, for a file that cannot be parsed at all.
    """
    try:
        parsed = FORMATS[format].parse(data, FileOptions(text_split=text_split, binary=binary))
    except ValueError as error:
        raise SourceError(f"dataset {dataset!r}, file {path}: {error}") from None
    return apply_policy(parsed, dataset=dataset, path=path, on_bad_row=on_bad_row)


def apply_policy(parsed: Parsed, *, dataset: str, path: str, on_bad_row: str) -> Parsed:
    """``parsed`` as is under ``skip``; under ``error``, a SourceError for its first bad row."""
    if parsed.bad and on_bad_row == "error":
        first = min(parsed.bad, key=lambda bad: bad.row)
        place = bad_row_place(dataset, path, first.row, first.detail)
        raise SourceError(bad_row_error(place, first.reason))
    return parsed


def parse_file(
    data: bytes,
    path: str,
    *,
    format: str,
    dataset: str,
    text_split: str = "paragraph",
    binary: str = "error",
    on_bad_row: str = "error",
) -> tuple[list[int], list[str]]:
    """The good rows of one file, ``(row numbers, records)``: :func:`parse_rows` for callers that
    only need records (the driver's length estimate, the benches). Under ``skip`` the bad rows are
    left out uncounted; the read path counts them (``sources.RowFileDatasource``)."""
    parsed = parse_rows(
        data,
        path,
        format=format,
        dataset=dataset,
        text_split=text_split,
        binary=binary,
        on_bad_row=on_bad_row,
    )
    return parsed.rows, parsed.records


def _chunks(file: Readable, chunk_bytes: int) -> Iterator[bytes]:
    """``file`` read ``chunk_bytes`` at a time, to its end."""
    while chunk := file.read(chunk_bytes):
        yield chunk


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


@register_format("parquet", (".parquet",), late_file_errors=True)
def _parquet(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not file.seekable():  # Parquet's footer is at the end of the file
        file = pa.BufferReader(file.read())
    parquet = pq.ParquetFile(file)
    check_binary(parquet.schema_arrow, options.binary)
    meta = parquet.metadata
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    # rows of about chunk_bytes, by the row groups' sizes; encoded sizes (a dictionary-encoded
    # column is small) can be far below decoded ones, hence the cap
    batch_rows = min(max(1, chunk_bytes * meta.num_rows // max(1, size)), PARQUET_BATCH_ROWS)
    start = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, use_threads=False):
        rows = list(range(start, start + batch.num_rows))
        start += batch.num_rows
        yield table_records(pa.Table.from_batches([batch]), rows, options.binary)


def binary_columns(schema) -> list[str]:
    """Columns of an Arrow schema that hold bytes (at any depth: a list of binary counts)."""
    return [f.name for f in schema if _holds_binary(f.type)]


def _holds_binary(arrow_type) -> bool:
    import pyarrow as pa

    checks = ("is_binary", "is_large_binary", "is_fixed_size_binary", "is_binary_view")
    if any(getattr(pa.types, check, lambda _: False)(arrow_type) for check in checks):
        return True
    if pa.types.is_dictionary(arrow_type):  # e.g. a pandas categorical of bytes
        return _holds_binary(arrow_type.value_type)
    return any(_holds_binary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def check_binary(schema, binary: str) -> list[str]:
    """The binary columns of an Arrow schema, to be decoded as UTF-8 (``binary: utf8``).

    Raises:
        ValueError: a binary column under ``binary: error``.
    """
    decode = binary_columns(schema)
    if decode and binary != "utf8":
        raise ValueError(
            f"column(s) {decode} hold binary (bytes) values, not text; set the dataset's "
            f"binary: utf8 to decode them as UTF-8 text, or store them as string columns"
        )
    return decode


def table_records(table, rows: list[int], binary: str) -> Parsed:
    """An Arrow table's rows as records (Parquet files and Hugging Face datasets); ``rows`` are
    their row numbers. Binary columns are refused, or decoded as UTF-8 with ``binary: utf8`` (see
    module note); other non-JSON values (timestamps, decimals) become their ``str``. A string
    column holding bytes that are not UTF-8 (Arrow does not check what writers put there) is
    decoded row by row too, so those rows are ``invalid_utf8`` bad rows, not a failed file.

    Raises:
        ValueError: a binary column under ``binary: error``.
    """
    import pyarrow as pa

    decode = check_binary(table.schema, binary)
    try:
        records = table.to_pylist()
    except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8 (a bad writer)
        table = table.cast(pa.schema([f.with_type(_as_binary(f.type)) for f in table.schema]))
        decode = binary_columns(table.schema)  # decoded row by row: a bad row is skippable
        records = table.to_pylist()
    parsed = Parsed()
    for row, record in zip(rows, records, strict=True):
        try:
            for name in decode:
                record[name] = _decoded(record[name])
        except UnicodeDecodeError as error:
            parsed.add_bad(row, "invalid_utf8", f"field {name!r}: not valid UTF-8 ({error.reason})")
            continue
        parsed.rows.append(row)
        parsed.records.append(json.dumps(record, ensure_ascii=False, default=_json_str))
    return parsed


def _as_binary(arrow_type):
    """``arrow_type`` with its strings, at any depth, as binary (the same bytes, not checked)."""
    import pyarrow as pa

    if pa.types.is_string(arrow_type):
        return pa.binary()
    if pa.types.is_large_string(arrow_type):
        return pa.large_binary()
    if pa.types.is_map(arrow_type):
        return pa.map_(_as_binary(arrow_type.key_type), _as_binary(arrow_type.item_type))
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        field = arrow_type.value_field
        kind = pa.list_ if pa.types.is_list(arrow_type) else pa.large_list
        return kind(field.with_type(_as_binary(field.type)))
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_as_binary(field.type)) for field in arrow_type])
    if pa.types.is_dictionary(arrow_type):
        return pa.dictionary(arrow_type.index_type, _as_binary(arrow_type.value_type))
    return arrow_type


def _json_str(value: Any) -> str:
    """A value JSON has no type for, as text (a timestamp, a decimal); bytes are never made text
    (``str`` would give ``"b'...'"``): a binary column that :func:`binary_columns` missed fails
    loudly."""
    if isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"a binary value {bytes(value)[:20]!r} in a column not known to be binary")
    return str(value)


def _decoded(value: Any) -> Any:
    """``value`` with every bytes inside it decoded as strict UTF-8."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):  # a map's entries come as (key, value) tuples
        return [_decoded(item) for item in value]
    return value


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


@register_format("json", (".json",), late_file_errors=True)
def _json(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    """A JSON list element by element: ``json.loads``' own steps (the C scanner for each value, the
    array and whitespace rules of ``json.decoder``) over a window of the decoded text, so records
    and errors (message, line, column) are those of ``json.loads`` on the whole file. A value is
    taken once the characters the scanner may look at after it are in the window (a number could
    go on); a value that fails is tried again with more text, until the file has ended (the
    failure may be the window's edge). A list's own errors (a missing or trailing comma) are put
    into words by ``json.loads`` itself, on the few characters at fault. Undecodable bytes become
    lone surrogates, so the file still parses and the records holding them can be skipped one by
    one (bytes outside strings make the JSON invalid)."""
    text = _JsonText(file, chunk_bytes)
    scan = json.JSONDecoder().scan_once
    parsed, row, state, single = Parsed(), 0, "start", ()
    while True:
        buf, at, more = text.buf, text.at, False
        if state == "start":
            if not buf and not text.ended:
                more = True
            elif text.base == 0 and at == 0 and buf.startswith("\ufeff"):
                raise text.error("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0)
            else:
                text.at = at = _WS(buf, at).end()
                if at == len(buf) and not text.ended:
                    more = True
                elif at == len(buf):  # empty, or whitespace only: no rows (config calls it empty)
                    break
                elif buf.startswith("[", at):
                    text.at, state = at + 1, "first"
                else:
                    state = "single"
        elif state == "first":  # after "["
            text.at = at = _WS(buf, at).end()
            if at == len(buf) and not text.ended:
                more = True
            elif buf.startswith("]", at):
                text.at, state = at + 1, "trailing"
            else:
                state = "element"
        elif state == "comma":  # at a "," after an element
            after = _WS(buf, at + 1).end()
            if after == len(buf) and not text.ended:
                more = True
            elif buf.startswith("]", after):  # a trailing comma
                raise text.list_error(at, after + 1)
            else:
                text.at, state = after, "element"
        elif state in ("element", "single"):
            scanned = text.scan(scan, at)
            if scanned is None:
                more = True
            elif state == "single":
                single, text.at, state = (scanned[0],), scanned[1], "trailing"
            else:
                value, end = scanned
                after = _WS(buf, end).end()
                if after == len(buf) and not text.ended:
                    more = True
                elif buf.startswith(("]", ","), after):
                    _json_record(parsed, row, value)
                    row += 1
                    if buf[after] == "]":
                        text.at, state = after + 1, "trailing"
                    else:
                        text.at, state = after, "comma"
                else:
                    raise text.list_error(end, after + 1)
        elif state == "trailing":
            text.at = at = _WS(buf, at).end()
            if at < len(buf):
                raise text.error("Extra data", at)
            if text.ended:
                break
            more = True
        if more:
            if parsed.rows or parsed.bad:
                yield parsed
                parsed = Parsed()
            text.more()
    if single:
        [records] = single
        if isinstance(records, dict):
            records = [records]
        if not isinstance(records, list):
            raise ValueError("a .json file must hold a list of records")
        for row, record in enumerate(records):
            _json_record(parsed, row, record)
    yield parsed


_WS = re.compile(r"[ \t\n\r]*").match
"""Whitespace as ``json.decoder`` skips it."""


class _JsonText:
    """The window of a JSON file's decoded text that :func:`_json` parses: ``buf`` from character
    ``base`` of the file; ``at``, where parsing stands in it (what is before is done)."""

    def __init__(self, file: Readable, chunk_bytes: int):
        self.file, self.chunk_bytes = file, chunk_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf, self.at, self.base, self.ended = "", 0, 0, False
        self.lines, self.line_start = 0, -1  # newlines before base; the last one's position
        self.started = False  # a leading byte order mark looked for

    def more(self) -> None:
        """Drop what is done, and decode more of the file (at least as much as is held, so that a
        long value is not scanned once per chunk)."""
        done = self.buf[: self.at]
        if (newlines := done.count("\n")) > 0:
            self.lines += newlines
            self.line_start = self.base + done.rindex("\n")
        self.base += self.at
        self.buf, self.at = self.buf[self.at :], 0
        data = self.file.read(max(self.chunk_bytes, len(self.buf)))
        self.ended = not data
        if not self.started:
            while len(data) < len(BOM) and (piece := self.file.read(self.chunk_bytes)):
                data += piece
            data, self.started = data.removeprefix(BOM), True
        self.buf += self.decoder.decode(data, final=self.ended)

    def scan(self, scan, at: int) -> tuple[Any, int] | None:
        """The value at ``at`` and where it ends, or None: more text is needed to tell."""
        try:
            value, end = scan(self.buf, at)
        except StopIteration as stop:
            if not self.ended:
                return None
            raise self.error("Expecting value", stop.value) from None
        except json.JSONDecodeError as error:
            if not self.ended:
                return None
            raise self.error(error.msg, error.pos) from None
        if not self.ended and (
            end == len(self.buf) or (type(value) in (int, float) and end + 3 > len(self.buf))
        ):
            return None  # "1e" at the window's edge may go on ("1e+5": the scanner looks 3 ahead)
        return value, end

    def list_error(self, start: int, stop: int) -> ValueError:
        """The error of a list whose element ends at ``start`` and whose text goes on, wrongly, to
        ``stop``: what ``json.loads`` says of it (its wording differs between Python versions)."""
        try:
            json.loads("[0" + self.buf[start:stop])
        except json.JSONDecodeError as error:
            return self.error(error.msg, start + error.pos - 2)
        raise AssertionError(f"valid JSON list text: {self.buf[start:stop]!r}")

    def error(self, message: str, at: int) -> ValueError:
        """The file's error for ``json.loads``' ``message`` at ``at`` in the window."""
        newline = self.buf.rfind("\n", 0, at)
        line = self.lines + self.buf.count("\n", 0, at) + 1
        column = at - newline if newline >= 0 else self.base + at - self.line_start
        hint = " (one object per line? set format: jsonl)" if message == "Extra data" else ""
        return ValueError(
            f"not valid JSON at line {line}, column {column}: {message}{hint}; "
            f"a .json file is parsed whole, so on_bad_row cannot skip part of it"
        )


def _json_record(parsed: Parsed, row: int, record: Any) -> None:
    dumped = _utf8_json(record)
    if dumped is None:
        parsed.add_bad(row, "invalid_utf8", f"{_undecodable(record)}not valid UTF-8")
        return
    parsed.rows.append(row)
    parsed.records.append(dumped)


def _utf8_json(record: Any) -> str | None:
    """A parsed JSON value as JSON text, or None when its text is not all UTF-8 (a lone surrogate
    such as ``"\\ud800"``, which JSON can escape but no UTF-8 text holds)."""
    dumped = json.dumps(record, ensure_ascii=False)
    try:
        dumped.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return dumped


def _undecodable(record: Any) -> str:
    """``"field 'x': "`` for the first top-level field of a record that holds undecodable text."""
    if isinstance(record, dict):
        for key, value in record.items():
            if _utf8_json({key: value}) is None:
                return f"field {key!r}: "
    return ""


@register_format("jsonl", (".jsonl",))
def _jsonl(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    for lines in _line_parts(file, chunk_bytes):
        parsed = Parsed()
        for number, offset, line in lines:
            if not line.strip():
                continue
            text, problem = _decode_line(line, offset)
            if text is None:
                parsed.add_bad(number, "invalid_utf8", f"line {number} is {problem}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                parsed.add_bad(
                    number,
                    "invalid_json",
                    f"line {number} is not valid JSON: {error.msg} (column {error.colno})",
                )
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
