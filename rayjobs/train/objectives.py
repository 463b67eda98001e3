"""What each task trains on a batch (``config.task``): its loss, the unit the loss is a mean over,
and the values reported with it. ``rayjobs.data.tasks`` is the data side's half of the same table.

The train step and the evaluation call one ``Objective`` and never branch on the task: a loss is a
sum over the batch's units (labelled tokens for SFT, triples for DPO) that the caller divides by
the *global* count of units, so every unit weighs the same whatever its pack and rank.
"""

from __future__ import annotations

import torch

from rayjobs.data.preference import ROLE_CHOSEN
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.train import dpo
from rayjobs.train.model import PackedLM

Batch = dict[str, torch.Tensor]


def labelled_tokens(batch: Batch) -> int:
    """Positions of a batch that have a label."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _padding(seq_len: int, device: torch.device) -> Batch:
    zeros = torch.zeros(1, seq_len, dtype=torch.int64, device=device)
    return {
        "input_ids": zeros,
        "labels": torch.full_like(zeros, IGNORE_INDEX),
        "position_ids": torch.arange(seq_len, device=device).unsqueeze(0),
        "document_ids": zeros,
    }


class TokenLoss:
    """SFT: cross entropy over labelled tokens; its unit is a labelled token."""

    sums = ("loss",)
    """What ``forward`` sums over a batch, each a mean per unit once divided by the global count
    of units (``means``)."""

    def units(self, batch: Batch) -> int:
        return labelled_tokens(batch)

    def forward(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's loss sum (with the graph, for ``backward``) and its ``sums`` as a
        detached fp64 vector."""
        columns = (batch["input_ids"], batch["position_ids"], batch["document_ids"])
        local_sum, _ = model(*columns, batch["labels"])
        return local_sum, local_sum.detach().double().reshape(1)

    def means(self, sums: torch.Tensor, units: int) -> tuple[float, dict[str, float] | None]:
        """Global ``sums`` over the global count of units → (the mean loss, the other means)."""
        return float(sums[0]) / units, None

    def padding_row(self, seq_len: int, device: torch.device) -> Batch:
        """A row with nothing to learn: what a rank whose held-out share has run out evaluates
        while another still has batches, so every rank runs the same forwards (FSDP gathers each
        block's parameters from every rank in each)."""
        return _padding(seq_len, device)


class DPOObjective(TokenLoss):
    """DPO: the sigmoid DPO loss of each preference triple against a frozen ``reference`` (run
    without gradients on the same rows); its unit is a triple. Also sums the reward margin, the
    triples whose margin is positive, the chosen and rejected log-probs and rewards (beta × the
    policy's log-ratio to the reference: TRL's ``rewards/chosen`` and ``rewards/rejected``)."""

    sums = (
        "loss",
        "reward_margin",
        "reward_accuracy",
        "chosen_logps",
        "rejected_logps",
        "chosen_reward",
        "rejected_reward",
    )

    def __init__(self, reference: PackedLM, beta: float = 0.1):
        self.reference, self.beta = reference, beta

    def units(self, batch: Batch) -> int:
        """Triples: chosen documents, counted by their first token."""
        chosen = batch["response_role"] == ROLE_CHOSEN
        starts = chosen.clone()
        starts[:, 1:] &= ~chosen[:, :-1]
        return int(starts.sum())

    def forward(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = dpo.packed_logps(model, batch)
        with torch.no_grad():
            ref_chosen, ref_rejected = dpo.packed_logps(self.reference, batch)
        local_sum, _ = dpo.dpo_loss_sum(chosen, rejected, ref_chosen, ref_rejected, self.beta)
        chosen_reward = self.beta * (chosen - ref_chosen).detach()
        rejected_reward = self.beta * (rejected - ref_rejected).detach()
        margin = chosen_reward - rejected_reward
        values = [local_sum.detach(), margin.sum(), (margin > 0).sum(), chosen.sum(),
                  rejected.sum(), chosen_reward.sum(), rejected_reward.sum()]  # fmt: skip
        return local_sum, torch.stack([v.double() for v in values]).detach()

    def means(self, sums: torch.Tensor, units: int) -> tuple[float, dict[str, float] | None]:
        """(the mean DPO loss per triple, the other means with ``triples``: the count)."""
        means = {name: float(value) / units for name, value in zip(self.sums, sums, strict=True)}
        return means.pop("loss"), {**means, "triples": units}

    def padding_row(self, seq_len: int, device: torch.device) -> Batch:
        row = _padding(seq_len, device)
        zeros = row["document_ids"]
        return row | {"parent_ids": zeros, "response_role": zeros}


def objective_for(task: str, reference: PackedLM | None = None, beta: float = 0.1) -> TokenLoss:
    """The objective of ``task`` (``config.task``); DPO needs its frozen ``reference``."""
    if task == "dpo":
        if reference is None:
            raise ValueError("task dpo needs a reference model")
        return DPOObjective(reference, beta)
    return TokenLoss()
