"""A mask as tiles: the (full, partial) tiles of a dense mask and of a BlockMask, to hold one
against the other (the mask tests and the GPU checks)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask


def tiles_from_dense(mask: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce a dense [B,S,S] mask to [B,S/bs,S/bs] tiles: (full = all True, partial = some but not
    all)."""
    batch_size, seq_len, _ = mask.shape
    num_blocks = seq_len // block_size
    tiles = mask.reshape(batch_size, num_blocks, block_size, num_blocks, block_size).transpose(2, 3)
    full = tiles.all(dim=(-1, -2))
    return full, tiles.any(dim=(-1, -2)) & ~full


def tiles_from_block_mask(block_mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
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
