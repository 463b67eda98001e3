"""The Prometheus series the job exports (``ray.util.metrics``), one table for every side.

The data side's counts are recorded by the ledger (``rayjobs.job.ledger``), training's by each
train worker (``rayjobs.train.metrics``); docs/metrics.md and cluster/grafana are checked against
:data:`METRICS`.
"""

from __future__ import annotations

import time
from typing import Any

import ray

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
    "rayjobs_samples_without_trained_tokens": (
        "counter",
        ("run", "dataset"),
        "Samples with no token left to train (a prompt that fills seq_len, a response cut away)",
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
"""Every series the job exports (docs/metrics.md's table and cluster/grafana are checked against
it). A histogram is exported as ``_bucket`` (cumulative, by ``le``), ``_sum`` and ``_count``."""


BOUNDARIES = {
    "rayjobs_sample_tokens": [2.0**k for k in range(4, 16)],  # 16 … 32768 tokens
    "rayjobs_samples_per_pack": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256],
}
"""Bucket upper bounds of each histogram of ``METRICS``."""


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
