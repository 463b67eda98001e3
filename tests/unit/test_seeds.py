"""Tests for rayjobs.data.seeds: every random stream of a run is distinct, whatever the number of
datasets and epochs."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from rayjobs.data import seeds


def test_docstring_examples():
    results = doctest.testmod(seeds)
    assert results.attempted >= 2 and results.failed == 0  # guard: the examples ran


def test_no_two_streams_of_a_run_draw_the_same_numbers():
    """Five datasets, three epochs, four ranks: every (stream, keys) generator a run creates is
    distinct. The old seeding gave dataset 2's draw and the packer the same stream."""
    keys = [("pack", (epoch,)) for epoch in range(3)] + [("model_init", ())]
    keys += [
        (stream, (epoch, dataset))
        for stream in ("mix_draw", "mix_order")
        for epoch in range(3)
        for dataset in range(5)
    ]
    keys += [("stream_order", (e, d, c)) for e in range(3) for d in range(5) for c in range(2)]
    keys += [("pack_window", (e, w)) for e in range(3) for w in (0, 1, 2**40)]
    keys += [("train_rng", (rank, step)) for rank in range(4) for step in (0, 3, 12)]
    assert {name for name, _ in keys} == set(seeds.STREAMS), "guard: every stream is covered"
    draws = {(name, k): tuple(seeds.rng(7, name, *k).integers(2**63, size=4)) for name, k in keys}
    assert len(set(draws.values())) == len(draws)


def test_same_seed_same_stream_and_seeds_differ():
    first, again = (seeds.rng(3, "pack", 1).random(8) for _ in range(2))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, seeds.rng(4, "pack", 1).random(8))
    assert (
        seeds.torch_seed(3, "model_init")
        == seeds.torch_seed(3, "model_init")
        != seeds.torch_seed(4, "model_init")
    )


@pytest.mark.parametrize(
    ("stream", "keys", "error", "message"),
    [
        ("pack", (), ValueError, r"takes keys \('epoch',\)"),
        ("pack", (0, 0), ValueError, r"takes keys \('epoch',\)"),
        ("shuffle", (0,), KeyError, "unknown random stream 'shuffle'"),
    ],
)
def test_a_stream_takes_exactly_its_keys(stream, keys, error, message):
    with pytest.raises(error, match=message):
        seeds.rng(0, stream, *keys)


def test_every_stream_id_is_unique():
    ids = [stream_id for stream_id, _ in seeds.STREAMS.values()]
    assert len(ids) == len(set(ids))
