"""Every random stream of a run, named in one table and derived from the config's ``seed``.

A stream's generator is ``np.random.default_rng([seed, stream id, *keys])``. Each stream has its own
id and a fixed number of keys, so two streams never share a seed sequence whatever the number of
datasets or epochs (numpy's ``SeedSequence`` pads short entropy with zeros, so ``[a, b]`` and
``[a, b, 0]`` would collide: a fixed arity per stream rules that out). Before this table the mix
seeded dataset *i* with ``[seed, epoch, i]`` and the packer with ``[seed, epoch, 2]``, so with three
datasets the third dataset's draw and the packer's shuffles were the same stream.
"""

from __future__ import annotations

import numpy as np

STREAMS: dict[str, tuple[int, tuple[str, ...]]] = {
    # name: (stream id, keys after it); where it is used
    "mix_draw": (1, ("epoch", "dataset")),  # planned: which samples an epoch takes (mix.py)
    "mix_order": (2, ("epoch", "dataset")),  # planned: the epoch's interleaving (mix.py)
    "pack": (3, ("epoch",)),  # planned: the packer's shuffles over the epoch (epochs.py)
    "model_init": (4, ()),  # the model's initial weights on every rank (train.py)
    "stream_order": (5, ("epoch", "dataset", "copy")),  # stream: a pass's order, subsample
    "pack_window": (6, ("epoch", "window")),  # stream: the packer's shuffles in one window
    # a rank's torch RNG once its model is built (dropout): its own per rank, and anew from the
    # step a restart resumes at (train.py)
    "train_rng": (7, ("rank", "step")),
}
"""Every random stream of a run; a new use of randomness gets a new row here."""


def rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """The generator of ``stream`` (a name in :data:`STREAMS`) for these keys.

    >>> a, b = rng(0, "mix_draw", 0, 2).random(), rng(0, "pack", 0).random()
    >>> a != b
    True
    """
    if stream not in STREAMS:
        raise KeyError(f"unknown random stream {stream!r}; add it to rayjobs.data.seeds.STREAMS")
    stream_id, names = STREAMS[stream]
    if len(keys) != len(names):
        raise ValueError(f"stream {stream!r} takes keys {names}, got {keys}")
    return np.random.default_rng([seed, stream_id, *keys])


def torch_seed(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit seed for ``torch.manual_seed`` from the same table."""
    return int(rng(seed, stream, *keys).integers(2**63))
