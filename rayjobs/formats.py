"""File formats: one file's bytes → (row numbers, records as JSON object strings). No Ray.

Each format is a parser in the :data:`FORMATS` registry with the file extensions it claims;
``config`` infers a dataset's format from its files' extensions through it and validates
``datasets[].format`` against it, and ``sources`` (the Ray side) calls :func:`parse_rows` once per
file. Row numbers are what an error message shows: the 0-based record index in a JSON list, Parquet
or CSV file; the 1-based line number in JSONL and text files (a paragraph's first line).
``format: hf`` (Hugging Face datasets) is not a file format and is read by ``sources``.

Bad rows. A parser never stops at a bad row: it returns it as a :class:`BadRow` (row, reason,
detail) next to the good ones, and :func:`parse_rows` applies the dataset's ``on_bad_row``:
``error`` raises :class:`SourceError` naming dataset, file, row and reason; ``skip`` hands the bad
rows on, so that the read task emits them as rows with a ``_skip`` reason and the Tokenize actor,
which reports to the run's ledger, counts them (read tasks have no ledger: every count has one
home). The reasons a row can be skipped for are :data:`SKIP_REASONS`.

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
- A JSON list file is parsed whole: if it is not valid JSON the file is an error under either
  policy (its rows cannot be told apart; JSONL can skip one line).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class Parsed:
    """One file parsed: its good rows (numbers and records as JSON object strings) and its bad
    rows."""

    rows: list[int] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)

    def add_bad(self, row: int, reason: str, detail: str) -> None:
        self.bad.append(BadRow(row, reason, detail.replace("\n", "\\n")))


@dataclass(frozen=True)
class FileOptions:
    """A dataset's settings that a parser reads (``DatasetConfig`` fields of the same names)."""

    text_split: str = "paragraph"
    binary: str = "error"


@dataclass(frozen=True)
class Format:
    """A registered file format."""

    name: str
    extensions: tuple[str, ...]
    """File suffixes (with the dot) that mean this format when ``format`` is not set."""
    parse: Callable[[bytes, FileOptions], Parsed]
    """(file bytes, options) → good and bad rows; raises ValueError when the whole file is bad."""


FORMATS: dict[str, Format] = {}
"""File formats by name; config validation and extension inference read this registry."""

HF = "hf"
"""The ``format`` of a Hugging Face dataset (a Hub name or a ``save_to_disk`` folder)."""


def register_format(name: str, extensions: tuple[str, ...] = ()):
    """Decorator: register ``parse(data, options) -> Parsed`` as file format ``name``."""

    def register(parse: Callable[[bytes, FileOptions], Parsed]):
        if name in FORMATS or name == HF:
            raise ValueError(f"file format {name!r} is already registered")
        claimed = {ext for fmt in FORMATS.values() for ext in fmt.extensions} & set(extensions)
        if claimed:
            raise ValueError(f"extensions {sorted(claimed)} already belong to another format")
        FORMATS[name] = Format(name, tuple(extensions), parse)
        return parse

    return register


def format_of(path: str) -> str | None:
    """The registered format that claims ``path``'s extension, if any."""
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


def _lines(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset in the file, line) for every line: split at ``\\n``
    only, a trailing ``\\r`` dropped, a leading byte order mark skipped."""
    offset = len(BOM) if data.startswith(BOM) else 0
    for number, line in enumerate(data[offset:].split(b"\n"), start=1):
        yield number, offset, line.removesuffix(b"\r")
        offset += len(line) + 1


def _decode_line(line: bytes, offset: int) -> tuple[str | None, str]:
    """(text, "") or (None, why it is not UTF-8)."""
    try:
        return line.decode("utf-8"), ""
    except UnicodeDecodeError as error:
        return None, f"not valid UTF-8 (byte {offset + error.start} of the file)"


@register_format("parquet", (".parquet",))
def _parquet(data: bytes, options: FileOptions) -> Parsed:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(data))
    return table_records(table, list(range(table.num_rows)), options.binary)


def binary_columns(schema) -> list[str]:
    """Columns of an Arrow schema that hold bytes (at any depth: a list of binary counts)."""
    return [f.name for f in schema if _holds_binary(f.type)]


def _holds_binary(arrow_type) -> bool:
    import pyarrow as pa

    checks = ("is_binary", "is_large_binary", "is_fixed_size_binary", "is_binary_view")
    if any(getattr(pa.types, check, lambda _: False)(arrow_type) for check in checks):
        return True
    return any(_holds_binary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def table_records(table, rows: list[int], binary: str) -> Parsed:
    """An Arrow table's rows as records (Parquet files and Hugging Face datasets); ``rows`` are
    their row numbers. Binary columns are refused, or decoded as UTF-8 with ``binary: utf8`` (see
    module note); other non-JSON values (timestamps, decimals) become their ``str``.

    Raises:
        ValueError: a binary column under ``binary: error``.
    """
    decode = binary_columns(table.schema)
    if decode and binary != "utf8":
        raise ValueError(
            f"column(s) {decode} hold binary (bytes) values, not text; set the dataset's "
            f"binary: utf8 to decode them as UTF-8 text, or store them as string columns"
        )
    parsed = Parsed()
    for row, record in zip(rows, table.to_pylist(), strict=True):
        try:
            for name in decode:
                record[name] = _decoded(record[name])
        except UnicodeDecodeError as error:
            parsed.add_bad(row, "invalid_utf8", f"field {name!r}: not valid UTF-8 ({error.reason})")
            continue
        parsed.rows.append(row)
        parsed.records.append(json.dumps(record, ensure_ascii=False, default=str))
    return parsed


def _decoded(value: Any) -> Any:
    """``value`` with every bytes inside it decoded as strict UTF-8."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


@register_format("csv", (".csv",))
def _csv(data: bytes, options: FileOptions) -> Parsed:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    data = data.removeprefix(BOM)
    names = _csv_header(data)
    if names is None:
        return Parsed()
    ragged: dict[int, str] = {}

    def on_ragged(row) -> str:
        if row.number is None:  # not known with threaded parsing, which is off below
            raise ValueError(f"a CSV row has {row.actual_columns} fields: {row.text!r:.80}")
        ragged[row.number - 2] = (  # number counts the header as row 1
            f"{row.actual_columns} fields where the header has {row.expected_columns}: "
            f"{row.text!r:.80}"
        )
        return "skip"

    table = pacsv.read_csv(
        pa.BufferReader(data),
        read_options=pacsv.ReadOptions(use_threads=False, column_names=names, skip_rows=1),
        parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_ragged),
        convert_options=pacsv.ConvertOptions(
            column_types={name: pa.binary() for name in names},  # decoded below, cell by cell
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
            null_values=[],
        ),
    )
    parsed = Parsed()
    index = 0
    columns = [table.column(name).to_pylist() for name in names]
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
    for row, detail in sorted(ragged.items()):  # ragged rows after the last good one
        parsed.add_bad(row, "ragged_csv_row", detail)
    return parsed


def _csv_header(data: bytes) -> list[str] | None:
    """The column names of a CSV file (None: no header, an empty file)."""
    lines = (line.decode("utf-8", "surrogateescape") for line in io.BytesIO(data))
    header = next(csv.reader(lines), None)
    if header is None:
        return None
    try:
        "".join(header).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the header row is not valid UTF-8") from None
    if len(set(header)) != len(header):
        raise ValueError(f"the header row repeats a column name: {header}")
    return header


@register_format("json", (".json",))
def _json(data: bytes, options: FileOptions) -> Parsed:
    # Undecodable bytes become lone surrogates, so the file still parses and the records holding
    # them can be skipped one by one (bytes outside strings make the JSON invalid).
    text = data.removeprefix(BOM).decode("utf-8", "surrogateescape")
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        hint = " (one object per line? set format: jsonl)" if "Extra data" in str(error) else ""
        raise ValueError(
            f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}{hint}; "
            f"a .json file is parsed whole, so on_bad_row cannot skip part of it"
        ) from None
    if isinstance(records, dict):
        records = [records]
    if not isinstance(records, list):
        raise ValueError("a .json file must hold a list of records")
    parsed = Parsed()
    for row, record in enumerate(records):
        dumped = json.dumps(record, ensure_ascii=False)
        try:
            dumped.encode("utf-8")
        except UnicodeEncodeError:
            parsed.add_bad(row, "invalid_utf8", f"{_undecodable(record)}not valid UTF-8")
            continue
        parsed.rows.append(row)
        parsed.records.append(dumped)
    return parsed


def _undecodable(record: Any) -> str:
    """``"field 'x': "`` for the first top-level field of a record that holds undecodable text."""
    if isinstance(record, dict):
        for key, value in record.items():
            try:
                json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                return f"field {key!r}: "
    return ""


@register_format("jsonl", (".jsonl",))
def _jsonl(data: bytes, options: FileOptions) -> Parsed:
    parsed = Parsed()
    for number, offset, line in _lines(data):
        if not line.strip():
            continue
        text, problem = _decode_line(line, offset)
        if text is None:
            parsed.add_bad(number, "invalid_utf8", f"line {number} is {problem}")
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            parsed.add_bad(
                number,
                "invalid_json",
                f"line {number} is not valid JSON: {error.msg} (column {error.colno})",
            )
            continue
        parsed.rows.append(number)
        parsed.records.append(text)
    return parsed


@register_format("text", (".txt", ".text", ".md"))
def _text(data: bytes, options: FileOptions) -> Parsed:
    parsed = Parsed()
    if options.text_split == "file":
        body = data.removeprefix(BOM)
        text, problem = _decode_line(body, len(data) - len(body))
        if text is None:
            parsed.add_bad(1, "invalid_utf8", f"the file is {problem}")
        else:
            parsed.rows.append(1)
            parsed.records.append(json.dumps({"text": text}, ensure_ascii=False))
        return parsed
    # (start line, lines, the first undecodable line's problem) of every document
    documents: list[tuple[int, list[str], str]] = []
    current: list[str] = []
    start, problem = 1, ""
    for number, offset, line in _lines(data):
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
    if current:
        documents.append((start, current, problem))
    for start, lines, problem in documents:
        if problem:
            parsed.add_bad(start, "invalid_utf8", problem)
        else:
            parsed.rows.append(start)
            parsed.records.append(json.dumps({"text": "\n".join(lines)}, ensure_ascii=False))
    return parsed
