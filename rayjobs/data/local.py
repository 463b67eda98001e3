"""The local runner: the streaming path's stages run one after another in this process, without
Ray (``rayjobs export --runner local``; ``auto`` takes it for an export one machine does in
seconds, where no cluster is named).

The same stages as ``stream.packed_rows``, the same callables: each epoch's passes over each
dataset (``reads.passes``: file order and subsample from the seed, a weighted dataset read a
margin more), each file read as a read task reads it (``sources.read_files``); the datasets'
raw rows interleaved in blocks of a window's ``stream.MIX_BLOCKS``-th, each dataset's next block
going where its share of the rows so far is furthest behind its expected share; ``Tokenize`` on
batches of ``stream.TOKENIZE_BATCH_ROWS`` rows; ``PackStream`` on each window of
``packer.window_rows`` samples, an epoch's last window on what is left. Every count goes to a
``Tally`` (``PackStream`` trims a weighted window to its datasets' shares through it). No warm-up
lane: it exists for a trainer's first batch, and costs packing efficiency.

Why a second runner: on one machine, the Ray path's fixed cost (Ray and its helper processes
started, Ray Data's executor, a worker process per stage, each importing Ray) is many times the
work of a data set one core tokenizes in seconds (docs/benchmarks.md, "Beside a TRL user's
path"). It runs in windows, so its memory is a window's, as the stream's is. It is deterministic:
the same config and files give the same rows (the Ray path's windows form as blocks arrive).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from rayjobs.config import Config, DatasetConfig
from rayjobs.data.estimate import Estimate, estimate
from rayjobs.data.formats import HF
from rayjobs.data.mix import MIX_MARGIN, budgets, epoch_fractions, sized
from rayjobs.data.packer import PackStream
from rayjobs.data.reads import pass_reads, passes
from rayjobs.data.sources import FileRead, read_files, read_options
from rayjobs.data.stream import (
    TOKENIZE_BATCH_ROWS,
    pack_kwargs,
    tokenize_kwargs,
    window_and_block,
)
from rayjobs.data.tally import Tally
from rayjobs.data.tokenize import Tokenize
from rayjobs.errors import ConfigError


def unsupported(config: Config) -> str | None:
    """Why the local runner cannot run ``config`` (None when it can): ``packing.mode: planned``
    (a plan over every sample's length, which the Ray path makes), or a Hugging Face dataset
    loaded by ``datasets`` (read through Ray Data)."""
    if config.packing.mode == "planned":
        return "packing.mode: planned is the Ray path's (this runner streams)"
    for spec in (*config.datasets, *config.eval.datasets):
        if spec.format == HF:
            return f"dataset {spec.name!r} is a Hugging Face dataset, which Ray Data reads"
    return None


def packed_rows(
    config: Config,
    pad_id: int,
    tally: Tally,
    estimates: dict[str, Estimate] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """The packed rows of every epoch, in epoch order, a window's at a time (``PackStream``'s
    output: 2-D numpy columns and ``epoch``); their counts in ``tally``. ``estimates``: the
    datasets' (``estimate.estimate``), when the caller has them."""
    problem = unsupported(config)
    if problem:
        raise ConfigError(f"the local runner cannot run this config: {problem}")
    estimates = estimates or estimate(config)
    fractions = epoch_fractions(config, estimates)
    margin = 1.0 + MIX_MARGIN if sized(config) else 1.0  # read a margin more, trim to the share
    if sized(config):
        tally.set_budgets(budgets(config, estimates, fractions))
    tokenize = Tokenize(**tokenize_kwargs(config, tally))
    pack = PackStream(**pack_kwargs(config, pad_id, tally))
    window, block = window_and_block(config, estimates)
    expected = [
        fractions[index] * estimates[spec.name].rows_hint
        for index, spec in enumerate(config.datasets)
    ]
    reads = [
        pass_reads(
            spec,
            [
                passes(spec, index, epoch, config.seed, fractions[index] * margin)
                for epoch in range(config.train.epochs)
            ],
        )
        for index, spec in enumerate(config.datasets)
    ]  # reads[dataset]: every file read of the run, epoch by epoch
    for epoch in range(config.train.epochs):
        streams = [
            _blocks(_read(spec, [r for r in reads[index] if r.epoch == epoch], estimates), block)
            for index, spec in enumerate(config.datasets)
        ]
        rows = _blocks(_mixed(streams, expected), TOKENIZE_BATCH_ROWS)
        yield from _windows((tokenize(batch) for batch in rows), window, pack)


def _read(
    spec: DatasetConfig, reads: list[FileRead], estimates: dict[str, Estimate] | None
) -> Iterator[pa.Table]:
    """One dataset's raw rows of ``reads``, as its read tasks would emit them."""
    sizes = estimates[spec.name].file_sizes if estimates else None
    return read_files(reads, read_options(spec), sizes)


def _blocks(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """``tables`` cut and joined into tables of ``rows`` rows (the last one shorter)."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        while count >= rows:
            joined = pa.concat_tables(held)
            yield joined.slice(0, rows)
            held, count = [joined.slice(rows)], count - rows
    if count:
        yield pa.concat_tables(held)


def _mixed(streams: list[Iterator[pa.Table]], expected: list[float]) -> Iterator[pa.Table]:
    """The datasets' blocks interleaved: next, the block of the dataset whose rows so far are
    the furthest below its share of ``expected`` rows; a dataset that ends leaves the others
    to go on in their ratio."""
    shares = np.asarray(expected, dtype=np.float64)
    shares = shares / shares.sum() if shares.sum() > 0 else np.full(len(streams), 1 / len(streams))
    emitted = np.zeros(len(streams))
    live = list(range(len(streams)))
    while live:
        index = min(live, key=lambda i: (emitted[i] / shares[i] if shares[i] else np.inf, i))
        block = next(streams[index], None)
        if block is None:
            live.remove(index)
            continue
        emitted[index] += block.num_rows
        yield block


def _windows(
    samples: Iterable[pa.Table], window: int, pack: PackStream
) -> Iterator[dict[str, np.ndarray]]:
    """Each ``window`` samples packed in one ``PackStream`` call, then what is left."""
    for batch in _blocks((table for table in samples if table.num_rows), window):
        yield pack(batch)


def tokenized(config: Config) -> Iterator[pa.Table]:
    """Every dataset read once, whole, in file order, and tokenized, counted by no one: the
    samples ``inspect`` takes its lengths from (``pipeline.tokenize``'s twin)."""
    tokenize = Tokenize(**tokenize_kwargs(config))
    for spec in config.datasets:
        reads = [FileRead(path) for path in spec.files]
        for batch in _blocks(_read(spec, reads, None), TOKENIZE_BATCH_ROWS):
            yield tokenize(batch)
