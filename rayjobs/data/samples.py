"""SFT samples (``task: sft``): templated segments → ``input_ids`` and per-sample shifted
``labels``, and packs of them → packed rows.

Labels are shifted here, once, inside each sample: ``labels[t]`` is the target for ``input_ids[t]``
(= ``input_ids[t + 1]`` when that token is trained, else -100) and a sample's last position is
always -100, so no position is ever trained to predict the next document's first token. A sample's
segments are tokenized as one text and a token is trained when it starts in a trainable segment
(tokenized apart, a SentencePiece tokenizer would put a space before every response). EOS ends
every sample unless its text already does; BOS starts it where the tokenizer's post-processor puts
one. Over-length samples follow ``packing.overflow``, every case counted (docs/data.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.rows import IGNORE_INDEX, assemble
from rayjobs.data.templates import Segment

TOKEN_LIST = pa.list_(pa.int32())


@dataclass(frozen=True)
class Fit:
    """How a sample is fitted into a row: ``packing.seq_len``, ``packing.overflow`` and, for a
    preference triple, the prompt tokens it keeps at least (``dpo.min_prompt_tokens``)."""

    seq_len: int
    overflow: str
    min_prompt_tokens: int = 64


class Templated(NamedTuple):
    """A raw row the template accepted: its place in the batch, its dataset, its origin (what
    ``sample_uid`` hashes: dataset, file, row) and what the template made of it (segments, or a
    ``Preference``)."""

    index: int
    spec: Any
    origin: str
    content: Any


def sample_uid(origin: str) -> int:
    """A stable 63-bit id of a sample from where it came from (dataset, file, row, piece)."""
    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(), "big") >> 1


def shift_labels(input_ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Labels shifted within one sample: ``labels[t] = input_ids[t+1]`` if token t+1 is trained.

    >>> shift_labels(np.array([5, 6, 7, 8]), np.array([False, False, True, True]))
    array([-100,    7,    8, -100], dtype=int32)
    """
    labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(trained[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def encode_segments(
    segments: Sequence[Segment],
    ids: Sequence[int],
    starts: Sequence[int],
    eos_id: int,
    train_on_input: bool,
    has_eos: bool = False,
    train_on_eos: str = "turn",
) -> tuple[np.ndarray, np.ndarray]:
    """A sample's ``input_ids`` and shifted labels from its segments' texts tokenized as one
    text (``ids``, and each token's character offset in the joined text, ``starts``): a token is
    trained when it starts in a trainable segment; EOS is appended (trained when the last segment
    is) unless the text ``has_eos`` already (see module note); ``train_on_eos`` (``turn``,
    ``last``, ``none``: the dataset's) untrains every EOS token of the sample, or all but its last.

    >>> segments = [Segment("Q: hi ", False), Segment("A: yo", True)]
    >>> encode_segments(segments, [1, 2, 3, 4], [0, 3, 6, 9], 0, False)[1].tolist()
    [-100, 3, 4, 0, -100]
    """
    ends = np.cumsum([len(segment.text) for segment in segments])
    trainable = np.array([train_on_input or s.trainable for s in segments] or [True], dtype=bool)
    which = np.minimum(np.searchsorted(ends, np.asarray(starts, dtype=np.int64), side="right"),
                       len(trainable) - 1)  # fmt: skip
    trained = trainable[which] if len(ids) else np.zeros(0, dtype=bool)
    if not has_eos:
        ids = [*ids, eos_id]
        trained = np.append(trained, trainable[-1])
    input_ids = np.asarray(ids, dtype=np.int32)
    if train_on_eos != "turn":
        eos = np.flatnonzero(trained & (input_ids == eos_id))
        trained[eos if train_on_eos == "none" else eos[:-1]] = False
    return input_ids, shift_labels(input_ids, trained)


def trained_parts(segments: Sequence[Segment], train_on_input: bool) -> list[str]:
    """The texts of a sample's runs of consecutive segments trained alike (one run with
    ``train_on_input``): where the tokenizer must tell which part a token starts in.

    >>> trained_parts([Segment("Q: ", False), Segment("hi ", False), Segment("A", True)], False)
    ['Q: hi ', 'A']
    """
    parts: list[str] = []
    last = None
    for segment in segments:
        trained = train_on_input or segment.trainable
        if parts and trained == last:
            parts[-1] += segment.text
        else:
            parts.append(segment.text)
        last = trained
    return parts


def apply_overflow(
    input_ids: np.ndarray, labels: np.ndarray, seq_len: int, policy: str
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Fit one sample into ``seq_len``: returns (pieces, truncated token count).

    A cut position's label pointed at a token now in another piece, so it becomes -100.
    """
    if len(input_ids) <= seq_len:
        return [(input_ids, labels)], 0
    if policy == "drop":
        return [], 0
    if policy == "truncate":
        kept = labels[:seq_len].copy()
        kept[-1] = IGNORE_INDEX
        return [(input_ids[:seq_len], kept)], len(input_ids) - seq_len
    pieces = []
    for start in range(0, len(input_ids), seq_len):
        piece_labels = labels[start : start + seq_len].copy()
        piece_labels[-1] = IGNORE_INDEX
        pieces.append((input_ids[start : start + seq_len], piece_labels))
    return pieces, 0


def flat_samples(batch: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """A batch's ``input_ids`` and ``labels`` as their chunks' values (zero-copy) and each sample's
    start in their concatenation, for ``rows.assemble``.

    Raises:
        ValueError: if a sample's labels differ in length from its input_ids.
    """
    tokens, starts = _flat_values(batch.column("input_ids"))
    labels, label_starts = _flat_values(batch.column("labels"))
    if not np.array_equal(starts, label_starts):
        raise ValueError("a sample's labels differ in length from its input_ids")
    return tokens, labels, starts


def _flat_values(column: pa.ChunkedArray) -> tuple[list[np.ndarray], np.ndarray]:
    """A list<int32> column as its chunks' values (zero-copy) and each row's start in their
    concatenation."""
    values, starts, offset = [], [], 0
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values.append(chunk.values.to_numpy()[offsets[0] : offsets[-1]])
        starts.append(offsets[:-1] - offsets[0] + offset)
        offset += int(offsets[-1] - offsets[0])
    return values, np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)


def encode_samples(
    tokenizer: Any, rows: Sequence[Templated], counts: dict[str, TokenizeCounts], fit: Fit
) -> tuple[dict[str, pa.Array], list[int]]:
    """Templated rows → samples (``input_ids``, ``labels``, ``source``, ``uid``, ``num_tokens``),
    each fitted to ``fit.seq_len`` by the overflow policy and counted (what overflow drops, cuts
    or leaves with nothing to train too); and, per sample, the index of the row it came from (a
    split row makes several)."""
    parts = [trained_parts(row.content, row.spec.train_on_input) for row in rows]
    texts = ["".join(text) for text in parts]
    encoded = tokenizer.encode_parts(parts)
    input_ids, labels, sources, uids, kept = [], [], [], [], []
    for row, text, (ids, starts) in zip(rows, texts, encoded, strict=True):
        has_eos = tokenizer.ends_with_eos(text)
        ids, starts = tokenizer.with_bos(ids, starts)
        ids, sample_labels = encode_segments(
            row.content,
            ids,
            starts,
            tokenizer.eos_id,
            row.spec.train_on_input,
            has_eos,
            getattr(row.spec, "train_on_eos", "turn"),
        )
        pieces, truncated = apply_overflow(ids, sample_labels, fit.seq_len, fit.overflow)
        tally = counts[row.spec.name]
        tally.truncated_tokens += truncated
        tally.samples_mostly_truncated += 2 * truncated > len(ids)
        if not pieces:
            tally.dropped("overflow_drop")
        tally.split_samples += max(0, len(pieces) - 1)
        for piece, (piece_ids, piece_labels) in enumerate(pieces):
            uids.append(sample_uid(f"{row.origin}\0{piece}"))
            kept.append(row.index)
            input_ids.append(piece_ids)
            labels.append(piece_labels)
            sources.append(row.spec.name)
            trained = int((piece_labels != IGNORE_INDEX).sum())
            tally.samples += 1
            tally.tokens += len(piece_ids)
            tally.trained_tokens += trained
            tally.samples_without_trained_tokens += trained == 0
    columns = {
        "input_ids": pa.array(input_ids, type=TOKEN_LIST),
        "labels": pa.array(labels, type=TOKEN_LIST),
        "source": pa.array(sources, type=pa.string()),
        "uid": pa.array(uids, type=pa.int64()),
        "num_tokens": pa.array([len(ids) for ids in input_ids], type=pa.int32()),
    }
    return columns, kept


def assemble_samples(
    batch: pa.Table, packs: list[np.ndarray], seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Packed rows of a batch of samples: ``packs`` holds each row's sample indices, in order."""
    lengths = batch.column("num_tokens").to_numpy().astype(np.int64)
    order = np.concatenate(packs) if packs else np.empty(0, dtype=np.int64)
    tokens, labels, starts = flat_samples(batch)
    return assemble(
        tokens,
        labels,
        starts[order],
        lengths[order],
        np.array([len(p) for p in packs], dtype=np.int64),
        seq_len,
        pad_id,
    )
