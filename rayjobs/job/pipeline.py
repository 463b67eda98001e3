"""The job: config → packed rows (streamed, or planned per epoch) → TorchTrainer → summary.

Design note. Two data paths share the reader, the Tokenize actors, the packer and the row
assembly. ``packing.mode: stream`` (default, ``stream.py``) is one lazy dataset for every epoch:
training starts as soon as the first window is packed, memory is set by window and block sizes,
and every stage scales with the cluster. ``packing.mode: planned`` (``epochs.py``) tokenizes
everything once, then plans each epoch's mix and packs in the driver from sample lengths: exact
shares and the same packs for the same seed, after a barrier as long as the tokenization.

Resources: a Tokenize actor pool (1 CPU per actor), packing actors at 0.5 CPU, trainers at
``train.cpus_per_worker``; an embedded local Ray declares max(4, 2 × cores) logical CPUs so read
tasks, the actor pools and the trainers fit at once (with only as many logical CPUs as cores, the
trainers starve the data operators and the job hangs: docs/training.md, "Resources and CPU vs GPU").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.data
import ray.train

from rayjobs.config import Config, MixConfig
from rayjobs.data import backends, checks, estimate, placement, stream
from rayjobs.data.counts import check_accounting, packing_efficiency, report, unpacked
from rayjobs.data.mix import with_shares
from rayjobs.data.planned import Epochs
from rayjobs.data.sources import read_dataset
from rayjobs.data.tally import Tally
from rayjobs.data.tokenizer import Tokenizer, load_fast
from rayjobs.errors import AccountingError, ConfigError, Interrupted, RunFailed, user_error
from rayjobs.job import claim
from rayjobs.job.connect import init_ray
from rayjobs.job.ledger import start_ledger
from rayjobs.job.monitor import DataMonitor
from rayjobs.job.runs import resume_name, storage_folder
from rayjobs.train import trackers
from rayjobs.train.callbacks import Callback
from rayjobs.train.names import EVAL_DATASET
from rayjobs.train.progress import Progress, planned_steps

logger = logging.getLogger("rayjobs.data")


def load_tokenizer(config: Config) -> Tokenizer:
    """The run's tokenizer; a tokenizer that cannot be loaded, or ``tokenizer.backend:
    fastokens`` where fastokens cannot load it, is a ``ConfigError``."""
    try:
        tokenizer = Tokenizer(config.tokenizer)
    except ConfigError:  # a setting the tokenizer refused (eos_token, add_bos) names itself
        raise
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception on a corrupt file
        if not isinstance(error, OSError | ValueError) and type(error) is not Exception:
            raise
        raise ConfigError(
            f"tokenizer.path: cannot load a tokenizer from {config.tokenizer.path!r} ({error})"
        ) from None
    if config.tokenizer.backend == "fastokens":
        _, problem = load_fast(tokenizer.backend)  # refused here, before Ray starts
        if problem:
            raise backends.refusal(problem)
    return tokenizer


def tokenize(config: Config, ledger: Any = None) -> ray.data.Dataset:
    """Every dataset read, templated and tokenized once (lazy; ``Epochs`` materializes it)."""
    where = placement.on_data_nodes(config)  # planned mode's reads keep to the data nodes too
    raw = [read_dataset(spec, **where) for spec in config.datasets]
    rows = raw[0].union(*raw[1:]) if len(raw) > 1 else raw[0]
    return stream.tokenized(rows, config, ledger)


@dataclass
class Job:
    """One run's data side, set up: its name, tokenizer, ``Ledger`` actor and packed rows."""

    config: Config
    name: str
    tokenizer: Tokenizer
    ledger: Any
    epochs: Epochs | None = None
    """planned mode: the epoch planner."""
    rows: ray.data.Dataset | None = None
    """stream mode: the packed rows of every epoch, one lazy dataset (column ``epoch``)."""

    held_out: HeldOut | None = None
    """The packed ``eval.datasets`` (``held_out``), once set up."""
    unused_columns: dict[str, list[str]] = field(default_factory=dict)
    """Each dataset's columns its template does not read (``estimate.columns``)."""
    monitor: DataMonitor | None = None
    """The data side's progress lines (``rayjobs.job.monitor``), stopped by ``close``."""
    encoder: backends.Choice | None = None
    """The encoder ``tokenizer.backend`` came to (``backends.choose``) and why: the summary's
    ``tokenizer``."""

    @property
    def local(self) -> bool:
        """Whether the local runner (``data.local``) packs this job's rows: its ledger is a
        ``Tally`` in this process, not a ``Ledger`` actor."""
        return isinstance(self.ledger, Tally)

    def snapshot(self) -> dict[str, Any]:
        return report(self.ledger, "snapshot")

    def close(self) -> None:
        """End the run's ``Ledger`` actors once their counts are read: a driver that outlives its
        jobs (a notebook, a service, a test session) would otherwise keep them, one per job."""
        if self.monitor is not None:
            self.monitor.stop()  # its last line, while the ledger still answers
        if not self.local:  # the local runner's counts live in this process
            ray.kill(self.ledger)
        if self.held_out is not None:
            ray.kill(self.held_out.ledger)

    def train_datasets(self) -> dict[str, ray.data.Dataset]:
        """What the trainer consumes, in order: one stream, or one dataset per epoch."""
        if self.rows is not None:
            return {"train": self.rows}
        return {f"train_epoch_{e}": self.epochs.packed(e) for e in range(self.config.train.epochs)}

    def mixes(self, snapshot: dict[str, Any]) -> list[dict[str, dict[str, float]]]:
        """The realized mix of each epoch: per dataset, samples, tokens and share (in ``mix.by``
        units) of what the pack stage packed."""
        mixes = []
        for epoch in sorted(snapshot["pack"]):
            counts = snapshot["pack"][epoch]
            mix = {
                spec.name: {
                    "samples": counts["documents_by_source"].get(spec.name, 0),
                    "tokens": counts["tokens_by_source"].get(spec.name, 0),
                }
                for spec in self.config.datasets
            }
            mixes.append(with_shares(mix, self.config.mix.by))
        return mixes

    def accounting(self, complete: bool = True) -> dict[str, Any]:
        """The data side's part of the run summary (docs/cli.md, "Run summary"): per-dataset
        tokenization counts with each dataset's mean share, the realized mix of every epoch, and
        pack totals over all epochs. Raises ``AccountingError`` when the counts do not add up.
        ``complete``: False when training stopped before the stream ended (``max_steps``); the
        samples tokenized but not packed by then are each dataset's ``unpacked_*``."""
        snapshot = self.snapshot()
        streamed = self.epochs is None  # stream mode, or the local runner
        problems = check_accounting(snapshot, streamed=streamed, complete=complete)
        if problems:
            raise AccountingError("the run's counts do not add up: " + "; ".join(problems))
        summary = accounting(snapshot)
        if streamed:
            for name, left in unpacked(snapshot).items():
                summary["datasets"][name]["unpacked_samples"] = left["samples"]
                summary["datasets"][name]["unpacked_tokens"] = left["tokens"]
        mixes = self.mixes(snapshot)
        for name, stats in summary["datasets"].items():
            stats["share"] = sum(mix[name]["share"] for mix in mixes) / max(1, len(mixes))
        summary["mix"] = [{"epoch": epoch, "datasets": mix} for epoch, mix in enumerate(mixes)]
        summary["actors"] = snapshot["actors"]
        if self.encoder is not None:
            summary["tokenizer"] = self.encoder.summary()
        summary["repeated_reports"] = snapshot["repeated_reports"]
        if self.epochs is not None:
            summary["packed"]["max_delay_windows"] = self.epochs.max_delay_windows
            summary["packed"]["plan_seconds"] = self.epochs.plan_seconds
        checks.require_training(summary["datasets"])
        for name, unused in self.unused_columns.items():
            if name in summary["datasets"]:
                summary["datasets"][name]["unused_columns"] = unused
        summary["warnings"] = [
            checks.unused_message(spec, self.unused_columns[spec.name])
            for spec in self.config.datasets
            if self.unused_columns.get(spec.name)
        ]
        if self.encoder is not None and self.encoder.warning:
            summary["warnings"].append(self.encoder.warning)  # warned of once, at start-up
        # (an epoch cut short by max_steps holds what was packed by then, in no set shares)
        for warning in checks.share_warnings(self.config, mixes if complete else mixes[:-1]):
            checks.logger.warning(warning)
            summary["warnings"].append(warning)
        for warning in checks.lost_warnings(self.config, summary["datasets"]):
            checks.logger.warning("in all rows read: %s", warning)
            summary["warnings"].append(warning)
        return summary


@dataclass
class HeldOut:
    """``eval.datasets``, read, tokenized and packed once: what every evaluation runs over."""

    ledger: Any
    """Their own ``Ledger`` (run ``<run>-eval``): their counts are not the training data's."""
    datasets: dict[str, ray.data.Dataset]
    """Each rank's share of the packs (``train.EVAL_DATASET`` + rank), materialized: consecutive
    slices of the packs, their sizes differing by at most one row."""
    batches: int
    """Forwards per rank per evaluation: the largest share's batches."""
    num_packs: int

    def summary(self, evals: list[dict[str, Any]]) -> dict[str, Any]:
        """The summary's ``eval`` counts: per-dataset tokenization and the packs. Raises
        ``AccountingError`` when the counts do not add up, or an evaluation did not see every
        pack exactly once."""
        return eval_accounting(
            self.ledger,
            [  # each against its own set: a resumed run's may predate a changed config
                f"the evaluation at step {e['step']} saw {e['rows']} of {e['packs']} eval packs"
                for e in evals
                if e["rows"] != e["packs"]
            ],
        )


def eval_accounting(ledger: Any, problems: list[str] | None = None) -> dict[str, Any]:
    """The eval sets' counts (``datasets``, ``packed``) from their ledger, every pack made.
    Raises ``AccountingError`` when they, or ``problems`` found by the caller, do not add up."""
    snapshot = report(ledger, "snapshot")
    problems = check_accounting(snapshot, streamed=True, complete=True) + (problems or [])
    if problems:
        raise AccountingError("the evaluation's counts do not add up: " + "; ".join(problems))
    return accounting(snapshot)


def eval_config(config: Config) -> Config:
    """The config that reads ``eval.datasets``: each dataset whole, once (one epoch, no mix, no
    warm-up lane: the packs are made before training starts)."""
    return config.model_copy(
        update={
            "datasets": config.eval.datasets,
            "mix": MixConfig(),
            "packing": config.packing.model_copy(update={"mode": "stream", "warmup_tokens": 0}),
            "train": config.train.model_copy(update={"epochs": 1}),
        }
    )


def eval_rows(config: Config, job: Job) -> tuple[ray.data.Dataset, Any]:
    """``eval.datasets`` packed (lazy: read, tokenized and packed when consumed) and their own
    ``Ledger`` (run ``<run>-eval``: their counts are not the training data's), which the caller
    ends. ``held_out`` trains with them; ``export`` and ``inspect`` write and report them."""
    names = [spec.name for spec in config.eval.datasets]
    config = backends.decided(config, job.config.tokenizer.backend)  # as the job's: decided once
    ledger = start_ledger(f"{job.name}-eval", names)
    try:
        rows = stream.packed_rows(eval_config(config), job.tokenizer.pad_id, ledger)
        rows.set_name(f"{job.name}.eval")  # the dashboard's Ray Data Overview shows it
        return rows, ledger
    except BaseException:
        ray.kill(ledger)
        raise


def held_out(config: Config, job: Job) -> HeldOut | None:
    """Pack ``eval.datasets`` once (None without them) and cut the packs into one share per
    rank. Materialized before training: every evaluation reads them again, and a lazy stream
    would re-read, re-tokenize and re-count them each time; an eval set is meant to be small."""
    if not config.eval.datasets:
        return None
    names = [spec.name for spec in config.eval.datasets]
    rows, ledger = eval_rows(config, job)
    try:
        rows = rows.materialize()
        num_packs = rows.count()
        if num_packs == 0:
            raise AccountingError(f"eval.datasets {names}: no sample left to evaluate on")
    except BaseException:
        ray.kill(ledger)  # the run fails here: nothing will read or close it
        raise
    workers = max(1, config.train.num_workers)
    cuts = [num_packs * rank // workers for rank in range(1, workers)]
    shares = rows.split_at_indices(cuts) if cuts else [rows]
    batch_size = config.eval.batch_size or config.train.batch_size
    batches = math.ceil(math.ceil(num_packs / workers) / batch_size)
    datasets = {f"{EVAL_DATASET}{rank}": share for rank, share in enumerate(shares)}
    return HeldOut(ledger, datasets, batches, num_packs)


def start_job(
    config: Config,
    prefix: str = "rayjobs",
    name: str | None = None,
    tokenizer: Tokenizer | None = None,
    local: bool = False,
) -> Job:
    """Set up a run's data side: load the tokenizer (a bad one fails before Ray starts; ``run``
    passes the one it loaded to check the model's config), connect to or start Ray, create the
    run's ``Ledger`` and the packed rows (lazy in stream mode; planned mode tokenizes once here).
    ``run``, ``export`` and the benches all start here.
    ``name``: the run's name (default ``<prefix>-<8 hex digits>``; a resumed run keeps its own).
    ``local``: for the local runner (``data.local``), which packs the rows as its caller reads
    them: no Ray, and a ``Tally`` in this process for the ledger."""
    tokenizer = tokenizer or load_tokenizer(config)
    if not local:
        init_ray(config)
    unused = estimate.columns(config)  # a column that changes what a row means: refused here
    # tokenizer.backend decided once, here: the Tokenize actors get the config that names it
    config, encoder = backends.choose(config, tokenizer)
    name = name or f"{prefix}-{uuid.uuid4().hex[:8]}"
    if local:
        return Job(config, name, tokenizer, Tally(), unused_columns=unused, encoder=encoder)
    rereads = config.packing.mode == "stream"  # a restarted worker group reads it again
    ledger = start_ledger(name, [spec.name for spec in config.datasets], rereads, config.mix.by)
    monitor = DataMonitor(ledger, config.mix.by)
    try:
        if config.packing.mode == "planned":
            logger.info("data: planned mode: tokenizing every dataset once, then each epoch's plan")
            monitor.start()
            epochs = Epochs(config, tokenize(config, ledger), tokenizer.pad_id, ledger, name)
            job = Job(config, name, tokenizer, ledger, epochs=epochs, unused_columns=unused)
            job.monitor, job.encoder = monitor, encoder
            checks.require_training(job.snapshot()["tokenize"])  # every sample is tokenized
            return job
        rows = stream.packed_rows(config, tokenizer.pad_id, ledger)
        rows.set_name(f"{name}.train")  # the dashboard's Ray Data Overview shows it
    except BaseException:
        monitor.stop()
        ray.kill(ledger)  # nothing will read or close it
        raise
    monitor.start()
    return Job(
        config, name, tokenizer, ledger, rows=rows, unused_columns=unused, monitor=monitor,
        encoder=encoder,
    )  # fmt: skip


def run(
    config: Config, resume: str | None = None, callbacks: Sequence[Callback] = ()
) -> dict[str, Any]:
    """Run the whole job and return the summary (docs/cli.md, "Run summary").

    ``resume``: a run name under ``train.storage_path`` (or ``latest``): the run continues from
    its latest periodic checkpoint (docs/resume.md) under the same name.
    ``callbacks``: hooks into every train worker's loop (``rayjobs.train.callbacks``)."""
    from rayjobs.train.build import check_model_config

    tokenizer = load_tokenizer(config)
    check_model_config(config, tokenizer)  # before Ray and the data start
    trackers.check(config.train.report_to, config.train.storage_path)
    name = resume_name(config, resume) if resume else f"rayjobs-{uuid.uuid4().hex[:8]}"
    folder = f"{storage_folder(config.train.storage_path)}/{name}"
    with claim.take(folder, f"run {name} ({folder})", " or start a new run"):
        return _run(config, name, tokenizer, callbacks)


def _run(config: Config, name: str, tokenizer: Tokenizer, callbacks: Sequence[Callback]) -> dict:
    """``run`` once its run folder is claimed (``claim``: no other run writes there)."""
    job = start_job(config, name=name, tokenizer=tokenizer)
    try:
        return _train(config, job, callbacks)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (the command line's Interrupted)
        raise Interrupted.of(interrupt, _stopped(config, job.name)) from None
    except ray.train.TrainingFailedError as error:
        if user_error(error) is not None:
            raise
        limit = config.train.max_failures
        raise RunFailed(
            f"training failed ({_failure(error)}), after {job.snapshot()['attempts']} worker "
            f"group(s) (train.max_failures: {limit}); {_stopped(config, job.name)}"
        ) from error
    finally:
        job.close()


def _failure(error: BaseException) -> str:
    """A failed run's reason in a line: each failed worker's exception, first line only."""
    failures = getattr(error, "worker_failures", None) or {}
    if not failures:
        failures = {None: getattr(error, "controller_failure", error)}
    reasons = []
    for rank, failure in sorted(failures.items(), key=lambda item: str(item[0])):
        cause = getattr(failure, "cause", None) or failure
        text = str(cause).strip().splitlines()
        reason = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
        reasons.append(reason if rank is None else f"rank {rank}: {reason}")
    return "; ".join(reasons)


def _stopped(config: Config, name: str) -> str:
    """Where an interrupted run left its checkpoints, and how to continue it."""
    where = f"{storage_folder(config.train.storage_path)}/{name}"
    if config.train.num_workers == 0:
        return f"run {name} stopped; its checkpoints so far are under {where}"
    return (
        f"run {name} stopped; its checkpoints so far are under {where} (continue it with "
        f"`rayjobs run CONFIG --resume {name}`, from a periodic checkpoint)"
    )


def _trainer_class() -> type:
    """``TorchTrainer``, less its Ctrl-C handler: Ray Train's aborts the run, then exits the
    driver with status 0 (``sys.exit(0)`` from the handler), so a stopped run looked finished.
    Ctrl-C stays the caller's ``KeyboardInterrupt``, after which ``abort`` stops the run."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        controller = None

        def _register_sigint_handler(self, controller: Any) -> None:
            self.controller = controller

        def abort(self) -> None:
            """Stop the run's workers (best effort: the driver is going away)."""
            if self.controller is not None:
                with contextlib.suppress(Exception):
                    ray.get(self.controller.abort.remote(), timeout=30)

    return Trainer


def _train(config: Config, job: Job, callbacks: Sequence[Callback]) -> dict[str, Any]:
    """``run`` once its job is set up: train on its datasets, then the summary."""
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig

    from rayjobs.job.retries import NoRetryOnUserError
    from rayjobs.train.loop import train_loop

    datasets = job.train_datasets()
    job.held_out = held_out(config, job)
    callbacks = [*builtin_callbacks(config, job), *callbacks]
    evaluation = job.held_out.datasets if job.held_out else {}
    keep = config.train.keep_checkpoints
    trainer = _trainer_class()(
        train_loop,
        train_loop_config={
            # the validated config itself: validating it again in a worker would refuse a
            # template of template_modules, which the workers do not import
            "config": config,
            "vocab_size": job.tokenizer.vocab_size,
            "run_name": job.name,
            "datasets": list(datasets),
            "eval_batches": job.held_out.batches if job.held_out else None,
            "eval_packs": job.held_out.num_packs if job.held_out else None,
            "ledger": job.ledger,  # rank 0 counts the worker groups started (attempts)
            "callbacks": list(callbacks),
        },
        scaling_config=ScalingConfig(
            num_workers=config.train.num_workers,
            use_gpu=config.train.use_gpu,
            resources_per_worker={
                **config.train.resources_per_worker,
                "CPU": config.train.cpus_per_worker,
            },
            label_selector=config.train.label_selector or None,
        ),
        datasets={**datasets, **evaluation},
        # the training data split over the ranks; each rank reads its own eval share whole
        dataset_config=DataConfig(datasets_to_split=list(datasets)),
        run_config=RunConfig(
            name=job.name,
            storage_path=storage_folder(config.train.storage_path),
            failure_config=FailureConfig(max_failures=config.train.max_failures),
            callbacks=[NoRetryOnUserError()],  # a bad row would only fail again
            # the most recent N periodic checkpoints and the final one (reported last)
            checkpoint_config=CheckpointConfig(num_to_keep=keep + 1 if keep else None),
        ),
    )
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        trainer.abort()
        raise
    summary = dict(result.metrics)
    summary["run_name"] = job.name
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    if keep and config.train.num_workers == 0:  # the loop in the driver deleted the others
        summary["checkpoints"] = summary["checkpoints"][-keep:]
    elif keep:  # the periodic checkpoints Ray Train kept (listed by the workers as they saved)
        kept = {os.path.basename(c.path) for c, _ in result.best_checkpoints}
        summary["checkpoints"] = [
            c
            for c in summary["checkpoints"]
            if c["path"] is None or os.path.basename(c["path"]) in kept
        ]
    summary.update(job.accounting(complete=not summary["stopped_early"]))
    summary["attempts"] = job.snapshot()["attempts"]
    if job.held_out is not None:
        summary["eval"].update(job.held_out.summary(summary["eval"]["history"]))
    summary["untrained_packs"] = untrained_packs(config, summary, len(datasets))
    ray.get(job.ledger.add_mix.remote([m["datasets"] for m in summary["mix"]]))  # final gauges
    # Final values are exported before the job exits: the ledger dies with the driver, and the
    # train workers fit() just killed may still be exiting. Waits one metrics report interval
    # (``metrics.export_interval``) plus a margin after the last update (docs/metrics.md).
    ray.get(job.ledger.flush.remote())
    return summary


def builtin_callbacks(config: Config, job: Job) -> list[Callback]:
    """The run's own callbacks: ``Progress`` when its lines are shown (INFO enabled for the
    ``rayjobs.train`` logger, as ``rayjobs run`` does unless ``--quiet``) or trackers are on
    (``train.report_to``), writing into the run's folder."""
    spec = config.train
    show = logging.getLogger("rayjobs.train").isEnabledFor(logging.INFO)
    if not show and not spec.report_to:
        return []
    total = spec.max_steps
    if job.epochs is not None:  # every epoch's packs are planned by now
        packs = [job.epochs.num_packs[e] for e in range(spec.epochs)]
        total = planned_steps(packs, spec.num_workers, spec)
    chosen = None
    if spec.report_to:
        folder = os.path.join(storage_folder(spec.storage_path), job.name)
        chosen = trackers.Trackers(spec.report_to, folder, config.model_dump(), job.ledger)
    dtype = f"params {spec.param_dtype}"
    if spec.param_dtype == "fp32" and spec.precision in ("bf16", "fp16"):
        dtype += f", {spec.precision} autocast"
    return [
        Progress(spec.report_every, total, spec.epochs, show=show, trackers=chosen, dtype=dtype)
    ]


def untrained_packs(config: Config, summary: dict[str, Any], num_datasets: int) -> int | None:
    """Packs the pipeline produced that no rank trained on; None where that count means nothing
    (``stopped_early``: the stream ran ahead; a resumed run, or workers restarted with or without
    a checkpoint (``attempts`` > 1): its data was read again). Raises
    ``AccountingError`` beyond what the equal split may leave over: fewer than ``num_workers``
    rows of each dataset (with ``train.drop_last``, fewer than ``num_workers × batch_size``).
    No bound once the guard dropped a batch: a rank stops at the first batch another lacks, so
    what it held after that is not counted (``guard_dropped_batches`` says it happened)."""
    if summary["stopped_early"] or summary["resumes"] or summary.get("attempts", 1) > 1:
        return None
    spec = config.train
    untrained = summary["packed"]["num_packs"] - summary["num_packs"]
    workers = max(1, spec.num_workers)
    bound = num_datasets * (workers * (spec.batch_size if spec.drop_last else 1) - 1)
    if summary["guard_dropped_batches"]:
        bound = summary["packed"]["num_packs"]
    if not 0 <= untrained <= bound:
        raise AccountingError(
            f"the run's counts do not add up: {summary['packed']['num_packs']} packs made, "
            f"{summary['num_packs']} trained; at most {bound} may be left untrained"
        )
    return untrained


def accounting(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Per-dataset tokenization counts and pack totals over all epochs from a ``Ledger``
    snapshot."""
    timers = ("seconds", "cpu_seconds")
    datasets = {
        name: {key: value for key, value in counts.items() if key not in timers}
        for name, counts in snapshot["tokenize"].items()
    }
    pack = snapshot["pack"].values()
    num_tokens = sum(c["num_tokens"] for c in pack)
    num_slots = sum(c["num_slots"] for c in pack)
    return {
        "datasets": datasets,
        "packed": {
            "num_packs": sum(c["num_packs"] for c in pack),
            "num_tokens": num_tokens,
            "efficiency": packing_efficiency(num_tokens, num_slots),
        },
    }
