"""Sources: one dataset spec → a ``ray.data.Dataset`` of raw rows that know where they came from.

Every dataset, whatever its format, becomes rows of one schema: ``_dataset`` (the spec's name),
``_path`` and ``_row`` (the 0-based record index in a JSON list, Parquet or CSV file; the 1-based
line number in JSONL and text files, so a bad row can be reported by file and row) and ``_record``,
the row as a JSON object string. One schema lets every dataset flow through a single Tokenize actor
pool (one pool, not one per dataset, keeps the CPU budget of a small cluster predictable) and means
files whose rows disagree on types (a field missing here, a nested list there) never fail at the
Arrow layer. Files are read by ``RowFileDatasource``, a Ray ``FileBasedDatasource``: one read task
per file, spread over the cluster like Ray's own readers. Hugging Face datasets (hub names or
``save_to_disk`` folders) are read with ``datasets`` and handed over with
``ray.data.from_huggingface``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from rayjobs.config import DatasetConfig
from rayjobs.formats import HF, parse_file

_BLOCK_ROWS = 1024


def record_table(dataset: str, paths: list[str], rows: list[int], records: list[str]) -> pa.Table:
    """The common raw-row schema (see module note)."""
    return pa.table(
        {
            "_dataset": pa.array([dataset] * len(rows), type=pa.string()),
            "_path": pa.array(paths, type=pa.string()),
            "_row": pa.array(rows, type=pa.int64()),
            "_record": pa.array(records, type=pa.string()),
        }
    )


class RowFileDatasource(FileBasedDatasource):
    """JSON / JSONL / CSV / Parquet / text files → rows with ``_path`` and ``_row``."""

    def __init__(self, paths: list[str], *, format: str, dataset: str, text_split: str):
        super().__init__(paths)
        self.file_format = format
        self.dataset = dataset
        self.text_split = text_split

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        rows, records = parse_file(
            f.readall(),
            path,
            format=self.file_format,
            dataset=self.dataset,
            text_split=self.text_split,
        )
        for start in range(0, len(rows), _BLOCK_ROWS):
            end = start + _BLOCK_ROWS
            yield record_table(
                self.dataset, [path] * len(rows[start:end]), rows[start:end], records[start:end]
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
        files, format=spec.format, dataset=spec.name, text_split=spec.text_split
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
        records = [
            json.dumps(r, ensure_ascii=False, default=str)
            for r in batch.drop_columns(["_row"]).to_pylist()
        ]
        return record_table(spec.name, [label] * len(rows), rows, records)

    return ray.data.from_huggingface(loaded).map_batches(to_records, batch_format="pyarrow")
