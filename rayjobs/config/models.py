"""``train.model``: the built-in demo decoder or a Hugging Face causal LM, by ``kind``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rayjobs.config.base import Strict


class ModelConfig(Strict):
    """``train.model`` with ``kind: demo`` (the default): the small decoder of
    ``rayjobs.train.model``."""

    kind: Literal["demo"] = "demo"
    dim: int = Field(default=128, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> ModelConfig:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"dim ({self.dim}) must be n_heads ({self.n_heads}) heads of even width "
                f"(RoPE rotates pairs of dimensions)"
            )
        return self


class HFModelConfig(Strict):
    """``train.model`` with ``kind: hf``: a Hugging Face causal LM, pretrained (``path``) or an
    architecture initialised at random with the run's seed (``config_path`` or
    ``config.model_type``)."""

    kind: Literal["hf"]
    path: str | None = None
    """Pretrained weights: a local checkpoint directory or a Hub name (from the local cache unless
    ``allow_download``), loaded with ``AutoModelForCausalLM.from_pretrained``."""
    config_path: str | None = None
    """An architecture from a local ``config.json`` (or a folder holding one), random init."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Config values: overrides of the loaded config; without ``path`` or ``config_path`` the
    whole architecture, ``model_type`` included (``AutoConfig.for_model``). ``vocab_size`` and the
    bos/eos/pad token ids default to the tokenizer's for a random init."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] | None = None
    """Attention backend; default from ``train.attention`` (flex: ``flex_attention``, sdpa:
    ``sdpa``). ``flex_attention`` trains on CUDA only."""
    allow_download: bool = False
    """Let ``path`` (a Hub name) download; by default only the local cache is read."""

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if self.path is not None and self.config_path is not None:
            raise ValueError("set path (pretrained weights) or config_path (random init), not both")
        has_type = "model_type" in self.config
        if (self.path is not None or self.config_path is not None) and has_type:
            raise ValueError("config.model_type comes from path / config_path; remove it")
        if self.path is None and self.config_path is None and not has_type:
            raise ValueError(
                "set path (pretrained weights), config_path (a config.json) or "
                "config.model_type (an architecture, e.g. llama) to say which model to build"
            )
        return self


MODEL_KINDS = {"demo": ModelConfig, "hf": HFModelConfig}
"""``train.model.kind`` → its section."""
