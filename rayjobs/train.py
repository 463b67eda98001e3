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
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rayjobs import seeds
from rayjobs.collate import collate
from rayjobs.config import Config
from rayjobs.metrics import TrainMetrics
from rayjobs.model import Decoder, DecoderConfig, loss_sum


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


def resolve_attention(attention: str, device: torch.device) -> str:
    if attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise ValueError(
            "train.attention: flex has no backward pass on CPU in torch 2.13; "
            "use auto or sdpa when training without GPUs"
        )
    return attention


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
    torch.manual_seed(seeds.torch_seed(config.seed, "model_init"))
    model_config = config.train.model
    model = Decoder(
        DecoderConfig(
            vocab_size=loop_config["vocab_size"],
            dim=model_config.dim,
            n_layers=model_config.n_layers,
            n_heads=model_config.n_heads,
        )
    )
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay
    )
    seq_len = config.packing.seq_len
    series = TrainMetrics(loop_config.get("run_name", "rayjobs"), rank)
    losses: list[float] = []
    steps = rows = pack_tokens = trained_tokens = guard_dropped = 0
    names = loop_config.get("datasets") or [f"train_epoch_{e}" for e in range(config.train.epochs)]
    for index, name in enumerate(names):  # one stream of every epoch, or one dataset per epoch
        shard = ray.train.get_dataset_shard(name)
        guard = _Guard()
        for batch in rank_batches(shard, config.train.batch_size, device, guard):
            logits = model(
                batch["input_ids"],
                batch["position_ids"],
                batch["document_ids"],
                attention=attention,
            )
            local_sum, local_count = loss_sum(logits, batch["labels"])
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
            if steps % config.train.report_every == 0:
                epoch = int(batch["epoch"].max()) if "epoch" in batch else index
                ray.train.report({"step": steps, "epoch": epoch, "loss": step_loss})
            if config.train.max_steps is not None and steps >= config.train.max_steps:
                break
        guard_dropped += guard.dropped
        if config.train.max_steps is not None and steps >= config.train.max_steps:
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
        "attention": attention,
        "world_size": world_size,
    }
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            unwrapped = model.module if hasattr(model, "module") else model
            torch.save(unwrapped.state_dict(), os.path.join(directory, "model.pt"))
            with open(os.path.join(directory, "summary.json"), "w") as f:
                json.dump(summary, f)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(summary, checkpoint=checkpoint)
