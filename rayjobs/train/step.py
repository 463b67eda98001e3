"""One optimizer step and one evaluation, whatever the task (``objectives``)."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rayjobs.config import TrainConfig
from rayjobs.train.collate import collate
from rayjobs.train.collectives import all_reduce
from rayjobs.train.objectives import TokenLoss, labelled_tokens


class StepResult(NamedTuple):
    """``train_step``'s outcome: global means, and this rank's labelled tokens."""

    loss: float
    """SFT: mean cross entropy per labelled token; DPO: mean DPO loss per triple."""
    tokens: int
    """Labelled tokens of this rank's micro-batches."""
    grad_norm: float | None
    """The global gradient norm before clipping (None without ``max_grad_norm``)."""
    dpo: dict[str, float] | None = None
    """DPO: the means per triple of ``DPOObjective.sums`` but the loss, over the step's triples on
    every rank, and ``triples`` (their count)."""
    lr: float = 0.0
    """The learning rate this step used (the scheduler has moved on to the next one since)."""
    global_tokens: int = 0
    """Labelled tokens of the step's micro-batches on every rank."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group: list[dict[str, torch.Tensor]],
    *,
    fsdp: bool,
    bf16: bool,
    spec: TrainConfig,
    objective: TokenLoss | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    """One optimizer step over ``group`` (``grad_accum_steps`` micro-batches, the same count on
    every rank).

    The loss of each micro-batch is the ``objective``'s sum (default ``TokenLoss``: cross
    entropy over labelled tokens) divided by the group's *global* count of units, one all-reduce
    before the first backward, times the world size because DDP and FSDP average gradients over
    ranks: so every unit weighs the same whatever its pack, micro-batch and rank, and
    accumulating k micro-batches gives the gradient of one batch k times larger. Gradients are
    synchronized on the last micro-batch only (``no_sync``, FSDP2's
    ``set_requires_gradient_sync``). ``scaler``: fp16 (``train.precision``): the forward runs
    under fp16 autocast, the loss is scaled before backward and the gradients unscaled before
    clipping; a step whose gradients overflowed is skipped (``GradScaler.step``)."""
    objective = objective or TokenLoss()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    device = group[0]["input_ids"].device
    units = sum(objective.units(batch) for batch in group)
    tokens = sum(labelled_tokens(batch) for batch in group)
    # one all-reduce for both: the units weigh the loss, the tokens are reported
    global_units, global_tokens = (
        int(v) for v in all_reduce(torch.tensor([units, tokens], device=device))
    )
    global_units = max(1, global_units)
    sums = torch.zeros(len(objective.sums), dtype=torch.float64, device=device)
    for i, batch in enumerate(group):
        last = i == len(group) - 1
        sync = contextlib.nullcontext()
        if fsdp:
            model.set_requires_gradient_sync(last)
        elif not last and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync:
            local_sum, batch_sums = _forward(objective, model, batch, bf16, scaler is not None)
            scaled = local_sum.float() / global_units * world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        sums += batch_sums
    grad_norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    if spec.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = optimizer.param_groups[0]["lr"]
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss, metrics = objective.means(all_reduce(sums), global_units)
    return StepResult(loss, tokens, grad_norm, metrics, lr, global_tokens)


def _forward(
    objective: TokenLoss,
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    bf16: bool,
    fp16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective's forward on one micro-batch, under bf16 (or fp16) autocast where asked."""
    dtype = torch.float16 if fp16 else torch.bfloat16
    with torch.autocast(batch["input_ids"].device.type, dtype=dtype, enabled=bf16 or fp16):
        return objective.forward(model, batch)


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


def evaluate(
    model: torch.nn.Module,
    shard: Any,
    num_batches: int,
    batch_size: int,
    *,
    seq_len: int,
    device: torch.device,
    bf16: bool,
    objective: TokenLoss | None = None,
) -> EvalResult:
    """The held-out loss (DPO: loss and rewards) over this rank's share of the eval packs
    (``shard``: a Ray Data iterator, read whole), without gradients and with dropout off.

    Every rank runs ``num_batches`` forwards (the driver's count for the largest share), rows of
    padding once its own are done, so the sums hold every held-out pack exactly once: unlike the
    training split, nothing is left over, and the result does not depend on the number of
    workers but for rounding."""
    objective = objective or TokenLoss()
    training = model.training
    model.eval()
    sums = torch.zeros(len(objective.sums), dtype=torch.float64, device=device)
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
                    batch = objective.padding_row(seq_len, device)
                else:
                    counts[2] += len(batch["input_ids"])
                counts[0] += objective.units(batch)
                counts[1] += labelled_tokens(batch)
                sums += _forward(objective, model, batch, bf16)[1]
            if next(batches, None) is not None:
                raise RuntimeError(
                    f"evaluation: this rank holds more than the {num_batches} batches of "
                    f"{batch_size} rows the driver counted for its share"
                )
    finally:
        model.train(training)
    units, tokens, rows = (int(v) for v in all_reduce(counts))
    loss, metrics = objective.means(all_reduce(sums), max(1, units))
    return EvalResult(loss, tokens, rows, metrics)
