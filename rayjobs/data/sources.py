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
``RowFileDatasource``, a Ray ``Datasource`` over a list of ``FileRead``s: a read task per file
read, spread over the cluster like Ray's own readers. A read task streams its file in bounded
parts (``formats.read_rows``, ``formats.CHUNK_BYTES`` at a time; Parquet files are opened for
random access, to be read by record batch) and emits each part's rows as it goes, so its memory is
that of a part, not of the file. A ``FileRead`` may keep some of its rows and tag them on the way
out (the stream's passes, ``reads.PassRead``): then a whole run's reads of a dataset, every
epoch and every pass over its files, are one read operator, not a chain of operators per pass
joined by unions, whose scheduling costs Ray Data's executor time in proportion to their
number. Hugging Face datasets (hub names or ``save_to_disk`` folders) are
read with ``datasets`` and handed over with ``ray.data.from_huggingface``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from rayjobs.config import DatasetConfig
from rayjobs.data import files
from rayjobs.data.files import StorageOptions, explain, open_file
from rayjobs.data.formats import (
    HF,
    MAX_DEPTH,
    MAX_ROW_BYTES,
    Parsed,
    Readable,
    apply_policy,
    hf_label,
    read_rows,
    table_records,
)
from rayjobs.errors import SourceError

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
    return _tables(dataset, path, [parsed])


def _tables(dataset: str, path: str, parts: Iterable[Parsed]) -> Iterator[pa.Table]:
    """The parts of one file, in row order, as raw-row tables of ``_BLOCK_ROWS`` rows (the last
    one fewer), as if the file had been parsed whole: each part's good and bad rows in row order
    (bad ones with their ``_skip`` reason and, as ``_record``, what is wrong)."""
    rows: list[int] = []
    records: list[str] = []
    skips: list[str | None] = []
    for parsed in parts:
        if parsed.bad:
            entries = sorted(
                [*zip(parsed.rows, parsed.records, [None] * len(parsed.rows), strict=True)]
                + [(bad.row, bad.detail, bad.reason) for bad in parsed.bad],
                key=lambda entry: entry[0],
            )
            for row, record, skip in entries:
                rows.append(row)
                records.append(record)
                skips.append(skip)
        else:
            rows += parsed.rows
            records += parsed.records
            skips += [None] * len(parsed.rows)
        full = len(rows) - len(rows) % _BLOCK_ROWS
        for start in range(0, full, _BLOCK_ROWS):
            part = slice(start, start + _BLOCK_ROWS)
            yield record_table(
                dataset, [path] * _BLOCK_ROWS, rows[part], records[part], skips[part]
            )
        del rows[:full], records[:full], skips[:full]
    if rows:
        yield record_table(dataset, [path] * len(rows), rows, records, skips)


def read_tables(
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
) -> Iterator[pa.Table]:
    """One open file → raw-row tables, a part of the file at a time (``formats.read_rows``): what a
    read task emits (in-process, without Ray). The tables are those of the whole file parsed at
    once (``_BLOCK_ROWS`` rows each); a table is emitted as soon as its rows are parsed."""
    parts = read_rows(
        file,
        path,
        format=format,
        dataset=dataset,
        text_split=text_split,
        binary=binary,
        on_bad_row=on_bad_row,
        chunk_bytes=chunk_bytes,
        max_row_bytes=max_row_bytes,
        max_depth=max_depth,
    )
    yield from _tables(dataset, path, parts)


READ_ATTEMPTS = 4
"""Times a read task tries a file whose store fails it with a transient error (a dropped
connection, a throttled request) before the run fails; each retry skips the rows already
emitted, so none is emitted twice."""

RETRY_SECONDS = 0.5
"""The first retry's wait; it doubles at each one."""


def open_row_file(
    path: str, file_format: str, storage: StorageOptions | None = None
) -> pa.NativeFile:
    """A file opened as a read task reads it (``files.open_file``): an uncompressed Parquet file
    for random access (its footer is at its end; it is read by record batch), anything else as a
    buffered stream decompressed by its extension (and then read whole if it is Parquet)."""
    return open_file(path, random_access=file_format == "parquet", options=storage)[0]


@dataclass(frozen=True)
class FileRead:
    """One file as a read task reads it: every row (``RowFileDatasource``). Subclasses keep some
    of the rows and tag them (``reads.PassRead``)."""

    path: str

    def rows(self, table: pa.Table) -> pa.Table:
        """The rows of one part of the file that this read emits."""
        return table

    @property
    def share(self) -> float:
        """The fraction of the file's rows this read is expected to emit (for size estimates)."""
        return 1.0


READ_TASK_BYTES = 8 << 20
"""Bytes of files a read task reads, about (``_task_groups``): consecutive reads share a task up
to this. Ray sizes read tasks by its ``target_min_block_size`` (1 MiB): a task per
small file, each a few tens of milliseconds of parsing against a task's fixed costs (its
scheduling, its share of the executor's rounds, a worker for each one running at once), and on
2 cores those costs were most of the read stage: `rayjobs bench pipeline` streamed about a fifth
more tokens a second at 30x with tasks of 8 MiB, a third more with the mix's repartition dropped
too (``stream._coarse``; docs/benchmarks.md). A task still streams its rows block by block as it
parses them."""


class RowFileDatasource(Datasource):
    """A list of ``FileRead``s of one dataset's files → rows with ``_path``, ``_row`` and
    ``_skip`` (see module note), in the list's order: a read task per ``READ_TASK_BYTES`` of
    consecutive reads (fewer where Ray asks for fewer). ``chunk_bytes``: how much of a file a read
    task parses at a time (default ``formats.CHUNK_BYTES``). ``sizes``: each file's bytes, where
    the caller has them already (else asked of its filesystem here); a read task checks that it
    read them all. ``storage``: the dataset's filesystem options (``files.StorageOptions``)."""

    def __init__(
        self,
        reads: Sequence[FileRead],
        *,
        format: str,
        dataset: str,
        text_split: str,
        binary: str = "error",
        on_bad_row: str = "error",
        chunk_bytes: int | None = None,
        sizes: Mapping[str, int] | None = None,
        storage: StorageOptions | None = None,
        max_row_bytes: int = MAX_ROW_BYTES,
        max_depth: int = MAX_DEPTH,
    ):
        super().__init__()
        self.reads = list(reads)
        self.options = {
            "format": format,
            "dataset": dataset,
            "text_split": text_split,
            "binary": binary,
            "on_bad_row": on_bad_row,
            "chunk_bytes": chunk_bytes,
            "storage": storage,
            "max_row_bytes": max_row_bytes,
            "max_depth": max_depth,
        }
        paths = list(dict.fromkeys(r.path for r in self.reads))
        self.sizes = {p: sizes[p] for p in paths} if sizes else files.sizes(paths, storage)

    def get_name(self) -> str:
        return "RowFile"

    def _bytes(self, reads: Sequence[FileRead]) -> int:
        return int(sum(self.sizes[r.path] * r.share for r in reads))

    def estimate_inmemory_data_size(self) -> int | None:
        return self._bytes(self.reads)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        if not self.reads:
            return []
        tasks = []
        for group in _task_groups([self._bytes([read]) for read in self.reads], parallelism):
            reads = [self.reads[i] for i in group]
            metadata = BlockMetadata(
                num_rows=None,
                size_bytes=self._bytes(reads),
                exec_stats=None,
                input_files=tuple(dict.fromkeys(r.path for r in reads)),
            )
            sizes = {r.path: self.sizes[r.path] for r in reads}
            read = functools.partial(read_files, reads, self.options, sizes)
            tasks.append(ReadTask(read, metadata, per_task_row_limit=per_task_row_limit))
        return tasks


def _task_groups(sizes: Sequence[int], parallelism: int) -> list[list[int]]:
    """Consecutive reads (their ``sizes`` in bytes) grouped into read tasks: about one per
    ``READ_TASK_BYTES`` in all (at most ``parallelism``, never an empty one), a read joining the
    open task unless that takes it further past its share of the bytes than it stays short.

    >>> _task_groups([4 << 20] * 6, 200)
    [[0, 1], [2, 3], [4, 5]]
    >>> _task_groups([4 << 20] * 6, 2)
    [[0, 1, 2], [3, 4, 5]]
    >>> _task_groups([1 << 20, 30 << 20, 1 << 20], 200)
    [[0], [1], [2]]
    >>> _task_groups([30 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20], 200)
    [[0], [1, 2, 3, 4]]
    """
    total = sum(sizes)
    count = min(max(1, parallelism), len(sizes), max(1, -(-total // READ_TASK_BYTES)))
    groups: list[list[int]] = [[]]
    held = 0  # bytes of the open group
    for index, size in enumerate(sizes):
        if held and (held + size / 2) * count >= total and len(groups) < count:
            groups.append([])
            held = 0
        groups[-1].append(index)
        held += size
    return groups


def read_files(
    reads: Sequence[FileRead], options: dict[str, Any], sizes: Mapping[str, int] | None = None
) -> Iterator[pa.Table]:
    """What one read task runs (in-process, without Ray): each read's file opened on its
    filesystem (``files.open_file``) and streamed (``read_tables``), the rows it keeps emitted as
    they come. A transient error of the store (a dropped connection) reopens the file, up to
    ``READ_ATTEMPTS`` times with back-off, and passes over the rows already emitted; a stream that
    ends before the file's listed size (``sizes``) is such an error, never a short read."""
    storage = options.get("storage")
    parse = {k: v for k, v in options.items() if k != "storage"}
    for read in reads:
        emitted: int | None = None  # the last row number emitted (rows come in row order)
        for attempt in range(READ_ATTEMPTS):
            try:
                size = (sizes or {}).get(read.path)
                file, _ = open_file(read.path, parse["format"] == "parquet", storage, size)
                with file:
                    for table in read_tables(file, read.path, **parse):
                        if emitted is not None:
                            table = table.filter(pc.greater(table.column("_row"), emitted))
                        if not table.num_rows:
                            continue
                        last = table.column("_row")[-1].as_py()
                        kept = read.rows(table)
                        if kept.num_rows:
                            yield kept
                        emitted = last
                break
            except OSError as error:
                if attempt == READ_ATTEMPTS - 1 or not _transient(error):
                    after = "" if emitted is None else f" after row {emitted}"
                    raise SourceError(
                        f"dataset {options['dataset']!r}: reading{after} failed: "
                        f"{explain(error, read.path)}"
                    ) from None
                time.sleep(RETRY_SECONDS * 2**attempt)


PERMANENT = (*files.DENIED, *files.NO_BUCKET, "nosuchkey", "no_such_key", "not found",
             "no such file")  # fmt: skip
"""What stores say (lowercased) of errors a retry cannot mend."""


def _transient(error: OSError) -> bool:
    return not any(word in str(error).lower() for word in PERMANENT)


def read_dataset(
    spec: DatasetConfig,
    order_seed: int | None = None,
    *,
    chunk_bytes: int | None = None,
    label_selector: dict[str, str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> ray.data.Dataset:
    """The raw rows of one dataset spec (files or a Hugging Face dataset). With ``order_seed``,
    its files are read in a random order: a shuffle of the read tasks, so, unlike an all-to-all
    shuffle of blocks, nothing waits for the whole dataset to be read. ``chunk_bytes``: see
    ``RowFileDatasource`` (``rayjobs.bench.read`` compares sizes). ``label_selector``: the node
    labels the read tasks require (``ray.data_label_selector``; a Hugging Face dataset is handed
    over by ``ray.data.from_huggingface``, which takes none). ``sizes``: see
    ``RowFileDatasource``."""
    if spec.format == HF:
        rows = _read_huggingface(spec)
        return rows if order_seed is None else rows.randomize_block_order(seed=order_seed)
    files = list(spec.files)
    if order_seed is not None:
        files = [files[i] for i in np.random.default_rng(order_seed).permutation(len(files))]
    return read_file_list(
        spec,
        [FileRead(f) for f in files],
        chunk_bytes=chunk_bytes,
        label_selector=label_selector,
        sizes=sizes,
    )


def read_file_list(
    spec: DatasetConfig,
    reads: Sequence[FileRead],
    *,
    chunk_bytes: int | None = None,
    label_selector: dict[str, str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> ray.data.Dataset:
    """The rows ``reads`` keep of a file-based dataset's files, as one Ray Data read
    (``sizes``: see ``RowFileDatasource``)."""
    datasource = RowFileDatasource(reads, **read_options(spec, chunk_bytes), sizes=sizes)
    return ray.data.read_datasource(datasource, label_selector=label_selector or None)


def read_options(spec: DatasetConfig, chunk_bytes: int | None = None) -> dict[str, Any]:
    """How a dataset's files are read: ``RowFileDatasource``'s settings, and the ``options`` of
    ``read_files`` (which the local runner calls in-process)."""
    return {
        "format": spec.format,
        "dataset": spec.name,
        "text_split": spec.text_split,
        "binary": spec.binary,
        "on_bad_row": spec.on_bad_row,
        "chunk_bytes": chunk_bytes,
        "storage": spec.storage,
        "max_row_bytes": spec.max_row_bytes,
        "max_depth": spec.max_depth,
    }


def load_huggingface(spec: DatasetConfig) -> Any:
    """A Hugging Face dataset's ``split``: a ``save_to_disk`` folder (``load_from_disk``), else
    what ``load_dataset`` takes (a Hub name, found in the local cache when offline)."""
    import datasets

    source = str(spec.source)
    if files.saved_dataset(source):
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[spec.split]
        return loaded
    return datasets.load_dataset(
        source, name=spec.subset, data_files=spec.data_files, revision=spec.revision,
        split=spec.split,
    )  # fmt: skip


def _read_huggingface(spec: DatasetConfig) -> ray.data.Dataset:
    loaded = load_huggingface(spec)
    loaded = loaded.add_column("_row", list(range(len(loaded))))
    label = hf_label(spec.source, spec.split)

    def to_records(batch: pa.Table) -> pa.Table:
        rows = batch.column("_row").to_pylist()
        try:
            parsed = table_records(batch.drop_columns(["_row"]), rows, spec.binary)
        except ValueError as error:
            raise SourceError(f"dataset {spec.name!r}, {label}: {error}") from None
        parsed = apply_policy(parsed, dataset=spec.name, path=label, on_bad_row=spec.on_bad_row)
        empty = record_table(spec.name, [], [], [])
        return pa.concat_tables([empty, *parsed_tables(spec.name, label, parsed)])

    # The driver's table as it is: ``ray.data.from_huggingface`` would first reload the dataset
    # by its Hub name (a download online, retries offline) to look for the Hub's Parquet export.
    table = loaded.with_format("arrow")[:]
    return ray.data.from_arrow(table).map_batches(to_records, batch_format="pyarrow")
