"""rayjobs: raw text datasets → packed fixed-length training rows on Ray Data → Ray Train.

The package has two sides, one per kind of node, and the job on top (README, "Design"):

data side (CPU nodes; numpy, pyarrow, Ray Data; never torch):
    formats.py     one file's bytes → records (json | jsonl | parquet | csv | text registry)
    sources.py     each dataset's files → Ray rows {_dataset, _path, _row, _record}
    templates.py   row → text segments, trainable or not (alpaca | chat | text registry)
    tokenize.py    segments → input_ids + labels shifted per sample; overflow policy
    mix.py         per-epoch plan: weighted shares by tokens or samples, interleaved
    pack.py        streaming best-fit decreasing (strategy registry)
    rows.py        the packed-row contract: columns, dtypes, ignore index, layout, assembly
    stream.py      the default path: read → mix → Tokenize pool → PackStream pool, one stream
    epochs.py      planned mode's Ray adapters: plan in the driver, assemble rows in Ray Data
    seeds.py       every random stream of a run, from one table
train side (GPU nodes; torch):
    masks.py       document_ids → dense mask (SDPA) and BlockMask (FlexAttention)
    collate.py     packed rows → tensors on the rank's device
    ahead.py       a rank's read-ahead: batches taken in a thread, not by Ray's prefetch
    model.py       the demo decoder, Hugging Face causal LMs (PackedLM), the chunked loss
    train.py       the TorchTrainer loop: equal batches per rank, guard, checkpoint; and
                   ``train_batches``, the same batches for users' own loops (README)
on top:
    config.py      YAML + dotted overrides → typed Config, validated against the registries
    pipeline.py    the job: ``start_job`` (data side, shared by run/export/bench) and ``run``
    metrics.py     the run's Ledger (exact counts) and its Prometheus series; stage timers
    export.py      ``rayjobs export``: packed rows as Parquet + manifest
    inspect.py     ``rayjobs inspect``: the data side's figures, a decoded packed row, plots
    submit.py      ``rayjobs submit`` / status / logs / stop through Ray's Jobs API
    bench.py, bench_pipeline.py, bench_attention.py, bench_read.py, bench_train.py, cli.py
"""

import importlib
from typing import Any

_EXPORTS = {
    "Config": "rayjobs.config",
    "ConfigError": "rayjobs.config",
    "config_from_dict": "rayjobs.config",
    "load_config": "rayjobs.config",
    "StreamPacker": "rayjobs.data.pack",
    "pack_lengths": "rayjobs.data.pack",
    "plan_epoch": "rayjobs.data.mix",
    "Epochs": "rayjobs.data.planned",
    "start_job": "rayjobs.job.pipeline",
    "run": "rayjobs.job.pipeline",
    "Job": "rayjobs.job.pipeline",
    "train_batches": "rayjobs.train.loop",
    "hf_attention_mask": "rayjobs.train.masks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Exports load on first use, so ``import rayjobs.data.pack`` stays numpy-only and
    ``rayjobs.train.masks`` / ``rayjobs.train.model`` import without Ray or pydantic (the GPU checks run where
    only torch is installed)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rayjobs' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
