"""Building what a train worker trains: the attention backend, the model (demo decoder or Hugging
Face causal LM in a ``PackedLM``), its parallel wrapping (DDP or FSDP2), the DPO reference, the
optimizer and the LR schedule."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from rayjobs.config import Config, HFModelConfig, TrainConfig
from rayjobs.data import seeds
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.errors import ConfigError
from rayjobs.train.hf import attention_layers, build_hf_model, hf_config
from rayjobs.train.lora import adapt
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM

logger = logging.getLogger(__name__)


def resolve_attention(attention: str, device: torch.device) -> str:
    if attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise ValueError(
            "train.attention: flex has no backward pass on CPU in torch 2.13; "
            "use auto or sdpa when training without GPUs"
        )
    return attention


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``train.param_dtype`` → the parameters' torch dtype."""

HF_ATTENTION = {"sdpa": "sdpa", "flex": "flex_attention"}
"""``train.attention`` (resolved) → the Hugging Face attention implementation it means."""


def hf_attention(config: Config, device: torch.device) -> str:
    """The attention implementation of a ``kind: hf`` model on ``device``."""
    chosen = config.train.model.attn_implementation
    if chosen is None:
        return HF_ATTENTION[resolve_attention(config.train.attention, device)]
    if chosen == "flex_attention" and device.type != "cuda":
        raise ValueError(
            "train.model.attn_implementation: flex_attention has no backward pass on CPU in "
            "torch 2.13; use sdpa or eager when training without GPUs"
        )
    return chosen


def build_model(
    config: Config, tokenizer: Tokenizer, device: torch.device, attention: str
) -> PackedLM:
    """The run's model in a ``PackedLM``, initialised from the ``model_init`` seed (the same
    weights on every rank). ``attention``: the demo decoder's ``sdpa`` or ``flex``."""
    torch.manual_seed(seeds.torch_seed(config.seed, "model_init"))
    spec = config.train.model
    chunk = config.train.loss_chunk_tokens
    if not isinstance(spec, HFModelConfig):
        decoder = Decoder(
            DecoderConfig(
                vocab_size=tokenizer.vocab_size,
                dim=spec.dim,
                n_layers=spec.n_layers,
                n_heads=spec.n_heads,
            )
        )
        packed = PackedLM(decoder, attention, chunk).to(
            device, PARAM_DTYPES[config.train.param_dtype]
        )
        if config.train.activation_checkpointing:
            enable_activation_checkpointing(packed)
        return packed
    implementation = hf_attention(config, device)
    try:
        model = build_hf_model(
            seq_len=config.packing.seq_len,
            attn_implementation=implementation,
            # flex by default on GPUs; an architecture transformers runs no flex for (GPT-2)
            # takes the dense document mask through sdpa instead of failing on every rank
            flex_fallback="sdpa" if spec.attn_implementation is None else None,
            **_hf_sources(spec, tokenizer),
        )
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(_cannot_build(spec, error)) from None
    packed = PackedLM(model.to(device), loss_chunk_tokens=chunk)
    packed.check_head()  # in fp32, before the cast and the adapters
    if config.train.param_dtype == "bf16":
        packed.to(torch.bfloat16)
    if config.train.lora is not None:
        fp32_adapters = config.train.parallelism != "fsdp"
        packed.model = adapt(packed.model, config.train.lora, fp32_adapters)
    if config.train.activation_checkpointing:
        enable_activation_checkpointing(packed)
    if config.task == "dpo" and config.dpo.disable_dropout:
        disable_dropout(packed)
    return packed


def enable_activation_checkpointing(packed: PackedLM) -> None:
    """Each transformer block recomputes its activations in backward (training mode only, so a
    DPO reference never does): the demo decoder's blocks' ``checkpointing``, a Hugging Face
    model's own ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before),
    both non-reentrant ``torch.utils.checkpoint``, which replays the RNG state (dropout masks
    are the same in the recomputation) and composes with FSDP2 and DDP.

    Raises:
        ValueError: for a Hugging Face model without gradient checkpointing support.
    """
    if not packed.is_hf:
        for block in packed.model.blocks:
            block.checkpointing = True
        return
    if not getattr(packed.model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"train.activation_checkpointing: {type(packed.model).__name__} does not support "
            "gradient checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(packed.model, "activation_checkpointing_enable"):  # its name from transformers 5.2x
        packed.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        packed.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off whatever the mode: every ``nn.Dropout`` at p 0 (GPT-2 passes its module's p to
    SDPA too) and the float ``attention_dropout`` that Llama-style attention reads in training."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def check_model_config(config: Config, tokenizer: Tokenizer) -> str:
    """Read a Hugging Face model's config as the train workers will (no weights), so that a
    typo in ``train.model.config``, an unknown ``model_type`` or a model that does not fit the
    tokenizer or ``packing.seq_len`` (``model_mismatches``) fails before Ray and the data start,
    not in every worker once they have. Returns what was read, in words (``validate``'s line).

    Raises:
        ConfigError: naming ``train.model`` and what transformers refused, or each mismatch
            with both values and the keys to change.
    """
    spec = config.train.model
    if not isinstance(spec, HFModelConfig):
        return ""
    try:
        read = hf_config(**_hf_sources(spec, tokenizer)).get_text_config()
        window, _ = attention_layers(read)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(_cannot_build(spec, error)) from None
    own = spec.path is not None and config.tokenizer.path == spec.path
    problems, notes = model_mismatches(read, tokenizer, config, own)
    for note in notes:
        logger.warning(note)
    if problems:
        raise ConfigError("; ".join(problems))
    source = f"from {spec.path}" if spec.path else "random init"
    words = (
        f"{read.model_type} {source}, vocab_size {read.vocab_size}, max_position_embeddings "
        f"{getattr(read, 'max_position_embeddings', None)}"
    )
    if window is not None:
        words += f", sliding window {window}"
    return words + ("; tokenizer: the model's own" if own else "")


def _ids(value: Any) -> list[int]:
    """A config's token id setting (None, an id, or a list of ids: Llama 3's eos) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def model_mismatches(
    read: Any, tokenizer: Tokenizer, config: Config, own: bool
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a model's text config ``read`` against the run's tokenizer and
    ``packing.seq_len``: token ids beyond the model's ``vocab_size`` (a model with more rows than
    the tokenizer is fine: Qwen and Llama pad theirs), ``seq_len`` above
    ``max_position_embeddings``, and, unless the tokenizer is the model's own (``own``), eos,
    bos and pad ids that differ from the model config's. An eos or pad token the config names
    itself (``tokenizer.eos_token``, ``pad_token``) is a choice: a warning, not an error."""
    errors, warnings = [], []
    where = f"train.model ({config.train.model.path or 'its config'})"
    if tokenizer.vocab_size > read.vocab_size:
        errors.append(
            f"tokenizer.path: the tokenizer has {tokenizer.vocab_size} token ids but {where} "
            f"embeds {read.vocab_size} (vocab_size): ids beyond it would index no embedding; "
            "use the model's own tokenizer (leave tokenizer.path out) or a model with at least "
            f"{tokenizer.vocab_size} (train.model.config.vocab_size for a random init)"
        )
    positions = getattr(read, "max_position_embeddings", None)
    if positions is not None and config.packing.seq_len > positions:
        errors.append(
            f"packing.seq_len ({config.packing.seq_len}) is above {where}'s "
            f"max_position_embeddings ({positions}); lower packing.seq_len to at most "
            f"{positions} (or raise train.model.config.max_position_embeddings)"
        )
    if own:
        return errors, warnings
    bos = tokenizer.special_tokens.get("bos_token")
    ours = {
        "eos": (tokenizer.eos_id, config.tokenizer.eos_token),
        "bos": (tokenizer.backend.token_to_id(bos) if bos else None, None),
        "pad": (tokenizer.pad_id, config.tokenizer.pad_token),
    }
    for name, (token_id, chosen) in ours.items():
        theirs = _ids(getattr(read, f"{name}_token_id", None))
        if token_id is None or not theirs or token_id in theirs:
            continue
        shown = theirs[0] if len(theirs) == 1 else theirs
        message = (
            f"tokenizer.{name}_token: the tokenizer's {name} id is {token_id} but {where}'s "
            f"{name}_token_id is {shown}"
        )
        if chosen:
            warnings.append(f"{message} (tokenizer.{name}_token: {chosen!r} chosen)")
        else:
            errors.append(
                f"{message}: a tokenizer of another family; use the model's own tokenizer "
                f"(leave tokenizer.path out), or set tokenizer.{name}_token"
            )
    return errors, warnings


def _hf_sources(spec: HFModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """``build_hf_model`` / ``hf_config`` arguments that say which model: the config's sources and
    the tokenizer's vocabulary size and special token ids."""
    token_ids = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    if "bos_token" in tokenizer.special_tokens:
        bos = tokenizer.backend.token_to_id(tokenizer.special_tokens["bos_token"])
        if bos is not None:
            token_ids["bos_token_id"] = bos
    return {
        "vocab_size": tokenizer.vocab_size,
        "path": spec.path,
        "config_path": spec.config_path,
        "overrides": spec.config,
        "local_files_only": not spec.allow_download,
        "token_ids": token_ids,
    }


def _cannot_build(spec: HFModelConfig, error: Exception) -> str:
    source = spec.path or spec.config_path or spec.config.get("model_type")
    return f"train.model: cannot build the model from {source!r}: {error}"


def lr_lambda(schedule: str, warmup_steps: int, max_steps: int | None, min_ratio: float):
    """The LR multiplier after ``step`` optimizer steps: linear warm-up to 1 over
    ``warmup_steps``, then constant, or a cosine / linear decay to ``min_ratio`` at
    ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay

    return factor


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether the forward runs under bf16 autocast (``train.precision``; fp16: see
    ``loss_scaler``)."""
    if precision == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return precision == "bf16"


def loss_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """``train.precision: fp16``'s loss scaler (the forward then runs under fp16 autocast,
    ``train_step``); None otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def compute_dtype(spec: TrainConfig, bf16: bool) -> str:
    """The dtype the forward computes in, for the summary and the progress line."""
    if spec.precision == "fp16":
        return "fp16"
    return "bf16" if bf16 or spec.param_dtype == "bf16" else "fp32"


def transformer_blocks(packed: PackedLM) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the demo decoder's ``blocks``; for a Hugging
    Face model, its modules of the classes it lists in ``_no_split_modules`` (its decoder layers,
    the same units accelerate's FSDP auto-wrap uses)."""
    if not packed.is_hf:
        return list(packed.model.blocks)
    names = set(getattr(packed.model, "_no_split_modules", None) or ())
    blocks = [m for m in packed.model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"train.parallelism: fsdp: {type(packed.model).__name__} names no decoder layer "
            "class in _no_split_modules; use ddp"
        )
    return blocks


def parallelize(packed: PackedLM, parallelism: str, frozen: bool = False) -> torch.nn.Module:
    """The module the optimizer and the step use: DDP through Ray Train's ``prepare_model``, or
    FSDP2: ``fully_shard`` on every transformer block (``transformer_blocks``), then on the
    whole ``PackedLM`` (embeddings, final norm and head in the root group), whose ``logits``
    (the checkpoint's probe) then gathers like its forward: the root group, then each block in
    turn, never the whole model at once. ``frozen``: a model that never runs backward (the DPO
    reference): its root group reshards after every forward too (by default FSDP2 keeps a
    root's parameters gathered for the backward that follows, which a frozen model never runs,
    so they stayed whole for the run). Without a process group (``num_workers: 0``) the module
    itself."""
    if parallelism == "ddp" or not dist.is_initialized():
        import ray.train.torch

        return ray.train.torch.prepare_model(packed)
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in transformer_blocks(packed):
        fully_shard(block)
    fully_shard(packed, reshard_after_forward=True if frozen else None)
    register_fsdp_forward_method(packed, "logits")
    return packed


def frozen_reference(packed: PackedLM, fsdp: bool) -> PackedLM:
    """The DPO reference: eval mode, no gradients and, under FSDP, sharded as the policy is
    (``parallelize``): unsharded, every rank held a whole fp32 copy, twice a 2-rank policy's
    parameter memory and more with more ranks, of a model FSDP was chosen because it does not
    fit whole. It only runs forward under ``no_grad``, where FSDP2 gathers each block in turn."""
    packed = packed.eval().requires_grad_(False)
    return parallelize(packed, "fsdp", frozen=True) if fsdp else packed


def build_optimizer(model: torch.nn.Module, spec: TrainConfig) -> torch.optim.AdamW:
    """AdamW with ``train.weight_decay`` on weight matrices and embeddings only: biases and norm
    gains (parameters of fewer than 2 dimensions) are in a group without decay, as HF's Trainer
    (and so TRL) and nanoGPT do; decaying a norm gain pulls it toward 0 even where its gradient
    is 0. By dimension rather than by name: it holds for any architecture (Qwen3's q/k norms,
    Gemma's, the demo decoder's) and for FSDP2's DTensor parameters. Frozen parameters (a LoRA
    base) are left out. Its state is in each parameter's dtype (torch's AdamW)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=spec.lr)


def seed_rank(seed: int, rank: int, step: int) -> None:
    """Seed this rank's torch RNG (dropout) once its models are built: ``build_model`` seeds
    every rank alike, as the initial weights must be, and without this every rank would drop the
    same activations at every step (torchtune seeds ``seed + rank`` for the same reason).
    ``step``: where this attempt starts, so a restart from a checkpoint draws new masks rather
    than those of the run's first steps again."""
    torch.manual_seed(seeds.torch_seed(seed, "train_rng", rank, step))
