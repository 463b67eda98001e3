"""Mix: every weighted-share computation of a run, from the config's weights and ``mix.by``.

Streaming (the default) reads each dataset ``epoch_fractions`` times an epoch (whole passes plus a
subsample, a ``MIX_MARGIN`` more with weights) and the packers trim each dataset to its
``budgets`` through the ledger, so realized shares hit the weights. The planned path
(``plan_epoch``) draws each epoch's samples from their lengths alone, exactly, and interleaves
them evenly (docs/data.md, "Mixing").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rayjobs.data import seeds

if TYPE_CHECKING:
    from rayjobs.config import Config
    from rayjobs.data.estimate import Estimate


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


MIX_MARGIN = 0.1
"""Weighted mixing reads each dataset this much more than its share of an epoch, so that estimates
a little low still fill the share; the packers trim what lies beyond it (``Ledger.admit``)."""


def sized(config: Config) -> bool:
    """Whether each epoch holds set shares of the datasets (weights, or an epoch size: then each
    dataset in its natural proportion), read from estimates and trimmed by ledger budgets; else
    every epoch reads every dataset once, as it is."""
    epoch_size = config.mix.epoch_tokens if config.mix.by == "tokens" else config.mix.epoch_samples
    return config.datasets[0].weight is not None or epoch_size is not None


def epoch_fractions(config: Config, estimates: dict[str, Estimate]) -> list[float]:
    """How many times each dataset is read per epoch (1.0 = every sample once): its share of the
    epoch (by weight; without weights, in its natural proportion), in ``mix.by`` units, over its
    estimated size."""
    specs = config.datasets
    if not sized(config):
        return [1.0] * len(specs)
    by_tokens = config.mix.by == "tokens"
    sizes = np.array(
        [
            estimates[s.name].samples_hint * (estimates[s.name].mean_tokens if by_tokens else 1.0)
            for s in specs
        ]
    )
    weighted = specs[0].weight is not None
    shares = np.array([s.weight for s in specs], dtype=np.float64) if weighted else sizes.copy()
    shares /= shares.sum()
    total = (config.mix.epoch_tokens if by_tokens else config.mix.epoch_samples) or sizes.sum()
    return list(shares * total / sizes)


def budgets(
    config: Config, estimates: dict[str, Estimate], fractions: list[float]
) -> dict[tuple[int, str], float]:
    """Each dataset's share of each epoch in ``mix.by`` units, from the estimates: what its
    ``fraction`` of a read would hold (``Ledger.admit`` trims the margin read beyond it)."""
    by_tokens = config.mix.by == "tokens"
    return {
        (epoch, spec.name): fraction
        * estimates[spec.name].samples_hint
        * (estimates[spec.name].mean_tokens if by_tokens else 1.0)
        for epoch in range(config.train.epochs)
        for spec, fraction in zip(config.datasets, fractions, strict=True)
    }
