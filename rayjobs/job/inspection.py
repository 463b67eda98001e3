"""``rayjobs inspect``: the data side only, run as ``rayjobs export`` runs it, summarized, so a
config can be checked on real data before any GPU time is spent (docs/cli.md, "inspect").

The figures are the ledger's exact counts, the same ``export`` writes to its manifest; the rows are
reduced where they are, so the driver holds three numbers per pack. Sample lengths come from one
more read of every dataset through the job's reader and Tokenize stage (no ledger).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rayjobs.config import Config
from rayjobs.data import local
from rayjobs.errors import AccountingError
from rayjobs.job.limit import limit_config
from rayjobs.job.report import (
    PREVIEW_COLUMNS,
    TIMERS,
    document_spans,
    length_stats,
    pack_stats,
    plot,
    preview,
    require_matplotlib,
    row_stats,
    sample_digest,
)

# --limit: each dataset cut to its first N rows.


def inspect(
    config: Config,
    limit: int | None = None,
    plot_path: str | Path | None = None,
    runner: str = "auto",
) -> dict[str, Any]:
    """Run the config's data side (all epochs, as ``export``, by the runner ``export`` would
    take: ``export.choose_runner``), and return the report (module note); with ``plot_path``,
    also write the PNG there."""
    if plot_path is not None:
        require_matplotlib()
    with tempfile.TemporaryDirectory(prefix="rayjobs-inspect-") as folder:
        if limit is not None:
            config = limit_config(config, limit, folder)
        return _inspect(config, limit, plot_path, runner)


def _inspect(
    config: Config, limit: int | None, plot_path: str | Path | None, runner: str
) -> dict[str, Any]:
    from rayjobs.job.export import start_data_job

    job, chosen, estimates = start_data_job(config, "inspect", runner)
    try:
        report = _report(config, job, limit, plot_path, estimates)
    finally:
        job.close()
    return {**report, "runner": chosen}


def _report(
    config: Config,
    job: Any,
    limit: int | None,
    plot_path: str | Path | None,
    estimates: dict | None = None,
) -> dict[str, Any]:
    """``inspect`` once its job is set up: the rows read back, the report, the plot."""
    if job.local:  # the local runner: its windows, reduced as they come
        windows = local.packed_rows(job.config, job.tokenizer.pad_id, job.ledger, estimates)
        reduced = (row_stats(rows) for rows in windows)
    elif job.rows is not None:
        reduced = _reduced([(job.rows, 0)])
    else:
        reduced = _reduced([(job.epochs.packed(e), e) for e in range(config.train.epochs)])
    num_tokens, num_documents, candidate = _read_rows(reduced)
    summary = job.accounting()
    packs = job.snapshot()["pack"]
    packed = summary["packed"]
    if (len(num_tokens), int(num_tokens.sum())) != (packed["num_packs"], packed["num_tokens"]):
        raise AccountingError(
            f"inspect read {len(num_tokens)} rows of {int(num_tokens.sum())} tokens back, but the "
            f"ledger counted {packed['num_packs']} packs of {packed['num_tokens']} tokens"
        )
    wanted = []
    if candidate is not None:
        spans = document_spans(
            candidate["input_ids"], candidate["labels"], candidate["document_ids"],
            int(candidate["num_tokens"]),
        )  # fmt: skip
        documents = [np.concatenate([ids for _, ids in doc]) for doc in spans]
        wanted = [(sample_digest(ids), len(ids)) for ids in documents]
    lengths, found = _samples(job, wanted)
    seq_len = config.packing.seq_len
    packed.update(pack_stats(num_tokens, num_documents, seq_len))
    datasets = {}
    for name, stats in summary["datasets"].items():
        trimmed = {
            key: sum(p[f"trimmed{part}_by_source"].get(name, 0) for p in packs.values())
            for key, part in (("trimmed_samples", ""), ("trimmed_tokens", "_tokens"))
        }
        datasets[name] = {
            **stats,
            **trimmed,
            "length": length_stats(lengths.get(name, np.empty(0, np.int64))),
        }
    decode = job.tokenizer.backend.decode
    report = {
        "seq_len": seq_len,
        "mode": config.packing.mode,
        "limit": limit,
        "datasets": datasets,
        "packed": packed,
        "epochs": [
            {
                "epoch": entry["epoch"],
                "mix": entry["datasets"],
                "packs": {k: v for k, v in packs[entry["epoch"]].items() if k not in TIMERS},
            }
            for entry in summary["mix"]
        ],
        "tokenizer": summary.get("tokenizer"),
        "actors": summary["actors"],
        "repeated_reports": summary["repeated_reports"],
        "preview": None
        if candidate is None
        else preview(
            candidate,
            lambda ids: decode(ids, skip_special_tokens=False),
            None if config.task == "dpo" else [found.get(digest, []) for digest, _ in wanted],
        ),
    }
    if config.eval.datasets:
        report["eval"] = _eval_report(config, job)
    if plot_path is not None:
        by_dataset = {spec.name: lengths.get(spec.name, []) for spec in config.datasets}
        panels = plot(by_dataset, num_tokens / seq_len, seq_len, plot_path)
        report["plot"] = {"path": str(plot_path), "panels": panels}
    return report


def _reduced(parts: list[tuple[Any, int]]) -> Iterator[pa.Table]:
    """The packed rows of ``parts`` (Ray datasets of rows, each with its epoch), reduced by
    ``row_stats`` where they are."""
    for rows, epoch in parts:
        reduced = rows.map_batches(row_stats, batch_format="numpy", fn_kwargs={"epoch": epoch})
        yield from reduced.iter_batches(batch_format="pyarrow", batch_size=None)


def _read_rows(
    reduced: Iterable[pa.Table],
) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None]:
    """Every packed row, reduced by ``row_stats``: (tokens per row, documents per row, the
    preview row: the first seen with the most documents, or None without rows)."""
    tokens, documents = [], []
    candidate = None
    for batch in reduced:
        counts = batch.column("num_documents").to_numpy()
        tokens.append(batch.column("num_tokens").to_numpy())
        documents.append(counts)
        if not len(counts):
            continue
        best = int(np.argmax(counts))
        if candidate is None or counts[best] > candidate["num_documents"]:
            candidate = {
                name: np.asarray(batch.column(name)[best].values, dtype=np.int32)
                for name in (*PREVIEW_COLUMNS, "response_role")
                if name in batch.column_names
            }
            for name in ("num_tokens", "num_documents", "epoch"):
                candidate[name] = int(batch.column(name)[best].as_py())
    if not tokens:
        return np.empty(0, np.int64), np.empty(0, np.int64), None
    return np.concatenate(tokens).astype(np.int64), np.concatenate(documents), candidate


def _eval_report(config: Config, job: Any) -> dict[str, Any]:
    """The packed ``eval.datasets`` (``pipeline.eval_rows``, as a run packs them): their
    ledger's counts (what ``export`` writes to its manifest's ``eval``) and the packs' samples
    per pack and fill, from the rows read back."""
    import ray

    from rayjobs.job.export import local_eval_rows
    from rayjobs.job.pipeline import eval_accounting, eval_rows

    if job.local:
        windows, tally = local_eval_rows(config, job)
        num_tokens, num_documents, _ = _read_rows(row_stats(rows) for rows in windows)
        counts = eval_accounting(tally)
    else:
        rows, ledger = eval_rows(config, job)
        try:
            num_tokens, num_documents, _ = _read_rows(_reduced([(rows, 0)]))
            counts = eval_accounting(ledger)
        finally:
            ray.kill(ledger)
    packed = counts["packed"]
    if (len(num_tokens), int(num_tokens.sum())) != (packed["num_packs"], packed["num_tokens"]):
        raise AccountingError(
            f"inspect read {len(num_tokens)} eval rows of {int(num_tokens.sum())} tokens back, "
            f"but the ledger counted {packed['num_packs']} packs of {packed['num_tokens']} tokens"
        )
    packed.update(pack_stats(num_tokens, num_documents, config.packing.seq_len))
    return counts


def sample_stats(batch: pa.Table, wanted: list[tuple[int, int]]) -> pa.Table:
    """Tokenized samples → ``source``, ``num_tokens`` and ``match`` (the index in ``wanted``,
    pairs of (digest, length), of the sample's digest; -1 for none), a ``map_batches`` function:
    lengths for the report and the datasets of the preview's documents. Only samples of a wanted
    length are digested."""
    lengths = batch.column("num_tokens").to_numpy()
    match = np.full(batch.num_rows, -1, dtype=np.int32)
    if wanted and "input_ids" in batch.column_names:  # preference triples: no SFT documents
        index = {digest: i for i, (digest, _) in enumerate(wanted)}
        ids = batch.column("input_ids")
        for row in np.flatnonzero(np.isin(lengths, [length for _, length in wanted])):
            digest = sample_digest(np.asarray(ids[int(row)].values))
            match[row] = index.get(digest, -1)
    return pa.table(
        {
            "source": batch.column("source"),
            "num_tokens": pa.array(lengths.astype(np.int32)),
            "match": pa.array(match),
        }
    )


def _samples(
    job: Any, wanted: list[tuple[int, int]]
) -> tuple[dict[str, np.ndarray], dict[int, list[str]]]:
    """Each dataset's sample lengths (each sample once, module note) and, for each (digest,
    length) in ``wanted``, the datasets holding a sample with that digest."""
    if job.local:  # the local runner: its reader and Tokenize, here
        stats = (sample_stats(table, wanted) for table in local.tokenized(job.config))
    else:
        if job.epochs is not None:
            tokenized = job.epochs.tokenized  # planned mode: the job's own tokenization
        else:
            from rayjobs.job.pipeline import tokenize

            tokenized = tokenize(job.config)  # the job's reader and Tokenize stage, no ledger
        stats = tokenized.map_batches(
            sample_stats, batch_format="pyarrow", fn_kwargs={"wanted": wanted}
        ).iter_batches(batch_format="pyarrow", batch_size=None)
    sources, lengths, matches = [], [], []
    for batch in stats:
        sources.append(batch.column("source").to_numpy(zero_copy_only=False))
        lengths.append(batch.column("num_tokens").to_numpy())
        matches.append(batch.column("match").to_numpy())
    if not sources:
        return {}, {}
    source, length, match = (np.concatenate(parts) for parts in (sources, lengths, matches))
    by_dataset = {
        spec.name: length[source == spec.name].astype(np.int64) for spec in job.config.datasets
    }
    found: dict[int, list[str]] = {}
    for i, (digest, _) in enumerate(wanted):
        found[digest] = sorted(set(source[match == i].tolist()))
    return by_dataset, found
