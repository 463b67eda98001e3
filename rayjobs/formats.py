"""File formats: one file's bytes → (row numbers, records as JSON object strings). No Ray.

Each format is a parser in the :data:`FORMATS` registry with the file extensions it claims;
``config`` infers a dataset's format from its files' extensions through it and validates
``datasets[].format`` against it, and ``sources`` (the Ray side) calls the parser once per file.
Row numbers are what an error message shows: the 0-based record index in a JSON list, Parquet or
CSV file; the 1-based line number in JSONL and text files. ``format: hf`` (Hugging Face datasets)
is not a file format and is read by ``sources``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

Parsed = tuple[list[int], list[str]]
"""(row numbers, records as JSON object strings)."""


class SourceError(ValueError):
    """A file that cannot be parsed; names dataset, file and (where known) line."""


@dataclass(frozen=True)
class Format:
    """A registered file format."""

    name: str
    extensions: tuple[str, ...]
    """File suffixes (with the dot) that mean this format when ``format`` is not set."""
    parse: Callable[[bytes, str], Parsed]
    """(file bytes, text_split) → (row numbers, records); raises ValueError on a bad file."""


FORMATS: dict[str, Format] = {}
"""File formats by name; config validation and extension inference read this registry."""

HF = "hf"
"""The ``format`` of a Hugging Face dataset (a Hub name or a ``save_to_disk`` folder)."""


def register_format(name: str, extensions: tuple[str, ...] = ()):
    """Decorator: register ``parse(data, text_split) -> (rows, records)`` as file format
    ``name``."""

    def register(parse: Callable[[bytes, str], Parsed]) -> Callable[[bytes, str], Parsed]:
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


def parse_file(
    data: bytes, path: str, *, format: str, dataset: str, text_split: str = "paragraph"
) -> Parsed:
    """One file's bytes → (row numbers, records as JSON object strings); see module note.

    Raises:
        SourceError: naming the dataset, the file and, where the parser knows it, the line.
    """
    try:
        return FORMATS[format].parse(data, text_split)
    except ValueError as error:
        raise SourceError(f"dataset {dataset!r}, file {path}: {error}") from None


@register_format("parquet", (".parquet",))
def _parquet(data: bytes, text_split: str) -> Parsed:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return _table_records(pq.read_table(pa.BufferReader(data)))


@register_format("csv", (".csv",))
def _csv(data: bytes, text_split: str) -> Parsed:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    return _table_records(pacsv.read_csv(pa.BufferReader(data)))


def _table_records(table) -> Parsed:
    return list(range(table.num_rows)), [
        json.dumps(r, ensure_ascii=False, default=str) for r in table.to_pylist()
    ]


@register_format("json", (".json",))
def _json(data: bytes, text_split: str) -> Parsed:
    try:
        records = json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as error:
        hint = " (one object per line? set format: jsonl)" if "Extra data" in str(error) else ""
        raise ValueError(f"not valid JSON at line {error.lineno}: {error.msg}{hint}") from None
    if isinstance(records, dict):
        records = [records]
    if not isinstance(records, list):
        raise ValueError("a .json file must hold a list of records")
    return list(range(len(records))), [json.dumps(r, ensure_ascii=False) for r in records]


@register_format("jsonl", (".jsonl",))
def _jsonl(data: bytes, text_split: str) -> Parsed:
    rows, records = [], []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"line {number} is not valid JSON: {error.msg}") from None
        rows.append(number)
        records.append(line)
    return rows, records


@register_format("text", (".txt", ".text", ".md"))
def _text(data: bytes, text_split: str) -> Parsed:
    text = data.decode("utf-8")
    if text_split == "file":
        return [1], [json.dumps({"text": text}, ensure_ascii=False)]
    lines = text.splitlines()
    if text_split == "line":
        pairs = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    else:  # paragraphs: runs of non-blank lines
        pairs, current, start = [], [], 1
        for number, line in enumerate(lines + [""], start=1):
            if line.strip():
                start = start if current else number
                current.append(line)
            elif current:
                pairs.append((start, "\n".join(current)))
                current = []
    return (
        [number for number, _ in pairs],
        [json.dumps({"text": document}, ensure_ascii=False) for _, document in pairs],
    )
