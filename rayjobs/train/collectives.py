"""Collectives that work with or without a process group (``num_workers: 0`` runs in one
process)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(value: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """``value`` summed (or ``op``) over every rank, in place; as is without a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=op)
    return value


def all_gather_int(value: int, device: torch.device) -> list[int]:
    """``value`` of every rank, in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered = [
        torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size())
    ]
    dist.all_gather(gathered, torch.tensor(value, dtype=torch.long, device=device))
    return [int(t) for t in gathered]
