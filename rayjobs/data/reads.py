"""How each dataset is read over a run: per epoch, whole passes in a fresh file order plus a
seeded subsample (weights), every pass of the run one read operator whose tasks keep and tag their
rows (``PassRead``), and the warm-up lane's head of each dataset's first file."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from rayjobs.config import Config, DatasetConfig
from rayjobs.data import seeds
from rayjobs.data.estimate import Estimate, _parse_head
from rayjobs.data.files import common_root
from rayjobs.data.files import place as files_place
from rayjobs.data.formats import HF, HF_PLACE
from rayjobs.data.packer import lane_tokens
from rayjobs.data.sources import FileRead, read_dataset, read_file_list


@dataclass(frozen=True)
class Pass:
    """One read of a dataset within an epoch: its files in a fresh random order, whole or
    subsampled."""

    files: tuple[str, ...]
    """Files in reading order (empty for a Hugging Face dataset)."""
    order_seed: int
    sample: float | None
    """Fraction of rows kept by a random subsample; None for a whole pass."""
    sample_seed: int


def passes(spec: DatasetConfig, index: int, epoch: int, seed: int, fraction: float) -> list[Pass]:
    """How a dataset is read in one epoch: ``fraction`` of it as whole passes, then a random
    subsample; each pass its own file order (``seeds.STREAMS["stream_order"]``)."""
    whole, remainder = divmod(fraction, 1.0)
    reads = []
    for copy in range(int(whole) + (remainder > 1e-9)):
        rng = seeds.rng(seed, "stream_order", epoch, index, copy)
        order_seed, sample_seed = int(rng.integers(2**31)), int(rng.integers(2**31))
        order = np.random.default_rng(order_seed).permutation(len(spec.files))
        sample = remainder if copy == int(whole) else None
        reads.append(Pass(tuple(spec.files[i] for i in order), order_seed, sample, sample_seed))
    return reads


@dataclass(frozen=True)
class Head:
    """A dataset's part of the warm-up lane: the rows of ``path`` (the first file of the first
    epoch's first pass) numbered below ``below_row``."""

    path: str
    below_row: int
    rows: int


@dataclass(frozen=True)
class PassRead(FileRead):
    """One file of one pass (``Pass``) of one epoch as a read task reads it: the rows the pass
    keeps, tagged with the epoch and the pass (``_tag_epoch``). ``below``: the warm-up lane's
    read of the file, only its rows numbered below this; ``from_row``: the main lane's read of
    that file, only the rows from this on."""

    epoch: int = 0
    copy: int = 0
    sample: float | None = None
    sample_seed: int = 0
    root: str | None = None
    below: int | None = None
    from_row: int | None = None

    def rows(self, table: pa.Table) -> pa.Table:
        if self.below is not None:
            table = _below(table, self.below)
        if self.from_row is not None:
            table = table.filter(pc.greater_equal(table.column("_row"), self.from_row))
        if self.sample is not None:
            table = _subsample(table, self.sample, self.sample_seed, self.root)
        return _tag_epoch(table, self.epoch, self.copy)

    @property
    def share(self) -> float:
        return self.sample if self.sample is not None else 1.0


def pass_reads(
    spec: DatasetConfig, reads: list[list[Pass]], head: Head | None = None
) -> list[PassRead]:
    """Every file read of a dataset's run, epoch by epoch (``reads[epoch]``: that epoch's passes),
    pass by pass, in each pass's file order; the first epoch's first pass leaves the warm-up
    ``head`` out."""
    root = files_root(spec.files)
    return [
        PassRead(
            path,
            epoch=epoch,
            copy=copy,
            sample=read.sample,
            sample_seed=read.sample_seed,
            root=root,
            from_row=head.below_row
            if head and (epoch, copy) == (0, 0) and path == head.path
            else None,
        )
        for epoch, passes_ in enumerate(reads)
        for copy, read in enumerate(passes_)
        for path in read.files
    ]


def _run_stream(
    spec: DatasetConfig,
    reads: list[list[Pass]],
    where: dict[str, Any],
    head: Head | None,
    sizes: dict[str, int] | None = None,
) -> ray.data.Dataset:
    """One dataset's rows for the whole run (see ``pass_reads``): one read operator however many
    epochs and passes (each pass reads the files in a fresh random order: no all-to-all shuffle,
    which would wait for the whole dataset); the packer's window shuffles the samples.
    ``sizes``: the files' bytes (``Estimate.file_sizes``)."""
    if spec.format != HF:
        return read_file_list(spec, pass_reads(spec, reads, head), sizes=sizes, **where)
    parts = [  # a Hugging Face dataset: a read per pass, joined
        _tagged(_read_hf(spec, read, where), epoch, copy, where)
        for epoch, passes_ in enumerate(reads)
        for copy, read in enumerate(passes_)
    ]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _head_read(spec: DatasetConfig, head: Head, first: Pass) -> PassRead:
    """A dataset's part of the warm-up lane: the head of its first file, with the first pass's
    subsample."""
    return PassRead(
        head.path, sample=first.sample, sample_seed=first.sample_seed,
        root=files_root(spec.files), below=head.below_row,
    )  # fmt: skip


def _read_hf(spec: DatasetConfig, read: Pass, where: dict[str, Any]) -> ray.data.Dataset:
    """One pass over a Hugging Face dataset as raw rows, in a random block order."""
    rows = read_dataset(spec, order_seed=read.order_seed, **where)
    if read.sample is not None:  # (Dataset.random_sample takes no label selector)
        rows = rows.map_batches(
            _subsample, batch_format="pyarrow",
            fn_kwargs={"fraction": read.sample, "seed": read.sample_seed, "place": HF_PLACE},
            **where,
        )  # fmt: skip
    return rows


def files_root(files: tuple[str, ...] | list[str]) -> str | None:
    """The folder (or prefix) a dataset's files lie under (``files.common_root``); None without
    files (a Hugging Face dataset read in the driver)."""
    return common_root(files) if files else None


def _subsample(
    batch: pa.Table, fraction: float, seed: int, root: str | None = None, place: str | None = None
) -> pa.Table:
    """Each row kept with probability ``fraction``, decided by a hash of (seed, file, row), the
    file named by its path under ``root`` (``files_root``), or ``place`` for every row (a
    Hugging Face dataset: ``formats.HF_PLACE``): the same rows for the same seed whatever the
    blocks, their order, and wherever the dataset's folder lies."""
    paths = batch.column("_path").to_numpy(zero_copy_only=False)
    rows = batch.column("_row").to_numpy().astype(np.uint64)
    keys = np.empty(len(rows), dtype=np.uint64)
    for path in np.unique(paths):
        name = place or files_place(path, root)
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        mine = paths == path
        keys[mine] = rows[mine] + np.uint64(int.from_bytes(digest, "little"))
    return batch.filter(pa.array(_uniform(keys) < fraction))


def _uniform(keys: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 ``keys`` → floats uniform in [0, 1)."""
    z = keys + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _below(batch: pa.Table, row: int) -> pa.Table:
    return batch.filter(pc.less(batch.column("_row"), row))


def _tagged(
    rows: ray.data.Dataset, epoch: int, copy: int, where: dict[str, Any]
) -> ray.data.Dataset:
    """Rows tagged with their epoch and pass: the epoch groups them in the packer, and both
    tell a batch read twice in one epoch from a batch Ray runs again (``metrics.batch_key``)."""
    return rows.map_batches(
        _tag_epoch, batch_format="pyarrow", fn_kwargs={"epoch": epoch, "copy": copy}, **where
    )


def _tag_epoch(batch: pa.Table, epoch: int, copy: int) -> pa.Table:
    batch = batch.append_column("_epoch", pa.array(np.full(batch.num_rows, epoch, np.int32)))
    return batch.append_column("_pass", pa.array(np.full(batch.num_rows, copy, np.int32)))


def warmup_heads(
    config: Config, estimates: dict[str, Estimate], fractions: list[float], first_reads: list[Pass]
) -> dict[str, Head]:
    """Each file-based dataset's part of the warm-up lane (``packer.lane_tokens``: none for a
    first epoch of a few lanes' tokens), split in the ratio of the datasets' expected tokens in
    the first epoch, taken from the head of the first file each reads (parsed here, in the
    driver: one file per dataset)."""
    expected = {
        spec.name: fraction * estimates[spec.name].samples_hint * estimates[spec.name].mean_tokens
        for spec, fraction in zip(config.datasets, fractions, strict=True)
    }
    total = sum(expected.values())
    lane = lane_tokens(total, config.packing.warmup_tokens, config.packing.seq_len)
    if not lane:
        return {}
    heads = {}
    for spec, read in zip(config.datasets, first_reads, strict=True):
        if spec.format == HF or not total:
            continue
        tokens = lane * expected[spec.name] / total
        wanted = int(np.ceil(tokens / estimates[spec.name].mean_tokens / (read.sample or 1.0)))
        rows, _, _, _ = _parse_head(spec, read.files[0], wanted)
        if wanted and rows:
            below = rows[wanted] if wanted < len(rows) else rows[-1] + 1
            heads[spec.name] = Head(read.files[0], below, min(wanted, len(rows)))
    return heads
