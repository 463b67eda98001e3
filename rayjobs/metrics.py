"""Metrics: exact per-run accounting (the ``Ledger`` actor) and Prometheus series for the dashboard.

Design note. Two needs, one place. The run summary needs *exact* counts (samples, tokens,
truncation, drops, skips per dataset; packs and pad slots), gathered from Tokenize and packing
actors (``PackStream``; ``AssemblePacks`` in planned mode) spread over the cluster. Each of those
calls ``ray.get(ledger.add_….remote(...))`` once per batch, synchronously, so by the time a batch's
rows reach a trainer its counts are already in the ledger and the driver's final ``snapshot()``
misses nothing. The same calls feed ``ray.util.metrics`` counters, exported by every Ray node to
Prometheus (``ray_rayjobs_*``) and shown on the Ray dashboard / Grafana while the job runs.
Tokenization is counted over the run, by dataset (stream mode tokenizes every epoch's reads, planned
mode once); packing per epoch. A retried Ray task would count its batch twice.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import ray


class StageTimer:
    """Wall and CPU seconds of a block, the stage timers of the bench and the summary.

    CPU time is the process's (all threads: the Rust tokenizer's too); wall time also counts
    waiting for a core.

    >>> with StageTimer() as timer:
    ...     _ = sum(range(1000))
    >>> timer.seconds >= 0 and timer.cpu_seconds >= 0
    True
    """

    seconds = cpu_seconds = 0.0

    def __enter__(self) -> StageTimer:
        self._started, self._cpu_started = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds += time.perf_counter() - self._started
        self.cpu_seconds += time.process_time() - self._cpu_started


def report_actor(ledger: Any, kind: str) -> None:
    """Tell the run's ledger that an actor of ``kind`` started on this node (where the work ran)."""
    if ledger is not None and ray.is_initialized():
        report(ledger, "add_actor", kind, ray.get_runtime_context().get_node_id())


def report(ledger: Any, method: str, *args: Any) -> None:
    """Call ``ledger.<method>(*args)`` and wait for it (so counts are in before rows move on);
    no-op without a ledger (in-process use, unit tests)."""
    if ledger is not None:
        ray.get(getattr(ledger, method).remote(*args))


@dataclass
class TokenizeCounts:
    """What one batch did, per dataset: the run summary's accounting."""

    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated_tokens: int = 0
    dropped_samples: int = 0
    split_samples: int = 0
    skipped_rows: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent in Tokenize calls (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the actor process during those calls (all threads: the Rust tokenizer's too)."""


@dataclass
class PackCounts:
    """What one packing call emitted."""

    num_packs: int = 0
    num_tokens: int = 0
    """Non-pad tokens in the packs."""
    num_slots: int = 0
    """num_packs × seq_len."""
    num_documents: int = 0
    documents_by_source: dict[str, int] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    """Packing calls that emitted these packs (stream mode: each leaves at most one row's worth of
    padding more than global best-fit would)."""
    seconds: float = 0.0
    """Wall time spent assembling these packs (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the assembling process during those calls."""


def packing_efficiency(num_tokens: int, num_slots: int) -> float:
    """Share of pack slots holding real tokens (1.0 = no padding)."""
    return num_tokens / num_slots if num_slots else 0.0


def _merge(total: Any, part: Any) -> None:
    for name, value in asdict(part).items():
        current = getattr(total, name)
        if isinstance(value, dict):
            for key, amount in value.items():
                current[key] = current.get(key, 0) + amount
        elif isinstance(value, list):
            current.extend(value[: max(0, 5 - len(current))])
        else:
            setattr(total, name, current + value)


METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # name (exported as ray_<name>, counters with a _total suffix): (kind, tag keys, description)
    "rayjobs_samples": ("counter", ("run", "dataset"), "Tokenized samples"),
    "rayjobs_tokens": ("counter", ("run", "dataset"), "Tokenized tokens"),
    "rayjobs_trained_tokens": ("counter", ("run", "dataset"), "Tokens with a label"),
    "rayjobs_truncated_tokens": ("counter", ("run", "dataset"), "Tokens cut by overflow: truncate"),
    "rayjobs_dropped_samples": (
        "counter",
        ("run", "dataset"),
        "Over-length samples dropped by overflow: drop",
    ),
    "rayjobs_split_samples": (
        "counter",
        ("run", "dataset"),
        "Extra pieces made by overflow: split",
    ),
    "rayjobs_skipped_rows": (
        "counter",
        ("run", "dataset"),
        "Bad rows skipped under on_bad_row: skip",
    ),
    "rayjobs_packs": ("counter", ("run",), "Packed rows emitted"),
    "rayjobs_pack_slots": ("counter", ("run",), "Token slots in packs"),
    "rayjobs_pack_tokens": ("counter", ("run",), "Non-pad tokens in packs"),
    "rayjobs_packing_efficiency": ("gauge", ("run",), "Non-pad tokens / slots so far"),
    "rayjobs_mix_share": (
        "gauge",
        ("run", "dataset", "epoch"),
        "Realized share of the epoch (mix.by units)",
    ),
    "rayjobs_mix_samples": (
        "gauge",
        ("run", "dataset", "epoch"),
        "Samples of the dataset in the epoch",
    ),
    "rayjobs_mix_tokens": (
        "gauge",
        ("run", "dataset", "epoch"),
        "Tokens of the dataset in the epoch",
    ),
    "rayjobs_train_steps": ("counter", ("run",), "Optimizer steps taken (counted by rank 0)"),
    "rayjobs_train_tokens": ("counter", ("run",), "Labelled tokens trained on, all ranks"),
    "rayjobs_train_loss": (
        "gauge",
        ("run",),
        "Last step's loss, mean over the global batch's labelled tokens",
    ),
}
"""Every series the job exports (the README's metrics table and cluster/grafana are checked against
it)."""

_TOKENIZE_COUNTERS = (
    "samples",
    "tokens",
    "trained_tokens",
    "truncated_tokens",
    "dropped_samples",
    "split_samples",
    "skipped_rows",
)


def _series(names) -> dict[str, Any]:
    """``ray.util.metrics`` objects for some of ``METRICS`` (create them in the process that
    records)."""
    from ray.util import metrics

    kinds = {"counter": metrics.Counter, "gauge": metrics.Gauge}
    return {
        name: kinds[METRICS[name][0]](name, description=METRICS[name][2], tag_keys=METRICS[name][1])
        for name in names
    }


class TrainMetrics:
    """The training series, recorded by every train worker (steps and loss by rank 0 only)."""

    def __init__(self, run_name: str, rank: int):
        self.tags, self.rank = {"run": run_name}, rank
        self._steps, self._tokens, self._loss = _series(
            ["rayjobs_train_steps", "rayjobs_train_tokens", "rayjobs_train_loss"]
        ).values()

    def step(self, loss: float, local_tokens: int) -> None:
        if local_tokens:
            self._tokens.inc(local_tokens, tags=self.tags)
        if self.rank == 0:
            self._steps.inc(1, tags=self.tags)
            self._loss.set(loss, tags=self.tags)


@ray.remote(num_cpus=0)
class Ledger:
    """Cluster-wide counters of one run: tokenization by dataset, packing by epoch."""

    def __init__(self, run_name: str = "rayjobs"):
        self.tokenize: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)  # by dataset
        self.actors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.pack: dict[int, PackCounts] = defaultdict(PackCounts)
        self._run = run_name
        self._series = _series(name for name in METRICS if not name.startswith("rayjobs_train_"))
        self._counters = {name: self._series[f"rayjobs_{name}"] for name in _TOKENIZE_COUNTERS}
        self._packs, self._pack_slots, self._pack_tokens, self._efficiency = (
            self._series[f"rayjobs_{name}"]
            for name in ("packs", "pack_slots", "pack_tokens", "packing_efficiency")
        )
        self._mix = {
            name: self._series[f"rayjobs_mix_{name}"] for name in ("share", "samples", "tokens")
        }

    def add_tokenize(self, by_dataset: dict[str, TokenizeCounts]) -> None:
        """One Tokenize batch's counts, per dataset."""
        for dataset, counts in by_dataset.items():
            _merge(self.tokenize[dataset], counts)
            tags = {"run": self._run, "dataset": dataset}
            for name, counter in self._counters.items():
                if getattr(counts, name):
                    counter.inc(getattr(counts, name), tags=tags)

    def add_pack(self, epoch: int, counts: PackCounts) -> None:
        _merge(self.pack[epoch], counts)
        tags = {"run": self._run}
        if counts.num_packs:
            self._packs.inc(counts.num_packs, tags=tags)
            self._pack_slots.inc(counts.num_slots, tags=tags)
            self._pack_tokens.inc(counts.num_tokens, tags=tags)
        total_tokens = sum(c.num_tokens for c in self.pack.values())
        total_slots = sum(c.num_slots for c in self.pack.values())
        self._efficiency.set(packing_efficiency(total_tokens, total_slots), tags=tags)

    def add_mix(self, mixes: list[dict[str, dict[str, float]]]) -> None:
        """The realized mix of each epoch (``Job.mixes``: what the pack stage counted) as gauges."""
        for epoch, mix in enumerate(mixes):
            for dataset, stats in mix.items():
                tags = {"run": self._run, "dataset": dataset, "epoch": str(epoch)}
                for name, gauge in self._mix.items():
                    gauge.set(stats[name], tags=tags)

    def add_actor(self, kind: str, node_id: str) -> None:
        """An actor of ``kind`` (Tokenize, PackStream, ...) started on ``node_id``."""
        self.actors[kind][node_id] += 1

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict copy: ``{"tokenize": {dataset: counts}, "pack": {epoch: counts},
        "actors": {kind: {node id: actors started}}}`` (tokenization counted over the run,
        packing per epoch)."""
        return {
            "tokenize": {dataset: asdict(c) for dataset, c in sorted(self.tokenize.items())},
            "pack": {epoch: asdict(c) for epoch, c in sorted(self.pack.items())},
            "actors": {kind: dict(nodes) for kind, nodes in sorted(self.actors.items())},
        }
