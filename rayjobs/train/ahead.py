"""A consumer's read-ahead: batches of a Ray Data iterator taken in a background thread.

Design note. Ray Data's own prefetch (``iter_batches(prefetch_batches=1)``, the default) keeps a
window of at least ``prefetch_batches × batch_size`` rows of blocks ahead, and before it hands
the current block to the batcher it tops that window up, waiting for the next block if need be
(``prefetch_batches_locally``). A rank whose blocks so far end in a short one (``streaming_split
(equal=True)`` cuts blocks to even the ranks out: a 2-row piece, then a 33-row one) therefore
gets no batch, though it holds rows for several, until the stream yields one more block for it.
At the start of a run that block is the main lane's first window, so one rank's first batch waited
for a whole window though its warm-up rows were there (docs/design.md, "Trainers read ahead in a
thread, not with Ray's prefetch").

So the consumers here iterate with ``prefetch_batches=0`` (a batch waits for exactly the blocks
it is cut from) and take batches ``depth`` ahead in a thread of their own (``read_ahead``), which
gives back what the prefetch was for: while a step computes, the next batches' blocks are fetched
and collated. The thread holds at most ``depth + 1`` batches (``depth`` queued, one in hand).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

READ_AHEAD = 2
"""Batches a consumer's thread takes ahead of its step."""

_END = object()


def read_ahead(batches: Iterable[T], depth: int = READ_AHEAD) -> Iterator[T]:
    """``batches`` in order, taken up to ``depth`` ahead of the caller by a daemon thread that
    starts at this call (not at the first ``next``): a consumer that calls it before other work
    (a model's build) has its first batches fetched meanwhile. An exception raised by
    ``batches`` is raised here, where the caller reaches it. ``close()`` (a loop left early), or
    dropping the iterator, stops the thread at its next batch.

    >>> list(read_ahead(range(5), depth=2))
    [0, 1, 2, 3, 4]
    >>> list(read_ahead(iter([]), depth=1))
    []
    >>> list(read_ahead(range(3), depth=0))  # no thread: the plain loop
    [0, 1, 2]
    """
    if depth <= 0:
        return (batch for batch in batches)
    return _ReadAhead(batches, depth)


class _ReadAhead(Iterator[T]):
    """``read_ahead``'s iterator. The thread holds the queue and the stop flag, never this
    object, so an iterator dropped unfinished is collected and its ``__del__`` stops the thread."""

    def __init__(self, batches: Iterable[T], depth: int) -> None:
        handoff: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def put(item: tuple) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def fill() -> None:
            try:
                for batch in batches:
                    if not put((batch, None)):
                        return
                put((_END, None))
            except BaseException as error:  # handed to the consumer, raised in its thread
                put((_END, error))

        self._handoff, self._stop, self._done = handoff, stop, False
        threading.Thread(target=fill, name="rayjobs-read-ahead", daemon=True).start()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        batch, error = self._handoff.get()
        if error is not None or batch is _END:
            self.close()
            if error is not None:
                raise error
            raise StopIteration
        return batch

    def close(self) -> None:
        """Stop the thread at its next batch; the iterator ends."""
        self._done = True
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()
