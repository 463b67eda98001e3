"""rayjobs: raw text datasets → packed fixed-length training rows on Ray Data → Ray Train.

The package has one folder per side of the runtime and the job on top (docs/development.md,
"Layout"): ``data`` (CPU nodes; never torch), ``train`` (GPU nodes; torch), ``job`` (the pipeline,
its ledger, export, inspection, submission), ``bench``; ``config`` and ``cli`` at the root.
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
    "Callback": "rayjobs.train.callbacks",
    "train_batches": "rayjobs.train.batches",
    "hf_attention_mask": "rayjobs.train.masks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Exports load on first use, so ``import rayjobs.data.pack`` stays numpy-only and
    ``rayjobs.train.masks`` imports without Ray or pydantic (the GPU checks run where only torch
    is installed)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rayjobs' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
