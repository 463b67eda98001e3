"""What the driver knows of each dataset before streaming it: mean sample length (a tokenized head),
rows per byte, file sizes, and (only where weights need it) a row count."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray

from rayjobs.config import Config, DatasetConfig
from rayjobs.data import checks, files
from rayjobs.data.files import open_file
from rayjobs.data.formats import HF, read_rows
from rayjobs.data.placement import on_data_nodes
from rayjobs.data.sources import read_dataset, record_table
from rayjobs.data.tokenize import Tokenize
from rayjobs.errors import DataError

progress = logging.getLogger("rayjobs.data")
"""What the driver is doing before the data streams (INFO: ``rayjobs run`` shows it)."""

SAMPLE_ROWS = 2048
"""Rows of each dataset tokenized in the driver to estimate its mean sample length."""


@dataclass(frozen=True)
class Estimate:
    """What the driver knows of a dataset before streaming it."""

    mean_tokens: float
    """Mean tokens per sample, from a tokenized sample of the dataset."""
    rows: int | None = None
    """Raw rows in the dataset, bad ones included: counted for a Hugging Face dataset only."""
    rows_per_byte: float | None = None
    """Raw rows per byte of the files parsed for the sample (to size a dataset whose rows are not
    counted)."""
    file_sizes: dict[str, int] | None = None
    """Bytes of each of the dataset's files (stat'ed once, here; the reads are planned with
    them); None for a Hugging Face dataset."""
    samples_per_row: float = 1.0
    """Samples the job makes of a raw row, measured on the sample: below 1 where rows are bad
    (skipped) or dropped, above 1 where ``overflow: split`` cuts them. A weighted mix sizes a
    dataset in samples: sized in rows, one with many bad rows was read too little for its share
    (a ledger trims what is read beyond a share; it cannot add what was not read)."""

    @property
    def size(self) -> int | None:
        """Bytes in the dataset's files."""
        return sum(self.file_sizes.values()) if self.file_sizes is not None else None

    @property
    def rows_hint(self) -> float:
        """Raw rows in the dataset: counted, else its bytes times the raw rows per byte of its
        first files (what the streams are interleaved by: rows, before tokenization)."""
        if self.rows is not None:
            return float(self.rows)
        size = float(self.size or 1)
        return size * self.rows_per_byte if self.rows_per_byte else size

    @property
    def samples_hint(self) -> float:
        """Samples the dataset makes: its raw rows times the samples per raw row of its first
        rows (what shares and budgets count)."""
        return self.rows_hint * self.samples_per_row


def estimate(config: Config) -> dict[str, Estimate]:
    """Each dataset's mean sample length and size from its head: its raw rows per byte times
    its files' bytes (never a count of its rows, which would read every byte before the first
    batch; a Hugging Face dataset knows its length). A head that trains nothing in every dataset
    is refused, and one that loses samples warned of (``checks``)."""
    packing = config.packing
    tokenize = Tokenize(
        config.datasets, config.tokenizer, packing.seq_len, packing.overflow,
        min_prompt_tokens=config.dpo.min_prompt_tokens,
    )  # fmt: skip
    estimates, heads = {}, {}
    where = on_data_nodes(config)
    for spec in config.datasets:
        progress.info("data: %s: estimating sample lengths from its first rows", spec.name)
        limit = SAMPLE_ROWS
        while True:  # a head the template or the overflow policy left nothing of: a longer one
            sample, density, raw_rows, skipped = _head(spec, where, limit)
            table, counts = tokenize.counted(sample) if sample else (None, {})
            lengths = table.column("num_tokens").to_numpy() if table else np.empty(0)
            taken = sample.num_rows if sample is not None else 0
            if len(lengths) or taken < limit:  # samples, or every row of the dataset read
                break
            limit *= 8
        head = asdict(counts[spec.name]) if spec.name in counts else {}
        if not len(lengths):
            raise DataError(_nothing_left(spec, taken, head, skipped))
        heads[spec.name] = head
        sizes = files.sizes(spec.files, spec.storage) if spec.files else None
        count = None
        # A Hugging Face dataset has no bytes to size it by: counted (it knows its length),
        # else it weighed 1 row in the mix of unweighted streams and its rows came after every
        # epoch of the file datasets'.
        if spec.format == HF:
            progress.info("data: %s: counting its rows (for the mix's shares)", spec.name)
            count = read_dataset(spec, sizes=sizes, **where).count()
        estimates[spec.name] = Estimate(
            float(lengths.mean()), count, density, sizes, len(lengths) / raw_rows
        )
    checks.require_training(heads, "the first rows of every dataset")
    for warning in checks.lost_warnings(config, heads):
        checks.logger.warning("in the first rows: %s", warning)
    return estimates


COLUMN_ROWS = 256
"""Rows of each dataset's head whose columns are held against its template (``columns``)."""


def columns(config: Config) -> dict[str, list[str]]:
    """Each dataset's columns that most of its head's rows have and its template does not read
    (each warned of once, here), from the head of its first file.

    Raises:
        DataError: a column that changes what a row means (``checks.REFUSED``).
    """
    where = on_data_nodes(config)
    unused = {}
    for spec in config.datasets:
        if spec.format == HF:
            sample = _head(spec, where, COLUMN_ROWS).table
            records = sample.column("_record").to_pylist() if sample is not None else []
        else:  # one file's head, however many files and however few rows the first holds
            records = _parse_head(spec, spec.files[0], COLUMN_ROWS)[1][:COLUMN_ROWS]
        unused[spec.name] = checks.column_findings(spec, records)
        checks.warn_unused(spec, unused[spec.name])
    return unused


def _nothing_left(
    spec: DatasetConfig, taken: int, head: dict[str, Any], skipped: Counter[str]
) -> str:
    """Why a dataset has no sample, in one line: its bad rows' skip reasons (parsing, then the
    template) and its samples' drop reasons (``packing.overflow``), counted."""
    bad = Counter(skipped) + Counter(head.get("skipped_by_reason", {}))
    dropped = Counter(head.get("dropped_by_reason", {}))
    said = ", ".join(f"{reason} {n}" for reason, n in sorted((bad + dropped).items()))
    if not dropped:
        return (
            f"dataset {spec.name!r}: every row read was bad and skipped under on_bad_row: skip "
            f"({said or 'none counted'}); no row is left to train on. Fix the data, or set "
            "on_bad_row: error to stop at the first bad row with its file and row"
        )
    return (
        f"dataset {spec.name!r}: no sample left of its {taken} parsed rows "
        f"({sum(bad.values())} bad and skipped, {sum(dropped.values())} dropped by "
        f"packing.overflow: {said}); see packing.overflow"
    )


class Head(NamedTuple):
    """The head of a dataset as the driver parsed it (``_head``)."""

    table: pa.Table | None
    """Its good rows (``sources.record_table``), None when it has none."""
    density: float | None
    """Raw rows per byte of the files parsed."""
    raw_rows: float
    """Raw rows, bad ones included, that the good rows kept stand for."""
    skipped: Counter[str]
    """Bad rows parsed, by skip reason (``formats.SKIP_REASONS``)."""


def _head(
    spec: DatasetConfig, where: dict[str, Any] | None = None, limit: int = SAMPLE_ROWS
) -> Head:
    """Up to ``limit`` good rows from the first files of a dataset, parsed in the driver (a
    cost that does not grow with the number of files; a Hugging Face dataset goes through Ray);
    the raw rows per byte of the files parsed; and the raw rows, bad ones included, that the good
    rows kept stand for (so samples per raw row = samples of the sample / this). ``where``:
    ``on_data_nodes``, for the read of a Hugging Face dataset."""
    if spec.format == HF:
        refs = read_dataset(spec, **(where or {})).limit(limit).to_arrow_refs()
        table = pa.concat_tables(ray.get(refs)) if refs else None
        return Head(table, None, float(table.num_rows if table is not None else 1), Counter())
    tables, count, good_rows, parsed_bytes = [], 0, 0, 0
    skipped: Counter[str] = Counter()
    for path in spec.files:
        rows, records, consumed, bad = _parse_head(spec, path, limit - count)
        keep = min(len(rows), limit - count)
        tables.append(record_table(spec.name, [path] * keep, rows[:keep], records[:keep]))
        count += keep
        good_rows += len(rows)
        skipped += bad
        parsed_bytes += consumed
        if count >= limit:
            break
    raw = good_rows + skipped.total()
    density = raw / parsed_bytes if parsed_bytes else None
    raw_rows = count * raw / good_rows if good_rows else 1.0
    return Head(pa.concat_tables(tables) if tables else None, density, raw_rows, skipped)


def _parse_head(
    spec: DatasetConfig, path: str, limit: int
) -> tuple[list[int], list[str], int, Counter[str]]:
    """The first good rows of one file, parsed in the driver a bounded part at a time
    (``formats.read_rows``, as a read task does) until more than ``limit`` are in, or the file
    ends: (row numbers, records, bytes read for them, bad rows among them by skip reason). Start-up
    reads the head of a large first file, never the whole of it."""
    rows: list[int] = []
    records: list[str] = []
    bad: Counter[str] = Counter()
    # no read-ahead: the raw file's ``tell()`` is the bytes read, compressed or not
    file, raw = open_file(path, spec.format == "parquet", spec.storage, read_ahead=False)
    with file:
        parts = read_rows(
            file, path, format=spec.format, dataset=spec.name, text_split=spec.text_split,
            binary=spec.binary, on_bad_row=spec.on_bad_row, max_row_bytes=spec.max_row_bytes,
            max_depth=spec.max_depth,
        )  # fmt: skip
        for part in parts:
            rows += part.rows
            records += part.records
            bad.update(row.reason for row in part.bad)
            if len(rows) > limit:
                break
        consumed = raw.tell()
    return rows, records, consumed, bad
