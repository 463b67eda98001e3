"""Tests for rayjobs.data.rows, the packed-row contract: the layout scenario table, the vectorized
layout and gather against row-by-row references, and the refusals."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayjobs.data import rows
from rayjobs.data.pack import pack_lengths
from rayjobs.data.rows import IGNORE_INDEX, assemble, layout_rows, ranges
from support.packed import PAD_ID, assemble_bins, random_window


def _layout(lengths: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    document_ids, position_ids = layout_rows(
        np.array(lengths, dtype=np.int64), [len(lengths)], seq_len
    )
    return document_ids[0], position_ids[0]


def _reference_layout(lengths: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """Written out token by token: each document, then one padding document if room is left."""
    segments = list(lengths) + ([seq_len - sum(lengths)] if sum(lengths) < seq_len else [])
    document_ids = [d for d, n in enumerate(segments) for _ in range(n)]
    position_ids = [p for n in segments for p in range(n)]
    return document_ids, position_ids


def test_docstring_examples():
    results = doctest.testmod(rows)
    assert results.attempted >= 7 and results.failed == 0  # guard: the examples ran


# ---------------------------------------------------------------- layout, scenario table

LAYOUT_SCENARIOS = [
    # two documents, 2 tokens of padding: padding is document 2, positions restart for it too
    ([3, 2], 7, [0, 0, 0, 1, 1, 2, 2], [0, 1, 2, 0, 1, 0, 1]),
    # exact fit: no padding document
    ([2, 3], 5, [0, 0, 1, 1, 1], [0, 1, 0, 1, 2]),
    # single document filling the row
    ([4], 4, [0, 0, 0, 0], [0, 1, 2, 3]),
    # single document plus one padding token
    ([3], 4, [0, 0, 0, 1], [0, 1, 2, 0]),
    # one-token documents
    ([1, 1, 1], 4, [0, 1, 2, 3], [0, 0, 0, 0]),
    # empty pack: the whole row is padding, document 0
    ([], 3, [0, 0, 0], [0, 1, 2]),
]


@pytest.mark.parametrize(("lengths", "seq_len", "document_ids", "position_ids"), LAYOUT_SCENARIOS)
def test_layout(lengths, seq_len, document_ids, position_ids):
    got_document_ids, got_position_ids = _layout(lengths, seq_len)
    assert got_document_ids.dtype == np.int32 and got_position_ids.dtype == np.int32
    assert got_document_ids.tolist() == document_ids
    assert got_position_ids.tolist() == position_ids


@pytest.mark.parametrize(
    ("lengths", "seq_len", "message"),
    [
        ([4, 4], 7, "more than seq_len=7"),
        ([3, 0], 7, "must be positive; document 1 has length 0"),
        ([3, -1], 7, "must be positive; document 1 has length -1"),
        ([1] * 25 + [0], 30, "document 25 has length 0 \\(1 such\\)"),  # past a list's first 20
        ([1], 0, "seq_len must be positive"),
    ],
)
def test_layout_rejects(lengths, seq_len, message):
    with pytest.raises(ValueError, match=message):
        _layout(lengths, seq_len)


def test_layout_rows_equals_a_token_by_token_reference():
    rng = np.random.default_rng(11)
    rows_lengths = [rng.integers(1, 20, rng.integers(0, 5)) for _ in range(40)]
    rows_lengths = [r for r in rows_lengths if r.sum() <= 64]
    rows_lengths.append(np.array([30, 34]))  # a full row: no padding segment
    document_ids, position_ids = layout_rows(
        np.concatenate(rows_lengths), [len(r) for r in rows_lengths], 64
    )
    assert any(len(r) == 0 for r in rows_lengths) and any(len(r) >= 3 for r in rows_lengths), (
        "guard: varied rows"
    )
    for row, lengths in enumerate(rows_lengths):
        expected_documents, expected_positions = _reference_layout(lengths.tolist(), 64)
        assert document_ids[row].tolist() == expected_documents
        assert position_ids[row].tolist() == expected_positions


@given(st.lists(st.tuples(st.integers(0, 2**31 - 100), st.integers(0, 20)), max_size=30))
def test_ranges_equals_concatenated_aranges(pairs):
    starts = np.array([s for s, _ in pairs], dtype=np.int64)
    lengths = np.array([n for _, n in pairs], dtype=np.int64)
    expected = np.concatenate(
        [np.arange(s, s + n) for s, n in pairs] + [np.empty(0, dtype=np.int64)]
    )
    np.testing.assert_array_equal(ranges(starts, lengths, np.int32), expected)


# ---------------------------------------------------------------- assembly


def test_assemble_literal() -> None:
    input_ids = [np.array([11, 12, 13]), np.array([21, 22]), np.array([31, 32, 33, 34])]
    labels = [np.array([12, 13, -100]), np.array([-100, -100]), np.array([-100, 33, 34, -100])]
    packed = assemble_bins(input_ids, labels, [np.array([2, 1]), np.array([0])], seq_len=6)
    assert packed["input_ids"].tolist() == [[31, 32, 33, 34, 21, 22], [11, 12, 13, 0, 0, 0]]
    assert packed["labels"].tolist() == [
        [-100, 33, 34, -100, -100, -100],
        [12, 13, -100, -100, -100, -100],
    ]
    assert packed["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert packed["num_documents"].tolist() == [2, 1]
    assert packed["num_tokens"].tolist() == [6, 3]
    assert set(packed) == set(rows.PACKED_COLUMNS) | set(rows.STAT_COLUMNS)


def test_assemble_from_shuffled_chunks_equals_a_row_by_row_reference() -> None:
    """Documents stored in shuffled chunks (as Arrow hands them to ``AssemblePacks``) gather into
    the same rows as concatenating each bin's samples by hand."""
    rng = np.random.default_rng(5)
    seq_len = 48
    input_ids, labels = random_window(rng, num_samples=120, seq_len=seq_len)
    bins = pack_lengths(np.array([len(ids) for ids in input_ids]), seq_len, "first_fit")
    stored = rng.permutation(len(input_ids))  # storage order differs from pack order
    chunks = np.array_split(stored, 7)
    lengths = np.array([len(ids) for ids in input_ids])
    starts = np.empty(len(input_ids), dtype=np.int64)
    starts[stored] = np.cumsum(lengths[stored]) - lengths[stored]
    order = np.concatenate(bins)
    packed = assemble(
        [np.concatenate([input_ids[i] for i in chunk]) for chunk in chunks],
        [np.concatenate([labels[i] for i in chunk]) for chunk in chunks],
        starts[order],
        lengths[order],
        np.array([len(b) for b in bins]),
        seq_len,
        PAD_ID,
    )
    full = [sum(lengths[b]) == seq_len for b in bins]
    assert any(full) and not all(full), "guard: full rows and padded rows"
    assert max(len(b) for b in bins) >= 3, "guard: a row holds several documents"
    for row, indices in enumerate(bins):
        tokens = np.concatenate([input_ids[i] for i in indices])
        padding = seq_len - len(tokens)
        np.testing.assert_array_equal(
            packed["input_ids"][row], np.append(tokens, [PAD_ID] * padding)
        )
        np.testing.assert_array_equal(
            packed["labels"][row],
            np.concatenate([labels[i] for i in indices] + [np.full(padding, IGNORE_INDEX)]),
        )
        expected_documents, expected_positions = _reference_layout(
            [int(lengths[i]) for i in indices], seq_len
        )
        assert packed["document_ids"][row].tolist() == expected_documents
        assert packed["position_ids"][row].tolist() == expected_positions


@pytest.mark.parametrize(
    ("tokens", "labels", "starts", "lengths", "per_row", "message"),
    [
        (
            [np.arange(5)],
            [np.arange(5)],
            [0, 3],
            [2, 3],
            [2],
            r"Document 1 \(start 3, 3 tokens\) reaches outside the 5 tokens",
        ),
        ([np.arange(6)], [np.arange(5)], [0], [6], [1], "Got 6 tokens but 5 labels"),
        (
            [np.arange(11)],
            [np.arange(11)],
            [0, 6],
            [6, 5],
            [2],
            r"Row 0 holds documents of lengths \[6, 5\], 11 tokens, more than seq_len=8",
        ),
        ([np.arange(4)], [np.arange(4)], [0, 2], [2, 0], [2], "must be positive"),
    ],
)
def test_assemble_rejects(tokens, labels, starts, lengths, per_row, message) -> None:
    with pytest.raises(ValueError, match=message):
        assemble(
            tokens,
            labels,
            np.array(starts),
            np.array(lengths),
            np.array(per_row),
            seq_len=8,
            pad_id=PAD_ID,
        )
