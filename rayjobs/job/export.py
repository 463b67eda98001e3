"""``rayjobs export``: run the data side only and write the packed rows as Parquet plus a manifest.

Layout of ``OUT`` (``manifest``'s names; docs/cli.md, "rayjobs export"): ``train/*.parquet`` (every
epoch's packed rows: the data-contract columns as ``fixed_size_list<int32>`` of ``seq_len``, with
``parent_ids`` and ``response_role`` for ``task: dpo``, plus ``num_tokens``, ``num_documents``,
``seq_lengths`` (each row's documents' lengths and its padding's, what TRL's padding-free collator
reads) and ``epoch``), ``_validation/*.parquet`` (the packed ``eval.datasets``, when the config has
them: the rows a run evaluates on, same columns but ``epoch``), ``_tokenizer/`` (the run's
tokenizer), ``_README.md`` (the dataset card) and ``_manifest.json``: the validated config,
per-dataset accounting (the same numbers as the run summary), the realized mix and the pack counts
of each epoch, the eval sets' own counts (``eval``: datasets and packs, the run summary's
``eval.datasets`` and ``eval.packed``) and the special tokens' ids, so exported data can be
audited, decoded and reused by any trainer. Every path in it is relative to ``OUT``.

Labels (``labels``, ``--labels``): ``hf`` by default, the Hugging Face convention every other
trainer reads (``labels[t] = input_ids[t]`` where trained; -100 on prompts, padding and each
document's first token), or ``shifted``, as rayjobs trains on them; the manifest's ``labels`` and
each Parquet file's schema metadata (``rayjobs.labels``) say which (``rows.LABEL_CONVENTIONS``).
Design note: rayjobs' own shifted rows, fed to a Hugging Face model's ``labels=`` (which shifts
again), train every position to predict the token after next, silently; so the default is what
the other trainers expect, and rayjobs' readers (``rayjobs bench train``) convert back. DPO rows
follow the same rule: the conversion moves labels inside each document, and a response document
starts with the prompt's last token, which is never trained.

``OUT`` is a folder or a URI of one on object storage (``s3://bucket/prefix``), new or empty;
``--overwrite`` replaces an earlier export there and nothing else (a mistyped ``--out`` must not
be wiped). An export is finished when its manifest exists, and only then: a local one is written
beside ``OUT`` and renamed into place, on an object store the manifest is written last. What an
interrupted export left, the next one clears (docs/cli.md, "rayjobs export").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from rayjobs.config import Config
from rayjobs.data import backends, files, local
from rayjobs.data.estimate import estimate, progress
from rayjobs.data.mix import epoch_fractions
from rayjobs.data.preference import PREFERENCE_COLUMNS
from rayjobs.data.rows import (
    LABEL_CONVENTIONS,
    LABELS_METADATA,
    PACKED_COLUMNS,
    STAT_COLUMNS,
    hf_labels,
)
from rayjobs.data.tally import Tally
from rayjobs.errors import ConfigError, Interrupted
from rayjobs.job import claim
from rayjobs.job.card import (
    card,
    relative_paths,
    tokenizer_info,
    tokenizer_metadata,
    write_tokenizer,
)
from rayjobs.job.manifest import (
    CARD,
    LEGACY_MANIFEST,
    MANIFEST,
    TOKENIZER,
    TRAIN,
    VALIDATION,
)

LEGACY_FOLDERS = r"epoch=\d+|eval"
"""The data folders of an export in the layout before this one."""


def to_arrow(
    batch: dict[str, np.ndarray],
    epoch: bool = True,
    labels: str = "hf",
    metadata: dict[str, str] | None = None,
) -> pa.Table:
    """Packed rows (2-D numpy columns, labels shifted) → Arrow with fixed-size list columns,
    ``seq_lengths`` (``seq_lengths``) and ``epoch``, when the rows carry it and ``epoch`` is true;
    the labels in the convention ``labels`` (``rows.LABEL_CONVENTIONS``), which the schema's
    metadata states, with ``metadata`` (the export's tokenizer: ``card.tokenizer_metadata``)."""
    if labels not in LABEL_CONVENTIONS:
        raise ValueError(f"labels must be one of {', '.join(LABEL_CONVENTIONS)}, got {labels!r}")
    columns = {}
    for name in (*PACKED_COLUMNS, *PREFERENCE_COLUMNS):
        if name not in batch:  # the preference columns: task: dpo rows only
            continue
        values = batch[name]
        if name == "labels" and labels == "hf":
            values = hf_labels(values, batch["document_ids"])
        values = np.ascontiguousarray(values, dtype=np.int32)
        columns[name] = pa.FixedSizeListArray.from_arrays(values.reshape(-1), values.shape[1])
    for name in STAT_COLUMNS:
        if name in batch:
            columns[name] = pa.array(np.asarray(batch[name], dtype=np.int32))
    columns["seq_lengths"] = seq_lengths(np.asarray(batch["document_ids"]))
    if epoch and "epoch" in batch:
        columns["epoch"] = pa.array(np.asarray(batch["epoch"], dtype=np.int32))
    stated = {LABELS_METADATA: labels.encode()}
    stated |= {key.encode(): value.encode() for key, value in (metadata or {}).items()}
    return pa.table(columns).replace_schema_metadata(stated)


def seq_lengths(document_ids: np.ndarray) -> pa.ListArray:
    """[rows, seq_len] document ids → each row's run lengths of equal ids, which sum to
    ``seq_len`` (the padding after the last document is one more run): the ``seq_lengths`` TRL's
    padding-free collator builds each document's ``position_ids`` from.

    >>> seq_lengths(np.array([[0, 0, 1, 2, 2], [0, 0, 0, 0, 1]])).to_pylist()
    [[2, 1, 2], [4, 1]]
    """
    rows, width = document_ids.shape
    starts = np.ones((rows, width), dtype=bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    flat = np.flatnonzero(starts.reshape(-1))
    lengths = np.diff(np.r_[flat, rows * width]).astype(np.int32)
    offsets = np.r_[0, np.cumsum(starts.sum(axis=1))].astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(lengths))


@dataclass
class Target:
    """Where an export writes (``prepare_out``): ``writing`` on ``fs``, then ``commit`` puts
    it at ``out``."""

    fs: pafs.FileSystem
    out: str
    """``--out``'s path on ``fs``."""
    writing: str
    """Where the files go while the export runs: the staging folder beside a local ``out``,
    ``out`` itself on an object store."""
    shown: str
    """``--out`` as messages name it."""

    def commit(self) -> None:
        """Put a complete export at ``out``: the staging folder renamed into place (an earlier
        export there removed first); nothing to do on an object store."""
        if self.writing == self.out:
            return
        if self.fs.get_file_info(self.out).type == pafs.FileType.Directory:
            _clear(self.fs, self.out, _entries(self.fs, self.out))
            self.fs.delete_dir(self.out)
        self.fs.move(self.writing, self.out)

    def discard(self) -> None:
        """Delete the staging folder of a local export that failed (best effort: the next
        export to ``out`` clears what is left)."""
        if self.writing != self.out:
            with contextlib.suppress(OSError):
                self.fs.delete_dir(self.writing)

    def left(self) -> str:
        """What an interrupted export leaves, said for a person."""
        if self.writing == self.out:
            return (
                f"its files under {self.shown} have no {MANIFEST}, so no reader takes them for "
                "an export; the next export to it clears them"
            )
        return (
            f"nothing at {self.shown}; its files are in {self.writing}, which the next export "
            "to it clears"
        )


def staging(path: str) -> str:
    """The folder a local export at ``path`` is written into: ``.<name>.partial`` beside it."""
    parent, name = os.path.split(path.rstrip("/"))
    return os.path.join(parent, f".{name}.partial")


def prepare_out(out: str | os.PathLike, overwrite: bool = False) -> Target:
    """Check that ``out`` (a folder, or a URI of one: ``s3://bucket/prefix``) is new or empty,
    or holds an earlier export and ``overwrite`` is set; clear what an interrupted export left
    (a staging folder; on an object store, export-shaped entries without a manifest).

    Raises:
        ConfigError: ``out`` is not empty (and ``overwrite`` is off), or holds something that is
            not part of an export, or cannot be listed.
    """
    out = str(out)
    shown = files.shown(out)
    try:
        fs, path = files.filesystem(out)
        if fs.get_file_info(path).type == pafs.FileType.File:
            raise ConfigError(f"--out {shown} is a file, not a folder")
        entries = _entries(fs, path)
        remote = files.is_remote(out)
        target = Target(fs, path, path if remote else staging(path), shown)
        if not remote:
            _clear_staging(fs, target.writing, shown)
        foreign = _foreign(fs, entries)
        # On an object store export-shaped entries without a manifest are an interrupted
        # export's (exports write there directly); a local export never writes into --out.
        leftovers = (
            remote
            and not foreign
            and all(e.base_name not in (MANIFEST, LEGACY_MANIFEST) for e in entries)
        )
        if entries and not leftovers and not overwrite:
            raise ConfigError(
                f"--out {shown} is not empty; export into a new folder, or pass "
                "--overwrite to replace the earlier export there"
            )
        if foreign:
            raise ConfigError(
                f"--out {shown} holds {foreign[:3]}, which no export writes; --overwrite "
                f"only replaces an earlier export ({MANIFEST}, {TRAIN}/, {VALIDATION}/, ...), "
                "so remove them yourself"
            )
        if remote:  # no rename there: the earlier export goes now, its manifest first
            _clear(fs, path, entries)
        else:
            fs.create_dir(target.writing)
    except files.StorageError as error:
        raise ConfigError(f"--out {error}") from None
    except OSError as error:
        raise ConfigError(f"--out {files.explain(error, out)}") from None
    return target


def _clear_staging(fs: pafs.FileSystem, folder: str, shown: str) -> None:
    """Delete the staging folder an interrupted local export left (when it holds nothing but
    an export's entries)."""
    if fs.get_file_info(folder).type != pafs.FileType.Directory:
        return
    foreign = _foreign(fs, _entries(fs, folder))
    if foreign:
        raise ConfigError(
            f"--out {shown}: its staging folder {folder} holds {foreign[:3]}, which no export "
            "writes; remove it yourself"
        )
    fs.delete_dir(folder)


def _entries(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    return sorted(
        fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), key=lambda e: e.path
    )


def _foreign(fs: pafs.FileSystem, entries: list[pafs.FileInfo]) -> list[str]:
    """The names of ``entries`` that no export writes."""
    return [e.base_name for e in entries if not _export_entry(fs, e)]


def _clear(fs: pafs.FileSystem, path: str, entries: list[pafs.FileInfo]) -> None:
    """Delete an export's ``entries`` of ``path``, its manifest first: from then on, whatever
    is left of it is no finished export."""
    for entry in sorted(entries, key=lambda e: e.base_name not in (MANIFEST, LEGACY_MANIFEST)):
        if entry.type == pafs.FileType.Directory:
            fs.delete_dir(entry.path)
        else:
            fs.delete_file(entry.path)


def _export_entry(fs: pafs.FileSystem, entry: pafs.FileInfo) -> bool:
    """Whether ``entry`` (in an export folder) is something an export writes: the manifest or the
    card, the tokenizer's folder, or a data folder (``train``, ``_validation``; ``epoch=<number>``
    or ``eval`` of the layout before) of Parquet files only (a Hive-partitioned folder of the
    user's own, ``epoch=2024/notes.csv``, is not)."""
    if entry.base_name in (MANIFEST, LEGACY_MANIFEST, CARD):
        return entry.type == pafs.FileType.File
    if entry.base_name == TOKENIZER:
        return entry.type == pafs.FileType.Directory
    named = entry.base_name in (TRAIN, VALIDATION) or re.fullmatch(LEGACY_FOLDERS, entry.base_name)
    if not named or entry.type != pafs.FileType.Directory:
        return False
    inside = fs.get_file_info(pafs.FileSelector(entry.path, recursive=True))
    return all(f.type == pafs.FileType.File and f.extension == "parquet" for f in inside)


RUNNERS = ("auto", "local", "ray")
"""Where an export's data path runs (``--runner``): ``ray``, the job's own path on the Ray
cluster named (or an embedded local Ray); ``local``, the same stages in this process, without
Ray (``data.local``); ``auto``, ``local`` for an export of at most ``LOCAL_MAX_TOKENS`` where no
cluster is named, else ``ray``."""

LOCAL_MAX_TOKENS = 1 << 25
"""The most tokens (every epoch's, estimated from the datasets' heads) ``--runner auto`` exports
in this process: about a minute of one core, about where the Ray path on a 2-core machine
catches up (``rayjobs bench peers`` measures both). Beyond that, more cores and nodes do more:
Ray's start-up, a fixed cost, is paid back."""


def choose_runner(config: Config, runner: str = "auto") -> tuple[str, str, dict | None]:
    """The runner an export takes (``RUNNERS``), why (a phrase for the log and the manifest) and,
    when they were needed to decide, the datasets' ``estimate``s.

    Raises:
        ConfigError: an unknown runner, or ``local`` for datasets it cannot read.
    """
    if runner not in RUNNERS:
        raise ConfigError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    problem = local.unsupported(config)
    if runner == "local" and problem:
        raise ConfigError(f"--runner local: {problem}; use --runner ray")
    if runner != "auto":
        return runner, f"--runner {runner}", None
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "ray", "this process is connected to Ray", None
    if address:
        return "ray", f"a Ray cluster is named ({address})", None
    if problem:
        return "ray", problem, None
    estimates = estimate(config)
    fractions = epoch_fractions(config, estimates)
    tokens = config.train.epochs * sum(
        fraction * estimates[spec.name].samples_hint * estimates[spec.name].mean_tokens
        for spec, fraction in zip(config.datasets, fractions, strict=True)
    )
    about = f"about {tokens:,.0f} tokens (estimated)"
    if tokens > LOCAL_MAX_TOKENS:
        return "ray", f"{about}, more than the local runner takes ({LOCAL_MAX_TOKENS:,})", None
    return "local", f"no Ray cluster named, {about}", estimates


def start_data_job(
    config: Config, prefix: str, runner: str = "auto"
) -> tuple[Any, dict[str, str], dict | None]:
    """``export``'s and ``inspect``'s start: the tokenizer loaded (a bad one is refused before
    anything else), the runner chosen (``choose_runner``) and said, the job started on it.
    Returns the job, the runner as the manifest and the report name it (``name``, ``reason``),
    and the datasets' estimates where choosing needed them."""
    from rayjobs.job.pipeline import load_tokenizer, start_job

    tokenizer = load_tokenizer(config)
    runner, reason, estimates = choose_runner(config, runner)
    progress.info("data: the %s runner (%s)", runner, reason)
    job = start_job(config, prefix=prefix, tokenizer=tokenizer, local=runner == "local")
    return job, {"name": runner, "reason": reason}, estimates


def export(
    config: Config,
    out: str | os.PathLike,
    epochs: int | None = None,
    overwrite: bool = False,
    labels: str = "hf",
    runner: str = "auto",
) -> dict[str, Any]:
    """Write every epoch's packed rows under ``out`` (``train/*.parquet``; a folder or a URI of
    one on object storage) and return the manifest (also written). ``out`` must be new or
    empty; ``overwrite`` first empties an earlier export there (see module note). ``labels``:
    their convention (``rows.LABEL_CONVENTIONS``, module note). ``runner``: where the data path
    runs (``RUNNERS``)."""
    if epochs is not None and epochs < 1:  # before anything is emptied
        raise ConfigError(f"--epochs must be at least 1, got {epochs}")
    if labels not in LABEL_CONVENTIONS:
        raise ConfigError(f"--labels must be one of {', '.join(LABEL_CONVENTIONS)}, got {labels!r}")
    with claim.take(str(out), f"--out {files.shown(str(out))}", " or export elsewhere"):
        return _export(config, out, epochs, overwrite, labels, runner)


def _export(
    config: Config,
    out: str | os.PathLike,
    epochs: int | None,
    overwrite: bool,
    labels: str,
    runner: str,
) -> dict[str, Any]:
    """``export`` once ``out`` is claimed (``claim``: no other export writes there)."""
    target = prepare_out(out, overwrite)
    if epochs is not None:
        config = config.model_copy(
            update={"train": config.train.model_copy(update={"epochs": epochs})}
        )
    try:
        job, chosen, estimates = start_data_job(config, "export", runner)
        try:
            manifest = _write(config, job, target.fs, target.writing, labels, estimates)
            manifest["runner"] = chosen
            manifest = relative_paths(manifest)
            _write_text(target.fs, f"{target.writing}/{CARD}", card(manifest))
            _write_manifest(target.fs, target.writing, manifest)
        finally:
            job.close()
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (the command line's Interrupted)
        raise Interrupted.of(interrupt, f"export not finished: {target.left()}") from None
    except Exception as error:
        target.discard()  # a failed export's partial files (an interrupted one's stay: said)
        failed = claim.failure(error, f"--out {target.shown}")  # the store failed: one line
        if failed is None:
            raise
        raise failed from error
    target.commit()
    return manifest


def _write(
    config: Config,
    job: Any,
    fs: pafs.FileSystem,
    out: str,
    labels: str,
    estimates: dict | None = None,
) -> dict[str, Any]:
    """``export`` once its job is set up: the Parquet files, then the manifest (its caller
    writes it, last). ``estimates``: the datasets', for the local runner, where chosen with them."""
    write_tokenizer(job.tokenizer, fs, f"{out}/{TOKENIZER}")
    stated = {"labels": labels, "metadata": tokenizer_metadata(job.tokenizer)}
    arrow = {"batch_format": "numpy", "fn_kwargs": stated}
    if job.local:
        _write_local(job, fs, out, stated, estimates)
    elif job.rows is not None:  # stream: one pass over every epoch, its rows' epoch a column
        job.rows.map_batches(to_arrow, **arrow).write_parquet(f"{out}/{TRAIN}", filesystem=fs)
    else:
        for epoch in range(config.train.epochs):
            rows = job.epochs.packed(epoch).map_batches(to_arrow, **arrow)
            rows.write_parquet(f"{out}/{TRAIN}", filesystem=fs)
    summary = job.accounting()
    packs = job.snapshot()["pack"]
    manifest = {
        "config": config.model_dump(mode="json"),
        "seq_len": config.packing.seq_len,
        "labels": labels,
        "splits": {"train": TRAIN, **({"validation": VALIDATION} if config.eval.datasets else {})},
        "columns": [
            *PACKED_COLUMNS,
            *(PREFERENCE_COLUMNS if config.task == "dpo" else ()),
            *STAT_COLUMNS,
            "seq_lengths",
            "epoch",
        ],
        "epochs": [
            {
                "epoch": e["epoch"],
                "path": TRAIN,
                "mix": e["datasets"],
                "packs": packs[e["epoch"]],
            }
            for e in summary.pop("mix")
        ],
        **summary,
    }
    # the encoder the run chose (the summary's) and what a reader decodes with
    manifest["tokenizer"] = {**manifest.get("tokenizer", {}), **tokenizer_info(job.tokenizer)}
    if config.eval.datasets:
        manifest["eval"] = _write_eval(config, job, fs, f"{out}/{VALIDATION}", stated)
    return manifest


def _write_text(fs: pafs.FileSystem, path: str, text: str) -> None:
    with fs.open_output_stream(path, compression=None) as stream:
        stream.write(text.encode())


def _write_manifest(fs: pafs.FileSystem, out: str, manifest: dict[str, Any]) -> None:
    """The manifest, written last: an export is finished when it exists."""
    _write_text(fs, f"{out}/{MANIFEST}", json.dumps(manifest, indent=1, default=str))


def _write_local(
    job: Any, fs: pafs.FileSystem, out: str, stated: dict[str, Any], estimates: dict | None = None
) -> None:
    """Every epoch's packed rows from the local runner (``data.local``): a Parquet file per
    packer window, ``train/epoch-<e>-part-<n>.parquet``, its rows' epoch a column."""
    config = job.config
    fs.create_dir(f"{out}/{TRAIN}")
    rows = local.packed_rows(config, job.tokenizer.pad_id, job.ledger, estimates)
    _write_parts(fs, f"{out}/{TRAIN}", rows, stated, epochs=True)


def _write_parts(
    fs: pafs.FileSystem, folder: str, windows: Any, stated: dict[str, Any], epochs: bool
) -> None:
    """Each non-empty window of packed rows as the next Parquet file under ``folder``:
    ``epoch-<e>-part-<n>.parquet`` with an ``epoch`` column where ``epochs``, else
    ``part-<n>.parquet``. ``stated``: ``to_arrow``'s ``labels`` and ``metadata``."""
    parts: dict[int, int] = {}
    for rows in windows:
        if not len(rows["num_tokens"]):
            continue
        epoch = int(rows["epoch"][0]) if epochs else -1
        table = to_arrow(rows, epoch=epochs, **stated)
        index = parts[epoch] = parts.get(epoch, -1) + 1
        name = f"epoch-{epoch:04d}-part-{index:05d}" if epochs else f"part-{index:05d}"
        with fs.open_output_stream(f"{folder}/{name}.parquet") as stream:
            pq.write_table(table, stream)


def _write_eval(
    config: Config, job: Any, fs: pafs.FileSystem, folder: str, stated: dict[str, Any]
) -> dict[str, Any]:
    """The packed ``eval.datasets`` under ``folder`` (made even when no row is packed, so the
    manifest's path exists) and their counts."""
    from rayjobs.job.pipeline import eval_accounting, eval_rows

    if job.local:
        fs.create_dir(folder)
        windows, tally = local_eval_rows(config, job)
        _write_parts(fs, folder, windows, stated, epochs=False)
        return {"path": VALIDATION, **eval_accounting(tally)}
    rows, ledger = eval_rows(config, job)
    try:
        arrow = {"epoch": False, **stated}
        rows = rows.map_batches(to_arrow, batch_format="numpy", fn_kwargs=arrow)
        rows.write_parquet(folder, filesystem=fs)
        fs.create_dir(folder)
        counts = eval_accounting(ledger)
    finally:
        ray.kill(ledger)
    return {"path": VALIDATION, **counts}


def local_eval_rows(config: Config, job: Any) -> tuple[Any, Tally]:
    """``pipeline.eval_rows`` for the local runner: the packed ``eval.datasets`` a window at a
    time (lazy) and their own ``Tally``."""
    from rayjobs.job.pipeline import eval_config

    tally = Tally()
    decided = backends.decided(config, job.config.tokenizer.backend)  # as the job's
    return local.packed_rows(eval_config(decided), job.tokenizer.pad_id, tally), tally
