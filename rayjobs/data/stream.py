"""The streaming data path: one lazy Ray dataset of packed rows for every epoch of a run.

Design note. Nothing waits for the end of an earlier stage: read tasks (one per file read) feed
a Tokenize actor pool that grows with the cluster, then a pool of ``PackStream`` actors, then the
trainers through ``streaming_split``. The epochs are one stream (each row says its ``epoch``), so
the next epoch is read and tokenized while the current one trains: no idle gap at the boundary.
A dataset's whole run, every epoch's passes over its files (``pass_reads``), is one read operator
whose tasks keep and tag each pass's rows (``PassRead``): Ray Data's scheduling loop costs the
driver CPU for every operator at every step, and a chain of operators per pass joined by unions
(84 operators for three datasets read 2-13 times an epoch over three epochs) made that loop the
busiest process of a small job.

Packing without stranding. A ``map_batches`` actor gets no end-of-data call, so a packer that
carries under-filled packs from one call to the next can be left holding them when the stream
ends. ``PackStream`` therefore keeps nothing between calls: each call packs its whole batch
(best-fit decreasing, shuffled; under-filled packs re-packed once with the rest) and
emits every sample in exactly one row. The price is one under-filled tail per call, about half a
pack, so the window is sized in tokens, not samples: ``packing.window_tokens`` tokens per call
(the row count comes from a driver-side estimate of each dataset's mean sample length). The
window would also be the first batch's latency (no row leaves before its window is tokenized), so
the head of the first epoch, ``packing.warmup_tokens`` taken from the first file each dataset reads,
is a warm-up lane of its own: read, tokenized and packed by tasks (which give their CPUs back when
the lane is done) in windows a quarter of its size, and joined to the main lane by a union; the
main lane reads everything else. Packed rows leave in blocks of about 1 MiB (``BLOCK_BYTES``): the
trainers' ``streaming_split(equal=True)`` hands a block to one rank only while the blocks it still
holds can even the ranks out, so one block per window would hold the first batch back. The packer
tasks cut them as they put them in the object store (the plan's ``target_max_block_size``), not a
repartition operator after them: that copied every packed row once more, in another process. The
packing bench measures this packer at the job's window against global best-fit decreasing; the
pipeline bench measures the latency.

Mixing. Each dataset is its own stream per epoch: every sample once (no weights), or, with weights,
whole shuffled passes plus a random subsample, reading ``MIX_MARGIN`` (10%) more than its share of
the epoch (tokens or samples, ``mix.by``); the packers then trim each dataset to its share through
the ledger (``Ledger.admit``: first come, to the nearest sample, the same answer for a window Ray
runs again), so realized shares hit the weights whatever the subsample's luck, and the trimmed
samples are counted. Shares come from estimates (rows counted by a parse-only pass, mean lengths
tokenized from a sample of each dataset). Ray Data's ``Dataset.mix`` interleaves the datasets block
by block in the ratio of their expected rows, and raw blocks are cut to 1/``MIX_BLOCKS`` of a
window first, so every window holds every dataset in about its ratio. The planned path
(``packing.mode: planned``, ``epochs.py``) also repeats packs bit for bit per seed, at the price of
tokenizing everything before the first pack.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from rayjobs.config import Config, DatasetConfig
from rayjobs.data import seeds
from rayjobs.data.counts import PackCounts, StageTimer, batch_key, report, report_actor
from rayjobs.data.formats import HF, HF_PLACE, read_rows
from rayjobs.data.pack import StreamPacker
from rayjobs.data.preference import Triple, assemble_triples
from rayjobs.data.rows import assemble
from rayjobs.data.sources import (
    FileRead,
    compression_of,
    read_dataset,
    read_file_list,
    record_table,
)
from rayjobs.data.tokenize import TRIPLE_COLUMNS, Tokenize

SAMPLE_ROWS = 2048
"""Rows of each dataset tokenized in the driver to estimate its mean sample length."""

TOKENIZE_BATCH_ROWS = 256

TOKENIZE_CPUS = 1
"""Logical CPUs of a Tokenize actor, and the threads its tokenizer may use (``Tokenize``)."""

BLOCK_BYTES = 1 << 20
"""Bytes per block of packed rows (32 rows at seq_len 2048). Small blocks matter because the
trainers' ``streaming_split(equal=True)`` hands a block to one rank only while the blocks it still
holds can even the ranks out: one block per window would hold the first batch back until a second
window is packed (or the stream ends)."""

MIX_MARGIN = 0.1
"""Weighted mixing reads each dataset this much more than its share of an epoch, so that estimates
a little low still fill the share; the packers trim what lies beyond it (``Ledger.admit``)."""

MIX_BLOCKS = 16
"""Raw-row blocks per packer window at least, when datasets are mixed (see ``packed_rows``)."""

MIN_MIX_BLOCK_ROWS = 16

WARMUP_CALLS = 4
"""Packer calls over the warm-up lane: the first rows wait for a quarter of it."""

WARMUP_CPUS = 0.25
"""Logical CPUs of a warm-up lane task (short, and the main lane's actors hold theirs)."""


@dataclass(frozen=True)
class Estimate:
    """What the driver knows of a dataset before streaming it."""

    mean_tokens: float
    """Mean tokens per sample, from a tokenized sample of the dataset."""
    rows: int | None = None
    """Raw rows in the dataset, bad ones included (counted only when weights need it)."""
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


def estimate(config: Config, count_rows: bool) -> dict[str, Estimate]:
    """Each dataset's mean sample length (and, if asked, its row count)."""
    tokenize = Tokenize(
        config.datasets, config.tokenizer, config.packing.seq_len, config.packing.overflow
    )
    estimates = {}
    where = on_data_nodes(config)
    for spec in config.datasets:
        limit = SAMPLE_ROWS
        while True:  # a head the template or the overflow policy left nothing of: a longer one
            sample, density, raw_rows = _head(spec, where, limit)
            lengths = tokenize(sample).column("num_tokens").to_numpy() if sample else np.empty(0)
            taken = sample.num_rows if sample is not None else 0
            if len(lengths) or taken < limit:  # samples, or every row of the dataset read
                break
            limit *= 8
        if not len(lengths):
            raise ValueError(
                f"dataset {spec.name!r}: no samples in any of its {taken} good rows after "
                "templating (see on_bad_row and the overflow policy); it cannot be streamed"
            )
        sizes = {f: os.path.getsize(f) for f in spec.files} if spec.files else None
        count = None
        # A Hugging Face dataset has no bytes to size it by: counted always (it knows its
        # length), else it weighed 1 row in the mix of unweighted streams and its rows came
        # after every epoch of the file datasets'.
        if count_rows or spec.format == HF:
            count = read_dataset(spec, sizes=sizes, **where).count()
        estimates[spec.name] = Estimate(
            float(lengths.mean()), count, density, sizes, len(lengths) / raw_rows
        )
    return estimates


def _head(
    spec: DatasetConfig, where: dict[str, Any] | None = None, limit: int = SAMPLE_ROWS
) -> tuple[pa.Table | None, float | None, float]:
    """Up to ``limit`` good rows from the first files of a dataset, parsed in the driver (a
    cost that does not grow with the number of files; a Hugging Face dataset goes through Ray);
    the raw rows per byte of the files parsed; and the raw rows, bad ones included, that the good
    rows kept stand for (so samples per raw row = samples of the sample / this). ``where``:
    ``on_data_nodes``, for the read of a Hugging Face dataset."""
    if spec.format == HF:
        refs = read_dataset(spec, **(where or {})).limit(limit).to_arrow_refs()
        table = pa.concat_tables(ray.get(refs)) if refs else None
        return table, None, float(table.num_rows if table is not None else 1)
    tables, count, good_rows, bad_rows, parsed_bytes = [], 0, 0, 0, 0
    for path in spec.files:
        rows, records, consumed, bad = _parse_head(spec, path, limit - count)
        keep = min(len(rows), limit - count)
        tables.append(record_table(spec.name, [path] * keep, rows[:keep], records[:keep]))
        count += keep
        good_rows += len(rows)
        bad_rows += bad
        parsed_bytes += consumed
        if count >= limit:
            break
    density = (good_rows + bad_rows) / parsed_bytes if parsed_bytes else None
    raw_rows = count * (good_rows + bad_rows) / good_rows if good_rows else 1.0
    return (pa.concat_tables(tables) if tables else None), density, raw_rows


def _parse_head(
    spec: DatasetConfig, path: str, limit: int
) -> tuple[list[int], list[str], int, int]:
    """The first good rows of one file, parsed in the driver a bounded part at a time
    (``formats.read_rows``, as a read task does) until more than ``limit`` are in, or the file
    ends: (row numbers, records, bytes read for them, bad rows among them). Start-up reads the
    head of a large first file, never the whole of it."""
    rows: list[int] = []
    records: list[str] = []
    bad = 0
    codec = compression_of(path)
    with pa.OSFile(path) as raw:  # bytes read from disk: ``raw.tell()``, compressed or not
        file = pa.CompressedInputStream(raw, codec) if codec else raw
        parts = read_rows(
            file, path, format=spec.format, dataset=spec.name, text_split=spec.text_split,
            binary=spec.binary, on_bad_row=spec.on_bad_row,
        )  # fmt: skip
        for part in parts:
            rows += part.rows
            records += part.records
            bad += len(part.bad)
            if len(rows) > limit:
                break
        consumed = raw.tell()
    return rows, records, consumed, bad


@dataclass(frozen=True)
class Pass:
    """One read of a dataset within an epoch: its files in a fresh random order, whole or
    subsampled."""

    files: tuple[str, ...]
    """Files in reading order (empty for a Hugging Face dataset)."""
    order_seed: int
    sample: float | None
    """Fraction of rows kept by a random subsample; None for a whole pass."""
    sample_seed: int


def passes(spec: DatasetConfig, index: int, epoch: int, seed: int, fraction: float) -> list[Pass]:
    """How a dataset is read in one epoch: ``fraction`` of it as whole passes, then a random
    subsample; each pass its own file order (``seeds.STREAMS["stream_order"]``)."""
    whole, remainder = divmod(fraction, 1.0)
    reads = []
    for copy in range(int(whole) + (remainder > 1e-9)):
        rng = seeds.rng(seed, "stream_order", epoch, index, copy)
        order_seed, sample_seed = int(rng.integers(2**31)), int(rng.integers(2**31))
        order = np.random.default_rng(order_seed).permutation(len(spec.files))
        sample = remainder if copy == int(whole) else None
        reads.append(Pass(tuple(spec.files[i] for i in order), order_seed, sample, sample_seed))
    return reads


@dataclass(frozen=True)
class Head:
    """A dataset's part of the warm-up lane: the rows of ``path`` (the first file of the first
    epoch's first pass) numbered below ``below_row``."""

    path: str
    below_row: int
    rows: int


@dataclass(frozen=True)
class PassRead(FileRead):
    """One file of one pass (``Pass``) of one epoch as a read task reads it: the rows the pass
    keeps, tagged with the epoch and the pass (``_tag_epoch``). ``below``: the warm-up lane's
    read of the file, only its rows numbered below this; ``from_row``: the main lane's read of
    that file, only the rows from this on."""

    epoch: int = 0
    copy: int = 0
    sample: float | None = None
    sample_seed: int = 0
    root: str | None = None
    below: int | None = None
    from_row: int | None = None

    def rows(self, table: pa.Table) -> pa.Table:
        if self.below is not None:
            table = _below(table, self.below)
        if self.from_row is not None:
            table = table.filter(pc.greater_equal(table.column("_row"), self.from_row))
        if self.sample is not None:
            table = _subsample(table, self.sample, self.sample_seed, self.root)
        return _tag_epoch(table, self.epoch, self.copy)

    @property
    def share(self) -> float:
        return self.sample if self.sample is not None else 1.0


def pass_reads(
    spec: DatasetConfig, reads: list[list[Pass]], head: Head | None = None
) -> list[PassRead]:
    """Every file read of a dataset's run, epoch by epoch (``reads[epoch]``: that epoch's passes),
    pass by pass, in each pass's file order; the first epoch's first pass leaves the warm-up
    ``head`` out."""
    root = files_root(spec.files)
    return [
        PassRead(
            path,
            epoch=epoch,
            copy=copy,
            sample=read.sample,
            sample_seed=read.sample_seed,
            root=root,
            from_row=head.below_row
            if head and (epoch, copy) == (0, 0) and path == head.path
            else None,
        )
        for epoch, passes_ in enumerate(reads)
        for copy, read in enumerate(passes_)
        for path in read.files
    ]


def _run_stream(
    spec: DatasetConfig,
    reads: list[list[Pass]],
    where: dict[str, Any],
    head: Head | None,
    sizes: dict[str, int] | None = None,
) -> ray.data.Dataset:
    """One dataset's rows for the whole run (see ``pass_reads``): one read operator however many
    epochs and passes (each pass reads the files in a fresh random order: no all-to-all shuffle,
    which would wait for the whole dataset); the packer's window shuffles the samples.
    ``sizes``: the files' bytes (``Estimate.file_sizes``)."""
    if spec.format != HF:
        return read_file_list(spec, pass_reads(spec, reads, head), sizes=sizes, **where)
    parts = [  # a Hugging Face dataset: a read per pass, joined
        _tagged(_read_hf(spec, read, where), epoch, copy, where)
        for epoch, passes_ in enumerate(reads)
        for copy, read in enumerate(passes_)
    ]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _head_read(spec: DatasetConfig, head: Head, first: Pass) -> PassRead:
    """A dataset's part of the warm-up lane: the head of its first file, with the first pass's
    subsample."""
    return PassRead(
        head.path, sample=first.sample, sample_seed=first.sample_seed,
        root=files_root(spec.files), below=head.below_row,
    )  # fmt: skip


def _read_hf(spec: DatasetConfig, read: Pass, where: dict[str, Any]) -> ray.data.Dataset:
    """One pass over a Hugging Face dataset as raw rows, in a random block order."""
    rows = read_dataset(spec, order_seed=read.order_seed, **where)
    if read.sample is not None:  # (Dataset.random_sample takes no label selector)
        rows = rows.map_batches(
            _subsample, batch_format="pyarrow",
            fn_kwargs={"fraction": read.sample, "seed": read.sample_seed, "place": HF_PLACE},
            **where,
        )  # fmt: skip
    return rows


def files_root(files: tuple[str, ...] | list[str]) -> str | None:
    """The folder a dataset's files lie under (their deepest common folder); None without
    files (a Hugging Face dataset)."""
    if not files:
        return None
    return os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])


def _subsample(
    batch: pa.Table, fraction: float, seed: int, root: str | None = None, place: str | None = None
) -> pa.Table:
    """Each row kept with probability ``fraction``, decided by a hash of (seed, file, row), the
    file named by its path under ``root`` (``files_root``), or ``place`` for every row (a
    Hugging Face dataset: ``formats.HF_PLACE``): the same rows for the same seed whatever the
    blocks, their order, and wherever the dataset's folder lies."""
    paths = batch.column("_path").to_numpy(zero_copy_only=False)
    rows = batch.column("_row").to_numpy().astype(np.uint64)
    keys = np.empty(len(rows), dtype=np.uint64)
    for path in np.unique(paths):
        name = place or (os.path.relpath(os.path.abspath(path), root) if root else path)
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        mine = paths == path
        keys[mine] = rows[mine] + np.uint64(int.from_bytes(digest, "little"))
    return batch.filter(pa.array(_uniform(keys) < fraction))


def _uniform(keys: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 ``keys`` → floats uniform in [0, 1)."""
    z = keys + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _below(batch: pa.Table, row: int) -> pa.Table:
    return batch.filter(pc.less(batch.column("_row"), row))


def _tagged(
    rows: ray.data.Dataset, epoch: int, copy: int, where: dict[str, Any]
) -> ray.data.Dataset:
    """Rows tagged with their epoch and pass: the epoch groups them in the packer, and both
    tell a batch read twice in one epoch from a batch Ray runs again (``metrics.batch_key``)."""
    return rows.map_batches(
        _tag_epoch, batch_format="pyarrow", fn_kwargs={"epoch": epoch, "copy": copy}, **where
    )


def _tag_epoch(batch: pa.Table, epoch: int, copy: int) -> pa.Table:
    batch = batch.append_column("_epoch", pa.array(np.full(batch.num_rows, epoch, np.int32)))
    return batch.append_column("_pass", pa.array(np.full(batch.num_rows, copy, np.int32)))


def sized(config: Config) -> bool:
    """Whether each epoch holds set shares of the datasets (weights, or an epoch size: then each
    dataset in its natural proportion), read from estimates and trimmed by ledger budgets; else
    every epoch reads every dataset once, as it is."""
    epoch_size = config.mix.epoch_tokens if config.mix.by == "tokens" else config.mix.epoch_samples
    return config.datasets[0].weight is not None or epoch_size is not None


def epoch_fractions(config: Config, estimates: dict[str, Estimate]) -> list[float]:
    """How many times each dataset is read per epoch (1.0 = every sample once): its share of the
    epoch (by weight; without weights, in its natural proportion), in ``mix.by`` units, over its
    estimated size."""
    specs = config.datasets
    if not sized(config):
        return [1.0] * len(specs)
    by_tokens = config.mix.by == "tokens"
    sizes = np.array(
        [
            _samples_hint(estimates[s.name]) * (estimates[s.name].mean_tokens if by_tokens else 1.0)
            for s in specs
        ]
    )
    weighted = specs[0].weight is not None
    shares = np.array([s.weight for s in specs], dtype=np.float64) if weighted else sizes.copy()
    shares /= shares.sum()
    total = (config.mix.epoch_tokens if by_tokens else config.mix.epoch_samples) or sizes.sum()
    return list(shares * total / sizes)


def on_data_nodes(config: Config) -> dict[str, Any]:
    """Ray Data remote arguments that keep a data task or actor on the nodes
    ``ray.data_label_selector`` names (nothing when it is empty). Every data operator takes the
    same ones: operators whose arguments differ are not fused."""
    selector = config.ray.data_label_selector
    return {"label_selector": dict(selector)} if selector else {}


def cluster_cpus(config: Config | None = None) -> float:
    """Logical CPUs of the running Ray cluster's alive nodes that the data may use (those
    ``ray.data_label_selector`` matches): the actor pools' default ceilings follow it."""
    selector = config.ray.data_label_selector if config is not None else {}
    if not selector:
        return float(ray.cluster_resources().get("CPU", 1.0))
    cpus = sum(
        node["Resources"].get("CPU", 0.0)
        for node in ray.nodes()
        if node.get("Alive") and labels_match(node.get("Labels") or {}, selector)
    )
    return float(cpus) or 1.0


def labels_match(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node's ``labels`` satisfy a Ray label ``selector``: ``value``, ``!value``,
    ``in(a,b)``, ``!in(a,b)`` per key."""
    for key, wanted in selector.items():
        negate = wanted.startswith("!")
        wanted = wanted.removeprefix("!")
        if wanted.startswith("in(") and wanted.endswith(")"):
            values = {v.strip() for v in wanted[3:-1].split(",")}
        else:
            values = {wanted}
        if (labels.get(key) in values) == negate:
            return False
    return True


def tokenized(
    rows: ray.data.Dataset, config: Config, ledger: Any = None, tasks: bool = False
) -> ray.data.Dataset:
    """Raw rows → tokenized samples through one Tokenize actor pool, which grows up to
    ``ray.tokenize_concurrency`` actors (default half the cluster's CPUs) while data waits; or,
    with ``tasks`` (the warm-up lane), through tasks (``_stage_task``)."""
    kwargs = {
        "datasets": config.datasets,
        "tokenizer": config.tokenizer,
        "seq_len": config.packing.seq_len,
        "overflow": config.packing.overflow,
        "ledger": ledger,
        "threads": TOKENIZE_CPUS,
    }
    ceiling = config.ray.tokenize_concurrency or max(1, int(cluster_cpus(config)) // 2)
    actors = 0 if tasks else ceiling
    return _stage(
        rows, Tokenize, kwargs, TOKENIZE_BATCH_ROWS, config, num_cpus=TOKENIZE_CPUS, actors=actors
    )


def _stage(
    rows: ray.data.Dataset,
    stage: type,
    kwargs: dict[str, Any],
    batch_size: int,
    config: Config,
    num_cpus: float,
    actors: int,
) -> ray.data.Dataset:
    """``rows.map_batches`` through a ``map_batches`` class: a pool of up to ``actors`` actors
    of ``num_cpus`` each (starting at ``ray.min_actors``), or, with ``actors`` 0, tasks of
    ``WARMUP_CPUS`` (``_stage_task``)."""
    where = on_data_nodes(config)
    if not actors:
        return rows.map_batches(
            _stage_task, batch_size=batch_size, batch_format="pyarrow", num_cpus=WARMUP_CPUS,
            fn_kwargs={"stage": stage, "kwargs": kwargs}, **where,
        )  # fmt: skip
    return rows.map_batches(
        stage,
        batch_size=batch_size,
        batch_format="pyarrow",
        num_cpus=num_cpus,
        compute=ray.data.ActorPoolStrategy(
            min_size=min(config.ray.min_actors, actors), max_size=actors
        ),
        fn_constructor_kwargs=kwargs,
        **where,
    )


_STAGES: dict[str, Any] = {}


def _stage_task(batch: pa.Table, stage: type, kwargs: dict[str, Any]) -> Any:
    """Run a ``map_batches`` class as a task: one instance per worker process and arguments, so
    the tokenizer loads once per process. The warm-up lane runs this way: its work is short, and
    a task, unlike an actor, gives its CPU back when done (actors held for the whole run by a lane
    that finished early could starve the main lane and the trainers on a small cluster)."""
    import hashlib

    from ray import cloudpickle

    key = stage.__name__ + hashlib.blake2b(cloudpickle.dumps(kwargs)).hexdigest()
    if key not in _STAGES:
        _STAGES[key] = stage(**kwargs)
    return _STAGES[key](batch)


def window_rows(window_tokens: int, mean_tokens: float) -> int:
    """Samples per packer call: ``window_tokens`` over the mean sample length (the bench sizes its
    windows with this too)."""
    return max(1, int(window_tokens / max(1.0, mean_tokens)))


def _rows_hint(estimate: Estimate) -> float:
    """Raw rows in a dataset: counted, else its bytes times the raw rows per byte of its first
    files (what the streams are interleaved by: rows, before tokenization)."""
    if estimate.rows is not None:
        return float(estimate.rows)
    size = float(estimate.size or 1)
    return size * estimate.rows_per_byte if estimate.rows_per_byte else size


def _samples_hint(estimate: Estimate) -> float:
    """Samples a dataset makes: its raw rows times the samples per raw row of its first rows
    (what shares and budgets count)."""
    return _rows_hint(estimate) * estimate.samples_per_row


def warmup_heads(
    config: Config, estimates: dict[str, Estimate], fractions: list[float], first_reads: list[Pass]
) -> dict[str, Head]:
    """Each file-based dataset's part of the warm-up lane: ``packing.warmup_tokens`` split in the
    ratio of the datasets' expected tokens in the first epoch, taken from the head of the first
    file each reads (parsed here, in the driver: one file per dataset)."""
    if not config.packing.warmup_tokens:
        return {}
    expected = {
        spec.name: fraction * _samples_hint(estimates[spec.name]) * estimates[spec.name].mean_tokens
        for spec, fraction in zip(config.datasets, fractions, strict=True)
    }
    total = sum(expected.values())
    heads = {}
    for spec, read in zip(config.datasets, first_reads, strict=True):
        if spec.format == HF or not total:
            continue
        tokens = config.packing.warmup_tokens * expected[spec.name] / total
        wanted = int(np.ceil(tokens / estimates[spec.name].mean_tokens / (read.sample or 1.0)))
        rows, _, _, _ = _parse_head(spec, read.files[0], wanted)
        if wanted and rows:
            below = rows[wanted] if wanted < len(rows) else rows[-1] + 1
            heads[spec.name] = Head(read.files[0], below, min(wanted, len(rows)))
    return heads


def packed_rows(config: Config, pad_id: int, ledger: Any = None) -> ray.data.Dataset:
    """The packed rows of every epoch, in epoch order, as one lazy dataset (see module note)."""
    weighted = sized(config)
    estimates = estimate(config, count_rows=weighted)
    fractions = epoch_fractions(config, estimates)
    margin = 1.0 + MIX_MARGIN if weighted else 1.0  # read a margin more, trim to the share
    reads = [
        [
            passes(spec, index, epoch, config.seed, fractions[index] * margin)
            for epoch in range(config.train.epochs)
        ]
        for index, spec in enumerate(config.datasets)
    ]  # reads[dataset][epoch]: that epoch's passes over the dataset
    if weighted and ledger is not None:
        ray.get(ledger.set_budgets.remote(budgets(config, estimates, fractions)))
    heads = warmup_heads(config, estimates, fractions, [r[0][0] for r in reads])
    where = on_data_nodes(config)
    streams, expected = [], []
    for index, spec in enumerate(config.datasets):
        sizes = estimates[spec.name].file_sizes
        streams.append(_run_stream(spec, reads[index], where, heads.get(spec.name), sizes))
        expected.append(fractions[index] * _rows_hint(estimates[spec.name]))
    rows = streams[0]
    mean_tokens = float(np.mean([e.mean_tokens for e in estimates.values()]))
    window = window_rows(config.packing.window_tokens, mean_tokens)
    if len(streams) > 1:  # interleaved block by block in the ratio of expected rows
        # Blocks of at most 1/MIX_BLOCKS of a window, so each window holds every dataset in
        # about its ratio (a block is the unit Dataset.mix interleaves).
        block = max(MIN_MIX_BLOCK_ROWS, window // MIX_BLOCKS)
        streams = [s.repartition(target_num_rows_per_block=block) for s in streams]
        rows = streams[0].mix(*streams[1:], weights=list(np.array(expected) / sum(expected)))
    packers = config.ray.pack_concurrency or max(1, int(cluster_cpus(config)) // 4)
    packed = _packed(
        tokenized(rows, config, ledger), config, pad_id, ledger,
        window, packers,
    )  # fmt: skip
    if heads:
        specs = {spec.name: (spec, reads[i][0][0]) for i, spec in enumerate(config.datasets)}
        parts = []
        for name, head in heads.items():
            spec, first = specs[name]
            read = _head_read(spec, head, first)
            parts.append(read_file_list(spec, [read], sizes=estimates[name].file_sizes, **where))
        warm = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        warm_tokens = max(config.packing.warmup_tokens // WARMUP_CALLS, config.packing.seq_len)
        window = window_rows(warm_tokens, mean_tokens)  # at least a row's worth (long seq_len)
        warm = tokenized(warm, config, ledger, tasks=True)
        packed = _packed(warm, config, pad_id, ledger, window, 0).union(packed)
    # Every task's output cut into blocks of about BLOCK_BYTES. The setting is the plan's (Ray Data
    # plans a dataset with one context): it shapes the packers' output, and caps the raw-row and
    # tokenized blocks before them too (a zero-copy slice of a larger one; a 256-row tokenized
    # batch is ~0.5 MiB at the demo's lengths).
    packed.context.target_max_block_size = BLOCK_BYTES
    return packed


def budgets(
    config: Config, estimates: dict[str, Estimate], fractions: list[float]
) -> dict[tuple[int, str], float]:
    """Each dataset's share of each epoch in ``mix.by`` units, from the estimates: what its
    ``fraction`` of a read would hold (``Ledger.admit`` trims the margin read beyond it)."""
    by_tokens = config.mix.by == "tokens"
    return {
        (epoch, spec.name): fraction
        * _samples_hint(estimates[spec.name])
        * (estimates[spec.name].mean_tokens if by_tokens else 1.0)
        for epoch in range(config.train.epochs)
        for spec, fraction in zip(config.datasets, fractions, strict=True)
    }


def _packed(
    samples: ray.data.Dataset, config: Config, pad_id: int, ledger: Any, window: int, actors: int
) -> ray.data.Dataset:
    """Tokenized samples → packed rows through a pool of up to ``actors`` PackStream actors (0:
    tasks, the warm-up lane), one call per ``window`` samples (``packed_rows`` sets the block
    size)."""
    kwargs = {
        "seq_len": config.packing.seq_len,
        "strategy": config.packing.strategy,
        "pad_id": pad_id,
        "seed": config.seed,
        "ledger": ledger,
        "budget": config.mix.by if sized(config) else None,
    }
    return _stage(samples, PackStream, kwargs, window, config, num_cpus=0.5, actors=actors)


def pack_batch(
    lengths: np.ndarray, seq_len: int, strategy: str, rng: np.random.Generator
) -> list[np.ndarray]:
    """Every sample of one window in exactly one pack: best-fit decreasing over the shuffled
    window, under-filled packs re-packed once with each other; packs and documents shuffled."""
    packer = StreamPacker(seq_len, strategy, rng=rng)
    ids = np.arange(len(lengths))
    return packer.push(ids, lengths) + packer.flush()


class PackStream:
    """Ray Data ``map_batches`` class: a window of tokenized samples → its packed rows, every
    sample placed, nothing kept for the next call (see module note)."""

    def __init__(
        self,
        seq_len: int,
        strategy: str,
        pad_id: int,
        seed: int,
        ledger: Any = None,
        budget: str | None = None,
    ):
        """``budget``: ``tokens`` or ``samples`` when each dataset's share of an epoch is a
        budget held by the ledger (weighted mixing), else None."""
        self.seq_len, self.strategy, self.pad_id = seq_len, strategy, pad_id
        self.seed, self.ledger, self.budget = seed, ledger, budget
        report_actor(ledger, "PackStream")

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        outputs = []
        for epoch in sorted(pc.unique(batch.column("_epoch")).to_pylist()):
            mine = batch.filter(pc.equal(batch.column("_epoch"), epoch))
            key = window_key(mine, epoch)
            kept, trimmed = self._admitted(mine, epoch, key)
            with StageTimer() as timer:
                rows = self._pack(kept, epoch)
            counts = pack_counts(kept, rows, self.seq_len, timer, trimmed)
            report(self.ledger, "add_pack", epoch, counts, key, samples_per_pack(rows))
            outputs.append(rows)
        return {name: np.concatenate([rows[name] for rows in outputs]) for name in outputs[0]}

    def _admitted(self, batch: pa.Table, epoch: int, key: str) -> tuple[pa.Table, pa.Table | None]:
        """The window's samples that fit their datasets' shares of the epoch (all of them
        without a budget), and those trimmed."""
        if self.budget is None or self.ledger is None:
            return batch, None
        sources = batch.column("source").to_numpy(zero_copy_only=False)
        sizes = batch.column("num_tokens").to_numpy()
        if self.budget == "samples":
            sizes = np.ones_like(sizes)
        wants = {name: sizes[sources == name].tolist() for name in np.unique(sources)}
        grant = ray.get(self.ledger.admit.remote(key, epoch, wants))
        keep = np.zeros(len(sources), dtype=bool)
        for name, n in grant.items():
            keep[np.flatnonzero(sources == name)[:n]] = True
        return batch.filter(pa.array(keep)), batch.filter(pa.array(~keep))

    def _pack(self, batch: pa.Table, epoch: int) -> dict[str, np.ndarray]:
        lengths = batch.column("num_tokens").to_numpy().astype(np.int64)
        uids = batch.column("uid").to_numpy()
        # Seeded by the window's content: the same samples in a window pack the same way.
        rng = seeds.rng(self.seed, "pack_window", epoch, int(uids.min()) if len(uids) else 0)
        packs = pack_batch(lengths, self.seq_len, self.strategy, rng)
        if TRIPLE_COLUMNS[0] in batch.column_names:  # task: dpo: a unit of three documents each
            parts = [batch.column(name).to_numpy(zero_copy_only=False) for name in TRIPLE_COLUMNS]
            triples = [Triple(*triple) for triple in zip(*parts, strict=True)]
            rows = assemble_triples(triples, packs, self.seq_len, self.pad_id)
            rows["epoch"] = np.full(len(packs), epoch, dtype=np.int32)
            return rows
        order = np.concatenate(packs) if packs else np.empty(0, dtype=np.int64)
        tokens, labels, starts = flat_samples(batch)
        rows = assemble(
            tokens,
            labels,
            starts[order],
            lengths[order],
            np.array([len(p) for p in packs], dtype=np.int64),
            self.seq_len,
            self.pad_id,
        )
        rows["epoch"] = np.full(len(packs), epoch, dtype=np.int32)
        return rows


def samples_per_pack(rows: dict[str, np.ndarray]) -> list[int]:
    """Samples in each packed row: its documents (a preference triple is three)."""
    per_sample = 3 if "response_role" in rows else 1
    return (np.asarray(rows["num_documents"]) // per_sample).tolist()


def window_key(batch: pa.Table, epoch: int) -> str:
    """The identity of one epoch's part of a packer window (``metrics.batch_key``): its samples'
    uids and passes."""
    passes = batch.column("_pass") if "_pass" in batch.column_names else []
    return batch_key("pack", [epoch], batch.column("uid"), passes)


def flat_samples(batch: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """A batch's ``input_ids`` and ``labels`` as their chunks' values (zero-copy) and each sample's
    start in their concatenation, for ``rows.assemble``.

    Raises:
        ValueError: if a sample's labels differ in length from its input_ids.
    """
    tokens, starts = _flat_values(batch.column("input_ids"))
    labels, label_starts = _flat_values(batch.column("labels"))
    if not np.array_equal(starts, label_starts):
        raise ValueError("a sample's labels differ in length from its input_ids")
    return tokens, labels, starts


def _flat_values(column: pa.ChunkedArray) -> tuple[list[np.ndarray], np.ndarray]:
    """A list<int32> column as its chunks' values (zero-copy) and each row's start in their
    concatenation."""
    values, starts, offset = [], [], 0
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values.append(chunk.values.to_numpy()[offsets[0] : offsets[-1]])
        starts.append(offsets[:-1] - offsets[0] + offset)
        offset += int(offsets[-1] - offsets[0])
    return values, np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)


def _by_source(batch: pa.Table) -> tuple[dict[str, int], dict[str, int]]:
    """Samples and tokens of a batch by source."""
    by_source = batch.group_by("source").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
    names = by_source.column("source").to_pylist()
    return (
        dict(zip(names, by_source.column("num_tokens_count").to_pylist(), strict=True)),
        dict(zip(names, by_source.column("num_tokens_sum").to_pylist(), strict=True)),
    )


def pack_counts(
    batch: pa.Table,
    rows: dict[str, np.ndarray],
    seq_len: int,
    timer: StageTimer,
    trimmed: pa.Table | None = None,
) -> PackCounts:
    """What one pack call emitted (and trimmed to the datasets' shares), by source, for the
    ledger."""
    documents, tokens = _by_source(batch)
    trimmed_documents, trimmed_tokens = _by_source(trimmed) if trimmed is not None else ({}, {})
    num_packs = len(rows["num_tokens"])
    return PackCounts(
        num_packs=num_packs,
        num_tokens=int(rows["num_tokens"].sum()),
        num_slots=num_packs * seq_len,
        num_documents=batch.num_rows,
        calls=1,
        documents_by_source=documents,
        tokens_by_source=tokens,
        trimmed_by_source=trimmed_documents,
        trimmed_tokens_by_source=trimmed_tokens,
        seconds=timer.seconds,
        cpu_seconds=timer.cpu_seconds,
    )
