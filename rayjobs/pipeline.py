"""The job: config → tokenized samples (once) → a mixed, packed Ray dataset per epoch → TorchTrainer.

Design note. The data side has two phases.
1. ``tokenize``: read → template → tokenize for every dataset through one Tokenize actor pool,
   materialized once in the object store (spilled to disk when large) and reused by every epoch,
   so epochs re-mix and re-pack without re-tokenizing.
2. ``Epochs.packed(epoch)``: the driver pulls only (dataset, uid, length) of each sample, plans the
   epoch's mix with ``mix.plan_epoch`` (exact shares by samples or tokens, interleaved, seeded per
   epoch), cuts the plan into windows of ``packing.window`` samples, and Ray joins the plan to the
   samples (``ExpandPlan``), groups them by window and packs each window whole (``PackWindow``).
   Grouping gives every window a definite end, so no sample can be stranded in a packer actor, and
   window contents depend only on the plan, so the same seed gives the same packs.
The price is a barrier: packing of an epoch starts once tokenization is complete. For fine-tuning
sets (up to millions of samples) that is seconds to minutes on a cluster, and it buys exact mixes,
reproducible packs and tokenization once per run.

Resources: one Tokenize actor pool (1 CPU per actor), PackWindow actors at 0.5 CPU, trainers at
``train.cpus_per_worker``; an embedded local Ray declares max(4, 2 × cores) logical CPUs so read
tasks, the actor pools and the trainers fit at once (with only as many logical CPUs as cores, the
trainers starve the data operators and the job hangs: DESIGN.md, "CPU resources deadlock").
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data

from rayjobs.config import Config, ConfigError
from rayjobs.metrics import Ledger, packing_efficiency
from rayjobs.mix import plan_epoch
from rayjobs.pack import PackWindow
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
        raise ConfigError(f"tokenizer.path: cannot load a tokenizer from {config.tokenizer.path!r} "
                          f"({error})") from None


def tokenize(config: Config, ledger: Any = None) -> ray.data.Dataset:
    """Every dataset read, templated and tokenized (lazy; ``Epochs`` materializes it)."""
    raw = [read_dataset(spec) for spec in config.datasets]
    rows = raw[0].union(*raw[1:]) if len(raw) > 1 else raw[0]
    return rows.map_batches(
        Tokenize, batch_size=TOKENIZE_BATCH_ROWS, batch_format="pyarrow", num_cpus=1,
        concurrency=(1, config.ray.tokenize_concurrency),
        fn_constructor_kwargs={"datasets": config.datasets, "tokenizer": config.tokenizer,
                               "seq_len": config.packing.seq_len,
                               "overflow": config.packing.overflow, "ledger": ledger})


class ExpandPlan:
    """Ray Data ``map_batches`` function: each sample → one row per occurrence in the epoch plan,
    with its ``position`` in the epoch and its ``window``; samples not drawn disappear."""

    def __init__(self, plan: dict[str, np.ndarray], window: int):
        self.uids, self.positions, self.window = plan["uid"], plan["position"], window

    def __call__(self, batch: pa.Table) -> pa.Table:
        uids = batch.column("uid").to_numpy()
        starts = np.searchsorted(self.uids, uids, side="left")
        counts = np.searchsorted(self.uids, uids, side="right") - starts
        rows = np.repeat(np.arange(len(uids)), counts)
        occurrences = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(len(rows))
        positions = self.positions[occurrences]
        expanded = batch.take(pa.array(rows, type=pa.int64()))
        expanded = expanded.append_column("position", pa.array(positions, type=pa.int64()))
        return expanded.append_column("window", pa.array(positions // self.window, type=pa.int64()))


class Epochs:
    """The packed rows of each epoch, planned from one materialized tokenization."""

    def __init__(self, config: Config, ledger: Any = None):
        self.config = config
        self.ledger = ledger
        self.pad_id = load_tokenizer(config).pad_id
        self.tokenized = tokenize(config, ledger).materialize()
        catalog = {name: [] for name in ("source", "uid", "num_tokens")}
        for batch in self.tokenized.select_columns(list(catalog)).iter_batches(batch_format="numpy"):
            for name in catalog:
                catalog[name].append(batch[name])
        source, uid, num_tokens = (np.concatenate(catalog[n]) if catalog[n] else np.array([])
                                   for n in ("source", "uid", "num_tokens"))
        self.samples: list[tuple[np.ndarray, np.ndarray]] = []  # per dataset: (uids, lengths)
        for spec in config.datasets:
            mine = source == spec.name
            order = np.argsort(uid[mine], kind="stable")
            if not order.size:
                raise ConfigError(f"dataset {spec.name!r} has no samples after tokenization "
                                  f"(see skipped_rows and dropped_samples); it cannot be mixed")
            self.samples.append((uid[mine][order], num_tokens[mine][order].astype(np.int64)))

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index, sample index) of each occurrence, in epoch order."""
        mix = self.config.mix
        weights = [spec.weight for spec in self.config.datasets]
        return plan_epoch([lengths for _, lengths in self.samples],
                          None if weights[0] is None else weights, by=mix.by,
                          seed=self.config.seed, epoch=epoch, epoch_samples=mix.epoch_samples,
                          epoch_tokens=mix.epoch_tokens)

    def realized_mix(self, epoch: int) -> dict[str, dict[str, float]]:
        """Per dataset: samples, tokens and share (in ``mix.by`` units) of the epoch's plan."""
        dataset_ids, sample_ids = self.plan(epoch)
        tokens = np.concatenate([lengths for _, lengths in self.samples])
        offsets = np.cumsum([0] + [len(lengths) for _, lengths in self.samples])
        occurrence_tokens = tokens[offsets[dataset_ids] + sample_ids]
        realized = {}
        for index, spec in enumerate(self.config.datasets):
            mine = dataset_ids == index
            realized[spec.name] = {"samples": int(mine.sum()),
                                   "tokens": int(occurrence_tokens[mine].sum())}
        unit = "tokens" if self.config.mix.by == "tokens" else "samples"
        total = sum(r[unit] for r in realized.values()) or 1
        for stats in realized.values():
            stats["share"] = stats[unit] / total
        return realized

    def packed(self, epoch: int = 0) -> ray.data.Dataset:
        """The packed rows of one epoch as a lazy Ray dataset (data-contract columns)."""
        dataset_ids, sample_ids = self.plan(epoch)
        uids = np.concatenate([uids for uids, _ in self.samples])
        offsets = np.cumsum([0] + [len(u) for u, _ in self.samples])
        occurrence_uids = uids[offsets[dataset_ids] + sample_ids]
        order = np.argsort(occurrence_uids, kind="stable")
        plan = {"uid": occurrence_uids[order], "position": order.astype(np.int64)}
        packing = self.config.packing
        expanded = self.tokenized.map_batches(
            ExpandPlan, batch_format="pyarrow", num_cpus=0.5, concurrency=1,
            fn_constructor_kwargs={"plan": plan, "window": packing.window})
        return expanded.groupby("window").map_groups(
            PackWindow, batch_format="pyarrow", num_cpus=0.5, concurrency=1,
            fn_constructor_kwargs={"seq_len": packing.seq_len, "pad_id": self.pad_id,
                                   "strategy": packing.strategy, "seed": self.config.seed,
                                   "epoch": epoch, "ledger": self.ledger})


def build_epoch(config: Config, epoch: int = 0, ledger: Any = None) -> ray.data.Dataset:
    """The packed rows of one epoch (tokenizes first; use ``Epochs`` to share that work)."""
    return Epochs(config, ledger).packed(epoch)


def run(config: Config) -> dict[str, Any]:
    """Run the whole job and return the summary (see README, "Run summary")."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayjobs.train import train_loop

    vocab_size = load_tokenizer(config).vocab_size  # fail on a bad tokenizer before Ray starts
    init_ray(config)
    run_name = f"rayjobs-{uuid.uuid4().hex[:8]}"
    ledger = Ledger.remote(run_name)
    epochs = Epochs(config, ledger)
    datasets = {f"train_epoch_{epoch}": epochs.packed(epoch) for epoch in range(config.train.epochs)}
    mixes = [epochs.realized_mix(epoch) for epoch in range(config.train.epochs)]
    ray.get(ledger.add_mix.remote(mixes))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": config.model_dump(), "vocab_size": vocab_size},
        scaling_config=ScalingConfig(num_workers=config.train.num_workers,
                                     use_gpu=config.train.use_gpu,
                                     resources_per_worker={"CPU": config.train.cpus_per_worker}),
        datasets=datasets,
        run_config=RunConfig(name=run_name,
                             storage_path=os.path.abspath(config.train.storage_path)),
    )
    result = trainer.fit()
    summary = dict(result.metrics)
    summary["run_name"] = run_name
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    summary.update(accounting(ray.get(ledger.snapshot.remote())))
    for name, stats in summary["datasets"].items():
        stats["share"] = sum(mix[name]["share"] for mix in mixes) / len(mixes)
    summary["mix"] = [{"epoch": epoch, "datasets": mix} for epoch, mix in enumerate(mixes)]
    return summary


def accounting(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Per-dataset totals over all epochs from a ``Ledger`` snapshot."""
    keys = ("samples", "tokens", "trained_tokens", "truncated_tokens", "dropped_samples",
            "split_samples", "skipped_rows")
    datasets: dict[str, dict[str, Any]] = {}
    for per_dataset in snapshot["tokenize"].values():
        for name, counts in per_dataset.items():
            total = datasets.setdefault(name, {key: 0 for key in keys} | {"skipped_examples": []})
            for key in keys:
                total[key] += counts[key]
            total["skipped_examples"] = (total["skipped_examples"] + counts["skipped_examples"])[:5]
    pack = snapshot["pack"].values()
    num_tokens = sum(c["num_tokens"] for c in pack)
    num_slots = sum(c["num_slots"] for c in pack)
    return {"datasets": datasets,
            "packed": {"num_packs": sum(c["num_packs"] for c in pack), "num_tokens": num_tokens,
                       "efficiency": packing_efficiency(num_tokens, num_slots)}}
