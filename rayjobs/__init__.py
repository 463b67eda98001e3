"""rayjobs: raw text datasets → packed fixed-length training rows on Ray Data → Ray Train.

    config.py      YAML + dotted overrides → typed Config, validated before Ray starts
    sources.py     each dataset's files → rows {_dataset, _path, _row, _record}
    templates.py   tokenize.py   row → segments (alpaca | chat | text) → input_ids + shifted labels
    mix.py         per-epoch plan: weighted shares by tokens or samples, interleaved, seeded
    pack.py        epochs.py   streaming best-fit decreasing (planned in the driver) → rows of seq_len
    train.py       TorchTrainer: equal batches per rank → document-masked decoder (model.py, masks.py)

``pipeline.build_epochs`` gives the data side (one lazy Ray dataset per epoch); ``pipeline.run`` the job.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Config": "rayjobs.config", "ConfigError": "rayjobs.config", "config_from_dict": "rayjobs.config",
    "load_config": "rayjobs.config", "StreamPacker": "rayjobs.pack", "pack_lengths": "rayjobs.pack",
    "plan_epoch": "rayjobs.mix", "Epochs": "rayjobs.pipeline", "build_epoch": "rayjobs.pipeline",
    "run": "rayjobs.pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Exports load on first use, so ``rayjobs.masks`` and ``rayjobs.model`` import without Ray or
    pydantic (the GPU checks run where only torch is installed)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rayjobs' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
