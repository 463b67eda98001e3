"""The ledger: exact per-run accounting, an actor that every data batch reports to.

Design note. Two needs, one place. The run summary needs *exact* counts (samples, tokens,
truncation, drops, skips per dataset; packs and pad slots), gathered from Tokenize and packing
actors (``PackStream``; ``AssemblePacks`` in planned mode) spread over the cluster. Each of those
calls ``ray.get(ledger.add_….remote(...))`` once per batch, synchronously, so by the time a batch's
rows reach a trainer its counts are already in the ledger and the driver's final ``snapshot()``
misses nothing. The same calls feed ``ray.util.metrics`` counters, exported by every Ray node to
Prometheus (``ray_rayjobs_*``): the Ray dashboard charts them only where it is pointed at a
Prometheus (``RAY_PROMETHEUS_HOST``) and a Grafana (docs/metrics.md).
Tokenization is counted over the run, by dataset (stream mode tokenizes every epoch's reads, planned
mode once); packing per epoch. Exactly once: Ray runs a batch again when the actor that ran it died
(even after it reported), so every report carries the batch's identity (``batch_key``: a digest of
the rows it holds, with their epoch and pass) and the ledger adds a batch once, counting repeats
under ``repeated_reports``. A re-read is new work: a Ray Train restart in stream mode runs the
stream anew, and its batches count again (docs/resume.md, "Counts after a restart"), so there
(``rereads``) a key counts once per worker group: a re-read batch may hold exactly the rows of one
the first group counted (a file's first block), while its packs, mixed anew, never match; planned
mode's packs, assembled again, keep their keys and count once.

What reaches the Ray dashboard without Prometheus or Grafana: the ledger is a named actor
(``start_ledger``: named after the run, in the ``NAMESPACE`` namespace, so two runs on one
cluster never share one), listed on the Actors page as ``Ledger(run=<run>)``, and it prints the
data side's progress line (``monitor.format_line``) to its own log every ``LOG_INTERVAL``
seconds while the counts move, shown under Actors → the ledger → Log however the driver was started.
``rayjobs status JOB`` reads a running job's counts from that log (``rayjobs.job.watch``). The
lines are marked as no job's (``HIDDEN``), so no driver echoes them next to the one its own
``DataMonitor`` logs.
"""

from __future__ import annotations

import sys
import threading
import time

import ray

from rayjobs.data.counts import PackCounts, TokenizeCounts, packing_efficiency
from rayjobs.data.tally import Tally
from rayjobs.job.monitor import next_line
from rayjobs.metrics import METRICS, _init_counter, _series, wait_for_export

LOG_INTERVAL = 2.0
"""Seconds between two of the ledger's own progress lines (only when the counts moved): what
``rayjobs status`` reads, so a few seconds at most."""

NAMESPACE = "rayjobs"
"""The Ray namespace of every run's named ``Ledger`` actors."""

HIDDEN = ":job_id:ffffffff"
"""Printed before each progress line: Ray's log monitor then attributes the line to no running
job, so it stays in the ledger's log and no driver prints it (drivers show their own job's)."""

_TOKENIZE_COUNTERS = (
    "rows",
    "samples",
    "tokens",
    "trained_tokens",
    "truncated_tokens",
    "dropped_samples",
    "split_samples",
    "skipped_rows",
    "samples_without_trained_tokens",
)


@ray.remote(num_cpus=0)
class Ledger(Tally):
    """Cluster-wide counters of one run (``Tally``), each count also exported to Ray's metrics."""

    def __init__(
        self,
        run_name: str = "rayjobs",
        datasets: tuple[str, ...] | list[str] = (),
        rereads: bool = False,
    ):
        """``datasets``: the config's dataset names; every counter of each, and the pack
        counters, are exported at 0 from here on, before any batch (``_init_counter``).
        ``rereads``: see ``Tally``."""
        # Tally's methods named, not super(): a subclass of this class defined elsewhere (pickled
        # by value, its bases by name) gets Ray's actor class for ``Ledger`` in the worker,
        # which is no instance of this one, so a zero-argument super() fails there.
        Tally.__init__(self, rereads)
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
        self._sample_tokens = self._series["rayjobs_sample_tokens"]
        self._samples_per_pack = self._series["rayjobs_samples_per_pack"]
        self._zeroed: set[str] = set()
        for dataset in datasets:
            self._zero(dataset)
        for counter in (self._packs, self._pack_slots, self._pack_tokens):
            _init_counter(counter, {"run": self._run})
        self._last_record: float | None = None
        self._lock = threading.Lock()  # the progress thread reads what the reports change

    def __repr__(self) -> str:
        """The name the dashboard's Actors page and log prefixes show."""
        return f"Ledger(run={self._run})"

    def log_progress(self, by: str = "tokens", interval: float = LOG_INTERVAL) -> None:
        """From now on, print the progress line to this actor's log every ``interval`` seconds
        while the counts move, on a thread of its own; ``by``: the mix's unit (``mix.by``)."""
        thread = threading.Thread(
            target=self._progress, args=(by, interval), name="progress", daemon=True
        )
        thread.start()

    def _progress(self, by: str, interval: float) -> None:
        last, last_time = None, time.monotonic()
        while True:
            time.sleep(interval)
            try:
                with self._lock:
                    snapshot = self.snapshot()
            except RuntimeError:  # a report changed a dict it was copying: next time
                continue
            moment = time.monotonic()
            line, now = next_line(snapshot, last, last_time, moment, by)
            if line is None:
                continue
            print(f"{HIDDEN}\nrayjobs: {line}", file=sys.stderr, flush=True)
            last, last_time = now, moment

    def _zero(self, dataset: str) -> None:
        """Export every per-dataset counter of ``dataset`` at 0, once (``_init_counter``): at
        creation for the config's datasets, else at the dataset's first batch (a ledger created
        without them: a series then starts at that batch's values)."""
        if dataset not in self._zeroed:
            self._zeroed.add(dataset)
            for counter in self._counters.values():
                _init_counter(counter, {"run": self._run, "dataset": dataset})

    def add_tokenize(
        self,
        by_dataset: dict[str, TokenizeCounts],
        key: str | None = None,
        lengths: dict[str, list[int]] | None = None,
    ) -> bool:
        """``Tally.add_tokenize``, and the counts and ``lengths`` (the ``rayjobs_sample_tokens``
        histogram) exported, once per batch like the counts."""
        with self._lock:
            if not Tally.add_tokenize(self, by_dataset, key):
                return False
        for dataset, values in (lengths or {}).items():
            tags = {"run": self._run, "dataset": dataset}
            for value in values:
                self._sample_tokens.observe(value, tags=tags)
        for dataset, counts in by_dataset.items():
            self._zero(dataset)
            tags = {"run": self._run, "dataset": dataset}
            for name, counter in self._counters.items():
                if getattr(counts, name):
                    counter.inc(getattr(counts, name), tags=tags)
        self._last_record = time.monotonic()
        return True

    def add_pack(
        self,
        epoch: int,
        counts: PackCounts,
        key: str | None = None,
        samples_per_pack: list[int] | None = None,
    ) -> bool:
        """``Tally.add_pack``, and the counts and ``samples_per_pack`` (the
        ``rayjobs_samples_per_pack`` histogram) exported."""
        with self._lock:
            if not Tally.add_pack(self, epoch, counts, key):
                return False
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
        return True

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


def start_ledger(
    run_name: str, datasets: list[str], rereads: bool = False, by: str = "tokens"
) -> ray.actor.ActorHandle:
    """The run's ``Ledger``, named ``run_name`` in ``NAMESPACE`` (``rayjobs status`` finds it),
    printing its progress lines (``log_progress``)."""
    ledger = Ledger.options(name=run_name, namespace=NAMESPACE).remote(run_name, datasets, rereads)
    ledger.log_progress.remote(by)
    return ledger
