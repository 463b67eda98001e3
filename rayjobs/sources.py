"""Sources: one dataset spec → a ``ray.data.Dataset`` of raw rows that know where they came from.

Every dataset, whatever its format, becomes rows of one schema: ``_dataset`` (the spec's name),
``_path`` and ``_row`` (the 0-based record index in a JSON list, Parquet or CSV file; the 1-based
line number in JSONL and text files, so a bad row can be reported by file and row), ``_record``,
the row as a JSON object string, and ``_skip``: null, or, for a row the parser found bad under
``on_bad_row: skip``, its reason (``formats.SKIP_REASONS``), with ``_record`` then holding what is
wrong. Bad rows travel on like good ones because counts have one home: the Tokenize actor counts
them by reason and reports them to the run's ledger; read tasks have none. One schema lets every
dataset flow through a single Tokenize actor pool (one pool, not one per dataset, keeps the CPU
budget of a small cluster predictable) and means files whose rows disagree on types (a field
missing here, a nested list there) never fail at the Arrow layer. Files are read by
``RowFileDatasource``, a Ray ``FileBasedDatasource``: one read task per file, spread over the
cluster like Ray's own readers. Hugging Face datasets (hub names or ``save_to_disk`` folders) are
read with ``datasets`` and handed over with ``ray.data.from_huggingface``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from rayjobs.config import DatasetConfig
from rayjobs.formats import (
    HF,
    Parsed,
    SourceError,
    apply_policy,
    parse_rows,
    table_records,
)

_BLOCK_ROWS = 1024


def record_table(
    dataset: str,
    paths: list[str],
    rows: list[int],
    records: list[str],
    skips: list[str | None] | None = None,
) -> pa.Table:
    """The common raw-row schema (see module note); ``skips``: each row's skip reason or None
    (default: every row good)."""
    return pa.table(
        {
            "_dataset": pa.array([dataset] * len(rows), type=pa.string()),
            "_path": pa.array(paths, type=pa.string()),
            "_row": pa.array(rows, type=pa.int64()),
            "_record": pa.array(records, type=pa.string()),
            "_skip": pa.array(skips or [None] * len(rows), type=pa.string()),
        }
    )


def parsed_tables(dataset: str, path: str, parsed: Parsed) -> Iterator[pa.Table]:
    """One parsed file as raw-row tables of at most ``_BLOCK_ROWS`` rows, good and bad rows in
    row order (bad ones with their ``_skip`` reason and, as ``_record``, what is wrong)."""
    rows, records, skips = parsed.rows, parsed.records, [None] * len(parsed.rows)
    if parsed.bad:
        entries = sorted(
            [*zip(rows, records, skips, strict=True)]
            + [(bad.row, bad.detail, bad.reason) for bad in parsed.bad],
            key=lambda entry: entry[0],
        )
        rows, records, skips = (list(column) for column in zip(*entries, strict=True))
    for start in range(0, len(rows), _BLOCK_ROWS):
        part = slice(start, start + _BLOCK_ROWS)
        yield record_table(
            dataset, [path] * len(rows[part]), rows[part], records[part], skips[part]
        )


def file_tables(
    data: bytes,
    path: str,
    *,
    format: str,
    dataset: str,
    text_split: str = "paragraph",
    binary: str = "error",
    on_bad_row: str = "error",
) -> Iterator[pa.Table]:
    """One file's bytes → raw-row tables (what a read task emits; in-process, without Ray)."""
    parsed = parse_rows(
        data,
        path,
        format=format,
        dataset=dataset,
        text_split=text_split,
        binary=binary,
        on_bad_row=on_bad_row,
    )
    yield from parsed_tables(dataset, path, parsed)


class RowFileDatasource(FileBasedDatasource):
    """JSON / JSONL / CSV / Parquet / text files → rows with ``_path``, ``_row`` and ``_skip``."""

    def __init__(
        self,
        paths: list[str],
        *,
        format: str,
        dataset: str,
        text_split: str,
        binary: str = "error",
        on_bad_row: str = "error",
    ):
        super().__init__(paths)
        self.file_format = format
        self.dataset = dataset
        self.text_split = text_split
        self.binary = binary
        self.on_bad_row = on_bad_row

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        yield from file_tables(
            f.readall(),
            path,
            format=self.file_format,
            dataset=self.dataset,
            text_split=self.text_split,
            binary=self.binary,
            on_bad_row=self.on_bad_row,
        )


def read_dataset(spec: DatasetConfig, order_seed: int | None = None) -> ray.data.Dataset:
    """The raw rows of one dataset spec (files or a Hugging Face dataset). With ``order_seed``,
    its files are read in a random order: a shuffle of the read tasks, so, unlike an all-to-all
    shuffle of blocks, nothing waits for the whole dataset to be read."""
    if spec.format == HF:
        rows = _read_huggingface(spec)
        return rows if order_seed is None else rows.randomize_block_order(seed=order_seed)
    files = list(spec.files)
    if order_seed is not None:
        files = [files[i] for i in np.random.default_rng(order_seed).permutation(len(files))]
    datasource = RowFileDatasource(
        files,
        format=spec.format,
        dataset=spec.name,
        text_split=spec.text_split,
        binary=spec.binary,
        on_bad_row=spec.on_bad_row,
    )
    return ray.data.read_datasource(datasource)


def _read_huggingface(spec: DatasetConfig) -> ray.data.Dataset:
    import datasets

    source = str(spec.source)
    if Path(source).is_dir():
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[spec.split]
    else:
        loaded = datasets.load_dataset(source, split=spec.split)
    loaded = loaded.add_column("_row", list(range(len(loaded))))
    label = f"{source}[{spec.split}]"

    def to_records(batch: pa.Table) -> pa.Table:
        rows = batch.column("_row").to_pylist()
        try:
            parsed = table_records(batch.drop_columns(["_row"]), rows, spec.binary)
        except ValueError as error:
            raise SourceError(f"dataset {spec.name!r}, {label}: {error}") from None
        parsed = apply_policy(parsed, dataset=spec.name, path=label, on_bad_row=spec.on_bad_row)
        empty = record_table(spec.name, [], [], [])
        return pa.concat_tables([empty, *parsed_tables(spec.name, label, parsed)])

    return ray.data.from_huggingface(loaded).map_batches(to_records, batch_format="pyarrow")
