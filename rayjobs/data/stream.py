"""The default data path (``packing.mode: stream``): one lazy Ray dataset of packed rows for every
epoch of a run, wired here from the data side's stages.

Read tasks (``reads``) feed one Tokenize actor pool that grows with the cluster, then a pool of
``PackStream`` actors (``packer``), then the trainers through ``streaming_split``. The epochs are
one stream, so the next epoch is read and tokenized while the current one trains; the head of the
first epoch goes through a warm-up lane of its own so the first batch does not wait for a whole
window (docs/design.md, "Streaming, and what it guarantees").
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data

from rayjobs.config import Config
from rayjobs.data import templates
from rayjobs.data.estimate import Estimate, estimate, progress
from rayjobs.data.mix import MIX_MARGIN, budgets, epoch_fractions, sized
from rayjobs.data.packer import PackStream, lane_block_rows, window_rows
from rayjobs.data.placement import cluster_cpus, on_data_nodes
from rayjobs.data.reads import _head_read, _run_stream, passes, warmup_heads
from rayjobs.data.sources import read_file_list
from rayjobs.data.tokenize import Tokenize

TOKENIZE_BATCH_ROWS = 256
"""Rows of a Tokenize call at least (the warm-up lane's calls, and the local runner's)."""

WINDOW_CALLS = 4
"""Main-lane Tokenize calls per first packer window, about (``tokenize_batch_rows``). Each call
is a round of Ray Data's executor and a ledger report; at 256 rows, a fastokens call was a few tens
of milliseconds, and the actor waited on the executor between calls about as long as it worked.
Calls of a quarter window (about 1 Mi tokens, some 4,900 rows of the pipeline bench's data, at
the default window) streamed about a tenth more tokens a second (`rayjobs bench pipeline`, 30x,
2 cores). Sized by the window, a call of long documents is no larger, and a small window (or
epoch) does not wait for a large call."""

TOKENIZE_CPUS = 1
"""Logical CPUs of a Tokenize actor, and the threads its tokenizer may use (``Tokenize``)."""

BLOCK_BYTES = 1 << 20
"""Bytes per block of packed rows (32 rows at seq_len 2048). Small blocks matter because the
trainers' ``streaming_split(equal=True)`` hands a block to one rank only while the blocks it still
holds can even the ranks out: one block per window would hold the first batch back until a second
window is packed (or the stream ends)."""

OUTPUT_BUFFER_BLOCKS = 16
"""Blocks a Ray Data task or actor call may emit ahead of the executor taking them (Ray's default,
2, is ``DataContext._max_num_blocks_in_streaming_gen_buffer``). A packer call emits its whole
window at once, a window is dozens of ``BLOCK_BYTES`` blocks, and at 2 the call paused after every
2 until the executor's next round took them: the consumers drained a window at about 8 blocks a
second (0.5 M tokens/s on the bench's 2 cores, `rayjobs bench pipeline`), 4x that at 16, and a
run's last window is drained after everything else. At most this many blocks wait per task."""

MIX_BLOCKS = 16
"""Raw-row blocks per packer window at least, when datasets are mixed (see ``packed_rows``)."""

MIN_MIX_BLOCK_ROWS = 16

WARMUP_CPUS = 0.25
"""Logical CPUs of a warm-up lane task (short, and the main lane's actors hold theirs)."""


def tokenized(
    rows: ray.data.Dataset,
    config: Config,
    ledger: Any = None,
    tasks: bool = False,
    batch_rows: int = TOKENIZE_BATCH_ROWS,
) -> ray.data.Dataset:
    """Raw rows → tokenized samples through one Tokenize actor pool, which grows up to
    ``ray.tokenize_concurrency`` actors (default half the cluster's CPUs) while data waits, a
    call per ``batch_rows``; or, with ``tasks`` (the warm-up lane), through tasks
    (``_stage_task``)."""
    kwargs = tokenize_kwargs(config, ledger) | {"registry": shipped_templates(config)}
    ceiling = config.ray.tokenize_concurrency or max(1, int(cluster_cpus(config)) // 2)
    actors = 0 if tasks else ceiling
    return _stage(rows, Tokenize, kwargs, batch_rows, config, num_cpus=TOKENIZE_CPUS, actors=actors)


def tokenize_batch_rows(window: int, epoch_rows: float) -> int:
    """Rows of a main-lane Tokenize call: a ``WINDOW_CALLS``-th of the first window, a packer
    window of ``window`` rows or the epoch's expected rows where fewer (a call waits for its rows
    to be read, so one call of a small epoch's every row would read, tokenize and pack it one
    after the other), ``TOKENIZE_BATCH_ROWS`` at least.

    >>> tokenize_batch_rows(19_508, 42_000), tokenize_batch_rows(19_508, 1_400)
    (4877, 350)
    >>> tokenize_batch_rows(150, 42_000)
    256
    """
    return max(TOKENIZE_BATCH_ROWS, int(min(window, epoch_rows)) // WINDOW_CALLS)


def tokenize_kwargs(config: Config, ledger: Any = None) -> dict[str, Any]:
    """``Tokenize``'s arguments for the run's datasets (the templates: this process's)."""
    return {
        "datasets": config.datasets,
        "tokenizer": config.tokenizer,
        "seq_len": config.packing.seq_len,
        "overflow": config.packing.overflow,
        "ledger": ledger,
        "threads": TOKENIZE_CPUS,
        "min_prompt_tokens": config.dpo.min_prompt_tokens,
    }


def pack_kwargs(config: Config, pad_id: int, ledger: Any = None) -> dict[str, Any]:
    """``PackStream``'s arguments for the run."""
    return {
        "seq_len": config.packing.seq_len,
        "strategy": config.packing.strategy,
        "pad_id": pad_id,
        "seed": config.seed,
        "ledger": ledger,
        "budget": config.mix.by if sized(config) else None,
        "task": config.task,
    }


def shipped_templates(config: Config) -> dict[str, templates.Template]:
    """The templates of the config's datasets, by name, for the Tokenize actors and tasks.

    A template of the user's own (``template_modules``) is pickled by value: its module's code
    travels with the actors' arguments, so no node needs a copy of the module (a cluster's nodes
    have none unless ``rayjobs submit`` uploaded it, a local Ray's workers do not import from the
    config's folder). What that module imports must be installed on every node.
    """
    for name in config.template_modules:
        ray.cloudpickle.register_pickle_by_value(sys.modules[name])
    return {spec.template: templates.TEMPLATES[spec.template] for spec in config.datasets}


def _stage(
    rows: ray.data.Dataset,
    stage: type,
    kwargs: dict[str, Any],
    batch_size: int,
    config: Config,
    num_cpus: float,
    actors: int,
) -> ray.data.Dataset:
    """``rows.map_batches`` through a ``map_batches`` class: a pool of up to ``actors`` actors
    of ``num_cpus`` each (starting at ``ray.min_actors``), or, with ``actors`` 0, tasks of
    ``WARMUP_CPUS`` (``_stage_task``)."""
    where = on_data_nodes(config)
    if not actors:
        return rows.map_batches(
            _stage_task, batch_size=batch_size, batch_format="pyarrow", num_cpus=WARMUP_CPUS,
            fn_kwargs={"stage": stage, "kwargs": kwargs}, **where,
        )  # fmt: skip
    return rows.map_batches(
        stage,
        batch_size=batch_size,
        batch_format="pyarrow",
        num_cpus=num_cpus,
        compute=ray.data.ActorPoolStrategy(
            min_size=min(config.ray.min_actors, actors), max_size=actors
        ),
        fn_constructor_kwargs=kwargs,
        **where,
    )


_STAGES: dict[str, Any] = {}


def _stage_task(batch: pa.Table, stage: type, kwargs: dict[str, Any]) -> Any:
    """Run a ``map_batches`` class as a task: one instance per worker process and arguments, so
    the tokenizer loads once per process. The warm-up lane runs this way: its work is short, and
    a task, unlike an actor, gives its CPU back when done (actors held for the whole run by a lane
    that finished early could starve the main lane and the trainers on a small cluster)."""
    import hashlib

    from ray import cloudpickle

    key = stage.__name__ + hashlib.blake2b(cloudpickle.dumps(kwargs)).hexdigest()
    if key not in _STAGES:
        _STAGES[key] = stage(**kwargs)
    return _STAGES[key](batch)


def packed_rows(config: Config, pad_id: int, ledger: Any = None) -> ray.data.Dataset:
    """The packed rows of every epoch, in epoch order, as one lazy dataset (see module note)."""
    weighted = sized(config)
    estimates = estimate(config)
    fractions = epoch_fractions(config, estimates)
    margin = 1.0 + MIX_MARGIN if weighted else 1.0  # read a margin more, trim to the share
    reads = [
        [
            passes(spec, index, epoch, config.seed, fractions[index] * margin)
            for epoch in range(config.train.epochs)
        ]
        for index, spec in enumerate(config.datasets)
    ]  # reads[dataset][epoch]: that epoch's passes over the dataset
    if weighted and ledger is not None:
        ray.get(ledger.set_budgets.remote(budgets(config, estimates, fractions)))
    heads = warmup_heads(config, estimates, fractions, [r[0][0] for r in reads])
    where = on_data_nodes(config)
    window, block = window_and_block(config, estimates)
    streams, expected = [], []
    for index, spec in enumerate(config.datasets):
        sizes = estimates[spec.name].file_sizes
        stream = _run_stream(spec, reads[index], where, heads.get(spec.name), sizes)
        if len(config.datasets) > 1 and _coarse(estimates[spec.name], block):
            stream = stream.repartition(target_num_rows_per_block=block)
        streams.append(stream)
        expected.append(fractions[index] * estimates[spec.name].rows_hint)
    rows = streams[0]
    if len(streams) > 1:  # interleaved block by block in the ratio of expected rows
        rows = streams[0].mix(*streams[1:], weights=list(np.array(expected) / sum(expected)))
    packers = config.ray.pack_concurrency or max(1, int(cluster_cpus(config)) // 4)
    packed = _packed(
        tokenized(rows, config, ledger, batch_rows=tokenize_batch_rows(window, sum(expected))),
        config, pad_id, ledger,
        window, packers,
    )  # fmt: skip
    if heads:
        specs = {spec.name: (spec, reads[i][0][0]) for i, spec in enumerate(config.datasets)}
        parts = []
        for name, head in heads.items():
            spec, first = specs[name]
            read = _head_read(spec, head, first)
            parts.append(read_file_list(spec, [read], sizes=estimates[name].file_sizes, **where))
        warm = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        # one packer call over the whole lane (at least a row's worth: long seq_len)
        lane = max(config.packing.warmup_tokens, config.packing.seq_len)
        window = window_rows(lane, mean_sample_tokens(estimates))
        warm = tokenized(warm, config, ledger, tasks=True)
        warm = _packed(warm, config, pad_id, ledger, window, 0)
        # in blocks small enough that every rank's first batch comes from the lane: the
        # trainers' streaming_split(equal=True) holds a block back while the others cannot even
        # the ranks out, so a lane of one or two blocks fed one rank and left the rest waiting
        # for the first main window (seconds to minutes on large data)
        ranks = max(1, config.train.num_workers)
        block = lane_block_rows(config.packing.warmup_tokens, config.packing.seq_len, ranks)
        warm = warm.repartition(target_num_rows_per_block=block)
        packed = warm.union(packed)
    # Every task's output cut into blocks of about BLOCK_BYTES. The setting is the plan's (Ray Data
    # plans a dataset with one context): it shapes the packers' output, and caps the raw-row and
    # tokenized blocks before them too (a zero-copy slice of a larger one).
    packed.context.target_max_block_size = BLOCK_BYTES
    if hasattr(packed.context, "_max_num_blocks_in_streaming_gen_buffer"):  # a private setting
        packed.context._max_num_blocks_in_streaming_gen_buffer = OUTPUT_BUFFER_BLOCKS
    first = (
        f"a warm-up lane of {config.packing.warmup_tokens} tokens"
        if heads
        else f"the first window of {config.packing.window_tokens} tokens"
    )
    progress.info(
        "data: streaming %d epoch(s) of %d dataset(s); the first packed rows wait for %s",
        config.train.epochs, len(config.datasets), first,
    )  # fmt: skip
    return packed


def mean_sample_tokens(estimates: dict[str, Estimate]) -> float:
    """The datasets' mean sample length, unweighted (what windows are sized in rows by)."""
    return float(np.mean([e.mean_tokens for e in estimates.values()]))


def window_and_block(config: Config, estimates: dict[str, Estimate]) -> tuple[int, int]:
    """A packer window's rows and the mix's block (a window's ``MIX_BLOCKS``-th,
    ``MIN_MIX_BLOCK_ROWS`` at least), for the Ray path and the local runner alike."""
    window = window_rows(config.packing.window_tokens, mean_sample_tokens(estimates))
    return window, max(MIN_MIX_BLOCK_ROWS, window // MIX_BLOCKS)


def _coarse(estimate: Estimate, block: int) -> bool:
    """Whether a dataset's read blocks may hold more than twice ``block`` rows, the mix's target
    (a window's ``MIX_BLOCKS``-th): then its stream is repartitioned to ``block`` rows before the
    mix, so each window holds every dataset in about its ratio (a block is the unit
    ``Dataset.mix`` interleaves). A read block holds at most ``BLOCK_BYTES`` of rows in memory,
    more than they take in the file, so the rows per file byte overstate its rows. Reads are not
    repartitioned otherwise: a repartition is an operator of its own, a task per block, and at
    the default window it took a fifth of the steady rate (`rayjobs bench pipeline`). A
    Hugging Face dataset's blocks are as ``datasets`` wrote them: always repartitioned.

    >>> _coarse(Estimate(mean_tokens=200.0, rows_per_byte=1 / 800), block=1224)
    False
    >>> _coarse(Estimate(mean_tokens=200.0, rows_per_byte=1 / 800), block=64)
    True
    >>> _coarse(Estimate(mean_tokens=200.0, rows=10_000), block=1224)
    True
    """
    if estimate.rows_per_byte is None:
        return True
    return BLOCK_BYTES * estimate.rows_per_byte > 2 * block


def _packed(
    samples: ray.data.Dataset, config: Config, pad_id: int, ledger: Any, window: int, actors: int
) -> ray.data.Dataset:
    """Tokenized samples → packed rows through a pool of up to ``actors`` PackStream actors (0:
    tasks, the warm-up lane), one call per ``window`` samples (``packed_rows`` sets the block
    size)."""
    kwargs = pack_kwargs(config, pad_id, ledger)
    return _stage(samples, PackStream, kwargs, window, config, num_cpus=0.5, actors=actors)
