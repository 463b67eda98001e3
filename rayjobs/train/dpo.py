"""The DPO loss on packed preference rows (``rayjobs.data.preference`` lays the rows out).

``token_logps`` is the log-prob of every labelled position, computed like
``model.chunked_loss_sum``: only labelled positions reach the lm head, a chunk at a time inside
``torch.utils.checkpoint`` (a 128k vocabulary × a batch of positions would not fit otherwise).
``response_logps`` sums them per response document and pairs chosen and rejected per triple, in
pack order (row by row, left to right: the order of ``np.concatenate(bins)``). ``dpo_loss`` is the
sigmoid DPO loss with its rewards and metrics; ``dpo_loss_sum`` returns the sum and the triple
count, so a data-parallel caller divides by the *global* count, as the train step does for token
loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rayjobs.data.preference import ROLE_CHOSEN, ROLE_REJECTED
from rayjobs.data.rows import IGNORE_INDEX

if TYPE_CHECKING:
    from rayjobs.train.model import PackedLM


def _chunk_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → fp32, fp64 stays
    return -F.cross_entropy(logits, targets, reduction="none")


def token_logps(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int = 1024,  # model.DEFAULT_LOSS_CHUNK_TOKENS (not imported: it imports torch)
) -> torch.Tensor:
    """[B,S]: ``log p(labels[t] | input up to t)`` where ``labels[t]`` is not -100, else 0; fp32
    (fp64 for an fp64 model).

    As ``model.chunked_loss_sum``: only labelled positions reach ``head``, ``chunk_tokens`` of them
    at a time inside ``torch.utils.checkpoint`` (no batch-sized logits kept; backward recomputes a
    chunk's); ``chunk_tokens=0`` projects them all at once. An empty chunk still runs when nothing
    is labelled, so every head parameter takes part in backward (DDP expects that).

    Args:
        hidden: [B,S,dim] final hidden states.
        head: hidden [n,dim] → logits [n,vocab] (e.g. ``PackedLM.head``).
        labels: [B,S] shifted labels, -100 where no loss.
        chunk_tokens: labelled positions per chunk (>= 0).
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}.")
    labelled = (labels != IGNORE_INDEX).reshape(-1)
    selected = hidden.reshape(-1, hidden.shape[-1])[labelled]
    targets = labels.reshape(-1)[labelled].long()
    if not chunk_tokens:
        values = _chunk_logps(head, selected, targets)
    else:
        values = torch.cat(
            [
                checkpoint(
                    _chunk_logps,
                    head,
                    selected[start : start + chunk_tokens],
                    targets[start : start + chunk_tokens],
                    use_reentrant=False,
                )
                for start in range(0, max(len(targets), 1), chunk_tokens)
            ]
        )
    out = torch.zeros(labelled.shape, dtype=values.dtype, device=hidden.device)
    return out.masked_scatter(labelled, values).reshape(labels.shape)


def response_logps(
    logps: torch.Tensor, document_ids: torch.Tensor, response_role: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-triple summed log-probs of the chosen and of the rejected response, each fp64 [T].

    Sums ``logps`` [B,S] (``token_logps``) per document, then pairs the documents per row through
    the id arithmetic of the module note (chosen = prompt id + 1, rejected = prompt id + 2).
    Triples come in pack order: row by row, left to right within a row. The sums are taken in fp64:
    a response's log-prob is a sum of hundreds of values, often 1e3 in size, and DPO uses the
    small difference of two such sums (policy minus reference), which fp32 rounding (its step at
    1e3 is 1e-4) and summation order would otherwise blur; T values in fp64 cost nothing.

    Raises:
        ValueError: if a chosen document has no rejected document after it (not a preference row).
    """
    import torch

    batch_size, seq_len = document_ids.shape
    width = seq_len + 1  # ids of a row are at most its seq_len (3 per triple of >= 4 tokens)
    slot = torch.arange(batch_size, device=document_ids.device)[:, None] * width + document_ids
    slot = slot.reshape(-1).long()
    sums = torch.zeros(batch_size * width, dtype=torch.float64, device=logps.device)
    sums = sums.index_add(0, slot, logps.reshape(-1).double())
    roles = torch.zeros(batch_size * width, dtype=torch.long, device=logps.device)
    roles = roles.scatter(0, slot, response_role.reshape(-1).long())
    chosen = torch.nonzero(roles == ROLE_CHOSEN).reshape(-1)
    rejected = chosen + 1
    if not bool((roles[rejected.clamp(max=len(roles) - 1)] == ROLE_REJECTED).all()):
        raise ValueError(
            "A chosen document (response_role 1) has no rejected document (role 2) right after "
            "it; these are not preference rows (rayjobs.data.preference.assemble_triples)."
        )
    return sums[chosen], sums[rejected]


def packed_logps(
    model: PackedLM, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs [T] of every triple in ``batch`` (the
    :data:`DPO_COLUMNS` as tensors [B,S]) under ``model``, a ``PackedLM`` (demo decoder or Hugging
    Face model) or the DDP/FSDP module wrapping one: one forward with the preference mask, the lm
    head on labelled positions only, ``model.loss_chunk_tokens`` at a time. Run it under
    ``torch.no_grad()`` for the reference model."""
    return model(
        batch["input_ids"],
        batch["position_ids"],
        batch["document_ids"],
        batch["labels"],
        parent_ids=batch["parent_ids"],
        response_role=batch["response_role"],
    )


def _check_logps(*logps: torch.Tensor, beta: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}.")
    shapes = {tuple(x.shape) for x in logps}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            "policy_chosen, policy_rejected, ref_chosen and ref_rejected must be 1-D and of one "
            f"length (one value per triple), got shapes {[tuple(x.shape) for x in logps]}."
        )


def _margins(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """beta × the chosen and rejected log-ratios (the implicit rewards), in fp64 (see
    ``response_logps``: the log-ratio is a small difference of large sums)."""
    _check_logps(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta)
    chosen = beta * (policy_chosen.double() - ref_chosen.double())
    return chosen, beta * (policy_rejected.double() - ref_rejected.double())


def dpo_loss_sum(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmoid DPO loss summed over the triples as fp32, the number of triples): divide the sum
    by the *global* count of a data-parallel batch for the mean. Zero triples give (0, 0).
    """
    import torch
    import torch.nn.functional as F

    chosen, rejected = _margins(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    total = -F.logsigmoid(chosen - rejected).sum().float()
    return total, torch.tensor(len(chosen), device=total.device)


@dataclass(frozen=True)
class DPOLoss:
    """``dpo_loss``'s result: the loss to backpropagate and its metrics (detached)."""

    loss: torch.Tensor
    """Mean over triples of ``-logsigmoid(beta * ((pc - rc) - (pr - rr)))``."""
    chosen_rewards: torch.Tensor
    """[T] ``beta * (pc - rc)``."""
    rejected_rewards: torch.Tensor
    """[T] ``beta * (pr - rr)``."""
    reward_margin: torch.Tensor
    """Mean of chosen minus rejected reward."""
    reward_accuracy: torch.Tensor
    """Fraction of triples whose chosen reward is above the rejected one."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DPOLoss:
    """The sigmoid DPO loss (Rafailov et al. 2023), mean over triples, with rewards and metrics.

    Arguments are per-triple summed log-probs [T] (``packed_logps``), policy and frozen reference.

    Raises:
        ValueError: for no triples (a rank may have none: use ``dpo_loss_sum``), mismatched
            shapes or ``beta`` <= 0.
    """
    import torch.nn.functional as F

    chosen, rejected = _margins(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    if not len(chosen):
        raise ValueError("dpo_loss got no triples; use dpo_loss_sum where a batch may have none.")
    margin = (chosen - rejected).detach()
    return DPOLoss(
        loss=-F.logsigmoid(chosen - rejected).mean().float(),
        chosen_rewards=chosen.detach().float(),
        rejected_rewards=rejected.detach().float(),
        reward_margin=margin.mean().float(),
        reward_accuracy=(margin > 0).float().mean(),
    )
