"""Metrics: exact per-run accounting (the ``Ledger`` actor) and Prometheus series for the dashboard.

Design note. Two needs, one place. The run summary needs *exact* counts (samples, tokens,
truncation, drops, skips per dataset; packs and pad slots), gathered from Tokenize and AssemblePacks
actors spread over the cluster. Each of those calls ``ray.get(ledger.add_….remote(...))`` once per
batch, synchronously, so by the time a batch's rows reach a trainer its counts are already in the
ledger and the driver's final ``snapshot()`` misses nothing. The same calls feed ``ray.util.metrics``
counters, exported by every Ray node to Prometheus (``ray_rayjobs_*``) and shown on the Ray dashboard
/ Grafana while the job runs. Tokenization is counted once per run, by dataset; packing once per
epoch. A retried Ray task would count its batch twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from rayjobs.tokenize import TokenizeCounts


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


@ray.remote(num_cpus=0)
class Ledger:
    """Cluster-wide counters of one run: tokenization by dataset, packing by epoch."""

    def __init__(self, run_name: str = "rayjobs"):
        from ray.util import metrics

        self.tokenize: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)  # by dataset
        self.pack: dict[int, PackCounts] = defaultdict(PackCounts)
        tags = ("run", "dataset")
        self._run = run_name
        self._counters = {
            name: metrics.Counter(f"rayjobs_{name}", description=text, tag_keys=tags)
            for name, text in [
                ("samples", "Tokenized samples"), ("tokens", "Tokenized tokens"),
                ("trained_tokens", "Tokens with a label"),
                ("truncated_tokens", "Tokens cut by overflow: truncate"),
                ("dropped_samples", "Over-length samples dropped by overflow: drop"),
                ("split_samples", "Extra pieces made by overflow: split"),
                ("skipped_rows", "Bad rows skipped under on_bad_row: skip"),
            ]
        }
        pack_tags = ("run",)
        self._packs = metrics.Counter("rayjobs_packs", description="Packed rows emitted",
                                      tag_keys=pack_tags)
        self._pack_slots = metrics.Counter("rayjobs_pack_slots", description="Token slots in packs",
                                           tag_keys=pack_tags)
        self._pack_tokens = metrics.Counter("rayjobs_pack_tokens",
                                            description="Non-pad tokens in packs", tag_keys=pack_tags)
        self._mix = {
            name: metrics.Gauge(f"rayjobs_mix_{name}", description=text,
                                tag_keys=("run", "dataset", "epoch"))
            for name, text in [("share", "Realized share of the epoch (mix.by units)"),
                               ("samples", "Samples of the dataset in the epoch"),
                               ("tokens", "Tokens of the dataset in the epoch")]
        }
        self._efficiency = metrics.Gauge("rayjobs_packing_efficiency",
                                         description="Non-pad tokens / slots so far",
                                         tag_keys=pack_tags)

    def add_tokenize(self, dataset: str, counts: TokenizeCounts) -> None:
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
        """The planned mix of each epoch (from ``Epochs.realized_mix``) as gauges."""
        for epoch, mix in enumerate(mixes):
            for dataset, stats in mix.items():
                tags = {"run": self._run, "dataset": dataset, "epoch": str(epoch)}
                for name, gauge in self._mix.items():
                    gauge.set(stats[name], tags=tags)

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict copy: ``{"tokenize": {dataset: counts}, "pack": {epoch: counts}}``
        (tokenization runs once per run; packing once per epoch)."""
        return {"tokenize": {dataset: asdict(c) for dataset, c in sorted(self.tokenize.items())},
                "pack": {epoch: asdict(c) for epoch, c in sorted(self.pack.items())}}
