"""The run configuration: typed sections (``schema``) and the loader (``load``)."""

from rayjobs.config.load import _apply_override, config_from_dict, load_config, yaml_load
from rayjobs.config.models import HFModelConfig, LoraConfig, ModelConfig
from rayjobs.config.schema import (
    Config,
    DatasetConfig,
    DPOConfig,
    EvalConfig,
    MixConfig,
    PackingConfig,
    RayConfig,
    StorageConfig,
    TokenizerConfig,
    TrainConfig,
)
from rayjobs.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "DPOConfig",
    "DatasetConfig",
    "EvalConfig",
    "HFModelConfig",
    "LoraConfig",
    "MixConfig",
    "ModelConfig",
    "PackingConfig",
    "RayConfig",
    "StorageConfig",
    "TokenizerConfig",
    "TrainConfig",
    "_apply_override",
    "config_from_dict",
    "load_config",
    "yaml_load",
]
