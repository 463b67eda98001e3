"""``read_ahead``: the trainers' batches fetched in a thread that starts when they are asked for,
so a loop that asks before building its model has its first batches fetched meanwhile."""

from __future__ import annotations

import gc
import threading

import pytest

from rayjobs.train.ahead import read_ahead


class Source:
    """Batches 0..n-1, recording how far the reader has pulled and whether it was stopped."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0
        self.first = threading.Event()
        self.finished = threading.Event()

    def __iter__(self):
        try:
            for batch in range(self.n):
                self.pulled += 1
                self.first.set()
                yield batch
        finally:
            self.finished.set()


def test_the_first_batches_are_fetched_before_the_first_is_asked_for():
    source = Source(10)
    batches = read_ahead(source, depth=2)
    assert source.first.wait(timeout=10), "nothing was fetched until the first next()"
    assert list(batches) == list(range(10))


def test_an_iterator_dropped_unread_stops_its_thread():
    """A loop that never reaches its batches (its model build failed, say) leaves no thread
    behind: the reader stops at its next batch once the iterator is gone."""
    source = Source(1000)
    batches = read_ahead(source, depth=2)
    assert source.first.wait(timeout=10)
    del batches
    gc.collect()
    assert source.finished.wait(timeout=10)
    assert source.pulled <= 4  # depth 2 queued, one waiting to be put: it stopped there


def test_close_ends_the_iteration_and_the_thread():
    source = Source(1000)
    batches = read_ahead(source, depth=2)
    assert next(batches) == 0
    batches.close()
    assert source.finished.wait(timeout=10)
    assert list(batches) == []


def test_an_error_in_the_source_reaches_the_consumer_after_the_batches_before_it():
    def failing():
        yield 0
        raise ValueError("bad row")

    batches = read_ahead(failing(), depth=2)
    assert next(batches) == 0
    with pytest.raises(ValueError, match="bad row"):
        next(batches)
    assert list(batches) == []
