"""The streaming data path: one lazy Ray dataset of packed rows for every epoch of a run.

Design note. Nothing waits for the end of an earlier stage: read tasks (one per file) feed a
Tokenize actor pool that grows with the cluster, then a pool of ``PackStream`` actors, then the
trainers through ``streaming_split``. The epochs are one stream (each row says its ``epoch``), so
the next epoch is read and tokenized while the current one trains: no idle gap at the boundary.

Packing without stranding. A ``map_batches`` actor gets no end-of-data call, so a packer that
carries under-filled packs from one call to the next can be left holding them when the stream
ends. ``PackStream`` therefore keeps nothing between calls: each call packs its whole batch
(best-fit decreasing, shuffled; under-filled packs re-packed once with the rest) and
emits every sample in exactly one row. The price is one under-filled tail per call, about half a
pack, so the window is sized in tokens, not samples: ``packing.window_tokens`` tokens per call
(the row count comes from a driver-side estimate of each dataset's mean sample length). The
window is also the first batch's latency: no row leaves before a window is tokenized, so the first
batch comes after start-up plus ``window_tokens`` over the cluster's tokenize rate. The packing
bench measures this packer at the job's window against global best-fit decreasing; the pipeline
bench measures the latency.

Mixing. Each dataset is its own stream per epoch: every sample once (no weights), or, with weights,
whole shuffled passes plus a random subsample so that its expected share of the epoch (tokens or
samples, ``mix.by``) is its weight. Ray Data's ``Dataset.mix`` interleaves the datasets block by
block in the ratio of their expected rows, so every part of an epoch holds every dataset. Shares
are set from estimates (rows counted by a parse-only pass, mean lengths tokenized from a sample of
each dataset); the realized mix of each epoch is counted exactly by the pack stage and reported.
The planned path (``packing.mode: planned``, ``epochs.py``) hits shares exactly and repeats packs
bit for bit per seed, at the price of tokenizing everything before the first pack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from rayjobs import seeds
from rayjobs.config import Config, DatasetConfig
from rayjobs.formats import HF, parse_file
from rayjobs.metrics import PackCounts, StageTimer, report, report_actor
from rayjobs.pack import StreamPacker
from rayjobs.rows import assemble
from rayjobs.sources import read_dataset, record_table
from rayjobs.tokenize import Tokenize

SAMPLE_ROWS = 2048
"""Rows of each dataset tokenized in the driver to estimate its mean sample length."""

TOKENIZE_BATCH_ROWS = 256


@dataclass(frozen=True)
class Estimate:
    """What the driver knows of a dataset before streaming it."""

    mean_tokens: float
    """Mean tokens per sample, from a tokenized sample of the dataset."""
    rows: int | None = None
    """Rows in the dataset (counted only when weights need it)."""


def estimate(config: Config, count_rows: bool) -> dict[str, Estimate]:
    """Each dataset's mean sample length (and, if asked, its row count)."""
    tokenize = Tokenize(
        config.datasets, config.tokenizer, config.packing.seq_len, config.packing.overflow
    )
    estimates = {}
    for spec in config.datasets:
        sample = _head(spec)
        lengths = tokenize(sample).column("num_tokens").to_numpy() if sample else np.empty(0)
        if not len(lengths):
            raise ValueError(
                f"dataset {spec.name!r}: no samples in its first {SAMPLE_ROWS} rows after "
                "templating (see on_bad_row and the overflow policy); it cannot be streamed"
            )
        count = read_dataset(spec).count() if count_rows else None
        estimates[spec.name] = Estimate(float(lengths.mean()), count)
    return estimates


def _head(spec: DatasetConfig) -> pa.Table | None:
    """Up to ``SAMPLE_ROWS`` raw rows from the first files of a dataset, parsed in the driver: a
    cost that does not grow with the number of files (a Hugging Face dataset goes through Ray)."""
    if spec.format == HF:
        refs = read_dataset(spec).limit(SAMPLE_ROWS).to_arrow_refs()
        return pa.concat_tables(ray.get(refs)) if refs else None
    tables, count = [], 0
    for path in spec.files:
        rows, records = parse_file(
            Path(path).read_bytes(), path, format=spec.format, dataset=spec.name,
            text_split=spec.text_split,
        )  # fmt: skip
        keep = min(len(rows), SAMPLE_ROWS - count)
        tables.append(record_table(spec.name, [path] * keep, rows[:keep], records[:keep]))
        count += keep
        if count >= SAMPLE_ROWS:
            break
    return pa.concat_tables(tables) if tables else None


def _epoch_stream(
    spec: DatasetConfig, index: int, epoch: int, seed: int, fraction: float
) -> ray.data.Dataset:
    """One dataset's rows for one epoch: ``fraction`` of it (whole passes, then a random
    subsample), each pass reading its files in a fresh random order (no all-to-all shuffle: that
    would wait for the whole dataset), every row tagged with the epoch; the packer's window
    shuffles the samples."""
    passes, remainder = divmod(fraction, 1.0)
    parts = []
    for copy in range(int(passes) + (remainder > 1e-9)):
        rng = seeds.rng(seed, "stream_order", epoch, index, copy)
        part = read_dataset(spec, order_seed=int(rng.integers(2**31)))
        if copy == int(passes):
            part = part.random_sample(remainder, seed=int(rng.integers(2**31)))
        parts.append(part)
    rows = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    return rows.map_batches(_tag_epoch, batch_format="pyarrow", fn_kwargs={"epoch": epoch})


def _tag_epoch(batch: pa.Table, epoch: int) -> pa.Table:
    return batch.append_column("_epoch", pa.array(np.full(batch.num_rows, epoch, np.int32)))


def epoch_fractions(config: Config, estimates: dict[str, Estimate]) -> list[float]:
    """How many times each dataset is read per epoch (1.0 = every sample once): its weight's
    share of the epoch, in ``mix.by`` units, over its estimated size."""
    specs = config.datasets
    if specs[0].weight is None:
        return [1.0] * len(specs)
    by_tokens = config.mix.by == "tokens"
    sizes = np.array(
        [
            estimates[s.name].rows * (estimates[s.name].mean_tokens if by_tokens else 1.0)
            for s in specs
        ]
    )
    shares = np.array([s.weight for s in specs], dtype=np.float64)
    shares /= shares.sum()
    total = (config.mix.epoch_tokens if by_tokens else config.mix.epoch_samples) or sizes.sum()
    return list(shares * total / sizes)


def cluster_cpus() -> float:
    """Logical CPUs of the running Ray cluster (the actor pools' default ceilings follow it)."""
    return float(ray.cluster_resources().get("CPU", 1.0))


def tokenized(rows: ray.data.Dataset, config: Config, ledger: Any = None) -> ray.data.Dataset:
    """Raw rows → tokenized samples through one Tokenize actor pool, which grows up to
    ``ray.tokenize_concurrency`` actors (default half the cluster's CPUs) while data waits."""
    ceiling = config.ray.tokenize_concurrency or max(1, int(cluster_cpus()) // 2)
    return rows.map_batches(
        Tokenize,
        batch_size=TOKENIZE_BATCH_ROWS,
        batch_format="pyarrow",
        num_cpus=1,
        compute=ray.data.ActorPoolStrategy(
            min_size=min(config.ray.min_actors, ceiling), max_size=ceiling
        ),
        fn_constructor_kwargs={
            "datasets": config.datasets,
            "tokenizer": config.tokenizer,
            "seq_len": config.packing.seq_len,
            "overflow": config.packing.overflow,
            "ledger": ledger,
        },
    )


def window_rows(window_tokens: int, mean_tokens: float) -> int:
    """Samples per packer call: ``window_tokens`` over the mean sample length (the bench sizes its
    windows with this too)."""
    return max(1, int(window_tokens / max(1.0, mean_tokens)))


def _size_hint(spec: DatasetConfig, estimate: Estimate) -> float:
    """Relative size of a dataset for interleaving: its rows when counted, else its bytes."""
    if estimate.rows is not None:
        return float(estimate.rows)
    return float(sum(os.path.getsize(f) for f in spec.files)) if spec.files else 1.0


def packed_rows(config: Config, pad_id: int, ledger: Any = None) -> ray.data.Dataset:
    """The packed rows of every epoch, in epoch order, as one lazy dataset (see module note)."""
    estimates = estimate(config, count_rows=config.datasets[0].weight is not None)
    fractions = epoch_fractions(config, estimates)
    streams, expected = [], []
    for index, spec in enumerate(config.datasets):
        epochs = [
            _epoch_stream(spec, index, epoch, config.seed, fractions[index])
            for epoch in range(config.train.epochs)
        ]
        streams.append(epochs[0].union(*epochs[1:]) if len(epochs) > 1 else epochs[0])
        expected.append(fractions[index] * _size_hint(spec, estimates[spec.name]))
    rows = streams[0]
    if len(streams) > 1:  # interleaved block by block in the ratio of expected rows
        rows = rows.mix(*streams[1:], weights=list(np.array(expected) / sum(expected)))
    packers = config.ray.pack_concurrency or max(1, int(cluster_cpus()) // 4)
    return tokenized(rows, config, ledger).map_batches(
        PackStream,
        batch_size=window_rows(
            config.packing.window_tokens,
            float(np.mean([e.mean_tokens for e in estimates.values()])),
        ),
        batch_format="pyarrow",
        num_cpus=0.5,
        compute=ray.data.ActorPoolStrategy(
            min_size=min(config.ray.min_actors, packers), max_size=packers
        ),
        fn_constructor_kwargs={
            "seq_len": config.packing.seq_len,
            "strategy": config.packing.strategy,
            "pad_id": pad_id,
            "seed": config.seed,
            "ledger": ledger,
        },
    )


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

    def __init__(self, seq_len: int, strategy: str, pad_id: int, seed: int, ledger: Any = None):
        self.seq_len, self.strategy, self.pad_id = seq_len, strategy, pad_id
        self.seed, self.ledger = seed, ledger
        report_actor(ledger, "PackStream")

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        outputs = []
        for epoch in sorted(pc.unique(batch.column("_epoch")).to_pylist()):
            mine = batch.filter(pc.equal(batch.column("_epoch"), epoch))
            with StageTimer() as timer:
                rows = self._pack(mine, epoch)
            report(self.ledger, "add_pack", epoch, pack_counts(mine, rows, self.seq_len, timer))
            outputs.append(rows)
        return {name: np.concatenate([rows[name] for rows in outputs]) for name in outputs[0]}

    def _pack(self, batch: pa.Table, epoch: int) -> dict[str, np.ndarray]:
        lengths = batch.column("num_tokens").to_numpy().astype(np.int64)
        uids = batch.column("uid").to_numpy()
        # Seeded by the window's content: the same samples in a window pack the same way.
        rng = seeds.rng(self.seed, "pack_window", epoch, int(uids.min()) if len(uids) else 0)
        packs = pack_batch(lengths, self.seq_len, self.strategy, rng)
        order = np.concatenate(packs)
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


def pack_counts(
    batch: pa.Table, rows: dict[str, np.ndarray], seq_len: int, timer: StageTimer
) -> PackCounts:
    """What one pack call emitted, by source, for the ledger."""
    by_source = batch.group_by("source").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
    names = by_source.column("source").to_pylist()
    num_packs = len(rows["num_tokens"])
    return PackCounts(
        num_packs=num_packs,
        num_tokens=int(rows["num_tokens"].sum()),
        num_slots=num_packs * seq_len,
        num_documents=batch.num_rows,
        calls=1,
        documents_by_source=dict(
            zip(names, by_source.column("num_tokens_count").to_pylist(), strict=True)
        ),
        tokens_by_source=dict(
            zip(names, by_source.column("num_tokens_sum").to_pylist(), strict=True)
        ),
        seconds=timer.seconds,
        cpu_seconds=timer.cpu_seconds,
    )
