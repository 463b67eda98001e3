"""The DPO loss on packed preference rows (``rayjobs.data.preference`` lays the rows out).

``PackedLM`` gives the log-prob of every labelled position (``model.token_logps``: only labelled
positions reach the lm head, a chunk at a time). ``response_logps`` sums them per response document
and pairs chosen and rejected per triple, in pack order (row by row, left to right: the order of
``np.concatenate(bins)``). ``dpo_loss`` is the sigmoid DPO loss with its rewards and metrics;
``dpo_loss_sum`` returns the sum and the triple count, so a data-parallel caller divides by the
*global* count, as the train step does for token loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rayjobs.data.preference import ROLE_CHOSEN, ROLE_REJECTED

if TYPE_CHECKING:
    from rayjobs.train.model import PackedLM


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
    """(chosen, rejected) summed log-probs [T] of every triple in ``batch`` (the preference
    rows' columns as tensors [B,S]) under ``model``, a ``PackedLM`` or the DDP/FSDP module
    wrapping one: one forward with the preference mask, the lm head on labelled positions only
    (``PackedLM.forward`` with ``per_token``). Run it under ``torch.no_grad()`` for the
    reference model."""
    logps = model(
        batch["input_ids"],
        batch["position_ids"],
        batch["document_ids"],
        batch["labels"],
        parent_ids=batch["parent_ids"],
        per_token=True,
    )
    return response_logps(logps, batch["document_ids"], batch["response_role"])


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
