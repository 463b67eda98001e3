"""Pack tokenized samples into fixed-length rows: pure numpy, no Ray, no torch.

Design note
-----------
Algorithm: best-fit decreasing (BFD). Sort a window's lengths longest first (stable, so equal
lengths keep index order), then put each sample into the open bin with the *smallest* remaining
capacity that still fits it, opening a new bin only when none does. Open bins are int keys
``remaining << 32 | bin`` in a sorted list: one ``bisect`` finds the best bin, ties go to the oldest
bin, updates are C-level memmoves, full bins leave the list. The other strategies use the generic
per-item form. Strategies live in the :data:`STRATEGIES` registry.

Windows: ``StreamPacker`` packs a stream window by window. A stateless per-window packer wastes
every window's tail (its last bins hold what nothing else fitted); here a bin below 99.9% full
waits, and its samples are placed *first* in the next window (placed last, the small ones would
land in the tail bin again and again). A sample waits at most ``max_delay`` windows and ``flush()``
ends the stream, so nothing is lost. The carry is safe because the stream is planned in the
driver, which knows where it ends (``epochs.py``); inside a ``map_batches`` actor, which has no
end-of-data hook, it would strand samples (docs/design.md).

Why BFD: on the real sets it matches global BFD over the whole stream, and next-fit trails it by
several points (docs/benchmarks.md). BFD is not optimal, nor pointwise better than next-fit:
next-fit on a lucky order can beat it (scenario table in ``tests/test_pack.py``); it is the best
of these on realistic lengths.

Randomness comes only from the ``np.random.Generator`` given to ``StreamPacker``: samples are
shuffled before packing (so equal lengths land in random bins), packs are shuffled on emission and
documents inside each pack, so long and short samples do not arrive in runs. Same seed, same packs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

STRATEGIES: dict[str, type[Packer]] = {}
"""The packing strategies by name (the ``strategy`` of :func:`pack_lengths`, ``StreamPacker`` and
``packing.strategy``, which config validation checks against this registry). Add one with
:func:`register_strategy`."""


def register_strategy(name: str) -> Callable[[type[Packer]], type[Packer]]:
    """Class decorator: make a :class:`Packer` subclass available as strategy ``name``."""

    def register(packer: type[Packer]) -> type[Packer]:
        if name in STRATEGIES:
            raise ValueError(f"packing strategy {name!r} is already registered")
        STRATEGIES[name] = packer
        return packer

    return register


class Packer:
    """Places items one at a time into bins of capacity ``seq_len``; subclasses choose the bin
    (``_choose_bin``), or replace ``assign`` wholesale for speed (best-fit decreasing)."""

    sort_decreasing = False

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.remaining: list[int] = []  # remaining capacity of each bin, in opening order

    def order(self, lengths: np.ndarray, first: np.ndarray | None) -> np.ndarray:
        """Placement order: longest first for decreasing strategies, else as given; the items
        marked ``first`` (if any) before all others, each group in that order."""
        keys = [-lengths] if self.sort_decreasing else []
        if first is not None:
            keys.append(~first)
        return np.lexsort(keys) if keys else np.arange(len(lengths))  # last key is primary

    def assign(
        self, lengths: np.ndarray, first: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Packs validated ``lengths``: (placement order, bin of each placed item, number of
        bins)."""
        order = self.order(lengths, first)
        assigned: list[int] = []
        for length in lengths[order].tolist():
            bin_index = self._choose_bin(length)
            if bin_index is None:
                bin_index = self._open_bin()
            assigned.append(bin_index)
            self._set_remaining(bin_index, self.remaining[bin_index] - length)
        return order, np.array(assigned, dtype=np.int64), len(self.remaining)

    def _choose_bin(self, length: int) -> int | None:
        """Returns the open bin that takes an item of ``length``, or None to open a new one."""
        raise NotImplementedError

    def _open_bin(self) -> int:
        self.remaining.append(self.seq_len)
        return len(self.remaining) - 1

    def _set_remaining(self, bin_index: int, remaining: int) -> None:
        self.remaining[bin_index] = remaining


@register_strategy("bfd")
class _BestFitDecreasing(Packer):
    """The tightest bin that still fits, over the lengths sorted longest first.

    One tight loop instead of the generic per-item method calls: every non-full bin is one int key
    ``remaining << 32 | bin`` in a sorted list, so the choice is one ``bisect`` and the update one
    ``pop`` + ``insort`` (C-level memmoves); ties go to the oldest bin, as in the generic form.
    """

    sort_decreasing = True

    def assign(
        self, lengths: np.ndarray, first: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        order = self.order(lengths, first)
        keys: list[int] = []  # sorted: remaining capacity << 32 | bin index
        assigned: list[int] = []
        num_bins, seq_len, low = 0, self.seq_len, (1 << 32) - 1
        bisect_left, insort = bisect.bisect_left, bisect.insort
        for length in lengths[order].tolist():
            position = bisect_left(keys, length << 32)
            if position == len(keys):
                chosen, remaining = num_bins, seq_len - length
                num_bins += 1
            else:
                key = keys.pop(position)
                chosen, remaining = key & low, (key >> 32) - length
            if remaining:
                insort(keys, remaining << 32 | chosen)
            assigned.append(chosen)
        return order, np.array(assigned, dtype=np.int64), num_bins


@register_strategy("first_fit")
class _FirstFit(Packer):
    """The first bin, in opening order, that still has room."""

    def _choose_bin(self, length: int) -> int | None:
        for bin_index, remaining in enumerate(self.remaining):
            if remaining >= length:
                return bin_index
        return None


@register_strategy("ffd")
class _FirstFitDecreasing(_FirstFit):
    """First fit over the lengths sorted longest first."""

    sort_decreasing = True


@register_strategy("next_fit")
class _NextFit(Packer):
    """Only the newest bin is open; an item that does not fit closes it."""

    def _choose_bin(self, length: int) -> int | None:
        if self.remaining and self.remaining[-1] >= length:
            return len(self.remaining) - 1
        return None


def _bins_from_assignment(bin_of: np.ndarray, items: np.ndarray, num_bins: int) -> list[np.ndarray]:
    """Group ``items`` by ``bin_of`` (same length), keeping their order inside each bin."""
    grouping = np.argsort(bin_of, kind="stable")
    bounds = np.searchsorted(bin_of[grouping], np.arange(num_bins + 1))
    grouped = items[grouping]
    return [grouped[bounds[b] : bounds[b + 1]] for b in range(num_bins)]


def _check_lengths(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Returns ``lengths`` as a 1-D int64 array, or raises naming the first sample that cannot
    fit."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive number of tokens, got {seq_len}.")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(
            f"lengths must be a 1-D array of integers, got shape {lengths.shape} and dtype "
            f"{lengths.dtype}."
        )
    bad = np.flatnonzero((lengths < 1) | (lengths > seq_len))
    if bad.size:
        index = int(bad[0])
        raise ValueError(
            f"Sample {index} has length {int(lengths[index])}, but every sample must have "
            f"1..{seq_len} tokens to fit a row of seq_len={seq_len}; drop empty samples and "
            "truncate, split or drop "
            f"over-length ones before packing ({bad.size} sample(s) out of range)."
        )
    return lengths.astype(np.int64, copy=False)


def pack_lengths(
    lengths: np.ndarray, seq_len: int, strategy: str = "bfd", *, first: np.ndarray | None = None
) -> list[np.ndarray]:
    """Groups samples into bins whose total length is at most ``seq_len``.

    Deterministic: equal lengths are taken in index order.

    Args:
        lengths: 1-D integer array, the token count of each sample in the window; each 1..seq_len.
        seq_len: capacity of one packed row, in tokens.
        strategy: one of :data:`STRATEGIES`: ``"bfd"`` (best-fit decreasing), ``"ffd"`` (first-fit
            decreasing), ``"first_fit"`` (first fit in the given order), ``"next_fit"`` (only the
            newest bin is open).
        first: optional boolean mask of samples to place before all others (each group in the
            strategy's order); ``StreamPacker`` uses it so waiting samples are placed first.

    Returns:
        The bins in the order they were opened, each a non-empty int64 array of indices into
        ``lengths`` in the order the samples were placed. Every index appears in exactly one bin.

    Raises:
        ValueError: if a length is outside 1..seq_len (naming the sample) or the strategy is
        unknown.

    >>> lengths = np.array([2, 3, 8, 7])
    >>> [indices.tolist() for indices in pack_lengths(lengths, seq_len=10)]
    [[2, 0], [3, 1]]
    >>> [indices.tolist() for indices in pack_lengths(lengths, seq_len=10, strategy="next_fit")]
    [[0, 1], [2], [3]]
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown packing strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}."
        )
    order, assigned, num_bins = STRATEGIES[strategy](seq_len).assign(
        _check_lengths(lengths, seq_len), first
    )
    return _bins_from_assignment(assigned, order, num_bins)


class StreamPacker:
    """Packs a stream of samples window by window; under-filled packs wait for the next window.

    A stateless per-window packer wastes the tail of every window: its last packs are the leftovers
    nothing else fitted. Here a pack filled below ``carry_below`` × seq_len is not emitted; its
    samples rejoin the next window's pool, where smaller samples can complete them. A sample waits
    at most ``max_delay`` windows (then its pack is emitted as it is), and ``flush()`` packs what is
    left at the end of the stream, so nothing is lost and the delay is bounded. Randomness: the pool
    is shuffled before packing, emitted packs are shuffled, and so are the documents inside each.

    >>> packer = StreamPacker(seq_len=8, rng=np.random.default_rng(0))
    >>> emitted = packer.push(np.arange(3), np.array([8, 5, 2]))  # [8] full; [5, 2] waits
    >>> [sorted(b.tolist()) for b in emitted], [sorted(b.tolist()) for b in packer.flush()]
    ([[0]], [[1, 2]])
    """

    def __init__(
        self,
        seq_len: int,
        strategy: str = "bfd",
        *,
        rng: np.random.Generator,
        carry_below: float = 0.999,
        max_delay: int = 1,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"Unknown packing strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}."
            )
        self.seq_len, self.strategy, self.rng = seq_len, strategy, rng
        self.carry_below, self.max_delay = carry_below, max_delay
        self._ids = np.empty(0, dtype=np.int64)
        self._lengths = np.empty(0, dtype=np.int64)
        self._ages = np.empty(0, dtype=np.int64)
        self.max_delay_seen = 0
        """Most windows any emitted sample waited."""

    def push(self, ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Add one window of samples (ids and token lengths); return the packs (arrays of ids)
        ready to emit."""
        lengths = _check_lengths(lengths, self.seq_len)
        pool_ids = np.concatenate([self._ids, np.asarray(ids, dtype=np.int64)])
        pool_lengths = np.concatenate([self._lengths, lengths])
        pool_ages = np.concatenate([self._ages, np.zeros(len(lengths), dtype=np.int64)])
        return self._pack(pool_ids, pool_lengths, pool_ages, final=False)

    def flush(self) -> list[np.ndarray]:
        """Pack and return every sample still waiting (call once, at the end of the stream)."""
        return self._pack(self._ids, self._lengths, self._ages, final=True)

    def _pack(
        self, ids: np.ndarray, lengths: np.ndarray, ages: np.ndarray, final: bool
    ) -> list[np.ndarray]:
        if not len(ids):
            return []
        shuffled = self.rng.permutation(len(ids))
        order, assigned, num_bins = STRATEGIES[self.strategy](self.seq_len).assign(
            lengths[shuffled], first=ages[shuffled] > 0
        )
        bin_of = np.empty(len(ids), dtype=np.int64)
        bin_of[shuffled[order]] = assigned
        held = np.zeros(num_bins, dtype=bool)
        if not final:
            fills = np.bincount(bin_of, weights=lengths, minlength=num_bins)
            oldest = np.zeros(num_bins, dtype=np.int64)
            np.maximum.at(oldest, bin_of, ages)
            held = (fills < self.carry_below * self.seq_len) & (oldest < self.max_delay)
        waiting = held[bin_of]
        self._ids, self._lengths, self._ages = ids[waiting], lengths[waiting], ages[waiting] + 1
        emitted = np.flatnonzero(~held)
        rank = np.empty(num_bins, dtype=np.int64)
        rank[self.rng.permutation(emitted)] = np.arange(len(emitted))  # packs in random order
        items = np.flatnonzero(~waiting)
        item_rank = rank[bin_of[items]]
        items = items[np.lexsort((self.rng.random(len(items)), item_rank))]  # documents shuffled
        if len(items):
            self.max_delay_seen = max(self.max_delay_seen, int(ages[items].max()))
        if not len(emitted):
            return []
        sizes = np.bincount(item_rank, minlength=len(emitted))
        return np.split(ids[items], np.cumsum(sizes)[:-1])
