"""``Tally``: a run's exact counts (tokenization by dataset, packing by epoch) and the weighted
shares' budgets, in plain Python. The run's ``Ledger`` actor (``rayjobs.job.ledger``) is a
``Tally`` that also exports each count to Ray's metrics; the local runner (``data.local``) counts
into a ``Tally`` of its own, in its process. Either is the ``ledger`` that ``Tokenize`` and
``PackStream`` report to (``counts.report``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from rayjobs.data.counts import PackCounts, TokenizeCounts, _merge


class Tally:
    """A run's counters: tokenization by dataset, packing by epoch, each batch counted once."""

    def __init__(self, rereads: bool = False):
        """``rereads``: a restarted worker group reads the data again (stream mode), so a batch
        counts once per worker group (``start_attempt``), not once per run."""
        self._rereads = rereads
        self.tokenize: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)  # by dataset
        self.actors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.pack: dict[int, PackCounts] = defaultdict(PackCounts)
        self._budgets: dict[tuple[int, str], float] = {}
        self._used: dict[tuple[int, str], float] = defaultdict(float)
        self._admitted: dict[str, dict[str, int]] = {}
        self._seen: set[Any] = set()
        self.repeated_reports = 0
        self.attempts = 0  # worker groups started on the run (start_attempt)

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

    def _first(self, key: str | None) -> bool:
        """Whether the batch ``key`` names is reported for the first time (a ``None`` key always
        is); a repeat is Ray running the batch again (a task retried after its actor died) and
        is counted under ``repeated_reports``, not added."""
        if key is None:
            return True
        if self._rereads:
            key = (self.attempts, key)
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
    ) -> bool:
        """One Tokenize batch's counts, per dataset; ``key`` identifies the batch (see
        ``batch_key``), so a batch Ray runs twice is counted once. ``lengths``: each sample's
        tokens, per dataset (the ledger's histogram). Returns whether the batch was added."""
        if not self._first(key):
            return False
        for dataset, counts in by_dataset.items():
            _merge(self.tokenize[dataset], counts)
        return True

    def add_pack(
        self,
        epoch: int,
        counts: PackCounts,
        key: str | None = None,
        samples_per_pack: list[int] | None = None,
    ) -> bool:
        """One packing call's counts for ``epoch``; ``key`` as in ``add_tokenize``;
        ``samples_per_pack``: each emitted row's samples (the ledger's histogram). Returns
        whether the call was added."""
        if not self._first(key):
            return False
        _merge(self.pack[epoch], counts)
        return True

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
            "attempts": self.attempts,
        }
