"""Callbacks: hooks into the train loop, as Hugging Face's ``TrainerCallback``.

Subclass :class:`Callback`, override the hooks you need and pass instances to
``rayjobs.run(config, callbacks=[...])``. Every train worker runs them (check ``context.rank``
for rank-0-only work); they travel to the workers pickled, so define them at module level in an
importable module. A hook sees the loop's state; changing it changes the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rayjobs.train.checkpoint import TrainState
    from rayjobs.train.step import StepResult


@dataclass(frozen=True)
class LoopContext:
    """Where a hook runs."""

    rank: int
    world_size: int
    run_name: str
    attempt: int
    """0 for a run's first worker group, one more per restart from a checkpoint."""


class Callback:
    """No-op hooks, called on every rank in this order: ``on_train_begin`` once the model is
    built and restored (``state.steps``: the step a restart resumes from, else 0), ``on_batch``
    for each batch (``skipped``: passed over when resuming, else trained), ``on_report`` after
    each report to Ray Train (``train.report_every`` steps, checkpoints, evaluations),
    ``on_step`` after each optimizer step and whatever it reported, ``on_train_end`` with the
    run's summary (rank 0's is the one reported)."""

    def on_train_begin(self, context: LoopContext, state: TrainState) -> None:
        pass

    def on_batch(
        self,
        context: LoopContext,
        state: TrainState,
        batch: dict[str, torch.Tensor],
        skipped: bool,
    ) -> None:
        pass

    def on_report(self, context: LoopContext, state: TrainState, metrics: dict[str, Any]) -> None:
        pass

    def on_step(self, context: LoopContext, state: TrainState, result: StepResult) -> None:
        pass

    def on_train_end(
        self, context: LoopContext, state: TrainState, summary: dict[str, Any]
    ) -> None:
        pass
