"""Epochs: from one materialized tokenization, the packed rows of each epoch as a Ray dataset.

Design note. Mixing and packing decisions need only each sample's length, so the driver makes them
for a whole epoch, and Ray moves the tokens:

1. The tokenized samples (``pipeline.tokenize``) are materialized once; the driver pulls only
   (dataset, uid, length) of each sample.
2. ``mix.plan_epoch`` decides which samples make the epoch and in what interleaved order.
3. ``pack.StreamPacker`` packs that order window by window (``packing.window`` samples), carrying
   under-filled packs into the next window (at most ``max_delay`` windows) and flushing at the
   end: the driver knows where the stream ends, which a ``map_batches`` actor never does, so no
   sample can be stranded, and the efficiency matches global best-fit decreasing (bench).
4. Ray joins the plan to the samples (``ExpandPlan``: sample → its occurrences, each with its
   pack, slot and emission group) and assembles each group's rows (``AssemblePacks``, one
   ``map_groups`` call per emitted window). Rows depend only on the plan: same seed, same packs.

Planning costs O(samples) of driver memory and time; assembly is vectorized numpy
(``rows.assemble``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from rayjobs.config import Config
from rayjobs.data import seeds
from rayjobs.data.counts import PackCounts, StageTimer, batch_key, report
from rayjobs.data.mix import plan_epoch
from rayjobs.data.pack import StreamPacker
from rayjobs.data.packer import pack_counts
from rayjobs.data.placement import on_data_nodes
from rayjobs.data.rows import assemble, ranges
from rayjobs.data.samples import flat_samples
from rayjobs.errors import ConfigError

PACK_STAGE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}
"""Environment of the pack-stage actors: glibc keeps freed memory for the next call. Its default
returns every large array to the kernel on free, so each call page-faults its row-size arrays
again, which made assembly several times slower per call (docs/benchmarks.md; ``rayjobs bench
packing`` prints the stage timers). The heap stays at the largest group's working set."""


class ExpandPlan:
    """Ray Data ``map_batches`` class: each sample → one row per occurrence in the epoch plan,
    with that occurrence's ``pack``, ``slot`` (place inside the pack) and ``group``."""

    def __init__(self, plan: dict[str, np.ndarray], epoch: int = 0, ledger: Any = None):
        self.plan, self.epoch, self.ledger = plan, epoch, ledger  # plan: sorted by uid

    def __call__(self, batch: pa.Table) -> pa.Table:
        with StageTimer() as timer:
            expanded = self._expand(batch)
        # the join is part of the pack stage's time
        report(
            self.ledger,
            "add_pack",
            self.epoch,
            PackCounts(seconds=timer.seconds, cpu_seconds=timer.cpu_seconds),
            batch_key("expand", [self.epoch], batch.column("uid")),
        )
        return expanded

    def _expand(self, batch: pa.Table) -> pa.Table:
        uids = batch.column("uid").to_numpy()
        starts = np.searchsorted(self.plan["uid"], uids, side="left")
        counts = np.searchsorted(self.plan["uid"], uids, side="right") - starts
        rows = np.repeat(np.arange(len(uids)), counts)
        offsets = ranges(starts, counts)  # each sample's occurrences in the plan
        if (counts == 1).all():  # every sample once (no weights): no token is copied
            expanded = batch
        elif (counts <= 1).all():
            expanded = batch.filter(pa.array(counts == 1))
        else:
            expanded = batch.take(pa.array(rows, type=pa.int64()))
        for name in ("pack", "slot", "group"):
            expanded = expanded.append_column(name, pa.array(self.plan[name][offsets]))
        return expanded


class AssemblePacks:
    """Ray Data ``map_groups`` class: the samples of one emission group → their packed rows."""

    def __init__(self, seq_len: int, pad_id: int, epoch: int = 0, ledger: Any = None):
        self.seq_len, self.pad_id, self.epoch, self.ledger = seq_len, pad_id, epoch, ledger

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        with StageTimer() as timer:
            rows = self._assemble(batch)
        counts = pack_counts(batch, rows, self.seq_len, timer)
        # One call is one emission group (map_groups): its number names the batch, so a group
        # Ray runs again, or an epoch's dataset consumed twice, is counted once.
        key = batch_key("assemble", [self.epoch], pc.unique(batch.column("group")))
        report(self.ledger, "add_pack", self.epoch, counts, key, rows["num_documents"].tolist())
        return rows

    def _assemble(self, batch: pa.Table) -> dict[str, np.ndarray]:
        order = np.lexsort((batch.column("slot").to_numpy(), batch.column("pack").to_numpy()))
        packs = batch.column("pack").to_numpy()[order]
        documents_per_row = np.diff(np.flatnonzero(np.diff(packs, prepend=-1, append=-1)))
        lengths = batch.column("num_tokens").to_numpy().astype(np.int64)[order]
        tokens, labels, starts = flat_samples(batch)
        return assemble(
            tokens, labels, starts[order], lengths, documents_per_row, self.seq_len, self.pad_id
        )


class Epochs:
    """The packed rows of each epoch, planned in the driver from one materialized tokenization."""

    def __init__(
        self,
        config: Config,
        tokenized: ray.data.Dataset,
        pad_id: int,
        ledger: Any = None,
        run: str = "rayjobs",
    ):
        """``run``: the run's name, which names its datasets on the Ray dashboard
        (``<run>.tokenize``, ``<run>.train.epoch-<e>``; no ``/``: Ray Data names a log file
        after a dataset)."""
        self.config, self.ledger, self.pad_id, self.run = config, ledger, pad_id, run
        tokenized.set_name(f"{run}.tokenize")
        self.tokenized = tokenized.materialize()
        columns = self.tokenized.select_columns(["source", "uid", "num_tokens"]).to_arrow_refs()
        table = pa.concat_tables(ray.get(columns)) if columns else None
        if table is not None and pc.count_distinct(table["uid"]).as_py() != table.num_rows:
            raise ValueError(
                "two samples share a uid (the same dataset, file and row read twice?); "
                "the epoch plan could not tell them apart"
            )
        self.samples: list[tuple[np.ndarray, np.ndarray]] = []  # per dataset: (uids, lengths)
        for spec in config.datasets:
            mine = table.filter(pc.equal(table["source"], spec.name)) if table else None
            if mine is None or not mine.num_rows:
                raise ConfigError(
                    f"dataset {spec.name!r} has no samples after tokenization "
                    f"(see skipped_rows and dropped_samples); it cannot be mixed"
                )
            mine = mine.sort_by("uid")
            self.samples.append(
                (mine["uid"].to_numpy(), mine["num_tokens"].to_numpy().astype(np.int64))
            )
        self.plan_seconds = self.plan_cpu_seconds = 0.0
        self.max_delay_windows = 0
        self.num_packs: dict[int, int] = {}
        """Each planned epoch's packs."""
        self._occurrence_cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index, sample index) of each occurrence, in epoch order."""
        weights = [spec.weight for spec in self.config.datasets]
        mix = self.config.mix
        return plan_epoch(
            [lengths for _, lengths in self.samples],
            None if weights[0] is None else weights,
            by=mix.by,
            seed=self.config.seed,
            epoch=epoch,
            epoch_samples=mix.epoch_samples,
            epoch_tokens=mix.epoch_tokens,
        )

    def _occurrences(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uid, length and dataset index of each occurrence, in epoch order (planned once)."""
        if epoch not in self._occurrence_cache:
            self._occurrence_cache[epoch] = self._plan_occurrences(epoch)
        return self._occurrence_cache[epoch]

    def _plan_occurrences(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dataset_ids, sample_ids = self.plan(epoch)
        offsets = np.cumsum([0] + [len(uids) for uids, _ in self.samples])
        flat = offsets[dataset_ids] + sample_ids
        uids = np.concatenate([uids for uids, _ in self.samples])[flat]
        lengths = np.concatenate([lengths for _, lengths in self.samples])[flat]
        return uids, lengths, dataset_ids

    def pack_plan(self, epoch: int) -> dict[str, np.ndarray]:
        """Every occurrence's uid, pack, slot and emission group, sorted by uid."""
        with StageTimer() as timer:
            plan, max_delay = self._pack_plan(epoch)
        self.plan_seconds += timer.seconds
        self.plan_cpu_seconds += timer.cpu_seconds
        self.max_delay_windows = max(self.max_delay_windows, max_delay)
        self.num_packs[epoch] = int(plan["pack"].max()) + 1 if len(plan["pack"]) else 0
        return plan

    def _pack_plan(self, epoch: int) -> tuple[dict[str, np.ndarray], int]:
        uids, lengths, _ = self._occurrences(epoch)
        packing = self.config.packing
        packer = StreamPacker(
            packing.seq_len, packing.strategy, rng=seeds.rng(self.config.seed, "pack", epoch)
        )
        occurrences = np.arange(len(uids))
        packs: list[np.ndarray] = []
        groups: list[int] = []
        windows = range(0, len(uids), packing.window)
        for group, start in enumerate(windows):
            window = slice(start, start + packing.window)
            emitted = packer.push(occurrences[window], lengths[window])
            packs += emitted
            groups += [group] * len(emitted)
        final = packer.flush()
        packs += final
        groups += [len(windows)] * len(final)  # the flush is one more emission group
        sizes = np.array([len(p) for p in packs], dtype=np.int64)
        order = np.concatenate(packs)
        plan = {
            "uid": uids[order],
            "pack": np.repeat(np.arange(len(packs)), sizes),
            "slot": ranges(np.zeros(len(sizes), dtype=np.int64), sizes),
            "group": np.repeat(np.array(groups, dtype=np.int64), sizes),
        }
        by_uid = np.argsort(plan["uid"], kind="stable")
        return {name: values[by_uid] for name, values in plan.items()}, packer.max_delay_seen

    def packed(self, epoch: int = 0) -> ray.data.Dataset:
        """The packed rows of one epoch as a lazy Ray dataset (data-contract columns)."""
        expanded = self.tokenized.map_batches(
            ExpandPlan,
            batch_format="pyarrow",
            num_cpus=0.5,
            compute=ray.data.ActorPoolStrategy(size=1),
            runtime_env={"env_vars": PACK_STAGE_ENV},
            fn_constructor_kwargs={
                "plan": self.pack_plan(epoch),
                "epoch": epoch,
                "ledger": self.ledger,
            },
            **on_data_nodes(self.config),
        )
        packed = expanded.groupby("group").map_groups(
            AssemblePacks,
            batch_format="pyarrow",
            num_cpus=0.5,
            compute=ray.data.ActorPoolStrategy(size=1),
            runtime_env={"env_vars": PACK_STAGE_ENV},
            fn_constructor_kwargs={
                "seq_len": self.config.packing.seq_len,
                "pad_id": self.pad_id,
                "epoch": epoch,
                "ledger": self.ledger,
            },
            **on_data_nodes(self.config),
        )
        packed.set_name(f"{self.run}.train.epoch-{epoch}")
        return packed
