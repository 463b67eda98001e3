"""A consumer's read-ahead (rayjobs.train.ahead): a batch waits for the blocks it is cut from, not
for the one after them; errors and early stops behave as in a plain loop."""

from __future__ import annotations

import doctest
import threading
import time

import numpy as np
import pytest
import torch

from rayjobs.train import ahead
from rayjobs.train.batches import rank_batches

SEQ = 8
GATE_S = 5
"""How long the slow block's task waits to be let through before it goes on by itself."""


def test_ahead_doctests():
    results = doctest.testmod(ahead)
    assert results.attempted >= 3 and results.failed == 0


def test_an_error_reaches_the_consumer_after_the_batches_before_it():
    def source():
        yield from (0, 1)
        raise ValueError("dataset 'alpaca', file a.jsonl, row 7: no field 'output'")

    batches = ahead.read_ahead(source(), depth=2)
    assert [next(batches), next(batches)] == [0, 1]
    with pytest.raises(ValueError, match="row 7: no field 'output'"):
        next(batches)


def test_leaving_the_loop_early_stops_the_thread():
    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield i

    before = set(threading.enumerate())
    batches = ahead.read_ahead(source(), depth=2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    mine = [t for t in set(threading.enumerate()) - before if t.name == "rayjobs-read-ahead"]
    assert len(mine) == 1  # guard: the read-ahead ran in a thread of its own
    batches.close()
    mine[0].join(timeout=30)
    assert not mine[0].is_alive()
    # Three taken, two queued, one in the thread's hand, at most one more started.
    assert 3 <= len(pulled) <= 3 + 2 + 2


@pytest.fixture(scope="module")
def gate(ray_local):
    import ray

    @ray.remote(num_cpus=0)
    class Gate:
        """Holds the third block back until a consumer has had its first batch (or GATE_S)."""

        def __init__(self):
            self.opened = self.made = False

        def reset(self):
            self.opened = self.made = False

        def open(self):
            self.opened = True

        def is_open(self):
            return self.opened

        def mark_made(self):
            self.made = True

        def was_made(self):
            return self.made

    return Gate.remote()


def _stalling_dataset(gate):
    """Blocks of 2 and 33 packed rows at once, then one of 40 that waits at the gate: the shape
    a rank's first blocks can have under ``streaming_split(equal=True)`` (rayjobs.train.ahead)."""
    import ray

    def rows(batch, gate):
        block = int(batch["id"][0])
        if block == 2:
            waited = time.monotonic()
            while not ray.get(gate.is_open.remote()) and time.monotonic() - waited < GATE_S:
                time.sleep(0.05)
            ray.get(gate.mark_made.remote())
        n = {0: 2, 1: 33, 2: 40}[block]
        tokens = np.tile(np.arange(SEQ, dtype=np.int32), (n, 1))
        columns = dict.fromkeys(("input_ids", "labels", "position_ids"), tokens)
        return columns | {
            "document_ids": np.zeros((n, SEQ), dtype=np.int32),
            "num_tokens": np.full(n, SEQ, dtype=np.int32),
        }

    ray.get(gate.reset.remote())
    dataset = ray.data.range(3, override_num_blocks=3).map_batches(
        rows, batch_size=1, fn_kwargs={"gate": gate}
    )
    dataset.context.execution_options.preserve_order = True
    return dataset


def _first_batch_before_the_slow_block(batches, gate) -> bool:
    import ray

    first = next(iter(batches))
    assert first["input_ids"].shape == (4, SEQ)
    made = ray.get(gate.was_made.remote())
    ray.get(gate.open.remote())
    return not made


@pytest.mark.e2e
def test_a_rank_gets_its_first_batch_from_the_blocks_it_holds(gate):
    # Guard: Ray's own prefetch (the default) holds this first batch back for the third block.
    stalled = _stalling_dataset(gate).iterator().iter_torch_batches(batch_size=4, drop_last=True)
    assert not _first_batch_before_the_slow_block(stalled, gate)
    # The trainers' iteration does not.
    batches = rank_batches(_stalling_dataset(gate).iterator(), 4, torch.device("cpu"))
    assert _first_batch_before_the_slow_block(batches, gate)
    # The rest, the short last batch included (train.drop_last is false by default).
    assert sum(len(b["num_tokens"]) for b in batches) == 75 - 4
