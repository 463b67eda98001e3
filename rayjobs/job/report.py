"""The inspect report without Ray: statistics of lengths and packs, a decoded packed row with its
trained tokens marked, the report's text and its plot.

Labels are shifted per sample (``labels[t]`` is the target of position ``t``), so token ``t`` of a
document is marked as trained when ``labels[t - 1] != -100``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rayjobs.config import ConfigError
from rayjobs.data.rows import IGNORE_INDEX

MARKS = ("⟦", "⟧")
"""What the preview wraps the trained spans of a document in."""


TIMERS = ("seconds", "cpu_seconds")


PREVIEW_COLUMNS = ("input_ids", "labels", "document_ids")


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


def tokenizer_line(encoder: dict[str, Any]) -> str:
    """The run's encoder and why, in a line (``backends.Choice``)."""
    return f"tokenizer: encoded by {encoder['backend']} ({encoder['reason']})"


def format_report(report: dict[str, Any]) -> str:
    """The report as text (what ``rayjobs inspect`` prints before its JSON line)."""
    epochs = report["epochs"]
    limit = report["limit"]
    scope = f"first {limit} rows of each dataset" if limit else "every dataset whole"
    lines = [
        f"inspect: {len(epochs)} epoch(s), seq_len {report['seq_len']}, {report['mode']} mode, "
        f"{scope}",
    ]
    if report.get("tokenizer"):
        lines.append(tokenizer_line(report["tokenizer"]))
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
        if stats.get("dropped_by_reason"):
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats["dropped_by_reason"].items()))
            lines.append(f"  {name}: dropped samples by reason: {reasons}")
        lost = (
            stats.get("samples_without_trained_tokens", 0),
            stats.get("samples_mostly_truncated", 0),
        )
        if any(lost):
            lines.append(
                f"  {name}: {lost[0]} samples with no token left to train, {lost[1]} that lost "
                "most of their tokens to truncation"
            )
        if stats.get("unused_columns"):
            lines.append(f"  {name}: columns its template does not read: {stats['unused_columns']}")
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
