"""Tests for rayjobs.masks: a scenario table for the layout, then every derivation checked against
an independent reference (python loops, tiles of the dense mask, SDPA with the dense mask)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from rayjobs import masks


def _random_rows(rng: np.random.Generator, batch_size: int, seq_len: int) -> list[list[int]]:
    """Per row, 2-6 document lengths filling most of ``seq_len``, leaving room for padding."""
    rows = []
    for _ in range(batch_size):
        num_documents = int(rng.integers(2, 7))
        cuts = np.sort(rng.choice(np.arange(1, seq_len - 4), size=num_documents, replace=False))
        rows.append(np.diff(cuts, prepend=0).tolist())
    return rows


def _document_ids(rows: list[list[int]], seq_len: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([masks.layout_from_lengths(row, seq_len)[0] for row in rows])).long()


# ---------------------------------------------------------------- layout_from_lengths, scenario table

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
def test_layout_from_lengths(lengths, seq_len, document_ids, position_ids):
    got_document_ids, got_position_ids = masks.layout_from_lengths(lengths, seq_len)
    assert got_document_ids.dtype == np.int32 and got_position_ids.dtype == np.int32
    assert got_document_ids.tolist() == document_ids
    assert got_position_ids.tolist() == position_ids


@pytest.mark.parametrize(
    ("lengths", "seq_len", "message"),
    [
        ([4, 4], 7, "more than seq_len=7"),
        ([3, 0], 7, "must be positive"),
        ([3, -1], 7, "must be positive"),
        ([1], 0, "seq_len must be positive"),
    ],
)
def test_layout_from_lengths_rejects(lengths, seq_len, message):
    with pytest.raises(ValueError, match=message):
        masks.layout_from_lengths(lengths, seq_len)


def test_docstring_examples():
    assert doctest.testmod(masks).failed == 0


# ---------------------------------------------------------------- all derivations agree


def test_dense_mask_matches_python_loops():
    rng = np.random.default_rng(0)
    seq_len = 24
    rows = _random_rows(rng, batch_size=4, seq_len=seq_len)
    document_ids = _document_ids(rows, seq_len)
    assert all(len(row) >= 2 and sum(row) < seq_len for row in rows)  # guard: multi-document + padding

    expected = torch.zeros(len(rows), seq_len, seq_len, dtype=torch.bool)
    for b in range(len(rows)):
        for q in range(seq_len):
            for kv in range(seq_len):
                expected[b, q, kv] = bool(document_ids[b, q] == document_ids[b, kv]) and q >= kv

    mask = masks.document_causal_mask(document_ids)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert mask.any(dim=-1).all()  # every query row, padding included, attends somewhere


def test_position_ids_and_cu_seqlens_agree_with_layout():
    rng = np.random.default_rng(1)
    seq_len = 32
    # Random rows, then two exact-fit rows that both start with document 0 right after a row ending in
    # document 0: the row start must still be a boundary.
    rows = [*_random_rows(rng, batch_size=5, seq_len=seq_len), [seq_len], [20, 12]]
    layouts = [masks.layout_from_lengths(row, seq_len) for row in rows]
    document_ids = torch.from_numpy(np.stack([d for d, _ in layouts])).long()
    position_ids = torch.from_numpy(np.stack([p for _, p in layouts])).long()
    assert document_ids[-2, -1] == document_ids[-1, 0] == 0  # guard: the cross-row case is present

    assert torch.equal(masks.position_ids_from_document_ids(document_ids), position_ids)

    documents = [[*row, seq_len - sum(row)] if sum(row) < seq_len else row for row in rows]
    expected = [r * seq_len + start for r, row in enumerate(documents) for start in np.cumsum([0, *row[:-1]])]
    boundaries, max_seqlen = masks.cu_seqlens(document_ids)
    assert boundaries.dtype == torch.int32
    assert boundaries.tolist() == [*expected, len(rows) * seq_len]
    assert max_seqlen == max(max(row) for row in documents) == seq_len


# ---------------------------------------------------------------- BlockMask vs the dense mask


def _tiles_from_dense(mask: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce a dense [B,S,S] mask to [B,S/bs,S/bs] tiles: (full = all True, partial = some but not all)."""
    batch_size, seq_len, _ = mask.shape
    num_blocks = seq_len // block_size
    tiles = mask.reshape(batch_size, num_blocks, block_size, num_blocks, block_size).transpose(2, 3)
    full = tiles.all(dim=(-1, -2))
    return full, tiles.any(dim=(-1, -2)) & ~full


def _tiles_from_block_mask(block_mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The BlockMask's (full, partial) tiles as [B,num_q_blocks,num_kv_blocks] bools (head 0)."""

    def tiles(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        batch_size, _, num_q_blocks, num_kv_blocks = indices.shape
        out = torch.zeros(batch_size, num_q_blocks, num_kv_blocks, dtype=torch.bool)
        for b in range(batch_size):
            for q in range(num_q_blocks):
                out[b, q, indices[b, 0, q, : num_blocks[b, 0, q]].long()] = True
        return out

    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return full, tiles(block_mask.kv_num_blocks, block_mask.kv_indices)


def test_block_mask_structure_matches_dense_tiles():
    seq_len, block_size = 640, 128
    rows = [
        [300, 200, 90],  # a document spanning 2+ tiles (full tiles), borders inside tiles, padding
        [128, 256, 100, 50],  # borders on tile edges and inside, padding
        [40, 40, 40, 520],  # small documents in one tile, then a long one filling the row exactly
    ]
    document_ids = _document_ids(rows, seq_len)
    full, partial = _tiles_from_dense(masks.document_causal_mask(document_ids), block_size)
    # guards: full and partial tiles both occur, and rows differ (B=None would broadcast row 0)
    assert full.any() and partial.any()
    assert not torch.equal(full[0], full[1]) and not torch.equal(partial[0], partial[2])

    block_mask = masks.block_mask(document_ids, block_size=block_size)
    assert block_mask.shape == (len(rows), 1, seq_len, seq_len)
    got_full, got_partial = _tiles_from_block_mask(block_mask)
    assert torch.equal(got_full, full)
    assert torch.equal(got_partial, partial)


def test_compiled_flex_forward_matches_sdpa():
    """Compiled flex honours block sparsity (eager does not), so this checks the BlockMask end to end."""
    torch.manual_seed(0)
    batch_size, num_heads, seq_len, head_dim = 2, 2, 256, 16
    rows = [[128, 100], [20, 150, 70]]
    document_ids = _document_ids(rows, seq_len)
    assert all(len(row) >= 2 and sum(row) < seq_len for row in rows)  # guard: multi-document + padding
    # guard: row 0 skips a tile that row 1 needs, so broadcasting row 0's blocks (B=None) would be wrong
    full, partial = _tiles_from_dense(masks.document_causal_mask(document_ids), block_size=128)
    visited = full | partial
    assert (visited[1] & ~visited[0]).any()
    q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim) for _ in range(3))

    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.document_causal_mask(document_ids)[:, None])
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, block_mask=masks.block_mask(document_ids))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_layout_rows_equals_layout_from_lengths_row_by_row():
    rng = np.random.default_rng(11)
    rows = [rng.integers(1, 20, rng.integers(0, 5)) for _ in range(40)]
    rows = [r for r in rows if r.sum() <= 64]
    rows.append(np.array([30, 34]))  # a full row: no padding segment
    document_ids, position_ids = masks.layout_rows(np.concatenate(rows), [len(r) for r in rows], 64)
    assert any(len(r) == 0 for r in rows) and any(len(r) >= 3 for r in rows), "guard: varied rows"
    for row, lengths in enumerate(rows):
        expected_documents, expected_positions = masks.layout_from_lengths(lengths, 64)
        np.testing.assert_array_equal(document_ids[row], expected_documents)
        np.testing.assert_array_equal(position_ids[row], expected_positions)


@given(st.lists(st.tuples(st.integers(0, 2**31 - 100), st.integers(0, 20)), max_size=30))
def test_ranges_equals_concatenated_aranges(pairs):
    starts = np.array([s for s, _ in pairs], dtype=np.int64)
    lengths = np.array([n for _, n in pairs], dtype=np.int64)
    expected = np.concatenate([np.arange(s, s + n) for s, n in pairs] + [np.empty(0, dtype=np.int64)])
    np.testing.assert_array_equal(masks.ranges(starts, lengths, np.int32), expected)
