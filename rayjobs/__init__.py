"""rayjobs: raw text datasets → packed fixed-length training rows on Ray Data → Ray Train.

    config.py      YAML + dotted overrides → typed Config, validated before Ray starts
    sources.py     each dataset's files → rows {_dataset, _path, _row, _record}
    templates.py   tokenize.py   row → segments (alpaca | chat | text) → input_ids + shifted labels
    pack.py        PackWindow: best-fit-decreasing over a window → rows of exactly seq_len
    train.py       TorchTrainer: equal batches per rank → document-masked decoder (model.py, masks.py)

``pipeline.build_epoch`` is the data side as one lazy Ray dataset; ``pipeline.run`` the whole job.
"""

from rayjobs.config import Config, ConfigError, config_from_dict, load_config
from rayjobs.pack import pack_lengths, pack_window
from rayjobs.pipeline import build_epoch, run

__all__ = [
    "Config",
    "ConfigError",
    "build_epoch",
    "config_from_dict",
    "load_config",
    "pack_lengths",
    "pack_window",
    "run",
]
