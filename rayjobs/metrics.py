"""Metrics: exact per-run accounting (the ``Ledger`` actor) and Prometheus series for the dashboard.

Design note. Two needs, one place. The run summary needs *exact* counts (samples, tokens,
truncation, drops, skips per dataset; packs and pad slots), gathered from Tokenize and packing
actors (``PackStream``; ``AssemblePacks`` in planned mode) spread over the cluster. Each of those
calls ``ray.get(ledger.add_….remote(...))`` once per batch, synchronously, so by the time a batch's
rows reach a trainer its counts are already in the ledger and the driver's final ``snapshot()``
misses nothing. The same calls feed ``ray.util.metrics`` counters, exported by every Ray node to
Prometheus (``ray_rayjobs_*``) and shown on the Ray dashboard / Grafana while the job runs.
Tokenization is counted over the run, by dataset (stream mode tokenizes every epoch's reads, planned
mode once); packing per epoch. Exactly once: Ray runs a batch again when the actor that ran it died
(even after it reported), so every report carries the batch's identity (``batch_key``: a digest of
the rows it holds, with their epoch and pass) and the ledger adds a batch once, counting repeats
under ``repeated_reports``. A re-read is new work: a Ray Train restart in stream mode runs the
stream anew, and its batches are new to the ledger (a key hashes the rows in arrival order, the mix
interleaves the datasets differently each time), so they count again (README, "Checkpoints,
failures and resume"); planned mode's packs, assembled again, keep their keys and count once.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
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
    no-op without a ledger (in-process use, unit tests). If the ledger answers ``FAIL`` (fault
    injection, ``Ledger(fail_after=...)``), this process dies right after its report is in, as a
    crashed actor would: the tests of exactly-once accounting use it."""
    if ledger is not None and ray.get(getattr(ledger, method).remote(*args)) == FAIL:
        os._exit(1)


FINAL_SUMMARY = "summary.json"
"""The run summary's file in a finished run's final checkpoint (``train``): ``--resume latest``
passes over runs that hold one (there is nothing left to resume)."""

FAIL = "fail"
"""The ledger's answer that tells a reporting actor to die (fault injection)."""


@dataclass
class TokenizeCounts:
    """What one batch did, per dataset: the run summary's accounting."""

    rows: int = 0
    """Raw rows received (bad ones included): samples − split_samples + dropped_samples +
    skipped_rows (``check_accounting``)."""
    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated_tokens: int = 0
    dropped_samples: int = 0
    split_samples: int = 0
    responses_tokenized_alone: int = 0
    """Preference data: responses tokenized on their own, not after their prompt, because a
    token of prompt + response straddled the prompt's end (TRL's fallback)."""
    skipped_rows: int = 0
    """Bad rows skipped under ``on_bad_row: skip``, all reasons."""
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    """The same rows by reason (``formats.SKIP_REASONS``); sums to ``skipped_rows``."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' places and problems (5 distinct ones kept over the run: a row
    re-read in a later epoch is counted in ``skipped_rows`` again, but listed once)."""
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
    trimmed_by_source: dict[str, int] = field(default_factory=dict)
    """Samples tokenized but left out because their dataset had reached its share of the epoch
    (weighted stream mode reads a margin more than its share; ``Ledger.admit``)."""
    trimmed_tokens_by_source: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    """Packing calls that emitted these packs (stream mode: each leaves at most one row's worth of
    padding more than global best-fit would)."""
    seconds: float = 0.0
    """Wall time spent assembling these packs (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the assembling process during those calls."""


def batch_key(stage: str, *columns: Any) -> str:
    """A batch's identity for the ledger: a digest of the stage and the batch's identifying
    columns (e.g. dataset, file, row, epoch and pass of every row), the same when Ray runs the
    same batch again after a failure, different for any other batch."""
    import hashlib

    digest = hashlib.blake2b(stage.encode(), digest_size=16)
    for column in columns:
        values = column.to_numpy(zero_copy_only=False) if hasattr(column, "to_numpy") else column
        values = np.asarray(values)
        if values.dtype.kind in "OUS":
            digest.update("\0".join(map(str, values.tolist())).encode())
        else:
            digest.update(np.ascontiguousarray(values).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


class AccountingError(RuntimeError):
    """The run's counts do not add up (a lost or double-counted batch): the run fails."""


def check_accounting(snapshot: dict[str, Any], streamed: bool, complete: bool = True) -> list[str]:
    """The end-of-run check (every run): per dataset, rows read = samples − split pieces + dropped
    + skipped; and, when streamed (every tokenized sample packed once, every epoch tokenized
    anew), samples and tokens tokenized = documents and tokens in the packs + those trimmed to the
    dataset's share, over all epochs.
    (In planned mode the plan repeats or subsamples the tokenized samples per epoch, so only the
    first holds.) ``complete``: False when training stopped before the stream ended
    (``train.max_steps``): samples tokenized but still on their way to a packer when the pipeline
    was shut down are then allowed, so the packs may hold fewer, never more
    (``unpacked``). Returns the problems, empty when the books balance."""
    problems = []
    packed = packed_by_source(snapshot)
    for name, c in snapshot["tokenize"].items():
        rows = c["samples"] - c["split_samples"] + c["dropped_samples"] + c["skipped_rows"]
        if rows != c["rows"]:
            problems.append(
                f"dataset {name!r}: {c['rows']} rows read but samples − split pieces + dropped + "
                f"skipped = {rows}"
            )
        documents, tokens = packed.get(name, (0, 0))
        if complete:
            balanced = (documents, tokens) == (c["samples"], c["tokens"])
        else:
            balanced = documents <= c["samples"] and tokens <= c["tokens"]
        if streamed and not balanced:
            problems.append(
                f"dataset {name!r}: tokenized {c['samples']} samples / {c['tokens']} tokens but "
                f"the packs hold (or trimmed) {documents} / {tokens}"
                + ("" if complete else " (more than was tokenized)")
            )
    if streamed:
        for name in set(packed) - set(snapshot["tokenize"]):
            problems.append(f"dataset {name!r}: packed but never tokenized")
    return problems


def packed_by_source(snapshot: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per dataset, (documents, tokens) that reached a packer over all epochs: packed, or trimmed
    to the dataset's share."""
    documents: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    for counts in snapshot["pack"].values():
        for key, total in (
            ("documents_by_source", documents),
            ("trimmed_by_source", documents),
            ("tokens_by_source", tokens),
            ("trimmed_tokens_by_source", tokens),
        ):
            for name, value in counts.get(key, {}).items():
                total[name] += value
    return {name: (documents[name], tokens[name]) for name in documents.keys() | tokens.keys()}


def unpacked(snapshot: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per dataset, samples and tokens tokenized but never packed nor trimmed: 0 in a complete
    streamed run; after an early stop, what was in flight when the pipeline was shut down."""
    packed = packed_by_source(snapshot)
    return {
        name: {
            "samples": c["samples"] - packed.get(name, (0, 0))[0],
            "tokens": c["tokens"] - packed.get(name, (0, 0))[1],
        }
        for name, c in snapshot["tokenize"].items()
    }


def packing_efficiency(num_tokens: int, num_slots: int) -> float:
    """Share of pack slots holding real tokens (1.0 = no padding)."""
    return num_tokens / num_slots if num_slots else 0.0


def _merge(total: Any, part: Any) -> None:
    for name, value in asdict(part).items():
        current = getattr(total, name)
        if isinstance(value, dict):
            for key, amount in value.items():
                current[key] = current.get(key, 0) + amount
        elif isinstance(value, list):  # skipped_examples: the first 5 distinct (stream mode
            # re-reads a bad row every epoch, and the same row 5 times said nothing more)
            current.extend(v for v in dict.fromkeys(value) if v not in current)
            del current[5:]
        else:
            setattr(total, name, current + value)


METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # name (exported as ray_<name>, counters with a _total suffix): (kind, tag keys, description)
    "rayjobs_rows": ("counter", ("run", "dataset"), "Raw rows read, bad ones included"),
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
        "Bad rows skipped under on_bad_row: skip (all reasons; by reason in the run summary)",
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
    "rayjobs_sample_tokens": (
        "histogram",
        ("run", "dataset"),
        "Tokens per sample after template, tokenizer and overflow (a triple: its unit)",
    ),
    "rayjobs_samples_per_pack": ("histogram", ("run",), "Samples (triples) per packed row"),
    "rayjobs_train_steps": (
        "counter",
        ("run",),
        "Optimizer steps executed by rank 0 (redone after a worker restart: counted again)",
    ),
    "rayjobs_train_tokens": (
        "counter",
        ("run",),
        "Labelled tokens trained on, all ranks (redone steps: counted again)",
    ),
    "rayjobs_train_loss": (
        "gauge",
        ("run",),
        "Last step's loss over the global batch: SFT mean cross entropy per labelled token, DPO"
        " mean DPO loss per preference triple",
    ),
    "rayjobs_train_tokens_per_s": (
        "gauge",
        ("run", "rank"),
        "This rank's labelled tokens per second over its last step (data wait included)",
    ),
    "rayjobs_eval_loss": (
        "gauge",
        ("run",),
        "Last evaluation's mean loss over every held-out pack (eval.datasets)",
    ),
    "rayjobs_dpo_reward_accuracy": (
        "gauge",
        ("run",),
        "DPO: last step's share of triples whose chosen reward beats the rejected one",
    ),
    "rayjobs_dpo_reward_margin": (
        "gauge",
        ("run",),
        "DPO: last step's mean chosen minus rejected reward",
    ),
    "rayjobs_dpo_chosen_reward": (
        "gauge",
        ("run",),
        "DPO: last step's mean beta x (policy - reference) log-prob of the chosen responses",
    ),
    "rayjobs_dpo_rejected_reward": (
        "gauge",
        ("run",),
        "DPO: last step's mean beta x (policy - reference) log-prob of the rejected responses",
    ),
}
"""Every series the job exports (the README's metrics table and cluster/grafana are checked against
it). A histogram is exported as ``_bucket`` (cumulative, by ``le``), ``_sum`` and ``_count``."""

BOUNDARIES = {
    "rayjobs_sample_tokens": [2.0**k for k in range(4, 16)],  # 16 … 32768 tokens
    "rayjobs_samples_per_pack": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256],
}
"""Bucket upper bounds of each histogram of ``METRICS``."""

_TOKENIZE_COUNTERS = (
    "rows",
    "samples",
    "tokens",
    "trained_tokens",
    "truncated_tokens",
    "dropped_samples",
    "split_samples",
    "skipped_rows",
)


def export_interval() -> float:
    """Seconds between two exports of this process's ``ray.util.metrics`` to its node's metrics
    agent: Ray's ``metrics_report_interval_ms`` (10 s by default; ``RAY_metrics_report_interval_ms``
    where the node was started), never under 1 s (Ray's floor)."""
    try:
        interval_ms = ray._config.metrics_report_interval_ms()
    except Exception:  # noqa: BLE001 - a private accessor: fall back to Ray's default
        interval_ms = 10_000
    return max(int(interval_ms), 1000) / 1000


def wait_for_export(last_record: float | None) -> float:
    """Sleep until this process has exported what it recorded up to ``last_record`` (a
    ``time.monotonic()``; None: nothing recorded, no wait): one export interval after it, plus a
    margin. Ray exports periodically and has no public flush. A process that ends exports its
    last values on the way out, but only if it gets that far: when a job's driver exits, Ray
    kills the job's remaining workers, and an actor still exiting (a Ray Train worker that
    ``fit`` has just killed) can lose what it recorded since its last export (seen once: the
    last step's ``rayjobs_train_*``). Returns the seconds slept."""
    if last_record is None:
        return 0.0
    interval = export_interval()
    left = last_record + interval + max(1.0, 0.2 * interval) - time.monotonic()
    if left > 0:
        time.sleep(left)
    return max(0.0, left)


def _init_counter(counter: Any, tags: dict[str, str]) -> None:
    """Export ``counter`` at 0 for ``tags`` (``Counter.inc`` refuses 0; Ray records a counter's
    increments, so a 0 adds nothing). Done when the recording object is created, before any
    work: Prometheus's ``increase()`` and ``rate()`` count from a series' first sample, so a
    series that first appears at its first batch's value loses that value to them (one torn line:
    ``increase()`` 0); one that first appears at 0 does not, once a scrape has seen the 0. A
    series that never moves (no bad rows, no overflow) exists too, as 0, for the panels."""
    counter._record(0, tags=tags)


def _series(names) -> dict[str, Any]:
    """``ray.util.metrics`` objects for some of ``METRICS`` (create them in the process that
    records)."""
    from ray.util import metrics

    series = {}
    for name in names:
        kind, tags, description = METRICS[name]
        if kind == "histogram":
            series[name] = metrics.Histogram(
                name, description=description, boundaries=BOUNDARIES[name], tag_keys=tags
            )
        else:
            kinds = {"counter": metrics.Counter, "gauge": metrics.Gauge}
            series[name] = kinds[kind](name, description=description, tag_keys=tags)
    return series


DPO_GAUGES = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")
"""``StepResult.dpo`` keys exported as ``rayjobs_dpo_<key>``."""


class TrainMetrics:
    """The training series, recorded by every train worker (steps and loss by rank 0 only;
    tokens per second by every rank, tagged with it). The counters count work done: a worker
    that Ray Train restarts from a checkpoint (``train.max_failures``) redoes the steps after it,
    and they count again (the run summary's ``steps`` and ``tokens_trained`` are the trained
    state's); the killed process may also take what it recorded since its last export with it."""

    def __init__(self, run_name: str, rank: int):
        self.tags, self.rank = {"run": run_name}, rank
        self._rank_tags = {"run": run_name, "rank": str(rank)}
        self._steps, self._tokens, self._loss, self._speed = _series(
            [
                "rayjobs_train_steps",
                "rayjobs_train_tokens",
                "rayjobs_train_loss",
                "rayjobs_train_tokens_per_s",
            ]
        ).values()
        self._dpo = _series([f"rayjobs_dpo_{name}" for name in DPO_GAUGES])
        self._eval_loss = _series(["rayjobs_eval_loss"])["rayjobs_eval_loss"]
        self._last = time.monotonic()
        _init_counter(self._tokens, self.tags)  # every rank adds its own tokens
        if rank == 0:
            _init_counter(self._steps, self.tags)

    def step(self, loss: float, local_tokens: int, dpo: dict[str, float] | None = None) -> None:
        """One optimizer step: its global loss, this rank's labelled tokens and, for DPO, the
        step's ``StepResult.dpo`` (rank 0 sets the ``rayjobs_dpo_*`` gauges from it; an SFT run
        never exports them)."""
        now = time.monotonic()
        self._speed.set(local_tokens / max(now - self._last, 1e-9), tags=self._rank_tags)
        self._last = now
        if local_tokens:
            self._tokens.inc(local_tokens, tags=self.tags)
        if self.rank == 0:
            self._steps.inc(1, tags=self.tags)
            self._loss.set(loss, tags=self.tags)
            for name in DPO_GAUGES if dpo else ():
                self._dpo[f"rayjobs_dpo_{name}"].set(dpo[name], tags=self.tags)

    def evaluation(self, loss: float) -> None:
        """An evaluation's global loss (rank 0 sets ``rayjobs_eval_loss``; a run without
        ``eval.datasets`` never exports it), once it has run: the next step's tokens per second
        count from here, not over the evaluation's time."""
        self.paused()
        if self.rank == 0:
            self._eval_loss.set(loss, tags=self.tags)

    def paused(self) -> None:
        """Work between two steps has ended (a checkpoint's save, a report to Ray Train): the
        next step's tokens per second count from now, not over it (the gauge dipped after every
        checkpoint)."""
        self._last = time.monotonic()


@ray.remote(num_cpus=0)
class Ledger:
    """Cluster-wide counters of one run: tokenization by dataset, packing by epoch."""

    def __init__(
        self,
        run_name: str = "rayjobs",
        fail_after: dict[str, int] | None = None,
        dedupe: bool = True,
        datasets: tuple[str, ...] | list[str] = (),
    ):
        """``fail_after``: fault injection for tests, ``{"add_tokenize": n}`` makes the actor
        whose report is the n-th of that kind die right after it (once per kind); ``dedupe``
        off (tests only) adds a batch Ray runs again twice, as the ledger once did.
        ``datasets``: the config's dataset names; every counter of each, and the pack counters,
        are exported at 0 from here on, before any batch (``_init_counter``)."""
        self._fail_after = dict(fail_after or {})
        self._dedupe = dedupe
        self._reports: dict[str, int] = defaultdict(int)
        self.tokenize: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)  # by dataset
        self.actors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.pack: dict[int, PackCounts] = defaultdict(PackCounts)
        self._run = run_name
        self._budgets: dict[tuple[int, str], float] = {}
        self._used: dict[tuple[int, str], float] = defaultdict(float)
        self._admitted: dict[str, dict[str, int]] = {}
        self._seen: set[str] = set()
        self.repeated_reports = self.injected_faults = 0
        self.attempts = 0  # worker groups started on the run (start_attempt)
        self._series = _series(name for name in METRICS if not name.startswith("rayjobs_train_"))
        self._counters = {name: self._series[f"rayjobs_{name}"] for name in _TOKENIZE_COUNTERS}
        self._packs, self._pack_slots, self._pack_tokens, self._efficiency = (
            self._series[f"rayjobs_{name}"]
            for name in ("packs", "pack_slots", "pack_tokens", "packing_efficiency")
        )
        self._mix = {
            name: self._series[f"rayjobs_mix_{name}"] for name in ("share", "samples", "tokens")
        }
        self._sample_tokens = self._series["rayjobs_sample_tokens"]
        self._samples_per_pack = self._series["rayjobs_samples_per_pack"]
        self._zeroed: set[str] = set()
        for dataset in datasets:
            self._zero(dataset)
        for counter in (self._packs, self._pack_slots, self._pack_tokens):
            _init_counter(counter, {"run": self._run})
        self._last_record: float | None = None

    def _zero(self, dataset: str) -> None:
        """Export every per-dataset counter of ``dataset`` at 0, once (``_init_counter``): at
        creation for the config's datasets, else at the dataset's first batch (a ledger created
        without them: a series then starts at that batch's values)."""
        if dataset not in self._zeroed:
            self._zeroed.add(dataset)
            for counter in self._counters.values():
                _init_counter(counter, {"run": self._run, "dataset": dataset})

    def set_budgets(self, budgets: dict[tuple[int, str], float]) -> None:
        """Each dataset's share of each epoch, ``{(epoch, dataset): units}`` in ``mix.by`` units
        (weighted stream mode)."""
        self._budgets = dict(budgets)

    def admit(self, key: str, epoch: int, wants: dict[str, list[int]]) -> dict[str, int]:
        """How many of a packer window's samples of each dataset (in window order, ``wants``:
        each sample's size in ``mix.by`` units) fit the dataset's share of ``epoch``: first come,
        first served, to the nearest sample. The answer for ``key`` is kept, so a window Ray runs
        again gets the same one."""
        if key in self._admitted:
            return self._admitted[key]
        grant = {}
        for name, sizes in wants.items():
            budget = self._budgets.get((epoch, name))
            if budget is None:
                grant[name] = len(sizes)
                continue
            left = budget - self._used[epoch, name]
            total = np.cumsum(np.asarray(sizes, dtype=np.float64))
            n = int(np.searchsorted(total, left, side="right"))  # prefix that fits
            if n < len(sizes) and total[n] - left < left - (total[n - 1] if n else 0.0):
                n += 1  # one more comes nearer the share
            grant[name] = n
            self._used[epoch, name] += float(total[n - 1]) if n else 0.0
        self._admitted[key] = grant
        return grant

    def _answer(self, method: str) -> str | None:
        """``FAIL`` if fault injection wants this report's sender dead, else None."""
        self._reports[method] += 1
        if self._reports[method] == self._fail_after.get(method):
            self.injected_faults += 1
            return FAIL
        return None

    def _first(self, key: str | None) -> bool:
        """Whether the batch ``key`` names is reported for the first time (a ``None`` key always
        is); a repeat is Ray running the batch again (a task retried after its actor died) and
        is counted under ``repeated_reports``, not added."""
        if key is None or not self._dedupe:
            return True
        if key in self._seen:
            self.repeated_reports += 1
            return False
        self._seen.add(key)
        return True

    def add_tokenize(
        self,
        by_dataset: dict[str, TokenizeCounts],
        key: str | None = None,
        lengths: dict[str, list[int]] | None = None,
    ) -> str | None:
        """One Tokenize batch's counts, per dataset; ``key`` identifies the batch (see
        ``batch_key``), so a batch Ray runs twice is counted once. ``lengths``: each sample's
        tokens, per dataset (the ``rayjobs_sample_tokens`` histogram: observed here, once per
        batch like the counts)."""
        if not self._first(key):
            return None
        for dataset, values in (lengths or {}).items():
            tags = {"run": self._run, "dataset": dataset}
            for value in values:
                self._sample_tokens.observe(value, tags=tags)
        for dataset, counts in by_dataset.items():
            self._zero(dataset)
            _merge(self.tokenize[dataset], counts)
            tags = {"run": self._run, "dataset": dataset}
            for name, counter in self._counters.items():
                if getattr(counts, name):
                    counter.inc(getattr(counts, name), tags=tags)
        self._last_record = time.monotonic()
        return self._answer("add_tokenize")

    def add_pack(
        self,
        epoch: int,
        counts: PackCounts,
        key: str | None = None,
        samples_per_pack: list[int] | None = None,
    ) -> str | None:
        """One packing call's counts for ``epoch``; ``key`` as in ``add_tokenize``;
        ``samples_per_pack``: each emitted row's samples (the ``rayjobs_samples_per_pack``
        histogram)."""
        if not self._first(key):
            return None
        _merge(self.pack[epoch], counts)
        tags = {"run": self._run}
        for value in samples_per_pack or ():
            self._samples_per_pack.observe(value, tags=tags)
        if counts.num_packs:
            self._packs.inc(counts.num_packs, tags=tags)
            self._pack_slots.inc(counts.num_slots, tags=tags)
            self._pack_tokens.inc(counts.num_tokens, tags=tags)
        total_tokens = sum(c.num_tokens for c in self.pack.values())
        total_slots = sum(c.num_slots for c in self.pack.values())
        self._efficiency.set(packing_efficiency(total_tokens, total_slots), tags=tags)
        self._last_record = time.monotonic()
        return self._answer("add_pack")

    def add_mix(self, mixes: list[dict[str, dict[str, float]]]) -> None:
        """The realized mix of each epoch (``Job.mixes``: what the pack stage counted) as gauges."""
        for epoch, mix in enumerate(mixes):
            for dataset, stats in mix.items():
                tags = {"run": self._run, "dataset": dataset, "epoch": str(epoch)}
                for name, gauge in self._mix.items():
                    gauge.set(stats[name], tags=tags)
        self._last_record = time.monotonic()

    def flush(self) -> float:
        """Export the run's final values before the job exits; the run calls it last. Ray
        exports a gauge once per ``set`` and its agent drops the series two report intervals
        later, so the final packing efficiency is set again here, next to the mix gauges just
        set. Then wait until everything is exported (``wait_for_export``): the ledger dies with
        the driver, and the wait also gives the train workers ``fit`` has just killed the time to
        export their last steps on their way out. Returns the seconds waited."""
        if self.pack:
            total_tokens = sum(c.num_tokens for c in self.pack.values())
            total_slots = sum(c.num_slots for c in self.pack.values())
            efficiency = packing_efficiency(total_tokens, total_slots)
            self._efficiency.set(efficiency, tags={"run": self._run})
            self._last_record = time.monotonic()
        return wait_for_export(self._last_record)

    def add_actor(self, kind: str, node_id: str) -> None:
        """An actor of ``kind`` (Tokenize, PackStream, ...) started on ``node_id``."""
        self.actors[kind][node_id] += 1

    def start_attempt(self) -> int:
        """A train worker group started (its rank 0 calls this first): 1 for a run's first, one
        more for each restart, with or without a checkpoint to resume from. A restart reads the
        stream again from its start, so the weighted shares (``admit``) start afresh: they were
        the first attempt's, used up, and the re-read stream, its windows formed anew, was
        trimmed to almost nothing (its ranks then skipped their consumed rows into later
        epochs)."""
        self.attempts += 1
        if self.attempts > 1:
            self._used.clear()
            self._admitted.clear()
        return self.attempts

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict copy: ``{"tokenize": {dataset: counts}, "pack": {epoch: counts},
        "actors": {kind: {node id: actors started}}}`` (tokenization counted over the run,
        packing per epoch)."""
        return {
            "tokenize": {dataset: asdict(c) for dataset, c in sorted(self.tokenize.items())},
            "pack": {epoch: asdict(c) for epoch, c in sorted(self.pack.items())},
            "actors": {kind: dict(nodes) for kind, nodes in sorted(self.actors.items())},
            "repeated_reports": self.repeated_reports,
            "injected_faults": self.injected_faults,
            "attempts": self.attempts,
        }
