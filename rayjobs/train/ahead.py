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
    """``batches`` in order, taken up to ``depth`` ahead of the caller by a daemon thread; an
    exception raised by ``batches`` is raised here, where the caller reaches it. Closing the
    generator (a loop left early) stops the thread at its next batch.

    >>> list(read_ahead(range(5), depth=2))
    [0, 1, 2, 3, 4]
    >>> list(read_ahead(iter([]), depth=1))
    []
    >>> list(read_ahead(range(3), depth=0))  # no thread: the plain loop
    [0, 1, 2]
    """
    if depth <= 0:
        yield from batches
        return
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

    thread = threading.Thread(target=fill, name="rayjobs-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            batch, error = handoff.get()
            if error is not None:
                raise error
            if batch is _END:
                return
            yield batch
    finally:
        stop.set()
