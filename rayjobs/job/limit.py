"""``inspect --limit N``: each dataset cut to its first N rows, in file order, bad rows included.

Files wholly inside the first N rows are read as they are; the file holding the N-th row is
replaced by a copy of its rows up to it, in its own format, decompressed, in a temporary folder on
the driver (so on a cluster of several nodes use it with a local Ray); a Hugging Face dataset by
its first N records. Row numbers are kept.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from rayjobs.config import Config, ConfigError, DatasetConfig
from rayjobs.data import formats
from rayjobs.data.formats import BOM, HF
from rayjobs.data.sources import open_row_file


def limit_config(config: Config, limit: int, folder: str | Path) -> Config:
    """``config`` with every dataset cut to its first ``limit`` rows (module note); copies of cut
    files (and Hugging Face subsets) go under ``folder``.

    Raises:
        ConfigError: ``limit`` is not positive, or a file of a format that cannot be cut.
    """
    if limit < 1:
        raise ConfigError(f"--limit must be a positive number of rows, got {limit}")
    folder = Path(folder)
    datasets = [
        _limit_dataset(spec, limit, folder / f"dataset-{index}")
        for index, spec in enumerate(config.datasets)
    ]
    held_out = [
        _limit_dataset(spec, limit, folder / f"eval-{index}")
        for index, spec in enumerate(config.eval.datasets)
    ]
    return config.model_copy(
        update={
            "datasets": datasets,
            "eval": config.eval.model_copy(update={"datasets": held_out}),
        }
    )


def _limit_dataset(spec: DatasetConfig, limit: int, folder: Path) -> DatasetConfig:
    folder.mkdir(parents=True, exist_ok=True)
    if spec.format == HF:
        return _limit_hf(spec, limit, folder)
    files, taken = [], 0
    for path in spec.files:
        keep = limit - taken
        rows = _first_rows(spec, path, keep + 1)
        if len(rows) <= keep:
            files.append(path)
            taken += len(rows)
        else:
            # written decompressed: its name keeps its format's extension, not the codec's
            copy = folder / f"{len(files)}-{formats.without_compression(Path(path).name)}"
            with open(copy, "wb") as out:
                _cut(spec.format, path, rows[keep], keep, out, spec.storage)
            got = len(_first_rows(spec, str(copy), keep + 1))
            if got != keep:
                raise ConfigError(
                    f"--limit: cutting {path} after {keep} rows gave {got}; "
                    "use a --limit that ends at a file boundary"
                )
            files.append(str(copy))
            taken = limit
        if taken >= limit:
            break
    return spec.model_copy(update={"files": tuple(files)})


def _first_rows(spec: DatasetConfig, path: str, count: int) -> list[int]:
    """The row numbers of the first ``count`` rows of a file, good and bad (the job reads both
    under ``skip``). Reads only as far as needed where ``formats`` reads files part by part."""
    options = {
        "format": spec.format,
        "dataset": spec.name,
        "text_split": spec.text_split,
        "binary": spec.binary,
        "on_bad_row": "skip",
        "max_row_bytes": spec.max_row_bytes,
        "max_depth": spec.max_depth,
    }
    rows: list[int] = []
    with open_row_file(path, spec.format, spec.storage) as file:  # as a read task reads it
        for part in formats.read_rows(file, path, **options):
            rows += sorted([*part.rows, *(bad.row for bad in part.bad)])
            if len(rows) >= count:
                break
    return rows[:count]


_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")
"""Surrogates other than surrogateescape's (U+DC80-U+DCFF, the bytes that were not UTF-8)."""


def _open_lines(path: str, fmt: str, storage: Any = None) -> BinaryIO:
    """``path`` as a read task reads it (``sources.open_row_file``: decompressed by its
    extension), buffered so that its lines iterate."""
    return io.BufferedReader(open_row_file(path, fmt, storage))


def _cut(
    fmt: str, path: str, first_left_out: int, keep: int, out: BinaryIO, storage: Any = None
) -> None:
    """Write to ``out`` a file of format ``fmt`` holding the first ``keep`` rows of ``path``
    (``first_left_out``: the row number of the next one), decompressed. Streams, but for a JSON
    list and a compressed Parquet file."""
    if fmt in ("jsonl", "text"):  # row numbers are 1-based line numbers (split at \n only)
        with _open_lines(path, fmt, storage) as file:
            out.writelines(itertools.islice(file, first_left_out - 1))
        return
    if fmt == "json":  # a list of records, numbered from 0
        with open_row_file(path, fmt, storage) as file:
            data = file.read()
        text = data.removeprefix(BOM).decode("utf-8", "surrogateescape")
        records = json.dumps(json.loads(text)[:keep], ensure_ascii=False)
        # bytes that were not UTF-8 go back as they were (surrogateescape); a lone surrogate the
        # file escaped ("\ud800") goes back escaped, as no UTF-8 byte can hold it
        records = _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", records)
        out.write(records.encode("utf-8", "surrogateescape"))
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        # compressed: read whole, as formats' reader
        with open_row_file(path, fmt, storage) as file:
            source = pq.ParquetFile(file if file.seekable() else pa.BufferReader(file.read()))
            with pq.ParquetWriter(out, source.schema_arrow) as writer:
                for batch in source.iter_batches(batch_size=min(keep, 65536)):
                    writer.write_batch(batch.slice(0, keep))
                    keep -= min(keep, batch.num_rows)
                    if not keep:
                        break
        return
    if fmt == "csv":  # the header, then records up to the keep-th (blank lines are not records)
        consumed: list[str] = []

        def lines(file: Iterable[str]) -> Iterator[str]:
            for line in file:
                consumed.append(line)
                yield line

        lines_of = _open_lines(path, fmt, storage)
        with io.TextIOWrapper(
            lines_of, encoding="utf-8-sig", errors="surrogateescape", newline=""
        ) as file:
            reader = csv.reader(lines(file))
            next((header for header in reader if header), None)  # blank lines before it: none
            records = 0
            for record in reader:
                records += bool(record)
                if records == keep:
                    break
        out.write("".join(consumed).encode("utf-8", "surrogateescape"))
        return
    raise ConfigError(
        f"--limit: cannot cut {path} (format {fmt!r}) inside the file; "
        "use a --limit that ends at a file boundary"
    )


def _limit_hf(spec: DatasetConfig, limit: int, folder: Path) -> DatasetConfig:
    """A Hugging Face dataset's first ``limit`` records, saved to ``folder`` (read as the job
    reads the dataset: ``sources.load_huggingface``)."""
    from rayjobs.data.sources import load_huggingface

    loaded = load_huggingface(spec)
    loaded.select(range(min(limit, len(loaded)))).save_to_disk(str(folder))
    return spec.model_copy(update={"source": str(folder)})
