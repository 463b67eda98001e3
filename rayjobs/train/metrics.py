"""The training series each train worker records (``rayjobs.metrics``' table)."""

from __future__ import annotations

import time

from rayjobs.metrics import _init_counter, _series, wait_for_export

DPO_GAUGES = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")
"""``StepResult.dpo`` keys exported as ``rayjobs_dpo_<key>``."""


class TrainMetrics:
    """The training series, recorded by every train worker (steps and loss by rank 0 only;
    tokens per second by every rank, tagged with it). The counters count work done: a worker
    that Ray Train restarts from a checkpoint (``train.max_failures``) redoes the steps after it,
    and they count again (the run summary's ``steps`` and ``tokens_trained`` are the trained
    state's); the killed process may also take what it recorded since its last export with it."""

    def __init__(self, run_name: str, rank: int):
        self.tags, self.rank = {"run": run_name}, rank
        self._rank_tags = {"run": run_name, "rank": str(rank)}
        self._steps, self._tokens, self._loss, self._speed = _series(
            [
                "rayjobs_train_steps",
                "rayjobs_train_tokens",
                "rayjobs_train_loss",
                "rayjobs_train_tokens_per_s",
            ]
        ).values()
        self._dpo = _series([f"rayjobs_dpo_{name}" for name in DPO_GAUGES])
        self._eval_loss = _series(["rayjobs_eval_loss"])["rayjobs_eval_loss"]
        self._last = time.monotonic()
        self._recorded: float | None = None
        _init_counter(self._tokens, self.tags)  # every rank adds its own tokens
        if rank == 0:
            _init_counter(self._steps, self.tags)

    def step(self, loss: float, local_tokens: int, dpo: dict[str, float] | None = None) -> None:
        """One optimizer step: its global loss, this rank's labelled tokens and, for DPO, the
        step's ``StepResult.dpo`` (rank 0 sets the ``rayjobs_dpo_*`` gauges from it; an SFT run
        never exports them)."""
        now = time.monotonic()
        self._speed.set(local_tokens / max(now - self._last, 1e-9), tags=self._rank_tags)
        self._last = self._recorded = now
        if local_tokens:
            self._tokens.inc(local_tokens, tags=self.tags)
        if self.rank == 0:
            self._steps.inc(1, tags=self.tags)
            self._loss.set(loss, tags=self.tags)
            for name in DPO_GAUGES if dpo else ():
                self._dpo[f"rayjobs_dpo_{name}"].set(dpo[name], tags=self.tags)

    def evaluation(self, loss: float) -> None:
        """An evaluation's global loss (rank 0 sets ``rayjobs_eval_loss``; a run without
        ``eval.datasets`` never exports it), once it has run: the next step's tokens per second
        count from here, not over the evaluation's time."""
        self.paused()
        if self.rank == 0:
            self._eval_loss.set(loss, tags=self.tags)
            self._recorded = self._last  # set by paused()

    def paused(self) -> None:
        """Work between two steps has ended (a checkpoint's save, a report to Ray Train): the
        next step's tokens per second count from now, not over it (the gauge dipped after every
        checkpoint)."""
        self._last = time.monotonic()

    def flush(self) -> float:
        """Wait until this process has exported what it recorded (``wait_for_export``; usually
        already so by the end of a run's final save): Ray Train ends the workers once the final
        report is in, and a worker's last steps were lost with it under load. Returns the
        seconds waited."""
        return wait_for_export(self._recorded)
