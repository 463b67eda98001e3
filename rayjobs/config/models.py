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


class LoraConfig(Strict):
    """``train.lora``: LoRA adapters through PEFT (``peft.LoraConfig``, whose names these keys
    keep) on a ``kind: hf`` model; only the adapters (and ``modules_to_save``) train."""

    r: int = Field(default=8, gt=0)
    """The adapters' rank."""
    lora_alpha: float = Field(default=16.0, gt=0)
    """Scaling: the adapters' update is multiplied by ``lora_alpha / r``."""
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    target_modules: list[str] | str | None = None
    """Module names (or a regex, or ``all-linear``) that get adapters; null: PEFT's default for
    the architecture (Llama, Qwen: ``q_proj`` and ``v_proj``)."""
    modules_to_save: list[str] | None = None
    """Modules trained whole beside the adapters (``embed_tokens``, ``lm_head``: where a new token
    needs its embedding trained)."""
    save_merged: bool = False
    """Also write the final checkpoint's model with the adapters merged into its weights, in a
    ``merged`` folder that ``AutoModelForCausalLM.from_pretrained`` loads without PEFT."""

    def peft(self) -> dict[str, Any]:
        """The ``peft.LoraConfig`` keyword arguments of this section."""
        return self.model_dump(exclude={"save_merged"})


def check_training_choices(train: Any) -> None:
    """``TrainConfig``'s model, LoRA and precision settings that cannot go together, each refused
    before Ray starts, naming the keys to change.

    Raises:
        ValueError: for the first that does not fit.
    """
    if train.lora is not None and train.model.kind != "hf":
        raise ValueError(
            "train.lora adapts a Hugging Face model (PEFT): set train.model.kind: hf; the demo "
            "decoder trains whole"
        )
    if train.precision == "fp16" and not train.use_gpu:
        raise ValueError(
            "train.precision: fp16 (autocast with a loss scaler) runs on CUDA only; set "
            "train.use_gpu: true, or use bf16 on CPU"
        )
    if train.param_dtype == "bf16" and train.precision in ("fp32", "fp16"):
        raise ValueError(
            f"train.param_dtype: bf16 computes in bf16, but train.precision is "
            f"{train.precision}; set train.precision: auto (or bf16), or train.param_dtype: fp32"
        )
