"""Train: Ray Train ``TorchTrainer`` workers consume per-rank packed batches and train the decoder.

Design note.
- The trainer consumes the datasets named in ``loop_config["datasets"]`` in order: one stream of
  every epoch (``train``, stream mode; rows carry their ``epoch``), or one dataset per epoch
  (``train_epoch_<e>``, planned mode). Ray Train splits each with ``streaming_split(world_size,
  equal=True)``: equal rows per rank, and with a fixed batch size and ``drop_last`` equal batches
  per rank. No local shuffle buffer (Ray bug #66085: a buffer < 2 × batch_size yields short
  batches mid-stream); the packer already shuffles.
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

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rayjobs import masks, seeds
from rayjobs.collate import collate
from rayjobs.config import Config, HFModelConfig
from rayjobs.metrics import TrainMetrics
from rayjobs.model import Decoder, DecoderConfig, PackedLM, build_hf_model
from rayjobs.tokenize import Tokenizer


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
    shard: Any, batch_size: int, device: torch.device, guard: _Guard | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of one epoch, stopping on every rank as soon as any rank runs out.

    Before each step all ranks all-reduce (MIN) a "have a batch" flag; a batch held when another
    rank is out is not trained on and is counted in ``guard.dropped``.
    """
    batches = iter(
        shard.iter_torch_batches(
            batch_size=batch_size, drop_last=True, collate_fn=lambda b: collate(b, device)
        )
    )
    while True:
        batch = next(batches, None)
        have = _all_reduce(torch.tensor(int(batch is not None), device=device), dist.ReduceOp.MIN)
        if not int(have):
            if guard is not None:
                guard.dropped += batch is not None
            return
        yield batch


def train_batches(
    datasets: str | Sequence[str] = "train",
    batch_size: int = 8,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    guard: _Guard | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """The library API for a user's own ``train_loop_per_worker``: this rank's packed batches, on
    this rank's device, with the same number of batches on every rank.

    ``datasets``: the dataset names the ``TorchTrainer`` was given, read in order (``Job.
    train_datasets()``: ``"train"`` in stream mode, one per epoch in planned mode). Each batch holds
    ``input_ids``, ``labels`` (already shifted per document: compare logits at position t with
    ``labels[t]``, ignore ``-100``), ``position_ids`` (restarting per document), ``document_ids``
    and ``num_tokens`` as int64 tensors, and ``epoch`` in stream mode. With
    ``attn_implementation`` (``sdpa``, ``eager`` or ``flex_attention``, as a Hugging Face model's
    ``config._attn_implementation``) the batch also holds ``attention_mask``: the document-causal
    mask in that backend's form, built on the device (``masks.hf_attention_mask``; ``dtype`` is the
    eager path's score dtype). Pass it with ``position_ids`` to the model's forward.
    """
    import ray.train
    import ray.train.torch

    device = device if device is not None else ray.train.torch.get_device()
    for name in [datasets] if isinstance(datasets, str) else datasets:
        shard = ray.train.get_dataset_shard(name)
        for batch in rank_batches(shard, batch_size, device, guard):
            if attn_implementation is not None:
                batch["attention_mask"] = masks.hf_attention_mask(
                    batch["document_ids"], attn_implementation, dtype
                )
            yield batch


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
        return PackedLM(decoder, attention, chunk).to(device)
    token_ids = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    if "bos_token" in tokenizer.special_tokens:
        bos = tokenizer.backend.token_to_id(tokenizer.special_tokens["bos_token"])
        if bos is not None:
            token_ids["bos_token_id"] = bos
    implementation = hf_attention(config, device)
    try:
        model = build_hf_model(
            vocab_size=tokenizer.vocab_size,
            seq_len=config.packing.seq_len,
            path=spec.path,
            config_path=spec.config_path,
            overrides=spec.config,
            attn_implementation=implementation,
            local_files_only=not spec.allow_download,
            token_ids=token_ids,
        )
    except (OSError, ValueError, KeyError) as error:
        source = spec.path or spec.config_path or spec.config.get("model_type")
        raise ValueError(f"train.model: cannot build the model from {source!r}: {error}") from None
    packed = PackedLM(model.to(device), loss_chunk_tokens=chunk)
    packed.check_head()
    return packed


def save_model(model: PackedLM, tokenizer: Tokenizer, directory: str) -> None:
    """Write ``model`` into ``directory``: an HF model with ``save_pretrained``, the tokenizer
    next to it and ``probe.pt`` (``input_ids`` [1,16] and the model's fp32 ``logits`` on them,
    through the training path); the demo decoder as ``model.pt``."""
    if not model.is_hf:
        torch.save(model.model.state_dict(), os.path.join(directory, "model.pt"))
        return
    model.model.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    embeddings = model.model.get_input_embeddings()
    device = embeddings.weight.device
    input_ids = (torch.arange(16, device=device)[None] * 7919) % tokenizer.vocab_size
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model.logits(
            input_ids, torch.arange(16, device=device)[None], torch.zeros_like(input_ids)
        )
    model.train(was_training)
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


def train_loop(loop_config: dict[str, Any]) -> None:
    """The per-worker loop (``train_loop_per_worker`` of the TorchTrainer)."""
    import ray.train
    import ray.train.torch

    config = Config.model_validate(loop_config["config"])
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    device = ray.train.torch.get_device()
    attention = resolve_attention(config.train.attention, device)
    # Ray leaves OMP_NUM_THREADS unset for fractional-CPU actors, so torch would start one thread
    # per core in every worker: on a 2-core machine two workers ran 10x slower from
    # oversubscription.
    torch.set_num_threads(max(1, int(config.train.cpus_per_worker)))
    tokenizer = Tokenizer(config.tokenizer)
    packed = build_model(config, tokenizer, device, attention)
    model = ray.train.torch.prepare_model(packed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay
    )
    seq_len = config.packing.seq_len
    series = TrainMetrics(loop_config.get("run_name", "rayjobs"), rank)
    losses: list[float] = []
    checkpoints: list[dict[str, Any]] = []
    steps = rows = pack_tokens = trained_tokens = guard_dropped = 0
    stopped_early = False  # max_steps reached: the stream may not have ended
    names = loop_config.get("datasets") or [f"train_epoch_{e}" for e in range(config.train.epochs)]
    for index, name in enumerate(names):  # one stream of every epoch, or one dataset per epoch
        guard = _Guard()
        for batch in train_batches(name, config.train.batch_size, device=device, guard=guard):
            local_sum, local_count = model(
                batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"]
            )
            global_count = _all_reduce(local_count.detach().clone()).clamp(min=1)
            loss = local_sum / global_count * world_size
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step_loss = float(_all_reduce(local_sum.detach().clone()) / global_count)
            losses.append(step_loss)
            series.step(step_loss, int(local_count))
            steps += 1
            rows += len(batch["input_ids"])
            pack_tokens += int(batch["num_tokens"].sum())
            trained_tokens += int(local_count)
            every = config.train.checkpoint_every
            if steps % config.train.report_every == 0 or (every and steps % every == 0):
                epoch = int(batch["epoch"].max()) if "epoch" in batch else index
                metrics = {"step": steps, "epoch": epoch, "loss": step_loss}
                if every and steps % every == 0:
                    name = f"checkpoint_step_{steps:06d}"
                    checkpoints.append({"step": steps, "path": _checkpoint_path(name)})
                    with tempfile.TemporaryDirectory() as directory:
                        checkpoint = None
                        if rank == 0:
                            save_model(packed, tokenizer, directory)
                            checkpoint = ray.train.Checkpoint.from_directory(directory)
                        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
                else:
                    ray.train.report(metrics)
            if config.train.max_steps is not None and steps >= config.train.max_steps:
                stopped_early = True
                break
        guard_dropped += guard.dropped
        if stopped_early:
            break
    totals = torch.tensor([rows, pack_tokens, trained_tokens, guard_dropped], device=device)
    rows, pack_tokens, trained_tokens, guard_dropped = (int(v) for v in _all_reduce(totals))
    tenth = max(1, len(losses) // 10)
    summary = {
        "steps": steps,
        "steps_per_rank": _all_gather_int(steps, device),
        "loss_first": _mean(losses[:tenth]),
        "loss_last": _mean(losses[-tenth:]),
        "tokens_trained": trained_tokens,
        "num_packs": rows,
        "packing_efficiency": pack_tokens / (rows * seq_len) if rows else 0.0,
        "guard_dropped_batches": guard_dropped,
        "stopped_early": stopped_early,
        "attention": packed.attention,
        "model": config.train.model.kind,
        "checkpoints": checkpoints,
        "world_size": world_size,
    }
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            save_model(packed, tokenizer, directory)
            with open(os.path.join(directory, "summary.json"), "w") as f:
                json.dump(summary, f)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(summary, checkpoint=checkpoint)
