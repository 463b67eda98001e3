"""Train: Ray Train ``TorchTrainer`` workers consume per-rank packed batches and train the decoder.

Design note.
- The trainer consumes the datasets named in ``loop_config["datasets"]`` in order: one stream of
  every epoch (``train``, stream mode; rows carry their ``epoch``), or one dataset per epoch
  (``train_epoch_<e>``, planned mode). Ray Train splits each with ``streaming_split(world_size,
  equal=True)``: equal rows per rank (the remainder, fewer than ``world_size`` rows a dataset, is
  dropped by Ray), hence with a fixed batch size equal batches per rank, the last one short (the
  same on every rank; trained unless ``train.drop_last``; the summary's ``untrained_packs``
  counts what neither kept). No local shuffle buffer (Ray bug #66085: a buffer < 2 × batch_size
  yields short batches mid-stream); the packer already shuffles.
- A collective guard all-reduces "I have a batch" before every step, so if ranks ever disagree they
  stop together instead of hanging DDP; batches dropped that way are counted in the summary.
- Loss = cross entropy summed over labels ≠ -100 divided by the *global* count of such labels (one
  all-reduce per step), so every real token weighs the same whatever its pack and rank. DDP averages
  gradients over ranks, hence the factor ``world_size``.
- Attention: FlexAttention with a document-causal BlockMask on CUDA, SDPA with the dense mask from
  the same ``document_ids`` on CPU (FlexAttention has no CPU backward in torch 2.13).
- The model: ``train.model.kind`` demo (``Decoder``) or hf (a Hugging Face causal LM from
  ``build_hf_model``), wrapped in ``PackedLM``, which masks documents for the model's attention
  backend and computes the loss in chunks inside its forward; DDP wraps the ``PackedLM``.
- Checkpoints: every ``train.checkpoint_every`` steps (named ``checkpoint_step_<step>``, listed in
  the summary's ``checkpoints``) and at the end (the summary's ``checkpoint``). An HF model is saved
  with ``save_pretrained`` plus the run's tokenizer, so ``AutoModelForCausalLM.from_pretrained``
  loads the folder, with ``probe.pt``: the trained model's logits on a fixed input, to check a
  load against; the demo decoder as ``model.pt`` (its state dict).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rayjobs.config import Config, ConfigError, HFModelConfig, TrainConfig
from rayjobs.data import seeds
from rayjobs.data.preference import ROLE_CHOSEN
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.train import dpo, masks
from rayjobs.train.ahead import read_ahead
from rayjobs.train.collate import collate
from rayjobs.train.metrics import TrainMetrics
from rayjobs.train.model import (
    Decoder,
    DecoderConfig,
    PackedLM,
    build_hf_model,
    hf_config,
    hf_model_mask,
)


def _all_reduce(value: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=op)
    return value


def _all_gather_int(value: int, device: torch.device) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered = [
        torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size())
    ]
    dist.all_gather(gathered, torch.tensor(value, dtype=torch.long, device=device))
    return [int(t) for t in gathered]


class _Guard:
    """Counts batches a rank had but could not use because another rank had run out."""

    dropped = 0


def rank_batches(
    shard: Any,
    batch_size: int,
    device: torch.device,
    guard: _Guard | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of one epoch, stopping on every rank as soon as any rank runs out;
    the last may be short (``drop_last``: skipped).

    Before each step all ranks all-reduce (MIN) a "have a batch" flag; a batch held when another
    rank is out is not trained on and is counted in ``guard.dropped``.
    """
    # Ray's own prefetch off, batches read ahead in a thread instead (rayjobs.train.ahead says why).
    batches = read_ahead(
        shard.iter_torch_batches(
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=lambda b: collate(b, device),
            prefetch_batches=0,
        )
    )
    try:
        while True:
            batch = next(batches, None)
            have = _all_reduce(
                torch.tensor(int(batch is not None), device=device), dist.ReduceOp.MIN
            )
            if not int(have):
                if guard is not None:
                    guard.dropped += batch is not None
                return
            yield batch
    finally:
        batches.close()  # stops the read-ahead thread when a rank stops early


def train_batches(
    datasets: str | Sequence[str] = "train",
    batch_size: int = 8,
    *,
    attn_implementation: str | None = None,
    model_config: Any = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    guard: _Guard | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """The library API for a user's own ``train_loop_per_worker``: this rank's packed batches, on
    this rank's device, with the same number of batches on every rank: ``batch_size`` rows each,
    but for each dataset's last, which may be shorter (the same size on every rank; skipped with
    ``drop_last``, for static shapes).

    ``datasets``: the dataset names the ``TorchTrainer`` was given, read in order (``Job.
    train_datasets()``: ``"train"`` in stream mode, one per epoch in planned mode). Each batch holds
    ``input_ids``, ``labels`` (already shifted per document: compare logits at position t with
    ``labels[t]``, ignore ``-100``), ``position_ids`` (restarting per document), ``document_ids``
    and ``num_tokens`` as int64 tensors, and ``epoch`` in stream mode. With
    ``attn_implementation`` (``sdpa``, ``eager`` or ``flex_attention``, as a Hugging Face model's
    ``config._attn_implementation``) the batch also holds ``attention_mask``: the document-causal
    mask in that backend's form, built on the device (``masks.hf_attention_mask``; ``dtype`` is the
    eager path's score dtype). Pass it with ``position_ids`` to the model's forward. Give the
    model's ``config`` as ``model_config`` when it may have sliding-window layers (Mistral, Gemma,
    Qwen2 with ``use_sliding_window``): the mask is then the one each kind of layer needs
    (``model.hf_model_mask``), and ``attn_implementation`` defaults to the config's.
    """
    import ray.train
    import ray.train.torch

    device = device if device is not None else ray.train.torch.get_device()
    for name in [datasets] if isinstance(datasets, str) else datasets:
        shard = ray.train.get_dataset_shard(name)
        for batch in rank_batches(shard, batch_size, device, guard, drop_last):
            if attn_implementation is not None or model_config is not None:
                batch["attention_mask"] = attention_mask(
                    batch, attn_implementation, dtype, model_config
                )
            yield batch


def attention_mask(
    batch: dict[str, torch.Tensor],
    attn_implementation: str | None,
    dtype: torch.dtype = torch.float32,
    model_config: Any = None,
) -> Any:
    """``train_batches``' ``attention_mask``: the batch's document mask in the backend's form,
    built on the batch's device; on preference rows (``task: dpo``) from ``parent_ids`` too, so
    each response attends to its prompt (``rayjobs.data.preference``); with a ``model_config``, windowed
    (or one mask per kind of layer) as its sliding-window layers need."""
    if model_config is not None:
        return hf_model_mask(
            model_config.get_text_config(),
            batch["document_ids"],
            batch["position_ids"],
            attn_implementation,
            dtype,
            batch.get("parent_ids"),
        )
    return masks.hf_attention_mask(
        batch["document_ids"], attn_implementation, dtype, parent_ids=batch.get("parent_ids")
    )


def resolve_attention(attention: str, device: torch.device) -> str:
    if attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise ValueError(
            "train.attention: flex has no backward pass on CPU in torch 2.13; "
            "use auto or sdpa when training without GPUs"
        )
    return attention


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
        packed = PackedLM(decoder, attention, chunk).to(device)
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
    packed.check_head()
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


def check_model_config(config: Config, tokenizer: Tokenizer) -> None:
    """Read a Hugging Face model's config as the train workers will (no weights), so that a
    typo in ``train.model.config`` or an unknown ``model_type`` fails before Ray and the data
    start, not in every worker once they have.

    Raises:
        ConfigError: naming ``train.model`` and what transformers refused.
    """
    spec = config.train.model
    if not isinstance(spec, HFModelConfig):
        return
    try:
        hf_config(**_hf_sources(spec, tokenizer))
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(_cannot_build(spec, error)) from None


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


def save_model(
    model: PackedLM,
    tokenizer: Tokenizer,
    directory: str,
    state_dict: dict[str, torch.Tensor] | None = None,
    write: bool = True,
) -> None:
    """Write ``model`` into ``directory``: an HF model with ``save_pretrained``, the tokenizer
    next to it and ``probe.pt`` (``input_ids`` [1,16] and the model's fp32 ``logits`` on them,
    through the training path); the demo decoder as ``model.pt``.

    ``state_dict``: the ``PackedLM``'s full state dict when its parameters are sharded (FSDP2);
    every rank then calls this (the probe's forward gathers the shards) and only the one with
    ``write`` writes files."""
    inner = None
    if state_dict is not None:  # PackedLM keys → the inner model's
        inner = {k.removeprefix("model."): v for k, v in state_dict.items()}
    if not model.is_hf:
        if write:
            torch.save(inner or model.model.state_dict(), os.path.join(directory, "model.pt"))
        return
    embeddings = model.model.get_input_embeddings()
    device = embeddings.weight.device
    input_ids = (torch.arange(16, device=device)[None] * 7919) % tokenizer.vocab_size
    was_training = model.training
    model.eval()
    with torch.no_grad():  # under FSDP2 each group gathers in turn (``parallelize``)
        logits = model.logits(
            input_ids, torch.arange(16, device=device)[None], torch.zeros_like(input_ids)
        )
    model.train(was_training)
    if not write:
        return
    model.model.save_pretrained(directory, state_dict=inner)
    save_tokenizer(tokenizer, directory)
    torch.save(
        {"input_ids": input_ids.cpu(), "logits": logits.float().cpu()},
        os.path.join(directory, "probe.pt"),
    )


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """The run's tokenizer (special tokens and chat template included) as a Hugging Face
    tokenizer folder: ``AutoTokenizer.from_pretrained(directory)`` loads it."""
    from transformers import PreTrainedTokenizerFast

    special = dict(tokenizer.special_tokens)
    special["eos_token"] = tokenizer.backend.id_to_token(tokenizer.eos_id)
    special["pad_token"] = tokenizer.backend.id_to_token(tokenizer.pad_id)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, **special)
    if tokenizer.chat_template:
        fast.chat_template = tokenizer.chat_template
    fast.save_pretrained(directory)


def _checkpoint_path(name: str) -> str | None:
    """Where Ray Train persists the checkpoint reported as ``name`` (None if it cannot say)."""
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
        path = f"{storage.experiment_fs_path}/{name}"
        scheme = storage.storage_filesystem.type_name
    except Exception:  # a DeveloperAPI: its shape may change between Ray versions
        return None
    return path if scheme == "local" else f"{scheme}://{path}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


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
    """Whether the forward runs under bf16 autocast (``train.precision``)."""
    if precision == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return precision == "bf16"


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


@dataclasses.dataclass
class TrainState:
    """What a restarted worker needs besides model, optimizer and schedule: where it stopped in
    the data, and the run's totals so far (global, as rank 0 saved them)."""

    steps: int = 0
    dataset_index: int = 0
    """The dataset (``loop_config["datasets"]``) being consumed."""
    rows_consumed: int = 0
    """Rows of that dataset each rank trained on (a restart skips them)."""
    rows: int = 0
    pack_tokens: int = 0
    trained_tokens: int = 0
    guard_dropped: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per restart from a checkpoint: its step and the rows each rank skipped."""
    series: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Per-step values besides the loss (DPO: ``StepResult.dpo``'s), global."""
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per evaluation (``eval``): its step, loss, rows, labelled tokens and the packs
    of its eval set, DPO means."""


EVAL_DATASET = "eval_rank_"
"""The trainer's held-out datasets: ``eval_rank_<r>``, rank r's share of the eval packs
(``pipeline.held_out``)."""

TRAIN_STATE = "train_state.pt"
"""The file of a periodic checkpoint that holds what resuming needs: the model's and the
optimizer's full state dicts, the LR schedule's state and the ``TrainState``."""


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Full (unsharded) model and optimizer state dicts, valid on rank 0 (a collective under
    FSDP: every rank calls it)."""
    if not fsdp:
        unwrapped = model.module if hasattr(model, "module") else model
        return unwrapped.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict of an FSDP2 model, valid on rank 0 (a collective): the final
    model's, without the optimizer state ``_full_state`` would gather too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    blob: dict[str, Any] | None,
    fsdp: bool,
) -> None:
    """Load a checkpoint's full model and optimizer state. Under FSDP a collective: ``blob``
    is rank 0's (``None`` on the other ranks), which broadcasts each tensor in turn and every
    rank keeps its shard; only rank 0 reads the file."""
    if not fsdp:
        unwrapped = model.module if hasattr(model, "module") else model
        unwrapped.load_state_dict(blob["model"])
        optimizer.load_state_dict(blob["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    blob = blob or {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # Two calls, not set_state_dict: given an empty model state (the ranks but 0), it loads
    # the optimizer only, and rank 0 waited for them in the model's broadcast.
    set_model_state_dict(model, blob.get("model", {}), options=options)
    set_optimizer_state_dict(model, optimizer, blob.get("optimizer", {}), options=options)


def _restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    fsdp: bool,
) -> TrainState:
    """The ``TrainState`` of the latest checkpoint Ray Train holds for this run (after a worker
    failure, or for a run resumed by name), with model, optimizer and schedule loaded; a fresh
    state when there is none. The file is memory-mapped, not read whole (ranks of a node share
    the page cache and touch only what they copy). Under FSDP only rank 0 opens the checkpoint
    (on cloud storage: downloads it) and broadcasts it, each rank keeping its shard: every rank
    mapped the full model and optimizer state before, on every node, for a model sharded
    because it does not fit one device."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return TrainState()
    rank = ray.train.get_context().get_world_rank()
    reads = not fsdp or rank == 0
    with contextlib.ExitStack() as stack:
        blob, header = None, None
        if reads:
            directory = stack.enter_context(checkpoint.as_directory())
            path = os.path.join(directory, TRAIN_STATE)
            if os.path.exists(path):
                blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                header = {"scheduler": blob["scheduler"], "state": blob["state"]}
        if fsdp:  # rank 0 says whether there is a state to load (all raise alike), and its
            shared = [header]  # small parts
            dist.broadcast_object_list(shared, src=0)
            header = shared[0]
        if header is None:
            raise ValueError(
                f"checkpoint {checkpoint.path} holds no {TRAIN_STATE}: it is a finished run's "
                "final checkpoint, there is nothing to resume"
            )
        _load_state(model, optimizer, blob, fsdp)  # while the (mapped) file is there
        scheduler.load_state_dict(header["scheduler"])
        state = TrainState(**header["state"])
        del blob
    if rank != 0:  # totals are global: counted once
        state.rows = state.pack_tokens = state.trained_tokens = state.guard_dropped = 0
    state.resumes.append({"step": state.steps, "rows_skipped_per_rank": state.rows_consumed})
    return state


def _save_checkpoint(
    packed: PackedLM,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    tokenizer: Tokenizer,
    fsdp: bool,
    device: torch.device,
    metrics: dict[str, Any],
) -> None:
    """Report a periodic checkpoint (every rank calls it): the model as ``save_model`` writes it
    plus ``TRAIN_STATE`` with the global totals."""
    import ray.train

    name = f"checkpoint_step_{state.steps:06d}"
    state.checkpoints.append({"step": state.steps, "path": _checkpoint_path(name)})
    totals = _all_reduce(
        torch.tensor(
            [state.rows, state.pack_tokens, state.trained_tokens, state.guard_dropped],
            device=device,
        )
    )
    saved = dataclasses.replace(state, losses=list(state.losses), series=dict(state.series))
    saved.rows, saved.pack_tokens, saved.trained_tokens, saved.guard_dropped = (
        int(v) for v in totals
    )
    model_state, optimizer_state = _full_state(model, optimizer, fsdp)
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as directory:
        save_model(packed, tokenizer, directory, model_state if fsdp else None, rank == 0)
        checkpoint = None
        if rank == 0:
            blob = {
                "model": model_state,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "state": dataclasses.asdict(saved),
            }
            torch.save(blob, os.path.join(directory, TRAIN_STATE))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


def _groups(batches: Iterator[dict[str, torch.Tensor]], size: int):
    """Consecutive lists of up to ``size`` batches (the last may be shorter: the same length on
    every rank, since ``rank_batches`` yields the same number of batches everywhere)."""
    while group := list(itertools.islice(batches, size)):
        yield group


def _fault(loop_config: dict[str, Any], rank: int, state: TrainState) -> None:
    """Test hook (``loop_config["faults"]``: rank, step, marker file each): SIGKILL this worker
    after that step, once per marker: a worker dying the way a lost node's do. It first waits
    until Ray Train has committed the run's latest checkpoint (listed it in the run's snapshot),
    so which checkpoint a restart finds does not depend on timing."""
    import ray.train

    for fault in loop_config.get("faults", ()):
        if fault["rank"] != rank or fault["step"] != state.steps:
            continue
        if os.path.exists(fault["marker"]):
            continue
        if state.checkpoints:
            name = os.path.basename(state.checkpoints[-1]["path"])
            snapshot = ray.train.get_context().get_storage().checkpoint_manager_snapshot_path
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if os.path.exists(snapshot) and name in Path(snapshot).read_text():
                    break
                time.sleep(0.1)
        with open(fault["marker"], "w") as f:
            f.write(str(state.steps))
        os.kill(os.getpid(), signal.SIGKILL)


def _trace(
    loop_config: dict[str, Any], rank: int, state: TrainState, batch: dict, what: str
) -> None:
    """Test hook (``loop_config["trace"]``: a folder): append ``what attempt step fingerprint``
    for every row this rank trains on or skips when resuming, and ``loss attempt step value``
    after each step (``batch`` None), to measure what a restart re-sees, skips and continues."""
    folder = loop_config.get("trace")
    if not folder:
        return
    attempt = len(state.resumes)
    with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
        if batch is None:
            f.write(f"loss {attempt} {state.steps} {state.losses[-1]!r}\n")
            return
        for row in batch["input_ids"].cpu().numpy():
            digest = hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest()
            f.write(f"{what} {attempt} {state.steps + 1} {digest}\n")


class StepResult(NamedTuple):
    """``train_step``'s outcome: global means, and this rank's labelled tokens."""

    loss: float
    """SFT: mean cross entropy per labelled token; DPO: mean DPO loss per triple."""
    tokens: int
    """Labelled tokens of this rank's micro-batches."""
    grad_norm: float | None
    """The global gradient norm before clipping (None without ``max_grad_norm``)."""
    dpo: dict[str, float] | None = None
    """DPO: ``reward_margin``, ``reward_accuracy``, ``chosen_logps``, ``rejected_logps``,
    ``chosen_reward``, ``rejected_reward`` (beta × the policy's log-ratio to the reference, TRL's
    ``rewards/chosen`` and ``rewards/rejected``; means per triple over the step's triples on every
    rank) and ``triples`` (their count)."""
    lr: float = 0.0
    """The learning rate this step used (the scheduler has moved on to the next one since)."""


def _triples(response_role: torch.Tensor) -> int:
    """Triples in preference rows: chosen documents, counted by their first token."""
    chosen = response_role == ROLE_CHOSEN
    starts = chosen.clone()
    starts[:, 1:] &= ~chosen[:, :-1]
    return int(starts.sum())


def _units(batch: dict[str, torch.Tensor], preference: bool) -> tuple[int, int]:
    """A batch's loss units, what its loss sum is divided by once summed over every rank
    (labelled tokens; preference rows: triples), and its labelled tokens: one definition for
    training and evaluation."""
    tokens = int((batch["labels"] != IGNORE_INDEX).sum())
    return (_triples(batch["response_role"]) if preference else tokens), tokens


SUMS = (
    "loss",
    "reward_margin",
    "reward_accuracy",
    "chosen_logps",
    "rejected_logps",
    "chosen_reward",
    "rejected_reward",
)
"""What ``_forward`` sums over a batch: the loss (SFT: cross entropy over labelled tokens; DPO:
the DPO loss over triples), then, for DPO, the margin, the triples whose margin is positive, the
chosen and rejected log-probs and rewards; each a mean per unit once divided by the global count
of units (``_means``)."""


def _forward(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    bf16: bool,
    reference: PackedLM | None = None,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's forward, shared by training and evaluation: its loss sum (with the
    graph, for ``backward``) and its ``SUMS`` as a detached fp64 vector. ``reference``: the
    frozen DPO reference, run without gradients on the same rows."""
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=batch["input_ids"].device)
    columns = (batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"])
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        if reference is None:
            local_sum, _ = model(*columns)
        else:
            chosen, rejected = dpo.packed_logps(model, batch)
            with torch.no_grad():
                ref_chosen, ref_rejected = dpo.packed_logps(reference, batch)
            local_sum, _ = dpo.dpo_loss_sum(chosen, rejected, ref_chosen, ref_rejected, beta)
            chosen_reward = beta * (chosen - ref_chosen).detach()
            rejected_reward = beta * (rejected - ref_rejected).detach()
            margin = chosen_reward - rejected_reward
            sums[1:] += torch.stack(
                [
                    margin.sum(),
                    (margin > 0).sum(),
                    chosen.sum(),
                    rejected.sum(),
                    chosen_reward.sum(),
                    rejected_reward.sum(),
                ]
            ).detach()
    sums[0] += local_sum.detach().double()
    return local_sum, sums


def _means(
    sums: torch.Tensor, units: int, preference: bool
) -> tuple[float, dict[str, float] | None]:
    """Global ``SUMS`` over the global count of units → (the mean loss, for DPO the other means
    with ``triples``: the count)."""
    means = {name: float(value) / units for name, value in zip(SUMS, sums, strict=True)}
    loss = means.pop("loss")
    return loss, ({**means, "triples": units} if preference else None)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group: list[dict[str, torch.Tensor]],
    *,
    fsdp: bool,
    bf16: bool,
    spec: TrainConfig,
    reference: PackedLM | None = None,
    beta: float = 0.1,
) -> StepResult:
    """One optimizer step over ``group`` (``grad_accum_steps`` micro-batches, the same count on
    every rank).

    The loss of each micro-batch is its sum (cross entropy over labelled tokens; with a
    ``reference``, the DPO loss over preference triples) divided by the group's *global* count
    of tokens (triples), one all-reduce before the first backward, times the world size because
    DDP and FSDP average gradients over ranks: so every token (triple) weighs the same whatever
    its pack, micro-batch and rank, and accumulating k micro-batches gives the gradient of one
    batch k times larger. Gradients are synchronized on the last micro-batch only (``no_sync``,
    FSDP2's ``set_requires_gradient_sync``). ``reference``: the frozen DPO reference model (the
    policy's initial weights), run without gradients on the same rows."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    device = group[0]["input_ids"].device
    counted = [_units(batch, reference is not None) for batch in group]
    units, tokens = (sum(column) for column in zip(*counted, strict=True))
    global_units = max(1, int(_all_reduce(torch.tensor(units, device=device))))
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    for i, batch in enumerate(group):
        last = i == len(group) - 1
        sync = contextlib.nullcontext()
        if fsdp:
            model.set_requires_gradient_sync(last)
        elif not last and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync:
            local_sum, batch_sums = _forward(model, batch, bf16, reference, beta)
            (local_sum.float() / global_units * world_size).backward()
        sums += batch_sums
    grad_norm = None
    if spec.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss, metrics = _means(_all_reduce(sums), global_units, reference is not None)
    return StepResult(loss, tokens, grad_norm, metrics, lr)


class EvalResult(NamedTuple):
    """``evaluate``'s outcome: global means over every held-out pack, each counted once."""

    loss: float
    """SFT: mean cross entropy per labelled token; DPO: mean DPO loss per triple."""
    tokens: int
    """Labelled tokens evaluated, on every rank."""
    rows: int
    """Packed rows evaluated, on every rank."""
    dpo: dict[str, float] | None = None
    """DPO: the means of ``StepResult.dpo``, over every held-out triple."""


def _padding_row(seq_len: int, preference: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """A row with nothing to learn (every label ignored, no triple): what a rank whose held-out
    share has run out evaluates while another still has batches, so every rank runs the same
    forwards (FSDP gathers each block's parameters from every rank in each)."""
    zeros = torch.zeros(1, seq_len, dtype=torch.int64, device=device)
    row = {
        "input_ids": zeros,
        "labels": torch.full_like(zeros, IGNORE_INDEX),
        "position_ids": torch.arange(seq_len, device=device).unsqueeze(0),
        "document_ids": zeros,
    }
    if preference:
        row |= {"parent_ids": zeros, "response_role": zeros}
    return row


def evaluate(
    model: torch.nn.Module,
    shard: Any,
    num_batches: int,
    batch_size: int,
    *,
    seq_len: int,
    device: torch.device,
    bf16: bool,
    reference: PackedLM | None = None,
    beta: float = 0.1,
) -> EvalResult:
    """The held-out loss (DPO: loss and rewards) over this rank's share of the eval packs
    (``shard``: a Ray Data iterator, read whole), without gradients and with dropout off.

    Every rank runs ``num_batches`` forwards (the driver's count for the largest share), rows of
    padding once its own are done, so the sums hold every held-out pack exactly once: unlike the
    training split, nothing is left over, and the result does not depend on the number of
    workers but for rounding."""
    training = model.training
    model.eval()
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # units, labelled tokens, rows
    batches = iter(
        shard.iter_torch_batches(
            batch_size=batch_size, collate_fn=lambda b: collate(b, device), prefetch_batches=0
        )
    )
    try:
        with torch.no_grad():
            for _ in range(num_batches):
                batch = next(batches, None)
                if batch is None:
                    batch = _padding_row(seq_len, reference is not None, device)
                else:
                    counts[2] += len(batch["input_ids"])
                units, tokens = _units(batch, reference is not None)
                counts[0] += units
                counts[1] += tokens
                sums += _forward(model, batch, bf16, reference, beta)[1]
            if next(batches, None) is not None:
                raise RuntimeError(
                    f"evaluation: this rank holds more than the {num_batches} batches of "
                    f"{batch_size} rows the driver counted for its share"
                )
    finally:
        model.train(training)
    units, tokens, rows = (int(v) for v in _all_reduce(counts))
    loss, metrics = _means(_all_reduce(sums), max(1, units), reference is not None)
    return EvalResult(loss, tokens, rows, metrics)


def build_optimizer(model: torch.nn.Module, spec: TrainConfig) -> torch.optim.AdamW:
    """AdamW with ``train.weight_decay`` on weight matrices and embeddings only: biases and norm
    gains (parameters of fewer than 2 dimensions) are in a group without decay, as HF's Trainer
    (and so TRL) and nanoGPT do; decaying a norm gain pulls it toward 0 even where its gradient
    is 0. By dimension rather than by name: it holds for any architecture (Qwen3's q/k norms,
    Gemma's, the demo decoder's) and for FSDP2's DTensor parameters."""
    params = list(model.parameters())
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


def _skip_rows(batches: Iterator[dict[str, torch.Tensor]], rows: int):
    """The batches holding a rank's first ``rows`` rows (consumed before a checkpoint)."""
    while rows > 0 and (batch := next(batches, None)) is not None:
        rows -= len(batch["input_ids"])
        yield batch


def train_loop(loop_config: dict[str, Any]) -> None:
    """The per-worker loop (``train_loop_per_worker`` of the TorchTrainer)."""
    import ray.train
    import ray.train.torch

    config = Config.model_validate(loop_config["config"])
    spec = config.train
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    if rank == 0 and loop_config.get("ledger") is not None:
        ray.get(loop_config["ledger"].start_attempt.remote())
    device = ray.train.torch.get_device()
    attention = resolve_attention(spec.attention, device)
    # Ray leaves OMP_NUM_THREADS unset for fractional-CPU actors, so torch would start one thread
    # per core in every worker: on a 2-core machine two workers ran 10x slower from
    # oversubscription.
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    tokenizer = Tokenizer(config.tokenizer)
    packed = build_model(config, tokenizer, device, attention)
    fsdp = spec.parallelism == "fsdp" and dist.is_initialized()
    model = parallelize(packed, spec.parallelism)
    optimizer = build_optimizer(model, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(spec.schedule, spec.warmup_steps, spec.max_steps, spec.min_lr_ratio)
    )
    state = _restore(model, optimizer, scheduler, fsdp)
    reference = None
    if config.task == "dpo":  # the frozen reference: the policy's initial weights, once a worker
        reference = frozen_reference(build_model(config, tokenizer, device, attention), fsdp)
    seed_rank(config.seed, rank, state.steps)
    bf16 = use_bf16(spec.precision, device)
    seq_len = config.packing.seq_len
    series = TrainMetrics(loop_config.get("run_name", "rayjobs"), rank)
    held_out = None  # this rank's share of the eval packs (pipeline.held_out), and its batches
    if loop_config.get("eval_batches") is not None:
        held_out = ray.train.get_dataset_shard(f"{EVAL_DATASET}{rank}")

    def evaluation() -> dict[str, float]:
        """Evaluate now: ``state.evals`` and the gauge get the result, a report its metrics."""
        result = evaluate(
            model,
            held_out,
            loop_config["eval_batches"],
            config.eval.batch_size or spec.batch_size,
            seq_len=seq_len,
            device=device,
            bf16=bf16,
            reference=reference,
            beta=config.dpo.beta,
        )
        entry = {"step": state.steps, "loss": result.loss, "rows": result.rows}
        entry["packs"] = loop_config["eval_packs"]  # of the eval set this evaluation ran over
        entry |= {"tokens": result.tokens, **(result.dpo or {})}
        state.evals.append(entry)
        series.evaluation(result.loss)
        return {"eval_loss": result.loss} | {
            f"eval/dpo/{k}": v for k, v in (result.dpo or {}).items()
        }

    # max_steps reached: the stream may not have ended. Already at the start when the workers
    # restarted from a checkpoint of the last step (a failure after it): nothing left to train.
    stopped_early = spec.max_steps is not None and state.steps >= spec.max_steps
    # one stream of every epoch, or one dataset per epoch
    names = loop_config.get("datasets") or [f"train_epoch_{e}" for e in range(spec.epochs)]
    for index, name in enumerate([] if stopped_early else names):
        if index < state.dataset_index:
            continue  # consumed before the checkpoint this run resumed from
        skip = state.rows_consumed if index == state.dataset_index else 0
        state.dataset_index, state.rows_consumed = index, skip
        guard = _Guard()
        batches = train_batches(
            name, spec.batch_size, device=device, guard=guard, drop_last=spec.drop_last
        )
        # Resuming inside this dataset: its stream is read again from the start (Ray Data keeps no
        # iterator state), and each rank passes over the rows it had consumed by the checkpoint.
        for batch in _skip_rows(batches, skip):
            _trace(loop_config, rank, state, batch, "skip")
        for group in _groups(batches, spec.grad_accum_steps):
            for batch in group:
                _trace(loop_config, rank, state, batch, "train")
            result = train_step(
                model,
                optimizer,
                scheduler,
                group,
                fsdp=fsdp,
                bf16=bf16,
                spec=spec,
                reference=reference,
                beta=config.dpo.beta,
            )
            step_loss, trained, grad_norm = result.loss, result.tokens, result.grad_norm
            state.losses.append(step_loss)
            for name, value in (result.dpo or {}).items():
                state.series.setdefault(name, []).append(value)
            state.steps += 1
            state.rows += sum(len(b["input_ids"]) for b in group)
            state.pack_tokens += sum(int(b["num_tokens"].sum()) for b in group)
            state.rows_consumed += sum(len(b["input_ids"]) for b in group)
            state.trained_tokens += trained
            series.step(step_loss, trained, result.dpo)
            _trace(loop_config, rank, state, None, "loss")
            every = spec.checkpoint_every
            due = bool(every and state.steps % every == 0)
            evaluated = {}
            eval_every = config.eval.every_steps
            if held_out is not None and eval_every and state.steps % eval_every == 0:
                evaluated = evaluation()
            if state.steps % spec.report_every == 0 or due or evaluated:
                epoch = int(group[-1]["epoch"].max()) if "epoch" in group[-1] else index
                metrics = {
                    "step": state.steps,
                    "epoch": epoch,
                    "loss": step_loss,
                    "lr": result.lr,
                }
                if grad_norm is not None:
                    metrics["grad_norm"] = grad_norm
                metrics.update({f"dpo/{k}": v for k, v in (result.dpo or {}).items()})
                metrics.update(evaluated)
                if due:
                    _save_checkpoint(
                        packed, model, optimizer, scheduler, state, tokenizer, fsdp, device, metrics
                    )
                else:
                    ray.train.report(metrics)
                series.paused()
            _fault(loop_config, rank, state)
            if spec.max_steps is not None and state.steps >= spec.max_steps:
                stopped_early = True
                break
        state.guard_dropped += guard.dropped
        if stopped_early:
            break
    if held_out is not None and (not state.evals or state.evals[-1]["step"] != state.steps):
        evaluation()  # the trained model's, once, unless its last step was just evaluated
    totals = torch.tensor(
        [state.rows, state.pack_tokens, state.trained_tokens, state.guard_dropped], device=device
    )
    rows, pack_tokens, trained_tokens, guard_dropped = (int(v) for v in _all_reduce(totals))
    losses = state.losses
    tenth = max(1, len(losses) // 10)
    summary = {
        "steps": state.steps,
        "steps_per_rank": _all_gather_int(state.steps, device),
        "loss_first": _mean(losses[:tenth]),
        "loss_last": _mean(losses[-tenth:]),
        "tokens_trained": trained_tokens,
        "num_packs": rows,
        "packing_efficiency": pack_tokens / (rows * seq_len) if rows else 0.0,
        "guard_dropped_batches": guard_dropped,
        "stopped_early": stopped_early,
        "attention": packed.attention,
        "model": spec.model.kind,
        "precision": "bf16" if bf16 else "fp32",
        "parallelism": spec.parallelism if dist.is_initialized() else "none",
        "lr_schedule": spec.schedule,
        "checkpoints": state.checkpoints,
        "resumes": state.resumes,
        "world_size": world_size,
        "task": config.task,
    }
    if state.series:  # DPO: the first and last tenth of the steps, as the loss
        summary["dpo"] = {"beta": config.dpo.beta}
        for name, values in state.series.items():
            if name != "triples":
                summary["dpo"][f"{name}_first"] = _mean(values[:tenth])
                summary["dpo"][name] = _mean(values[-tenth:])
        summary["dpo"]["triples"] = int(sum(state.series["triples"]))
    if state.evals:
        summary["eval"] = {"loss": state.evals[-1]["loss"], "history": state.evals}
    model_state = _full_model_state(model) if fsdp else None
    with tempfile.TemporaryDirectory() as directory:
        save_model(packed, tokenizer, directory, model_state, write=rank == 0)
        checkpoint = None
        if rank == 0:
            with open(os.path.join(directory, FINAL_SUMMARY), "w") as f:
                json.dump(summary, f)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(summary, checkpoint=checkpoint)


FINAL_SUMMARY = "summary.json"
"""The run summary's file in a finished run's final checkpoint (``train``): ``--resume latest``
passes over runs that hold one (there is nothing left to resume)."""
