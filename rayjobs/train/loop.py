"""The per-worker train loop of the ``TorchTrainer``: batches → steps → reports, checkpoints,
evaluations → the run's summary.

The loop consumes the datasets named in ``loop_config["datasets"]`` in order: one stream of every
epoch (``train``, stream mode; rows carry their ``epoch``), or one dataset per epoch
(``train_epoch_<e>``, planned mode). Every step's loss is a mean over the *global* batch
(``step``); a restarted worker group resumes from the latest checkpoint, passing over the rows
each rank had consumed (``checkpoint``). Callbacks see every batch, report and step.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rayjobs.config import Config
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.train.batches import Guard, train_batches
from rayjobs.train.build import (
    build_model,
    build_optimizer,
    compute_dtype,
    frozen_reference,
    loss_scaler,
    lr_lambda,
    parallelize,
    resolve_attention,
    seed_rank,
    use_bf16,
)
from rayjobs.train.callbacks import Callback, LoopContext
from rayjobs.train.checkpoint import (
    driver_storage,
    drop_checkpoint,
    full_model_state,
    report,
    restore,
    save_checkpoint,
    save_model,
)
from rayjobs.train.collectives import all_gather_int, all_reduce
from rayjobs.train.lora import parameter_counts
from rayjobs.train.metrics import TrainMetrics
from rayjobs.train.names import EVAL_DATASET, FINAL_SUMMARY
from rayjobs.train.objectives import objective_for
from rayjobs.train.step import evaluate, train_step


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _groups(batches: Iterator[dict[str, torch.Tensor]], size: int):
    """Consecutive lists of up to ``size`` batches (the last may be shorter: the same length on
    every rank, since ``rank_batches`` yields the same number of batches everywhere)."""
    while group := list(itertools.islice(batches, size)):
        yield group


def _skip_rows(batches: Iterator[dict[str, torch.Tensor]], rows: int):
    """The batches holding a rank's first ``rows`` rows (consumed before a checkpoint)."""
    while rows > 0 and (batch := next(batches, None)) is not None:
        rows -= len(batch["input_ids"])
        yield batch


def checkpoint_due(spec: Any, state: Any, clock: float, device: torch.device) -> bool:
    """Whether the step just taken ends with a periodic checkpoint: every ``checkpoint_every``
    steps; or (``checkpoint_every_minutes``) at the run's first step, then once that many
    minutes have passed since ``clock`` (the last checkpoint, or the worker group's start). The
    clocks of the ranks differ: they agree through an all-reduce, as every rank must save."""
    every, minutes = spec.checkpoint_every, spec.checkpoint_every_minutes
    if every and state.steps % every == 0:
        return True
    if not minutes:
        return False
    late = not state.checkpoints or time.monotonic() - clock >= minutes * 60
    return bool(all_reduce(torch.tensor([int(late)], device=device), dist.ReduceOp.MAX)[0])


def warmup_steps(steps: int) -> int:
    """Steps left out of ``throughput``: the first tenth (at least one), as ``loss_first``."""
    return min(steps, max(1, steps // 10))


def throughput(step_ends: list[float], timed_tokens: int, began: float) -> dict[str, Any]:
    """The summary's ``throughput``, from the ``time.perf_counter()`` at the end of each step
    (everything the loop did for it: waiting for the batch, the step, reports, checkpoints,
    evaluations), the non-pad tokens of every rank in the steps after ``warmup_steps``, and when
    the loop began taking batches."""
    skip = warmup_steps(len(step_ends))
    timed = len(step_ends) - skip
    seconds = step_ends[-1] - step_ends[skip - 1] if timed > 0 else 0.0
    return {
        "warmup_steps": skip,
        "steps": timed,
        "seconds": seconds,
        "tokens_per_s": timed_tokens / seconds if seconds > 0 else None,
        "first_step_s": step_ends[0] - began if step_ends else None,
    }


def step_clock(step_ends: list[float]) -> dict[str, float]:
    """The summary's ``throughput.first_step_at`` and ``last_step_at``: when the first and the
    last step ended, as Unix times (``time.time()``), for a caller timing the run from its own
    clock (``rayjobs bench sft``: from the command's start); ``step_ends`` are perf_counter's."""
    if not step_ends:
        return {}
    offset = time.time() - time.perf_counter()
    return {"first_step_at": step_ends[0] + offset, "last_step_at": step_ends[-1] + offset}


def train_loop(loop_config: dict[str, Any]) -> None:
    """The per-worker loop (``train_loop_per_worker`` of the TorchTrainer)."""
    import ray.train
    import ray.train.torch

    config: Config = loop_config["config"]  # the driver's, validated there (``_train``)
    spec = config.train
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    if rank == 0 and loop_config.get("ledger") is not None:
        ray.get(loop_config["ledger"].start_attempt.remote())
    device = ray.train.torch.get_device()
    attention = resolve_attention(spec.attention, device)
    # Ray leaves OMP_NUM_THREADS unset for fractional-CPU actors, so torch would start one thread
    # per core in every worker, and workers sharing a node slow each other down many times over.
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    tokenizer = Tokenizer(config.tokenizer)
    # one stream of every epoch, or one dataset per epoch
    names = loop_config.get("datasets") or [f"train_epoch_{e}" for e in range(spec.epochs)]
    # A fresh run reads its first dataset from the start: it starts streaming now, while the
    # model builds (a restarted or resumed one knows where to start only from its checkpoint).
    first = None
    if ray.train.get_checkpoint() is None:
        first_guard = Guard()
        first = train_batches(
            names[0], spec.batch_size, device=device, guard=first_guard, drop_last=spec.drop_last
        )
    packed = build_model(config, tokenizer, device, attention)
    parameters = parameter_counts(packed)
    fsdp = spec.parallelism == "fsdp" and dist.is_initialized()
    model = parallelize(packed, spec.parallelism)
    optimizer = build_optimizer(model, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(spec.schedule, spec.warmup_steps, spec.max_steps, spec.min_lr_ratio)
    )
    scaler = loss_scaler(spec.precision, device)
    state = restore(model, optimizer, scheduler, fsdp, scaler)
    reference = None
    if config.task == "dpo":  # the frozen reference: the policy's initial weights, once a worker
        reference = frozen_reference(build_model(config, tokenizer, device, attention), fsdp)
    objective = objective_for(config.task, reference, config.dpo.beta)
    seed_rank(config.seed, rank, state.steps)
    callbacks: list[Callback] = list(loop_config.get("callbacks") or ())
    where = LoopContext(
        rank, world_size, loop_config.get("run_name", "rayjobs"), len(state.resumes)
    )
    bf16 = use_bf16(spec.precision, device)
    seq_len = config.packing.seq_len
    series = TrainMetrics(loop_config.get("run_name", "rayjobs"), rank)
    # num_workers 0: Ray Train's local mode does not persist checkpoints; the loop does
    storage = None
    if spec.num_workers == 0:
        storage = driver_storage(spec.storage_path, loop_config.get("run_name", "rayjobs"))
    held_out = None  # this rank's share of the eval packs (pipeline.held_out), and its batches
    if loop_config.get("eval_batches") is not None:
        held_out = ray.train.get_dataset_shard(f"{EVAL_DATASET}{rank}")

    def evaluation() -> dict[str, float]:
        """Evaluate now: ``state.evals`` and the gauge get the result, a report its metrics."""
        result = evaluate(
            model,
            held_out,
            loop_config["eval_batches"],
            config.eval.batch_size or spec.batch_size,
            seq_len=seq_len,
            device=device,
            bf16=bf16,
            objective=objective,
        )
        entry = {"step": state.steps, "loss": result.loss, "rows": result.rows}
        entry["packs"] = loop_config["eval_packs"]  # of the eval set this evaluation ran over
        entry |= {"tokens": result.tokens, **(result.dpo or {})}
        state.evals.append(entry)
        series.evaluation(result.loss)
        return {"eval_loss": result.loss} | {
            f"eval/dpo/{k}": v for k, v in (result.dpo or {}).items()
        }

    clock = time.monotonic()  # of the last checkpoint, or this worker group's start
    for callback in callbacks:
        callback.on_train_begin(where, state)
    # max_steps reached: the stream may not have ended. Already at the start when the workers
    # restarted from a checkpoint of the last step (a failure after it): nothing left to train.
    stopped_early = spec.max_steps is not None and state.steps >= spec.max_steps
    began, step_ends, step_tokens = time.perf_counter(), [], []  # this worker's, for throughput
    for index, name in enumerate([] if stopped_early else names):
        if index < state.dataset_index:
            continue  # consumed before the checkpoint this run resumed from
        skip = state.rows_consumed if index == state.dataset_index else 0
        state.dataset_index, state.rows_consumed = index, skip
        if index == 0 and first is not None:
            batches, guard = first, first_guard
        else:
            guard = Guard()
            batches = train_batches(
                name, spec.batch_size, device=device, guard=guard, drop_last=spec.drop_last
            )
        # Resuming inside this dataset: its stream is read again from the start (Ray Data keeps no
        # iterator state), and each rank passes over the rows it had consumed by the checkpoint.
        for batch in _skip_rows(batches, skip):
            for callback in callbacks:
                callback.on_batch(where, state, batch, True)
        for group in _groups(batches, spec.grad_accum_steps):
            for batch in group:
                for callback in callbacks:
                    callback.on_batch(where, state, batch, False)
            result = train_step(
                model,
                optimizer,
                scheduler,
                group,
                fsdp=fsdp,
                bf16=bf16,
                spec=spec,
                objective=objective,
                scaler=scaler,
            )
            step_loss, trained, grad_norm = result.loss, result.tokens, result.grad_norm
            state.losses.append(step_loss)
            for name, value in (result.dpo or {}).items():
                state.series.setdefault(name, []).append(value)
            state.steps += 1
            state.rows += sum(len(b["input_ids"]) for b in group)
            step_tokens.append(sum(int(b["num_tokens"].sum()) for b in group))
            state.pack_tokens += step_tokens[-1]
            state.rows_consumed += sum(len(b["input_ids"]) for b in group)
            state.trained_tokens += trained
            series.step(step_loss, trained, result.dpo)
            due = checkpoint_due(spec, state, clock, device)
            evaluated = {}
            eval_every = config.eval.every_steps
            if held_out is not None and eval_every and state.steps % eval_every == 0:
                evaluated = evaluation()
            if state.steps % spec.report_every == 0 or due or evaluated:
                epoch = int(group[-1]["epoch"].max()) if "epoch" in group[-1] else index
                metrics = {
                    "step": state.steps,
                    "epoch": epoch,
                    "loss": step_loss,
                    "lr": result.lr,
                }
                if grad_norm is not None:
                    metrics["grad_norm"] = grad_norm
                metrics.update({f"dpo/{k}": v for k, v in (result.dpo or {}).items()})
                metrics.update(evaluated)
                if due:
                    save_checkpoint(
                        packed, model, optimizer, scheduler, state, tokenizer, fsdp, device,
                        metrics, storage, scaler,
                    )  # fmt: skip
                    clock = time.monotonic()
                    keep = spec.keep_checkpoints
                    if storage is not None and keep and len(state.checkpoints) > keep:
                        drop_checkpoint(storage, state.checkpoints[-keep - 1]["path"])
                else:
                    ray.train.report(metrics)
                series.paused()
                for callback in callbacks:
                    callback.on_report(where, state, metrics)
            for callback in callbacks:
                callback.on_step(where, state, result)
            step_ends.append(time.perf_counter())
            if spec.max_steps is not None and state.steps >= spec.max_steps:
                stopped_early = True
                break
        state.guard_dropped += guard.dropped
        if stopped_early:
            break
    if held_out is not None and (not state.evals or state.evals[-1]["step"] != state.steps):
        evaluation()  # the trained model's, once, unless its last step was just evaluated
    timed_tokens = sum(step_tokens[warmup_steps(len(step_ends)) :])
    totals = torch.tensor(
        [state.rows, state.pack_tokens, state.trained_tokens, state.guard_dropped, timed_tokens],
        device=device,
    )
    rows, pack_tokens, trained_tokens, guard_dropped, timed_tokens = (
        int(v) for v in all_reduce(totals)
    )
    losses = state.losses
    tenth = max(1, len(losses) // 10)
    summary = {
        "steps": state.steps,
        "steps_per_rank": all_gather_int(state.steps, device),
        "loss_first": _mean(losses[:tenth]),
        "loss_last": _mean(losses[-tenth:]),
        "tokens_trained": trained_tokens,
        "num_packs": rows,
        "packing_efficiency": pack_tokens / (rows * seq_len) if rows else 0.0,
        "guard_dropped_batches": guard_dropped,
        "stopped_early": stopped_early,
        "throughput": throughput(step_ends, timed_tokens, began) | step_clock(step_ends),
        "attention": packed.attention,
        "model": spec.model.kind,
        "precision": compute_dtype(spec, bf16),
        "param_dtype": spec.param_dtype,
        "parameters": parameters,
        "parallelism": spec.parallelism if dist.is_initialized() else "none",
        "lr_schedule": spec.schedule,
        "checkpoints": state.checkpoints,
        "resumes": state.resumes,
        "world_size": world_size,
        "task": config.task,
    }
    if state.series:  # DPO: the first and last tenth of the steps, as the loss
        summary["dpo"] = {"beta": config.dpo.beta}
        for name, values in state.series.items():
            if name != "triples":
                summary["dpo"][f"{name}_first"] = _mean(values[:tenth])
                summary["dpo"][name] = _mean(values[-tenth:])
        summary["dpo"]["triples"] = int(sum(state.series["triples"]))
    if spec.lora is not None:
        summary["lora"] = spec.lora.peft()
    if state.evals:
        summary["eval"] = {"loss": state.evals[-1]["loss"], "history": state.evals}
    for callback in callbacks:
        callback.on_train_end(where, state, summary)
    model_state = full_model_state(model) if fsdp else None
    with tempfile.TemporaryDirectory() as directory:
        merged = spec.lora is not None and spec.lora.save_merged
        save_model(packed, tokenizer, directory, model_state, write=rank == 0, merged=merged)
        if rank == 0:
            with open(os.path.join(directory, FINAL_SUMMARY), "w") as f:
                json.dump(summary, f)
        series.flush()  # before Ray Train ends this worker
        report(summary, directory if rank == 0 else None, None, storage)
