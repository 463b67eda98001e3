"""Checkpoints: what a periodic checkpoint holds (the model as ``save_model`` writes it plus
``TRAIN_STATE``), how a worker group restarts from one, and the final save.

An HF model is saved with ``save_pretrained`` plus the run's tokenizer, so
``AutoModelForCausalLM.from_pretrained`` loads the folder, with ``probe.pt``: the trained model's
logits on a fixed input, to check a load against; the demo decoder as ``model.pt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from rayjobs.data.tokenizer import Tokenizer
from rayjobs.train.collectives import all_reduce
from rayjobs.train.lora import is_adapted, save_adapted
from rayjobs.train.model import PackedLM
from rayjobs.train.names import TRAIN_STATE


def save_model(
    model: PackedLM,
    tokenizer: Tokenizer,
    directory: str,
    state_dict: dict[str, torch.Tensor] | None = None,
    write: bool = True,
    merged: bool = False,
) -> None:
    """Write ``model`` into ``directory``: an HF model with ``save_pretrained``, the tokenizer
    next to it and ``probe.pt`` (``input_ids`` [1,16] and the model's fp32 ``logits`` on them,
    through the training path); the demo decoder as ``model.pt``. A model with LoRA adapters:
    as ``lora.save_adapted`` writes it (``merged``: with the merged model too).

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
    folders = [directory]
    if is_adapted(model.model):
        folders += save_adapted(model.model, directory, inner, merged)
    else:
        model.model.save_pretrained(directory, state_dict=inner)
    for folder in folders:
        save_tokenizer(tokenizer, folder)
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


def driver_storage(storage_path: str, run_name: str) -> Any:
    """The run's storage when its loop runs in the driver (``train.num_workers: 0``): Ray
    Train's local mode keeps a reported checkpoint where the loop wrote it (a temporary folder,
    gone after the run), so the loop persists its checkpoints itself, through Ray Train's own
    ``StorageContext``: the same folders, under ``storage_path/run_name``, as a run on workers."""
    from ray.train.v2._internal.execution.storage import StorageContext

    local = "://" not in storage_path
    return StorageContext(os.path.abspath(storage_path) if local else storage_path, run_name)


def checkpoint_path(name: str, storage: Any = None) -> str | None:
    """Where Ray Train persists the checkpoint reported as ``name`` (None if it cannot say);
    ``storage``: the ``driver_storage`` of a run in the driver."""
    import ray.train

    try:
        storage = storage or ray.train.get_context().get_storage()
        path = f"{storage.experiment_fs_path}/{name}"
        scheme = storage.storage_filesystem.type_name
    except Exception:  # a DeveloperAPI: its shape may change between Ray versions
        return None
    return path if scheme == "local" else f"{scheme}://{path}"


def report(
    metrics: dict[str, Any], directory: str | None, name: str | None, storage: Any = None
) -> None:
    """``ray.train.report`` of ``metrics`` with the checkpoint in ``directory`` (None: this rank
    reports none) named ``name`` (None: Ray Train's default name); with ``storage`` (a run in
    the driver) the checkpoint is first copied there, where Ray Train would have put it."""
    import ray.train

    checkpoint = None if directory is None else ray.train.Checkpoint.from_directory(directory)
    if checkpoint is not None and storage is not None:
        name = name or storage.make_default_checkpoint_dir_name()
        checkpoint = storage.persist_current_checkpoint(checkpoint, name)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


def drop_checkpoint(storage: Any, path: str) -> None:
    """Delete a periodic checkpoint of a run in the driver (``train.keep_checkpoints``: Ray
    Train's checkpoint manager does it for a run on workers)."""
    storage.storage_filesystem.delete_dir(path.split("://", 1)[-1])


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


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Full (unsharded) model and optimizer state dicts, valid on rank 0 (a collective under
    FSDP: every rank calls it)."""
    if not fsdp:
        unwrapped = model.module if hasattr(model, "module") else model
        return unwrapped.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict of an FSDP2 model, valid on rank 0 (a collective): the final
    model's, without the optimizer state ``_full_state`` would gather too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def load_state(
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


def restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    fsdp: bool,
    scaler: torch.amp.GradScaler | None = None,
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
                header["scaler"] = blob.get("scaler")
        if fsdp:  # rank 0 says whether there is a state to load (all raise alike), and its
            shared = [header]  # small parts
            dist.broadcast_object_list(shared, src=0)
            header = shared[0]
        if header is None:
            raise ValueError(
                f"checkpoint {checkpoint.path} holds no {TRAIN_STATE}: it is a finished run's "
                "final checkpoint, there is nothing to resume"
            )
        load_state(model, optimizer, blob, fsdp)  # while the (mapped) file is there
        scheduler.load_state_dict(header["scheduler"])
        if scaler is not None and header.get("scaler"):
            scaler.load_state_dict(header["scaler"])
        state = TrainState(**header["state"])
        del blob
    if rank != 0:  # totals are global: counted once
        state.rows = state.pack_tokens = state.trained_tokens = state.guard_dropped = 0
    state.resumes.append({"step": state.steps, "rows_skipped_per_rank": state.rows_consumed})
    return state


def save_checkpoint(
    packed: PackedLM,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    tokenizer: Tokenizer,
    fsdp: bool,
    device: torch.device,
    metrics: dict[str, Any],
    storage: Any = None,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Report a periodic checkpoint (every rank calls it): the model as ``save_model`` writes it
    plus ``TRAIN_STATE`` with the global totals (and fp16's ``scaler`` state). ``storage``: a run
    in the driver's (``driver_storage``)."""
    import ray.train

    name = f"checkpoint_step_{state.steps:06d}"
    state.checkpoints.append({"step": state.steps, "path": checkpoint_path(name, storage)})
    totals = all_reduce(
        torch.tensor(
            [state.rows, state.pack_tokens, state.trained_tokens, state.guard_dropped],
            device=device,
        )
    )
    saved = dataclasses.replace(state, losses=list(state.losses), series=dict(state.series))
    saved.rows, saved.pack_tokens, saved.trained_tokens, saved.guard_dropped = (
        int(v) for v in totals
    )
    model_state, optimizer_state = full_state(model, optimizer, fsdp)
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as directory:
        save_model(packed, tokenizer, directory, model_state if fsdp else None, rank == 0)
        if rank == 0:
            blob = {
                "model": model_state,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "state": dataclasses.asdict(saved),
            }
            if scaler is not None:
                blob["scaler"] = scaler.state_dict()
            torch.save(blob, os.path.join(directory, TRAIN_STATE))
        report(metrics, directory if rank == 0 else None, name, storage)
