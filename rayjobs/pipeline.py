"""The job: config → tokenized samples (once) → mixed, packed rows per epoch → TorchTrainer.

Design note. ``tokenize`` is read → template → tokenize for every dataset through one Tokenize
actor pool; ``epochs.Epochs`` materializes it once and plans every epoch from sample lengths
(mixing, then streaming best-fit-decreasing packing), so epochs re-mix and re-pack without
re-tokenizing. The price is a barrier: an epoch's packs flow once tokenization is complete, which
for fine-tuning sets (up to millions of samples) is seconds to minutes on a cluster.

Resources: one Tokenize actor pool (1 CPU per actor), plan-join and assembly actors at 0.5 CPU,
trainers at ``train.cpus_per_worker``; an embedded local Ray declares max(4, 2 × cores) logical
CPUs so read tasks, the actor pools and the trainers fit at once (with only as many logical CPUs
as cores, the trainers starve the data operators and the job hangs: README, "Design").
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray
import ray.data

from rayjobs.config import Config, ConfigError
from rayjobs.epochs import Epochs
from rayjobs.metrics import Ledger, packing_efficiency
from rayjobs.sources import read_dataset
from rayjobs.tokenize import Tokenize, Tokenizer

TOKENIZE_BATCH_ROWS = 256


def init_ray(config: Config) -> None:
    """Connect to ``ray.address`` / ``$RAY_ADDRESS``, or start an embedded local Ray."""
    if ray.is_initialized():
        return
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    num_cpus = config.ray.num_cpus or max(4, 2 * (os.cpu_count() or 1))
    ray.init(num_cpus=num_cpus, log_to_driver=True)  # dashboard on: metrics, State API


def load_tokenizer(config: Config) -> Tokenizer:
    """The run's tokenizer; a tokenizer that cannot be loaded is a ``ConfigError``."""
    try:
        return Tokenizer(config.tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"tokenizer.path: cannot load a tokenizer from {config.tokenizer.path!r} ({error})"
        ) from None


def tokenize(config: Config, ledger: Any = None) -> ray.data.Dataset:
    """Every dataset read, templated and tokenized (lazy; ``Epochs`` materializes it)."""
    raw = [read_dataset(spec) for spec in config.datasets]
    rows = raw[0].union(*raw[1:]) if len(raw) > 1 else raw[0]
    return rows.map_batches(
        Tokenize,
        batch_size=TOKENIZE_BATCH_ROWS,
        batch_format="pyarrow",
        num_cpus=1,
        concurrency=(1, config.ray.tokenize_concurrency),
        fn_constructor_kwargs={
            "datasets": config.datasets,
            "tokenizer": config.tokenizer,
            "seq_len": config.packing.seq_len,
            "overflow": config.packing.overflow,
            "ledger": ledger,
        },
    )


@dataclass
class Job:
    """One run's data side, set up: its name, tokenizer, ``Ledger`` actor and epoch planner."""

    config: Config
    name: str
    tokenizer: Tokenizer
    ledger: Any
    epochs: Epochs

    def snapshot(self) -> dict[str, Any]:
        return ray.get(self.ledger.snapshot.remote())

    def mixes(self, num_epochs: int) -> list[dict[str, dict[str, float]]]:
        """The realized mix of each epoch (planned once per epoch, see ``Epochs``)."""
        return [self.epochs.realized_mix(epoch) for epoch in range(num_epochs)]

    def accounting(self, num_epochs: int) -> dict[str, Any]:
        """The data side's part of the run summary (README, "Run summary"): per-dataset
        tokenization counts with each dataset's mean share, the realized mix of every epoch, and
        pack totals over all epochs."""
        summary = accounting(self.snapshot())
        mixes = self.mixes(num_epochs)
        for name, stats in summary["datasets"].items():
            stats["share"] = sum(mix[name]["share"] for mix in mixes) / len(mixes)
        summary["mix"] = [{"epoch": epoch, "datasets": mix} for epoch, mix in enumerate(mixes)]
        summary["packed"]["max_delay_windows"] = self.epochs.max_delay_windows
        summary["packed"]["plan_seconds"] = self.epochs.plan_seconds
        return summary


def start_job(config: Config, prefix: str = "rayjobs") -> Job:
    """Set up a run's data side: load the tokenizer (a bad one fails before Ray starts), connect to
    or start Ray, create the run's ``Ledger`` and the epoch planner (which tokenizes once). ``run``,
    ``export`` and the bench all start here."""
    tokenizer = load_tokenizer(config)
    init_ray(config)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    ledger = Ledger.remote(name)
    epochs = Epochs(config, tokenize(config, ledger), tokenizer.pad_id, ledger)
    return Job(config, name, tokenizer, ledger, epochs)


def run(config: Config) -> dict[str, Any]:
    """Run the whole job and return the summary (see README, "Run summary")."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayjobs.train import train_loop

    job = start_job(config)
    num_epochs = config.train.epochs
    datasets = {f"train_epoch_{epoch}": job.epochs.packed(epoch) for epoch in range(num_epochs)}
    ray.get(job.ledger.add_mix.remote(job.mixes(num_epochs)))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": config.model_dump(),
            "vocab_size": job.tokenizer.vocab_size,
            "run_name": job.name,
        },
        scaling_config=ScalingConfig(
            num_workers=config.train.num_workers,
            use_gpu=config.train.use_gpu,
            resources_per_worker={"CPU": config.train.cpus_per_worker},
        ),
        datasets=datasets,
        run_config=RunConfig(
            name=job.name, storage_path=os.path.abspath(config.train.storage_path)
        ),
    )
    result = trainer.fit()
    summary = dict(result.metrics)
    summary["run_name"] = job.name
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    summary.update(job.accounting(num_epochs))
    return summary


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
