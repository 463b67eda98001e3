"""Packed rows made by hand for the row and pack tests: random windows of samples and their rows."""

from __future__ import annotations

from collections import Counter

import numpy as np

from rayjobs.data.rows import IGNORE_INDEX, assemble

PAD_ID = 0


def assemble_bins(
    input_ids: list[np.ndarray],
    labels: list[np.ndarray],
    bins: list[np.ndarray],
    seq_len: int,
    pad_id: int = PAD_ID,
) -> dict[str, np.ndarray]:
    """Rows of ``bins`` (indices into the samples) through ``rayjobs.data.rows.assemble``."""
    lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    order = np.concatenate(bins) if bins else np.empty(0, dtype=np.int64)
    return assemble(
        input_ids,
        labels,
        starts[order],
        lengths[order],
        np.array([len(b) for b in bins], dtype=np.int64),
        seq_len,
        pad_id,
    )


def random_window(
    rng: np.random.Generator, num_samples: int, seq_len: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Samples with token ids >= 1 (so PAD_ID is recognizable), labels shifted within the sample and
    a masked prompt of random length."""
    lengths = np.minimum(rng.geometric(4 / seq_len, num_samples), seq_len)
    input_ids = [rng.integers(1, 1000, length, dtype=np.int32) for length in lengths]
    labels = []
    for ids in input_ids:
        sample_labels = np.append(ids[1:], IGNORE_INDEX).astype(np.int32)
        sample_labels[: rng.integers(0, len(ids))] = IGNORE_INDEX
        labels.append(sample_labels)
    return input_ids, labels


def exported_documents(table) -> Counter:
    """The documents of an export's packed rows (a Parquet table), counted: each as its tokens
    and labels (a document: a run of one ``document_ids`` value; padding left out)."""
    found: Counter = Counter()
    columns = ("input_ids", "labels", "document_ids", "num_tokens")
    for ids, labels, documents, tokens in zip(
        *(table.column(name).to_pylist() for name in columns), strict=True
    ):
        ids, labels, documents = (np.array(v[:tokens]) for v in (ids, labels, documents))
        cuts = [0, *(np.flatnonzero(np.diff(documents)) + 1).tolist(), tokens]
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            found[ids[start:end].tobytes() + labels[start:end].tobytes()] += 1
    return found
