"""``rayjobs inspect``: the data side only, summarized, so a config can be checked on real data
before any GPU time is spent: per dataset, rows read and skipped (by reason), samples, tokens,
sample lengths, truncation and drops; overall, packs, packing efficiency, samples per pack, the
fill of the packs, a decoded packed row with its trained tokens marked, and (``--plot``) a PNG of
the distributions.

Design note.

- **The same path, the same figures.** ``inspect`` runs ``pipeline.start_job`` on the config,
  exactly as ``rayjobs export`` does, reads every packed row back and reports
  ``Job.accounting()``, the ledger's exact counts: ``datasets``, ``packed``, and per epoch ``mix``
  and ``packs`` are the numbers ``export`` writes to its manifest (per-epoch stage timers left
  out). The rows are reduced where they are (``row_stats``: tokens and documents of each row,
  and one row per block kept whole as a preview candidate), so the driver holds three numbers
  per pack, and what it reads back must match the ledger's packs and tokens. Two runs agree
  exactly where the data side is deterministic: planned mode always (the same packs per seed);
  stream mode in its tokenization counts without weights, and in its packs when each epoch is
  one packer window without a warm-up lane. Otherwise which samples share a window, and with
  weights which are trimmed to a share, follow arrival order, and packs differ by a few between
  any two runs, an inspect and an export as two exports.
- **Epochs: all of them, as export.** ``inspect`` covers ``train.epochs`` epochs, the same as
  ``export`` without ``--epochs``, so its figures can be compared with an export of the same
  config. Stream mode re-reads and re-tokenizes every epoch, so ``rows``, ``samples`` and
  ``tokens`` count every epoch (as in the run summary; planned mode tokenizes once); for a quick
  look pass ``train.epochs=1``.
- **Sample lengths** (p50 / p95 / max, numpy's default linear percentiles) describe each
  dataset's samples, each once: what its rows become after the template, the tokenizer and the
  overflow policy (truncated samples count at ``seq_len``, split pieces one by one, dropped
  samples not at all). Packed rows do not say which dataset a document came from, so these come
  from the job's tokenized samples: in planned mode the job's own materialized tokenization, in
  stream mode one more read of every dataset through the job's reader and Tokenize stage
  (``pipeline.tokenize``, no ledger, so the counts above are untouched). Without weights every
  epoch packs exactly these samples (``samples`` = epochs × ``length.samples``); with weights an
  epoch repeats or subsamples them. The same pass finds the datasets of the preview row's
  documents (a document is the sample whose tokens it holds).
- **``--limit N``**: each dataset becomes its first N rows, in its file order (files are sorted
  by config validation), bad rows included: files wholly inside the first N rows are read as
  they are, the file holding the N-th row is replaced by a copy of its rows up to it (read
  decompressed, as a read task reads it, and written decompressed), in its own
  format (a JSONL / text file cut at that line, a JSON list, CSV or Parquet file at that record;
  row numbers are kept), written in a temporary folder on the driver's machine (so on a cluster
  of several nodes use it with a local Ray); a Hugging Face dataset by its first N records. The
  job then reads the cut dataset as it would the whole one: without weights every epoch reads
  exactly N rows of each dataset holding that many, with weights the mix repeats or subsamples
  the N rows to its shares. Bad-row messages name the copy for the cut file.
- **Eval sets** (``eval.datasets``): packed once, as a run packs them before training
  (``pipeline.eval_rows``, their own ledger), and reported apart (``eval``: per-dataset counts,
  packs, fill), never mixed into the figures above; ``--limit`` cuts them as it cuts the
  training datasets. ``export`` writes the same rows to ``eval/`` and the same counts to its
  manifest.
- **Trained tokens in the preview.** Labels are shifted per sample (``labels[t]`` is the target
  of position ``t``), so a token is trained when it is a target: token ``t`` of a document is
  marked when ``labels[t - 1] != -100``. The response and its EOS are marked, the prompt is not,
  and the count of marked tokens is the row's count of labels ≠ -100.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from rayjobs.config import Config, ConfigError, DatasetConfig
from rayjobs.data import formats
from rayjobs.data.counts import AccountingError
from rayjobs.data.formats import BOM, HF
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.data.sources import open_row_file

MARKS = ("⟦", "⟧")
"""What the preview wraps the trained spans of a document in."""

TIMERS = ("seconds", "cpu_seconds")

PREVIEW_COLUMNS = ("input_ids", "labels", "document_ids")


# ---------------------------------------------------------------------------------------------
# Pure functions: statistics, the preview, the report's text, the plot (no Ray).


def length_stats(lengths: Iterable[int]) -> dict[str, float | int]:
    """Count, mean, p50, p95 and max of sample lengths (numpy's default linear percentiles).

    >>> length_stats([2, 4, 6, 8, 10])
    {'samples': 5, 'mean': 6.0, 'p50': 6.0, 'p95': 9.6, 'max': 10}
    """
    values = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths))
    if not len(values):
        return {"samples": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0}
    p50, p95 = np.percentile(values, [50, 95])
    return {
        "samples": len(values),
        "mean": float(values.mean()),
        "p50": float(p50),
        "p95": float(p95),
        "max": int(values.max()),
    }


def pack_stats(num_tokens: np.ndarray, num_documents: np.ndarray, seq_len: int) -> dict[str, Any]:
    """Samples per pack (mean, p50, max) and pack fill (tokens / ``seq_len``: min, p5, p50,
    mean) of packed rows, from their ``num_tokens`` and ``num_documents``.

    >>> pack_stats(np.array([4, 3]), np.array([2, 1]), seq_len=4)["samples_per_pack"]
    {'mean': 1.5, 'p50': 1.5, 'max': 2}
    """
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    num_documents = np.asarray(num_documents, dtype=np.int64)
    if not len(num_tokens):
        return {
            "samples_per_pack": {"mean": 0.0, "p50": 0.0, "max": 0},
            "fill": {"min": 0.0, "p5": 0.0, "p50": 0.0, "mean": 0.0},
        }
    fill = num_tokens / seq_len
    p5, p50 = np.percentile(fill, [5, 50])
    return {
        "samples_per_pack": {
            "mean": float(num_documents.mean()),
            "p50": float(np.percentile(num_documents, 50)),
            "max": int(num_documents.max()),
        },
        "fill": {
            "min": float(fill.min()),
            "p5": float(p5),
            "p50": float(p50),
            "mean": float(fill.mean()),
        },
    }


def sample_digest(ids: np.ndarray) -> int:
    """A 63-bit digest of a sample's token ids: a packed document and the tokenized sample it came
    from have the same one."""
    data = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def row_stats(batch: dict[str, np.ndarray], epoch: int = 0) -> pa.Table:
    """A block of packed rows reduced to what ``inspect`` needs (a ``map_batches`` function):
    each row's ``num_tokens``, ``num_documents`` and ``epoch`` (the rows' own, else ``epoch``),
    and the token columns of one row, the block's first with the most documents (the preview
    candidate; null in the other rows)."""
    num_documents = np.asarray(batch["num_documents"])
    count = len(num_documents)
    epochs = np.asarray(batch["epoch"]) if "epoch" in batch else np.full(count, epoch)
    table = {
        "num_tokens": pa.array(np.asarray(batch["num_tokens"], dtype=np.int32)),
        "num_documents": pa.array(num_documents.astype(np.int32)),
        "epoch": pa.array(epochs.astype(np.int32)),
    }
    best = int(np.argmax(num_documents)) if count else -1
    for name in (*PREVIEW_COLUMNS, "response_role"):
        if name not in batch:  # response_role: preference rows only
            continue
        values: list[Any] = [None] * count
        if count:
            values[best] = np.asarray(batch[name][best], dtype=np.int32)
        table[name] = pa.array(values, type=pa.list_(pa.int32()))
    return pa.table(table)


def document_spans(
    input_ids: np.ndarray, labels: np.ndarray, document_ids: np.ndarray, num_tokens: int
) -> list[list[tuple[bool, np.ndarray]]]:
    """The documents of one packed row, each as runs of (trained, token ids) in order; a token is
    trained when it is a target, i.e. the label before it is not ``IGNORE_INDEX`` (module note).
    Padding (after ``num_tokens``) is left out.

    >>> spans = document_spans(np.array([7, 8, 9, 5, 6, 0]), np.array([-100, 9, -100, 6, -100,
    ...     -100]), np.array([0, 0, 0, 1, 1, 2]), num_tokens=5)
    >>> [[(t, ids.tolist()) for t, ids in doc] for doc in spans]
    [[(False, [7, 8]), (True, [9])], [(False, [5]), (True, [6])]]
    """
    input_ids, labels = np.asarray(input_ids)[:num_tokens], np.asarray(labels)[:num_tokens]
    document_ids = np.asarray(document_ids)[:num_tokens]
    documents = []
    for document in np.unique(document_ids):
        where = np.flatnonzero(document_ids == document)
        ids, targets = input_ids[where], labels[where]
        trained = np.zeros(len(ids), dtype=bool)
        trained[1:] = targets[:-1] != IGNORE_INDEX
        cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
        runs = zip(np.split(trained, cuts), np.split(ids, cuts), strict=True)
        documents.append([(bool(flags[0]), part) for flags, part in runs if len(part)])
    return documents


ROLES = ("prompt", "chosen", "rejected")
"""``response_role`` values (``dpo.ROLE_PROMPT`` …) as the preview names them."""


def preview(
    row: dict[str, np.ndarray],
    decode: Callable[[list[int]], str],
    sources: list[list[str]] | None = None,
) -> dict[str, Any]:
    """One packed row, decoded document by document, trained spans wrapped in :data:`MARKS`.

    ``row``: ``input_ids``, ``labels``, ``document_ids``, ``num_tokens`` (and ``epoch``);
    ``sources``: the datasets each document was found in, when known. Preference rows
    (``response_role``) name each document's part of its triple instead (``role``).
    """
    num_tokens = int(row["num_tokens"])
    documents = []
    roles = None
    if "response_role" in row:  # preference rows: each document's part of its triple
        ids = np.asarray(row["document_ids"])[:num_tokens]
        first = np.unique(ids, return_index=True)[1]
        roles = [ROLES[int(r)] for r in np.asarray(row["response_role"])[first]]
    for index, spans in enumerate(
        document_spans(row["input_ids"], row["labels"], row["document_ids"], num_tokens)
    ):
        text = "".join(
            f"{MARKS[0]}{decode(ids.tolist())}{MARKS[1]}" if trained else decode(ids.tolist())
            for trained, ids in spans
        )
        documents.append(
            {
                "document": index,
                "source": sources[index] if sources is not None else None,
                **({"role": roles[index]} if roles is not None else {}),
                "tokens": int(sum(len(ids) for _, ids in spans)),
                "trained_tokens": int(sum(len(ids) for trained, ids in spans if trained)),
                "text": text,
            }
        )
    return {
        "epoch": int(row.get("epoch", 0)),
        "num_documents": len(documents),
        "num_tokens": num_tokens,
        "padding": len(np.asarray(row["input_ids"])) - num_tokens,
        "trained_tokens": int((np.asarray(row["labels"]) != IGNORE_INDEX).sum()),
        "documents": documents,
    }


def format_preview(shown: dict[str, Any]) -> str:
    """The preview as text: a header line per document (with its datasets, when known), then its
    marked text.

    >>> print(format_preview({"documents": [{"document": 0, "source": ["a"], "tokens": 3,
    ...     "trained_tokens": 1, "text": "Q: A:⟦ yes⟧"}], "padding": 2}))
    ── document 0 (a): 3 tokens, 1 trained
    Q: A:⟦ yes⟧
    ── padding: 2 tokens
    """
    lines = []
    for document in shown["documents"]:
        source = document["source"]
        source = "" if source is None else f" ({', '.join(source) or 'dataset not found'})"
        if "role" in document:  # a preference triple's prompt, chosen or rejected response
            source = f" ({document['role']})"
        lines.append(
            f"── document {document['document']}{source}: {document['tokens']} tokens, "
            f"{document['trained_tokens']} trained"
        )
        lines.append(document["text"])
    if shown["padding"]:
        lines.append(f"── padding: {shown['padding']} tokens")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Rows of cells, left-aligned first column, the others right-aligned."""
    cells = [header] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  "
        + "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]


def _eval_lines(evaluation: dict[str, Any]) -> list[str]:
    """The report's ``eval`` (held-out sets, packed once as a run packs them) as text."""
    packed = evaluation["packed"]
    lines = [
        f"eval (held out): packs {packed['num_packs']}  packing efficiency "
        f"{packed['efficiency']:.4f}  samples per pack: mean "
        f"{packed['samples_per_pack']['mean']:.2f}"
    ]
    for name, stats in evaluation["datasets"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats["skipped_by_reason"].items()))
        lines.append(
            f"  {name}: rows {stats['rows']} skipped {stats['skipped_rows']}"
            + (f" ({reasons})" if reasons else "")
            + f" samples {stats['samples']} tokens {stats['tokens']} trained "
            f"{stats['trained_tokens']} truncated {stats['truncated_tokens']} dropped "
            f"{stats['dropped_samples']}"
        )
    return lines


def _number(value: float) -> str:
    return f"{value:g}" if float(value).is_integer() else f"{value:.1f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as text (what ``rayjobs inspect`` prints before its JSON line)."""
    epochs = report["epochs"]
    limit = report["limit"]
    scope = f"first {limit} rows of each dataset" if limit else "every dataset whole"
    lines = [
        f"inspect: {len(epochs)} epoch(s), seq_len {report['seq_len']}, {report['mode']} mode, "
        f"{scope}",
    ]
    header = ["dataset", "rows", "skipped", "samples", "tokens", "trained", "truncated"]
    header += ["dropped", "split", "length p50", "p95", "max"]
    rows = []
    for name, stats in report["datasets"].items():
        length = stats["length"]
        rows.append(
            [
                name,
                stats["rows"],
                stats["skipped_rows"],
                stats["samples"],
                stats["tokens"],
                stats["trained_tokens"],
                stats["truncated_tokens"],
                stats["dropped_samples"],
                stats["split_samples"],
                _number(length["p50"]),
                _number(length["p95"]),
                length["max"],
            ]
        )
    lines += _table(header, rows)
    for name, stats in report["datasets"].items():
        if stats["skipped_by_reason"]:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats["skipped_by_reason"].items()))
            lines.append(f"  {name}: skipped rows by reason: {reasons}")
        if stats.get("trimmed_samples"):
            lines.append(
                f"  {name}: {stats['trimmed_samples']} samples ({stats['trimmed_tokens']} tokens) "
                "tokenized but trimmed to the dataset's share"
            )
    measured = ", ".join(f"{n} {s['length']['samples']}" for n, s in report["datasets"].items())
    counted = "every epoch's reads" if report["mode"] == "stream" else "the one tokenization"
    lines.append(f"  (rows, samples, tokens: {counted}; lengths: each sample once, {measured})")
    packed = report["packed"]
    per_pack, fill = packed["samples_per_pack"], packed["fill"]
    lines.append(
        f"packs {packed['num_packs']}  packing efficiency {packed['efficiency']:.4f}  "
        f"samples per pack: mean {per_pack['mean']:.2f}, p50 {_number(per_pack['p50'])}, "
        f"max {per_pack['max']}"
    )
    if len(epochs) > 1:
        lines.append(
            "  per epoch: "
            + ", ".join(f"{e['epoch']}: {e['packs']['num_packs']} packs" for e in epochs)
        )
    lines.append(
        f"pack fill (tokens / seq_len): min {fill['min']:.3f}, p5 {fill['p5']:.3f}, "
        f"p50 {fill['p50']:.3f}, mean {fill['mean']:.4f}"
    )
    if report.get("eval") is not None:
        lines += _eval_lines(report["eval"])
    shown = report["preview"]
    if shown is not None:
        lines.append(
            f"preview: a packed row of epoch {shown['epoch']}, {shown['num_documents']} "
            f"documents, {shown['num_tokens']} tokens + {shown['padding']} padding, "
            f"{shown['trained_tokens']} trained; {MARKS[0]}…{MARKS[1]} = tokens the loss trains on"
        )
        lines.append(format_preview(shown))
    if report.get("plot"):
        plot = report["plot"]
        lines.append(f"plot: {plot['path']} ({len(plot['panels'])} panels)")
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise ``ConfigError`` (with the install line) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'rayjobs[plot]' (or pip install matplotlib)"
        ) from None


AXES_COLOR = "#e9f0f7"
"""Background of every panel, a tint no antialiased black text on white makes (a test counts the
panels in the PNG by it)."""


def plot(lengths: dict[str, np.ndarray], fill: np.ndarray, seq_len: int, out: str | Path) -> list:
    """Write a PNG to ``out``: one panel per dataset (histogram of its sample lengths) and one of
    pack fill (histogram of tokens per pack / ``seq_len``); return the panels' titles, in order.
    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = len(lengths) + 1
    columns = min(3, panels)
    grid = math.ceil(panels / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * grid), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    for index, (name, values) in enumerate(lengths.items()):
        axes = figure.add_subplot(grid, columns, index + 1, facecolor=AXES_COLOR)
        values = np.asarray(values)
        axes.hist(values, bins=min(64, seq_len), range=(0, seq_len), color="#3b75af")
        if len(values):
            axes.axvline(float(np.percentile(values, 50)), color="black", lw=1, ls="--")
        axes.set_title(f"{name}: sample length")
        axes.set_xlabel(f"tokens (p50 dashed; seq_len {seq_len})")
        axes.set_ylabel("samples")
    axes = figure.add_subplot(grid, columns, panels, facecolor=AXES_COLOR)
    axes.hist(np.asarray(fill), bins=50, range=(0, 1), color="#d9822b")
    axes.set_title("pack fill")
    axes.set_xlabel("tokens per pack / seq_len")
    axes.set_ylabel("packs")
    figure.savefig(out, format="png", facecolor="white")
    return [a.get_title() for a in figure.axes]


# ---------------------------------------------------------------------------------------------
# --limit: each dataset cut to its first N rows.


def limit_config(config: Config, limit: int, folder: str | Path) -> Config:
    """``config`` with every dataset cut to its first ``limit`` rows (module note); copies of cut
    files (and Hugging Face subsets) go under ``folder``.

    Raises:
        ConfigError: ``limit`` is not positive, or a file of a format that cannot be cut.
    """
    if limit < 1:
        raise ConfigError(f"--limit must be a positive number of rows, got {limit}")
    folder = Path(folder)
    datasets = [
        _limit_dataset(spec, limit, folder / f"dataset-{index}")
        for index, spec in enumerate(config.datasets)
    ]
    held_out = [
        _limit_dataset(spec, limit, folder / f"eval-{index}")
        for index, spec in enumerate(config.eval.datasets)
    ]
    return config.model_copy(
        update={
            "datasets": datasets,
            "eval": config.eval.model_copy(update={"datasets": held_out}),
        }
    )


def _limit_dataset(spec: DatasetConfig, limit: int, folder: Path) -> DatasetConfig:
    folder.mkdir(parents=True, exist_ok=True)
    if spec.format == HF:
        return _limit_hf(spec, limit, folder)
    files, taken = [], 0
    for path in spec.files:
        keep = limit - taken
        rows = _first_rows(spec, path, keep + 1)
        if len(rows) <= keep:
            files.append(path)
            taken += len(rows)
        else:
            # written decompressed: its name keeps its format's extension, not the codec's
            copy = folder / f"{len(files)}-{formats.without_compression(Path(path).name)}"
            with open(copy, "wb") as out:
                _cut(spec.format, path, rows[keep], keep, out)
            got = len(_first_rows(spec, str(copy), keep + 1))
            if got != keep:
                raise ConfigError(
                    f"--limit: cutting {path} after {keep} rows gave {got}; "
                    "use a --limit that ends at a file boundary"
                )
            files.append(str(copy))
            taken = limit
        if taken >= limit:
            break
    return spec.model_copy(update={"files": tuple(files)})


def _first_rows(spec: DatasetConfig, path: str, count: int) -> list[int]:
    """The row numbers of the first ``count`` rows of a file, good and bad (the job reads both
    under ``skip``). Reads only as far as needed where ``formats`` reads files part by part."""
    options = {
        "format": spec.format,
        "dataset": spec.name,
        "text_split": spec.text_split,
        "binary": spec.binary,
        "on_bad_row": "skip",
    }
    rows: list[int] = []
    with open_row_file(path, spec.format) as file:  # as a read task reads it
        for part in formats.read_rows(file, path, **options):
            rows += sorted([*part.rows, *(bad.row for bad in part.bad)])
            if len(rows) >= count:
                break
    return rows[:count]


_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")
"""Surrogates other than surrogateescape's (U+DC80-U+DCFF, the bytes that were not UTF-8)."""


def _open_lines(path: str, fmt: str) -> BinaryIO:
    """``path`` as a read task reads it (``sources.open_row_file``: decompressed by its
    extension), buffered so that its lines iterate."""
    return io.BufferedReader(open_row_file(path, fmt))


def _cut(fmt: str, path: str, first_left_out: int, keep: int, out: BinaryIO) -> None:
    """Write to ``out`` a file of format ``fmt`` holding the first ``keep`` rows of ``path``
    (``first_left_out``: the row number of the next one), decompressed. Streams, but for a JSON
    list and a compressed Parquet file."""
    if fmt in ("jsonl", "text"):  # row numbers are 1-based line numbers (split at \n only)
        with _open_lines(path, fmt) as file:
            out.writelines(itertools.islice(file, first_left_out - 1))
        return
    if fmt == "json":  # a list of records, numbered from 0
        with open_row_file(path, fmt) as file:
            data = file.read()
        text = data.removeprefix(BOM).decode("utf-8", "surrogateescape")
        records = json.dumps(json.loads(text)[:keep], ensure_ascii=False)
        # bytes that were not UTF-8 go back as they were (surrogateescape); a lone surrogate the
        # file escaped ("\ud800") goes back escaped, as no UTF-8 byte can hold it
        records = _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", records)
        out.write(records.encode("utf-8", "surrogateescape"))
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with open_row_file(path, fmt) as file:  # compressed: read whole, as formats' reader
            source = pq.ParquetFile(file if file.seekable() else pa.BufferReader(file.read()))
            with pq.ParquetWriter(out, source.schema_arrow) as writer:
                for batch in source.iter_batches(batch_size=min(keep, 65536)):
                    writer.write_batch(batch.slice(0, keep))
                    keep -= min(keep, batch.num_rows)
                    if not keep:
                        break
        return
    if fmt == "csv":  # the header, then records up to the keep-th (blank lines are not records)
        consumed: list[str] = []

        def lines(file: Iterable[str]) -> Iterator[str]:
            for line in file:
                consumed.append(line)
                yield line

        with io.TextIOWrapper(
            _open_lines(path, fmt), encoding="utf-8-sig", errors="surrogateescape", newline=""
        ) as file:
            reader = csv.reader(lines(file))
            next((header for header in reader if header), None)  # blank lines before it: none
            records = 0
            for record in reader:
                records += bool(record)
                if records == keep:
                    break
        out.write("".join(consumed).encode("utf-8", "surrogateescape"))
        return
    raise ConfigError(
        f"--limit: cannot cut {path} (format {fmt!r}) inside the file; "
        "use a --limit that ends at a file boundary"
    )


def _limit_hf(spec: DatasetConfig, limit: int, folder: Path) -> DatasetConfig:
    """A Hugging Face dataset's first ``limit`` records, saved to ``folder`` (read as the job
    reads the dataset: ``sources.load_huggingface``)."""
    from rayjobs.data.sources import load_huggingface

    loaded = load_huggingface(spec)
    loaded.select(range(min(limit, len(loaded)))).save_to_disk(str(folder))
    return spec.model_copy(update={"source": str(folder)})


# ---------------------------------------------------------------------------------------------
# The job.


def inspect(
    config: Config, limit: int | None = None, plot_path: str | Path | None = None
) -> dict[str, Any]:
    """Run the config's data side (all epochs, as ``export``), and return the report (module
    note); with ``plot_path``, also write the PNG there."""
    if plot_path is not None:
        require_matplotlib()
    with tempfile.TemporaryDirectory(prefix="rayjobs-inspect-") as folder:
        if limit is not None:
            config = limit_config(config, limit, folder)
        return _inspect(config, limit, plot_path)


def _inspect(config: Config, limit: int | None, plot_path: str | Path | None) -> dict[str, Any]:
    from rayjobs.job.pipeline import start_job

    job = start_job(config, prefix="inspect")
    try:
        return _report(config, job, limit, plot_path)
    finally:
        job.close()


def _report(
    config: Config, job: Any, limit: int | None, plot_path: str | Path | None
) -> dict[str, Any]:
    """``inspect`` once its job is set up: the rows read back, the report, the plot."""
    if job.rows is not None:
        parts = [(job.rows, 0)]
    else:
        parts = [(job.epochs.packed(e), e) for e in range(config.train.epochs)]
    num_tokens, num_documents, candidate = _read_rows(parts)
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


def _read_rows(
    parts: list[tuple[Any, int]],
) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None]:
    """Every packed row of ``parts`` (datasets of rows, each with its epoch), reduced by
    ``row_stats``: (tokens per row, documents per row, the preview row: the first seen with the
    most documents, or None without rows)."""
    tokens, documents = [], []
    candidate = None
    for rows, epoch in parts:
        reduced = rows.map_batches(row_stats, batch_format="numpy", fn_kwargs={"epoch": epoch})
        for batch in reduced.iter_batches(batch_format="pyarrow", batch_size=None):
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

    from rayjobs.job.pipeline import eval_accounting, eval_rows

    rows, ledger = eval_rows(config, job)
    try:
        num_tokens, num_documents, _ = _read_rows([(rows, 0)])
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
    if job.epochs is not None:
        tokenized = job.epochs.tokenized  # planned mode: the job's own tokenization
    else:
        from rayjobs.job.pipeline import tokenize

        tokenized = tokenize(job.config)  # the job's reader and Tokenize stage, no ledger
    stats = tokenized.map_batches(
        sample_stats, batch_format="pyarrow", fn_kwargs={"wanted": wanted}
    )
    sources, lengths, matches = [], [], []
    for batch in stats.iter_batches(batch_format="pyarrow", batch_size=None):
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
