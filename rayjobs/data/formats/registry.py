"""The file-format registry and the read path every format shares: parts, bad rows, policy.

A format is a parser (``Parser``: an open file → one :class:`Parsed` per part, in row order)
registered with the extensions it claims. A parser never stops at a bad row: it returns it as a
:class:`BadRow` next to the good ones, and :func:`read_rows` applies the dataset's ``on_bad_row``
(docs/data.md, "Bad rows"). Row numbers are what an error message shows: the 0-based record index
in a JSON list, Parquet or CSV file; the 1-based line number in JSONL and text files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from rayjobs.data.formats.limits import MAX_DEPTH, MAX_ROW_BYTES
from rayjobs.errors import SourceError

SKIP_REASONS = (
    "invalid_json",  # formats: a JSONL line that is not valid JSON
    "invalid_utf8",  # formats: a line, cell or binary value that is not UTF-8
    "ragged_csv_row",  # formats: a CSV row with more or fewer fields than the header
    "wrong_type",  # templates: a field (or the row) of the wrong type, e.g. a number for text
    "missing_field",  # templates: a required field absent or null
    "empty_field",  # templates: a required text field empty or whitespace
    "template_error",  # tokenize: a template or the chat template raised on the row
    "unknown_turn_key",  # templates: a turn key that decides training elsewhere, not read here
    "too_large",  # formats: a row over max_row_bytes
    "too_deep",  # formats: a row's JSON nested deeper than max_depth
    "too_many_turns",  # templates: a conversation of more than max_turns turns
)
"""Why a row was skipped under ``on_bad_row: skip``: the keys of ``skipped_by_reason``."""

BOM = b"\xef\xbb\xbf"


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
    max_row_bytes: int = MAX_ROW_BYTES
    max_depth: int = MAX_DEPTH


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


_PLACE = re.compile(r", file (.*), row (\d+): ")


def bad_row_order(text: str) -> tuple[str, int, str]:
    """A text starting with ``bad_row_place``'s place, ordered by that place in the data: file,
    then row (row 10 after row 9); a text without one first."""
    found = _PLACE.search(text)
    return (found[1], int(found[2]), text) if found else ("", 0, text)


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
    max_row_bytes: int = MAX_ROW_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Iterator[Parsed]:
    """One open file → its good rows and (under ``on_bad_row: skip``) bad rows, a part at a time
    (about ``chunk_bytes``, default :data:`CHUNK_BYTES`, of file each): what a read task runs.

    Raises:
        SourceError: under ``on_bad_row: error``, for the file's first bad row, naming dataset,
            file, row and reason; under either policy, for a file that cannot be parsed at all
            (see module note for when rows were handed on before).
    """
    fmt = FORMATS[format]
    options = FileOptions(text_split, binary, max_row_bytes, max_depth)
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
