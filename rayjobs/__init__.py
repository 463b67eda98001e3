"""rayjobs: raw text datasets → packed fixed-length training rows on Ray Data → Ray Train.

    config.py      YAML + dotted overrides → typed Config, validated before Ray starts
    sources.py     each dataset's files → rows {_dataset, _path, _row, _record}
    templates.py   tokenize.py   row → segments (alpaca | chat | text) → input_ids + shifted labels
    mix.py         per-epoch plan: weighted shares by tokens or samples, interleaved, seeded
    pack.py        epochs.py   streaming best-fit decreasing (planned in the driver) → rows of seq_len
    train.py       TorchTrainer: equal batches per rank → document-masked decoder (model.py, masks.py)

``pipeline.build_epochs`` gives the data side (one lazy Ray dataset per epoch); ``pipeline.run`` the job.
"""

from rayjobs.config import Config, ConfigError, config_from_dict, load_config
from rayjobs.pack import StreamPacker, pack_lengths
from rayjobs.mix import plan_epoch
from rayjobs.pipeline import Epochs, build_epoch, run

__all__ = [
    "Config",
    "ConfigError",
    "Epochs",
    "build_epoch",
    "config_from_dict",
    "load_config",
    "pack_lengths",
    "StreamPacker",
    "plan_epoch",
    "run",
]
