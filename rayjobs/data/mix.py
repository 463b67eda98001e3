"""Mix: which samples of which dataset make up one epoch, in what order, from the config's weights.

Design note. A dataset's ``weight`` is its target share of the epoch, counted in samples or in
tokens (``mix.by``). The plan is computed from the sample lengths alone (pure numpy, no Ray), after
tokenization, so "30% of the tokens come from chat" can be met exactly, not just on average:

1. Epoch size: ``mix.epoch_samples`` / ``mix.epoch_tokens``, default everything once.
2. Dataset i gets ``share_i × size`` of it. Its samples are drawn from successive permutations
   (a fresh shuffle per pass): a dataset that needs more than it has is repeated, one that needs
   less is subsampled without replacement. By tokens, the prefix of that draw whose token count
   is closest to the target is taken.
3. Interleaving: the k draws of a dataset get stratified keys ``(j + U) / k``; sorting all keys
   spreads every dataset evenly over the whole epoch (each tenth of the epoch holds a tenth of each
   dataset, up to one sample), instead of one dataset after another.
4. Draws and order come from the ``mix_draw`` and ``mix_order`` streams of ``rayjobs.data.seeds``,
   keyed by (epoch, dataset): the same seed gives the same epoch, each epoch draws and orders
   differently.

Rejected: ``ray.data.Dataset.mix`` (alpha in Ray 2.60): it has no sampling with replacement, its
default uses every row so weights only shape the order, and it cannot target token shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rayjobs.data import seeds


def with_shares(mix: dict[str, dict[str, float]], by: str) -> dict[str, dict[str, float]]:
    """Add each dataset's ``share`` of the epoch, in ``by`` units (``samples`` or ``tokens``), to a
    ``{dataset: {"samples": n, "tokens": n}}`` mix; returns it.

    >>> counts = {"a": {"samples": 1, "tokens": 30}, "b": {"samples": 3, "tokens": 10}}
    >>> mix = with_shares(counts, "tokens")
    >>> [stats["share"] for stats in mix.values()]
    [0.75, 0.25]
    """
    total = sum(stats[by] for stats in mix.values()) or 1
    for stats in mix.values():
        stats["share"] = stats[by] / total
    return mix


def _targets(sizes: np.ndarray, shares: np.ndarray, total: int) -> np.ndarray:
    """Split ``total`` by ``shares`` into integers that add up to it (largest remainder)."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    remainder = total - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
    return counts


def _draw(rng: np.random.Generator, num_samples: int, passes: int) -> np.ndarray:
    return np.concatenate([rng.permutation(num_samples) for _ in range(passes)])


def plan_epoch(
    lengths: Sequence[np.ndarray],
    weights: Sequence[float] | None,
    *,
    by: str = "tokens",
    seed: int = 0,
    epoch: int = 0,
    epoch_samples: int | None = None,
    epoch_tokens: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Plan one epoch of a weighted mix.

    Args:
        lengths: per dataset, the token length of each of its samples (in a canonical order).
        weights: per dataset, its target share (any positive scale; normalised here); None for
            the datasets' natural proportions.
        by: ``"tokens"`` or ``"samples"``: what the shares count.
        seed, epoch: seed the draws and the order.
        epoch_samples, epoch_tokens: epoch size (at most one; default all samples / tokens once).

    Returns:
        ``(dataset_ids, sample_indices)`` in epoch order: occurrence t is sample
        ``sample_indices[t]`` of dataset ``dataset_ids[t]``.

    >>> ids, samples = plan_epoch([np.array([5, 5]), np.array([1, 1, 1, 1])], [1, 1], by="samples",
    ...                           epoch_samples=4)
    >>> np.bincount(ids).tolist()
    [2, 2]
    """
    num_samples = np.array([len(x) for x in lengths], dtype=np.int64)
    num_tokens = np.array([int(x.sum()) for x in lengths], dtype=np.int64)
    if weights is None:  # natural proportions: with the default epoch size, every sample once
        weights = num_tokens if by == "tokens" else num_samples
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.sum()
    if (num_samples == 0).any():
        raise ValueError(
            f"dataset {int(np.flatnonzero(num_samples == 0)[0])} has no samples to mix"
        )
    picks: list[np.ndarray] = []
    if by == "samples":
        total = epoch_samples or int(num_samples.sum())
        for i, count in enumerate(_targets(num_samples, shares, total)):
            if not count:  # a small epoch's share that rounds to no sample
                picks.append(np.zeros(0, dtype=np.int64))
                continue
            rng = seeds.rng(seed, "mix_draw", epoch, i)
            picks.append(_draw(rng, num_samples[i], -(-count // num_samples[i]))[:count])
    elif by == "tokens":
        total = epoch_tokens or int(num_tokens.sum())
        for i, target in enumerate(shares * total):
            rng = seeds.rng(seed, "mix_draw", epoch, i)
            drawn = _draw(rng, num_samples[i], int(target // num_tokens[i]) + 1)
            cumulative = np.cumsum(lengths[i][drawn])
            k = int(np.searchsorted(cumulative, target))  # cumulative[k] >= target > [k - 1]
            closer_below = k > 0 and target - cumulative[k - 1] < cumulative[k] - target
            picks.append(drawn[: k if closer_below else k + 1])
    else:
        raise ValueError(f"mix.by must be 'tokens' or 'samples', not {by!r}")
    keys = []
    for i, chosen in enumerate(picks):
        rng = seeds.rng(seed, "mix_order", epoch, i)
        keys.append((np.arange(len(chosen)) + rng.random(len(chosen))) / max(1, len(chosen)))
    order = np.argsort(np.concatenate(keys), kind="stable")
    dataset_ids = np.concatenate([np.full(len(c), i, dtype=np.int64) for i, c in enumerate(picks)])
    return dataset_ids[order], np.concatenate(picks)[order]
