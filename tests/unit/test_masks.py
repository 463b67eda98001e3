"""Tests for rayjobs.train.masks: the dense mask and the BlockMask, each checked against an
independent reference (python loops, tiles of the dense mask, SDPA with the dense mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from rayjobs.data.rows import layout_rows
from rayjobs.train import masks
from support.tiles import tiles_from_block_mask, tiles_from_dense


def _random_rows(rng: np.random.Generator, batch_size: int, seq_len: int) -> list[list[int]]:
    """Per row, 2-6 document lengths filling most of ``seq_len``, leaving room for padding."""
    rows = []
    for _ in range(batch_size):
        num_documents = int(rng.integers(2, 7))
        cuts = np.sort(rng.choice(np.arange(1, seq_len - 4), size=num_documents, replace=False))
        rows.append(np.diff(cuts, prepend=0).tolist())
    return rows


def _document_ids(rows: list[list[int]], seq_len: int) -> torch.Tensor:
    lengths = np.array([n for row in rows for n in row], dtype=np.int64)
    return torch.from_numpy(layout_rows(lengths, [len(row) for row in rows], seq_len)[0]).long()


# ---------------------------------------------------------------- all derivations agree


def test_dense_mask_matches_python_loops():
    rng = np.random.default_rng(0)
    seq_len = 24
    rows = _random_rows(rng, batch_size=4, seq_len=seq_len)
    document_ids = _document_ids(rows, seq_len)
    assert all(
        len(row) >= 2 and sum(row) < seq_len for row in rows
    )  # guard: multi-document + padding

    expected = torch.zeros(len(rows), seq_len, seq_len, dtype=torch.bool)
    for b in range(len(rows)):
        for q in range(seq_len):
            for kv in range(seq_len):
                expected[b, q, kv] = bool(document_ids[b, q] == document_ids[b, kv]) and q >= kv

    mask = masks.document_causal_mask(document_ids)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert mask.any(dim=-1).all()  # every query row, padding included, attends somewhere


# ---------------------------------------------------------------- BlockMask vs the dense mask


def test_block_mask_structure_matches_dense_tiles():
    seq_len, block_size = 640, 128
    rows = [
        [300, 200, 90],  # a document spanning 2+ tiles (full tiles), borders inside tiles, padding
        [128, 256, 100, 50],  # borders on tile edges and inside, padding
        [40, 40, 40, 520],  # small documents in one tile, then a long one filling the row exactly
    ]
    document_ids = _document_ids(rows, seq_len)
    full, partial = tiles_from_dense(masks.document_causal_mask(document_ids), block_size)
    # guards: full and partial tiles both occur, and rows differ (B=None would broadcast row 0)
    assert full.any() and partial.any()
    assert not torch.equal(full[0], full[1]) and not torch.equal(partial[0], partial[2])

    block_mask = masks.block_mask(document_ids, block_size=block_size)
    assert block_mask.shape == (len(rows), 1, seq_len, seq_len)
    got_full, got_partial = tiles_from_block_mask(block_mask)
    assert torch.equal(got_full, full)
    assert torch.equal(got_partial, partial)


def test_compiled_flex_forward_matches_sdpa():
    """Compiled flex honours block sparsity (eager does not), so this checks the BlockMask end to
    end."""
    torch.manual_seed(0)
    batch_size, num_heads, seq_len, head_dim = 2, 2, 256, 16
    rows = [[128, 100], [20, 150, 70]]
    document_ids = _document_ids(rows, seq_len)
    assert all(
        len(row) >= 2 and sum(row) < seq_len for row in rows
    )  # guard: multi-document + padding
    # guard: row 0 skips a tile that row 1 needs, so broadcasting row 0's blocks (B=None) would be
    # wrong
    full, partial = tiles_from_dense(masks.document_causal_mask(document_ids), block_size=128)
    visited = full | partial
    assert (visited[1] & ~visited[0]).any()
    q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim) for _ in range(3))

    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=masks.document_causal_mask(document_ids)[:, None]
    )
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, block_mask=masks.block_mask(document_ids))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_compiled_flex_forward_matches_sdpa_on_preference_rows():
    """The same end-to-end check for the preference mask (``parent_ids``,
    ``rayjobs.data.preference``): triples of three documents, responses seeing their prompt and not
    each other."""
    import numpy as np

    from rayjobs.data import preference

    rng = np.random.default_rng(0)
    triples = [
        preference.Triple(*(rng.integers(0, 50, n) for n in lengths))
        for lengths in ((90, 30, 60), (20, 40, 10), (100, 80, 20), (5, 5, 5))
    ]
    rows = preference.assemble_triples(triples, [np.array([0, 1]), np.array([2, 3])], 256, pad_id=0)
    document_ids, parent_ids = (torch.as_tensor(rows[c]) for c in ("document_ids", "parent_ids"))
    dense = masks.document_causal_mask(document_ids, parent_ids)
    assert (dense & ~masks.document_causal_mask(document_ids)).any()  # guard: prompts shared
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 256, 16) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    block = masks.block_mask(document_ids, parent_ids=parent_ids)
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, block_mask=block)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- the forms HF models take


def test_hf_attention_masks_follow_the_same_rule():
    """sdpa: the boolean mask [B,1,S,S]; eager: 0 where it allows, the dtype's minimum elsewhere
    (finite: padding rows stay finite); flex_attention: the BlockMask; others refused."""
    rows = [[5, 7, 3], [9, 4]]
    document_ids = _document_ids(rows, seq_len=20)
    dense = masks.document_causal_mask(document_ids)[:, None]
    assert torch.equal(masks.hf_attention_mask(document_ids, "sdpa"), dense)
    for dtype in (torch.float32, torch.bfloat16):
        additive = masks.hf_attention_mask(document_ids, "eager", dtype)
        assert additive.dtype == dtype and additive.shape == dense.shape
        assert torch.equal(additive == 0, dense)
        assert (additive[~dense] == torch.finfo(dtype).min).all()
        scores = torch.softmax(torch.randn(dense.shape).to(dtype) + additive, dim=-1)
        assert torch.isfinite(scores).all()
    block_mask = masks.hf_attention_mask(document_ids, "flex_attention")
    assert isinstance(block_mask, BlockMask) and block_mask.shape == (2, 1, 20, 20)
    with pytest.raises(ValueError, match="flash_attention_2"):
        masks.hf_attention_mask(document_ids, "flash_attention_2")


# ---------------------------------------------------------------- sliding windows


def test_a_sliding_window_keeps_the_last_positions_of_the_document():
    """With ``window`` w a query sees its own document's last w positions (itself included), as
    transformers' sliding layers do (``kv > q - w``); every form agrees with the dense mask. A
    literal row: documents of 5 and 3 tokens, 2 of padding, window 3."""
    document_ids = _document_ids([[5, 3]], seq_len=10)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]])
    dense = masks.document_causal_mask(document_ids, position_ids=position_ids, window=3)
    seen = [torch.nonzero(dense[0, q]).flatten().tolist() for q in range(10)]
    assert seen == [
        [0],
        [0, 1],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
        [5],
        [5, 6],
        [5, 6, 7],
        [8],
        [8, 9],
    ]
    sdpa = masks.hf_attention_mask(document_ids, "sdpa", position_ids=position_ids, window=3)
    assert torch.equal(sdpa, dense[:, None])
    additive = masks.hf_attention_mask(document_ids, "eager", position_ids=position_ids, window=3)
    assert torch.equal(additive == 0, dense[:, None])
    block = masks.block_mask(document_ids, block_size=2, position_ids=position_ids, window=3)
    full, partial = tiles_from_dense(dense, 2)
    assert torch.equal(tiles_from_block_mask(block)[0], full)
    assert torch.equal(tiles_from_block_mask(block)[1], partial)
    assert not torch.equal(dense, masks.document_causal_mask(document_ids))  # guard: it cut
    with pytest.raises(ValueError, match="a sliding window needs position_ids"):
        masks.document_causal_mask(document_ids, window=3)


def test_a_sliding_window_on_a_preference_row_counts_positions_not_places():
    """A rejected response sits after the chosen one in the row but continues the prompt's
    positions: its window reaches back into the prompt as it would unpacked. Prompt [a b c]
    (document 0: a b at positions 0 1), chosen (c x y: 2 3 4), rejected (c z: 2 3), window 2."""
    document_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2]])
    parent_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 2, 3]])
    dense = masks.document_causal_mask(document_ids, parent_ids, position_ids, window=2)
    seen = [torch.nonzero(dense[0, q]).flatten().tolist() for q in range(7)]
    assert seen == [[0], [0, 1], [1, 2], [2, 3], [3, 4], [1, 5], [5, 6]]
    mod = masks.document_mask_mod(document_ids, parent_ids, position_ids, window=2)
    q, kv = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    assert torch.equal(mod(torch.zeros_like(q), None, q, kv), dense[0])
