"""The streaming packer: ``PackStream``, a ``map_batches`` class that packs each window of tokenized
samples into fixed-length rows, every sample placed in the call that received it.

A ``map_batches`` actor gets no end-of-data call, so a packer that carried under-filled packs from
one call to the next could be left holding them when the stream ends: ``PackStream`` keeps nothing
between calls, and the window is sized in tokens so each call's one under-filled tail is small
(docs/design.md, "Streaming, and what it guarantees"). With weights, each window is first trimmed to
its datasets' shares of the epoch through the ledger (``Ledger.admit``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayjobs.data import seeds
from rayjobs.data.counts import PackCounts, StageTimer, batch_key, report, report_actor
from rayjobs.data.pack import StreamPacker
from rayjobs.data.tasks import TASKS

WARMUP_SKIP = 4
"""A first epoch expected to hold at most this many times ``packing.warmup_tokens`` gets no
warm-up lane: its first window waits for at most this many lanes' tokens (seconds of
tokenizing)."""

LANE_MIN_ROWS = 1000
"""Nor does one expected to fill fewer rows than this: the lane's one cost is its under-filled
tail row, under 0.1 point of efficiency only over this many rows (several points on the bundled
sets, ``rayjobs bench packing``). Without a lane the first batch waits for the first main window
(``packing.window_tokens``, or the whole epoch where smaller)."""


def lane_tokens(epoch_tokens: float, warmup_tokens: int, seq_len: int) -> int:
    """Tokens of the first epoch's warm-up lane, packed in one call: ``warmup_tokens``, or 0 for
    no lane (``WARMUP_SKIP``, ``LANE_MIN_ROWS``).

    >>> lane_tokens(4_000_000, 262_144, 2048), lane_tokens(1_500_000, 262_144, 2048)
    (262144, 0)
    """
    small = max(WARMUP_SKIP * warmup_tokens, LANE_MIN_ROWS * seq_len)
    return 0 if not warmup_tokens or epoch_tokens <= small else warmup_tokens


LANE_BLOCKS_PER_RANK = 8
"""Blocks per rank the warm-up lane's packed rows are cut into (``lane_block_rows``)."""


def lane_block_rows(lane_tokens: int, seq_len: int, ranks: int) -> int:
    """Rows per block of the warm-up lane's packed rows: about ``LANE_BLOCKS_PER_RANK`` blocks
    for each of ``ranks`` consumers, so an equal split can hand every rank some at once.

    >>> lane_block_rows(262_144, 2048, 2), lane_block_rows(262_144, 8192, 8)
    (8, 1)
    """
    return max(1, lane_tokens // seq_len // (LANE_BLOCKS_PER_RANK * ranks))


def window_rows(window_tokens: int, mean_tokens: float) -> int:
    """Samples per packer call: ``window_tokens`` over the mean sample length (the bench sizes its
    windows with this too)."""
    return max(1, int(window_tokens / max(1.0, mean_tokens)))


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
        task: str = "sft",
    ):
        """``budget``: ``tokens`` or ``samples`` when each dataset's share of an epoch is a
        budget held by the ledger (weighted mixing), else None. ``task``: what the samples are
        (``rayjobs.data.tasks.TASKS``)."""
        self.task = TASKS[task]
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
            per_pack = rows["num_documents"] // self.task.documents_per_sample
            report(self.ledger, "add_pack", epoch, counts, key, per_pack.tolist())
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
        grant = report(self.ledger, "admit", key, epoch, wants)
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
        rows = self.task.assemble(batch, packs, self.seq_len, self.pad_id)
        rows["epoch"] = np.full(len(packs), epoch, dtype=np.int32)
        return rows


def window_key(batch: pa.Table, epoch: int) -> str:
    """The identity of one epoch's part of a packer window (``metrics.batch_key``): its samples'
    uids and passes."""
    passes = batch.column("_pass") if "_pass" in batch.column_names else []
    return batch_key("pack", [epoch], batch.column("uid"), passes)


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
