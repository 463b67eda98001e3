"""SFT samples from a whole Tokenize batch at once: ``encode_flat``, the array form of
``samples.encode_samples`` (the job's ``task: sft`` encoder, ``tasks.TASKS``).

``encode_samples`` builds each sample with a few numpy calls of its own (its labels, the segment
each token starts in, its EOS, its overflow pieces) and the batch's columns from lists of arrays:
per row, Python and numpy call overhead that cost the Tokenize actor about a fifth of its time
beside the ``tokenizers`` backend, and most of it beside a faster one. ``encode_flat`` lays the
batch's tokens out in one array, one row after another, and does each of those steps once for the
batch, with index arithmetic; per row it keeps only what must be per row: the template's
segments, the EOS check of each text and each sample's uid (a hash of its origin). Its samples,
counts and row indices are those of ``encode_samples``, value for value (``tests/unit/
test_flat.py`` compares the two on every bundled data set, through the Tokenize actor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.rows import IGNORE_INDEX, ranges
from rayjobs.data.samples import (
    TOKEN_LIST,
    Fit,
    Templated,
    encode_samples,
    sample_uid,
    trained_parts,
)
from rayjobs.data.tokenizer import LONG_CHARS


def _encoded(tokenizer: Any, rows: Sequence[Templated], fit: Fit) -> tuple[np.ndarray, ...]:
    """Every row's token ids one after another, per token a character offset in the part of its
    text where the token starts, each row's count of tokens (``Tokenizer.encode_parts_flat``;
    the parts: runs of segments trained alike), and each row's count of tokens left out.

    A text over ``LONG_CHARS`` is encoded a chunk at a time (``Tokenizer.encode_long``), and,
    unless overflow splits it, only its first ``seq_len + 2`` tokens are kept: the sample is cut
    or dropped all the same, and the tokens left out are counted."""
    parts = [trained_parts(row.content, row.spec.train_on_input) for row in rows]
    long = [i for i, p in enumerate(parts) if sum(map(len, p)) > LONG_CHARS]
    hidden = np.zeros(len(rows), dtype=np.int64)
    if not long:
        return (*tokenizer.encode_parts_flat(parts), hidden)
    keep = None if fit.overflow == "split" else fit.seq_len + 2
    short = sorted(set(range(len(rows))) - set(long))
    pieces = {}
    if short:
        ids, starts, lengths = tokenizer.encode_parts_flat([parts[i] for i in short])
        bounds = np.cumsum(lengths)[:-1]
        pieces = dict(zip(short, zip(np.split(ids, bounds), np.split(starts, bounds), strict=True),
                          strict=True))  # fmt: skip
    for i in long:
        long_ids, long_starts, total = tokenizer.encode_long("".join(parts[i]), keep)
        pieces[i] = (long_ids, long_starts)
        hidden[i] = total - len(long_ids)
    ordered = [pieces[i] for i in range(len(rows))]
    return (
        np.concatenate([i for i, _ in ordered]),
        np.concatenate([s for _, s in ordered]),
        np.fromiter((len(i) for i, _ in ordered), dtype=np.int64, count=len(rows)),
        hidden,
    )


def encode_flat(
    tokenizer: Any, rows: Sequence[Templated], counts: dict[str, TokenizeCounts], fit: Fit
) -> tuple[dict[str, pa.Array], list[int]]:
    """``samples.encode_samples``, a batch at a time (see module note): templated rows → samples
    (``input_ids``, ``labels``, ``source``, ``uid``, ``num_tokens``), fitted to ``fit.seq_len`` and
    counted; and, per sample, the index of the row it came from."""
    if not rows:
        return encode_samples(tokenizer, rows, counts, fit)
    n = len(rows)
    # Segments, one after another over the batch: each one's length, whether it is trained, and
    # where each row's begin. A row without segments gets one empty trained segment (as
    # ``encode_segments`` trains such a row's EOS).
    seg_lengths: list[int] = []
    seg_trained: list[bool] = []
    seg_counts = np.empty(n, dtype=np.int64)
    texts: list[str] = []
    for i, row in enumerate(rows):
        everything = row.spec.train_on_input
        segments = row.content
        texts.append("".join([s.text for s in segments]))
        if segments:
            seg_lengths += [len(s.text) for s in segments]
            seg_trained += [everything or s.trainable for s in segments]
            seg_counts[i] = len(segments)
        else:
            seg_lengths.append(0)
            seg_trained.append(True)
            seg_counts[i] = 1
    ids, starts, lengths, hidden = _encoded(tokenizer, rows, fit)
    total = int(lengths.sum())
    bos_id = tokenizer.bos_id
    first = np.minimum(np.cumsum(lengths) - lengths, max(total - 1, 0))
    first_ids = ids[first] if total else np.zeros(n, dtype=np.int64)  # (a row without ids: masked)
    bos = np.zeros(n, dtype=bool) if bos_id is None else ~((lengths > 0) & (first_ids == bos_id))
    eos = np.fromiter((not tokenizer.ends_with_eos(t) for t in texts), dtype=bool, count=n)

    # Each sample's tokens: [BOS] ids [EOS], rows one after another.
    sizes = lengths + bos + eos
    ends = np.cumsum(sizes)
    begins = ends - sizes
    where = ranges(begins + bos, lengths)
    out_ids = np.empty(int(ends[-1]), dtype=np.int32)
    out_starts = np.zeros(int(ends[-1]), dtype=np.int64)  # BOS: offset 0
    out_ids[where] = ids
    out_starts[where] = starts
    out_ids[begins[bos]] = bos_id if bos_id is not None else 0
    out_ids[ends[eos] - 1] = tokenizer.eos_id

    # Trained: the segment a token starts in, found over the batch's segments at once; rows are
    # spaced one character apart so no offset reaches into the next row's segments.
    seg_lengths_np = np.asarray(seg_lengths, dtype=np.int64)
    seg_trained_np = np.asarray(seg_trained, dtype=bool)
    seg_row = np.repeat(np.arange(n), seg_counts)
    text_lengths = np.bincount(seg_row, weights=seg_lengths_np, minlength=n).astype(np.int64)
    base = np.cumsum(text_lengths + 1) - (text_lengths + 1)
    seg_first = np.cumsum(seg_counts) - seg_counts
    seg_local_ends = np.cumsum(seg_lengths_np) - np.repeat(
        np.cumsum(text_lengths) - text_lengths, seg_counts
    )
    seg_ends = base[seg_row] + seg_local_ends
    sample_row = np.repeat(np.arange(n), sizes)
    which = np.searchsorted(seg_ends, base[sample_row] + out_starts, side="right")
    which = np.minimum(which - seg_first[sample_row], seg_counts[sample_row] - 1)
    trained = seg_trained_np[seg_first[sample_row] + which]
    last_trained = seg_trained_np[seg_first + seg_counts - 1]
    trained[ends[eos] - 1] = last_trained[eos]  # EOS: trained where the last segment is
    _untrain_eos(trained, out_ids, sample_row, rows, tokenizer.eos_id)

    # Labels shifted within each sample; a sample's last position is never trained.
    labels = np.full(len(out_ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(trained[1:], out_ids[1:], IGNORE_INDEX)
    labels[ends - 1] = IGNORE_INDEX

    # Overflow: each row's pieces (start, length) in the arrays above.
    seq_len, policy = fit.seq_len, fit.overflow
    over = sizes > seq_len
    if policy == "split":
        pieces = np.where(over, -(-sizes // seq_len), 1)
    elif policy == "drop":
        pieces = np.where(over, 0, 1)
    else:
        pieces = np.ones(n, dtype=np.int64)
    piece_row = np.repeat(np.arange(n), pieces)
    piece_index = np.arange(len(piece_row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    piece_start = begins[piece_row] + piece_index * seq_len
    piece_length = np.minimum(sizes[piece_row] - piece_index * seq_len, seq_len)
    labels[piece_start + piece_length - 1] = IGNORE_INDEX  # a cut position's target is elsewhere
    offsets = np.zeros(len(piece_row) + 1, dtype=np.int64)
    np.cumsum(piece_length, out=offsets[1:])
    gather = np.repeat(piece_start - offsets[:-1], piece_length) + np.arange(int(offsets[-1]))
    piece_ids, piece_labels = out_ids[gather], labels[gather]
    trained_counts = (
        np.add.reduceat((piece_labels != IGNORE_INDEX).astype(np.int64), offsets[:-1])
        if len(piece_row)
        else np.zeros(0, dtype=np.int64)
    )

    _count(rows, counts, sizes + hidden, pieces, over, policy, seq_len, piece_row, piece_length,
           trained_counts)  # fmt: skip
    origins = [rows[i].origin for i in piece_row.tolist()]
    uids = [sample_uid(f"{o}\0{k}") for o, k in zip(origins, piece_index.tolist(), strict=True)]
    names = pa.array([row.spec.name for row in rows], type=pa.string())
    row_index = np.fromiter((row.index for row in rows), dtype=np.int64, count=n)
    list_offsets = pa.array(offsets.astype(np.int32))
    columns = {
        "input_ids": pa.ListArray.from_arrays(list_offsets, pa.array(piece_ids), type=TOKEN_LIST),
        "labels": pa.ListArray.from_arrays(list_offsets, pa.array(piece_labels), type=TOKEN_LIST),
        "source": names.take(pa.array(piece_row)),
        "uid": pa.array(uids, type=pa.int64()),
        "num_tokens": pa.array(piece_length.astype(np.int32)),
    }
    return columns, row_index[piece_row].tolist()


EOS_MODES = {"turn": 0, "last": 1, "none": 2}
"""``datasets[].train_on_eos`` as a number per row."""


def _untrain_eos(
    trained: np.ndarray,
    ids: np.ndarray,
    sample_row: np.ndarray,
    rows: Sequence[Templated],
    eos_id: int,
) -> None:
    """``train_on_eos`` over the batch, in place: rows of ``none`` train no EOS token, rows of
    ``last`` only their last trained one (``samples.encode_segments``, row by row)."""
    modes = np.fromiter(
        (EOS_MODES[getattr(row.spec, "train_on_eos", "turn")] for row in rows), dtype=np.int8
    )
    if not modes.any():
        return
    mode = modes[sample_row]
    at = np.flatnonzero(trained & (ids == eos_id) & (mode > 0))
    rows_at = sample_row[at]
    last = np.append(rows_at[1:] != rows_at[:-1], True) & (mode[at] == 1)
    trained[at[~last]] = False


def _count(
    rows: Sequence[Templated],
    counts: dict[str, TokenizeCounts],
    sizes: np.ndarray,
    pieces: np.ndarray,
    over: np.ndarray,
    policy: str,
    seq_len: int,
    piece_row: np.ndarray,
    piece_length: np.ndarray,
    trained_counts: np.ndarray,
) -> None:
    """The batch's tallies by dataset, as ``encode_samples`` counts them row by row."""
    names = [row.spec.name for row in rows]
    order = list(dict.fromkeys(names))
    dataset = np.fromiter((order.index(name) for name in names), dtype=np.int64, count=len(rows))
    truncated = np.where(over, sizes - seq_len, 0) if policy == "truncate" else sizes * 0
    k = len(order)

    def by_row(values: np.ndarray) -> list[int]:
        return np.bincount(dataset, weights=values, minlength=k).astype(np.int64).tolist()

    def by_piece(values: np.ndarray) -> list[int]:
        return (
            np.bincount(dataset[piece_row], weights=values, minlength=k).astype(np.int64).tolist()
        )

    sums = zip(
        by_row(truncated),
        by_row(2 * truncated > sizes),
        by_row(pieces == 0),
        by_row(np.maximum(pieces - 1, 0)),
        by_piece(np.ones(len(piece_row))),
        by_piece(piece_length),
        by_piece(trained_counts),
        by_piece(trained_counts == 0),
        strict=True,
    )
    for name, (cut, mostly, dropped, split, samples, tokens, trained, untrained) in zip(
        order, sums, strict=True
    ):
        tally = counts[name]
        tally.truncated_tokens += cut
        tally.samples_mostly_truncated += mostly
        if dropped:
            tally.dropped_samples += dropped
            tally.dropped_by_reason["overflow_drop"] = (
                tally.dropped_by_reason.get("overflow_drop", 0) + dropped
            )
        tally.split_samples += split
        tally.samples += samples
        tally.tokens += tokens
        tally.trained_tokens += trained
        tally.samples_without_trained_tokens += untrained
