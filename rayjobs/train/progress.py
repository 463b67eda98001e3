"""Progress: rank 0's line every ``train.report_every`` steps, and the trackers' scalars.

``Progress`` is a built-in callback (``rayjobs.train.callbacks``): ``rayjobs run`` adds it to the
run's callbacks, and a user's own ``rayjobs.run(config, callbacks=[...])`` keeps it. Every
``every`` steps (and at the last step) rank 0 computes one set of scalars (loss, learning rate,
gradient norm, tokens per second, packing efficiency, epoch; DPO rewards; an evaluation's loss)
and hands it to the progress line on stderr (``show``) and to the trackers
(``rayjobs.train.trackers``), so both say the same. A train worker's stderr reaches the driver's
log through Ray's ``log_to_driver``, prefixed with the worker's pid: the line reads
``rayjobs: step 10/85 epoch 0/3 loss ...`` in a terminal, in ``rayjobs logs`` and on the Ray
dashboard's job page alike. It imports no torch, so the driver builds it.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any

from rayjobs.train.callbacks import Callback, LoopContext

if TYPE_CHECKING:
    import torch

    from rayjobs.train.checkpoint import TrainState
    from rayjobs.train.step import StepResult
    from rayjobs.train.trackers import Trackers


EVAL_COUNTS = ("step", "loss", "rows", "packs", "tokens")
"""Keys of an evaluation's entry (``TrainState.evals``) that are not DPO means."""


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def planned_steps(packs_per_epoch: list[int], workers: int, spec: Any) -> int:
    """The optimizer steps of a planned run (``packing.mode: planned``): each epoch's packs
    split equally over the workers (Ray Data's ``streaming_split(equal=True)`` leaves the
    remainder out), cut into batches (``drop_last``: whole ones only) and groups of
    ``grad_accum_steps``; at most ``max_steps``. ``spec``: the ``TrainConfig``."""
    steps = 0
    for packs in packs_per_epoch:
        rows = packs // max(1, workers)
        batches = rows // spec.batch_size if spec.drop_last else math.ceil(rows / spec.batch_size)
        steps += math.ceil(batches / spec.grad_accum_steps)
    return min(steps, spec.max_steps) if spec.max_steps is not None else steps


FIELDS = (
    ("loss", "loss", ".4f"),
    ("lr", "lr", ".3g"),
    ("grad_norm", "grad_norm", ".3f"),
    ("dpo/reward_accuracy", "reward_accuracy", ".3f"),
    ("dpo/reward_margin", "reward_margin", ".3f"),
    ("eval_loss", "eval_loss", ".4f"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("packing_efficiency", "packing", ".3f"),
)
"""The progress line's scalars after step and epoch, in order: (key, label, format)."""


def format_line(step: int, scalars: dict[str, float], total: int | None, epochs: int | None,
                elapsed: float, eta: float | None) -> str:  # fmt: skip
    """One progress line (without the ``rayjobs:`` prefix)."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if "epoch" in scalars:
        epoch = int(scalars["epoch"])
        parts.append(f"epoch {epoch}/{epochs}" if epochs else f"epoch {epoch}")
    parts += [f"{label} {scalars[key]:{form}}" for key, label, form in FIELDS if key in scalars]
    parts.append(f"elapsed {duration(elapsed)}")
    if eta is not None:
        parts.append(f"eta {duration(eta)}")
    return "  ".join(parts)


class Progress(Callback):
    """Rank 0's progress line and tracker scalars every ``every`` steps and at the last step.

    ``total_steps``: the run's steps where known (``max_steps``, or a planned run's count),
    shown as ``step/total`` with an ETA; ``epochs``: shown as ``epoch/epochs``; ``show``: print
    the line (``rayjobs run --quiet`` does not); ``trackers``: where the scalars also go;
    ``dtype``: the parameters' and autocast dtypes, in words, at the line's end. Its
    other methods are usable from a loop of one's own: call ``begin``, then ``step`` after each
    optimizer step, then ``end``."""

    def __init__(
        self,
        every: int,
        total_steps: int | None = None,
        epochs: int | None = None,
        show: bool = True,
        trackers: Trackers | None = None,
        dtype: str | None = None,
    ):
        self.every, self.total, self.epochs = every, total_steps, epochs
        self.dtype = dtype
        self.show, self.trackers = show, trackers
        self._batch: dict[str, torch.Tensor] | None = None
        self._result: StepResult | None = None
        self._evaluated: dict[str, float] = {}
        self._logged_step = self._eval_step = -1
        self._start = self._last_time = 0.0
        self._start_step = 0
        self._tokens = self._last_tokens = 0

    # --- the callback's hooks: rank 0 only ----------------------------------------------------

    def on_train_begin(self, context: LoopContext, state: TrainState) -> None:
        if context.rank == 0:
            self.begin(context.run_name, state.steps)

    def on_batch(self, context: LoopContext, state: TrainState, batch, skipped: bool) -> None:
        if context.rank == 0 and not skipped:
            self._batch = batch  # its epoch and row length, read when a line is due

    def on_report(self, context: LoopContext, state: TrainState, metrics: dict[str, Any]) -> None:
        if context.rank == 0:
            self._evaluated |= {
                k: float(v) for k, v in metrics.items() if k == "eval_loss" or k.startswith("eval/")
            }

    def on_step(self, context: LoopContext, state: TrainState, result: StepResult) -> None:
        if context.rank != 0:
            return
        self._tokens += result.global_tokens
        self._result = result
        if state.steps % self.every == 0 or self._evaluated:
            self.step(state.steps, self.scalars(state, result))

    def on_train_end(
        self, context: LoopContext, state: TrainState, summary: dict[str, Any]
    ) -> None:
        if context.rank != 0:
            return
        if self._result is not None and state.steps != self._logged_step:
            self.step(state.steps, self.scalars(state, self._result))  # the last step's
        history = summary.get("eval", {}).get("history", [])
        if history and history[-1]["step"] != self._eval_step and self.trackers is not None:
            # the loop's closing evaluation, run after the last step without a report
            entry = history[-1]
            evaluated = {"eval_loss": entry["loss"]}
            evaluated |= {f"eval/dpo/{k}": v for k, v in entry.items() if k not in EVAL_COUNTS}
            self.trackers.log(evaluated, entry["step"])
        self.end()

    # --- the scalars, the line, the trackers ----------------------------------------------------

    def scalars(self, state: TrainState, result: StepResult) -> dict[str, float]:
        """The values of this step: the result's, tokens per second since the last line (wall
        time, evaluations and checkpoints between steps included), rank 0's packing efficiency
        so far, the epoch of its last batch (a planned run: its dataset's), and any evaluation
        reported since the last line."""
        scalars = {"loss": result.loss, "lr": result.lr}
        if result.grad_norm is not None:
            scalars["grad_norm"] = result.grad_norm
        scalars |= {f"dpo/{k}": v for k, v in (result.dpo or {}).items() if k != "triples"}
        now = time.monotonic()
        if now > self._last_time and self._tokens > self._last_tokens:
            scalars["tokens_per_s"] = (self._tokens - self._last_tokens) / (now - self._last_time)
        self._last_time, self._last_tokens = now, self._tokens
        if self._batch is not None:
            seq_len = self._batch["input_ids"].shape[-1]
            if state.rows:
                scalars["packing_efficiency"] = state.pack_tokens / (state.rows * seq_len)
            if "epoch" in self._batch:
                scalars["epoch"] = int(self._batch["epoch"].max())
            else:
                scalars["epoch"] = state.dataset_index
        if self._evaluated:
            scalars |= self._evaluated
            self._evaluated = {}
            self._eval_step = state.steps
        return scalars

    def begin(self, run_name: str, step: int = 0) -> None:
        """Start the clock (``step``: where a restart resumes) and open the trackers."""
        self._start = self._last_time = time.monotonic()
        self._start_step = step
        if self.trackers is not None:
            self.trackers.open(run_name, step)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        """Print the line of ``step`` and log its scalars to the trackers."""
        self._logged_step = step
        elapsed = time.monotonic() - self._start
        eta = None
        done = step - self._start_step
        if self.total and done > 0 and elapsed > 0:
            eta = max(0, self.total - step) * elapsed / done
        if self.show:
            line = format_line(step, scalars, self.total, self.epochs, elapsed, eta)
            if self.dtype:
                line += f"  {self.dtype}"
            self.emit(line)
        if self.trackers is not None:
            self.trackers.log(scalars, step)

    def end(self) -> None:
        """Close the trackers, logging the run's per-dataset counts first."""
        if self.trackers is not None:
            self.trackers.close(self._logged_step)

    def emit(self, line: str) -> None:
        """Write one line on stderr; a subclass may send it elsewhere. Written, not printed: Ray
        Train's workers turn ``print`` into log records, and print twice where a library (a
        tracker) has wrapped ``sys.stderr``."""
        sys.stderr.write(f"rayjobs: {line}\n")
        sys.stderr.flush()
