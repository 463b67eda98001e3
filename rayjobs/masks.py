"""Document boundaries → every mask and index the model needs, in one place.

A packed row of ``seq_len`` tokens holds several documents. The packer records them as
``document_ids`` (0..k-1 in order; padding, if any, is its own last document k) and
``position_ids`` (restarting at 0 at each document start). Everything else is derived here:

- ``layout_from_lengths``: document lengths → ``document_ids``/``position_ids`` (numpy, packer side).
- ``position_ids_from_document_ids`` and ``cu_seqlens``: torch, collate side (FlashAttention varlen).
- ``document_causal_mask``: dense [B,S,S] boolean mask for SDPA (the CPU path; FlexAttention has no
  backward on CPU in torch 2.13).
- ``document_mask_mod`` and ``block_mask``: the same rule for FlexAttention (the CUDA path).

The rule: query q attends key kv iff both are in the same document and q >= kv. Padding is a
document like any other, so every query row attends at least to itself (no NaN rows); its labels
are -100, so it never reaches the loss.

BlockMask notes (torch 2.13): build it on the rank from plain tensors, once per step. Its
``mask_mod`` is a closure over ``document_ids``: it does not pickle with stdlib pickle, and
``BlockMask.to(device)`` does not move the captured tensor. Per-row masks need ``B=batch_size``;
with ``B=None`` row 0's blocks are broadcast to every row, which eager flex hides (it ignores block
sparsity) and compiled flex gets wrong. Eager ``create_block_mask`` materializes the dense
[B,1,S,S] mask, so on CUDA a ``torch.compile``d ``create_block_mask`` is used; a fresh closure
with the same shapes reuses the compiled graph (no recompilation per batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layout_from_lengths(lengths: Sequence[int] | np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Lay out the documents of one pack in a row of ``seq_len`` tokens.

    Args:
        lengths: token count of each document, in pack order; each > 0, sum <= ``seq_len``.
        seq_len: length of the packed row.

    Returns:
        ``(document_ids, position_ids)``, each int32 of shape [seq_len]. Document i gets id i;
        if the documents fill fewer than ``seq_len`` tokens, the padding is one more document with
        id ``len(lengths)``. Position ids restart at 0 at every document start, padding included.

    Raises:
        ValueError: if a length is not positive or the lengths add up to more than ``seq_len``.

    >>> document_ids, position_ids = layout_from_lengths([3, 2], seq_len=7)
    >>> document_ids.tolist()
    [0, 0, 0, 1, 1, 2, 2]
    >>> position_ids.tolist()
    [0, 1, 2, 0, 1, 0, 1]
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    document_ids, position_ids = layout_rows(lengths, np.array([len(lengths)]), seq_len)
    return document_ids[0], position_ids[0]


def row_segments(lengths: np.ndarray, documents_per_row: np.ndarray,
                 seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segments of packed rows, row after row: each row's documents, then its padding.

    Args:
        lengths: token count of every document, row after row, in pack order.
        documents_per_row: how many of ``lengths`` belong to each row.
        seq_len: length of every row.

    Returns:
        ``(segment_lengths, segment_ids, segment_documents)`` in layout order, int64: the length
        of each segment, its id inside the row (documents 0..k-1, padding k) and the index into
        ``lengths`` of its document (-1 for padding). The lengths add up to rows × seq_len.

    Raises:
        ValueError: if a length is not positive or a row's lengths add up to more than ``seq_len``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    documents_per_row = np.asarray(documents_per_row, dtype=np.int64)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    if (lengths <= 0).any():
        raise ValueError(
            f"Every document length must be positive, got {lengths.tolist()[:20]}; drop empty documents before packing."
        )
    num_rows = len(documents_per_row)
    row_of_document = np.repeat(np.arange(num_rows), documents_per_row)
    row_tokens = np.bincount(row_of_document, weights=lengths, minlength=num_rows).astype(np.int64)
    if (row_tokens > seq_len).any():
        row = int(np.flatnonzero(row_tokens > seq_len)[0])
        mine = lengths[row_of_document == row]
        raise ValueError(
            f"Documents of lengths {mine.tolist()} hold {int(row_tokens[row])} tokens, more than seq_len={seq_len}; "
            "the packer must not put them in one row."
        )
    padded = np.flatnonzero(row_tokens < seq_len)
    first_document = np.cumsum(documents_per_row) - documents_per_row
    order = np.argsort(np.concatenate([row_of_document, padded]), kind="stable")
    segment_lengths = np.concatenate([lengths, seq_len - row_tokens[padded]])[order]
    segment_ids = np.concatenate([np.arange(len(lengths)) - first_document[row_of_document],
                                  documents_per_row[padded]])[order]
    segment_documents = np.concatenate([np.arange(len(lengths)),
                                        np.full(len(padded), -1, dtype=np.int64)])[order]
    return segment_lengths, segment_ids, segment_documents


def index_dtype(size: int) -> type:
    """int32 when every index below ``size`` fits (half the memory traffic), else int64."""
    return np.int32 if size < 2**31 else np.int64


def ranges(starts: np.ndarray, lengths: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorized.

    Builds one array in place (ones, a jump at each range start, a cumulative sum): the packer's
    output arrays are large and fresh memory costs a page fault per 4 KiB, so temporaries matter.

    >>> ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist()
    [5, 6, 9, 10, 11]
    """
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    out = np.ones(int(lengths.sum()), dtype=dtype)
    if len(out):
        first = np.cumsum(lengths) - lengths
        out[0] = starts[0]
        out[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
        np.cumsum(out, out=out)
    return out


def layout_rows(lengths: np.ndarray, documents_per_row: np.ndarray,
                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``layout_from_lengths`` for many rows at once, vectorized.

    Args:
        lengths: token count of every document, row after row, in pack order.
        documents_per_row: how many of ``lengths`` belong to each row.
        seq_len: length of every row.

    Returns:
        ``(document_ids, position_ids)``, int32 [num_rows, seq_len], as ``layout_from_lengths``.
    """
    segment_lengths, segment_ids, _ = row_segments(lengths, documents_per_row, seq_len)
    shape = (len(documents_per_row), seq_len)
    document_ids = np.repeat(segment_ids.astype(np.int32), segment_lengths)
    position_ids = ranges(np.zeros_like(segment_lengths), segment_lengths, np.int32)
    return document_ids.reshape(shape), position_ids.reshape(shape)


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B,S]: True at the first token of each document (and at every row start)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def position_ids_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions within each document: int64 [B,S], 0 at each document start, +1 per token after."""
    starts = _document_starts(document_ids)
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    start_of_document = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of_document


def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries over the flattened batch, as FlashAttention's varlen kernels expect.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 [num_documents + 1] offsets into the flattened [B*S]
        tokens, starting at 0 and ending at B*S, with a boundary at every document change and every
        row start (a document never spans rows); and the longest document's length.
    """
    starts = torch.nonzero(_document_starts(document_ids).reshape(-1)).reshape(-1)
    end = torch.tensor([document_ids.numel()], device=document_ids.device)
    boundaries = torch.cat([starts, end]).to(torch.int32)
    return boundaries, int(boundaries.diff().max())


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Dense bool [B,S,S]: ``mask[b, q, kv]`` is True iff q and kv share a document and q >= kv."""
    seq_len = document_ids.shape[1]
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return same_document & causal


def document_mask_mod(document_ids: torch.Tensor) -> MaskMod:
    """FlexAttention ``mask_mod`` for the document-causal rule over ``document_ids`` [B,S]."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    # Built on first use: torch.compile costs ~1.7 s even before compiling anything.
    return torch.compile(create_block_mask)


def block_mask(document_ids: torch.Tensor, block_size: int = 128) -> BlockMask:
    """FlexAttention BlockMask for ``document_ids`` [B,S], on ``document_ids.device``, one mask per row.

    Call it on the rank, in the step: the result holds a closure over ``document_ids``.
    """
    batch_size, seq_len = document_ids.shape
    build = create_block_mask if document_ids.device.type == "cpu" else _compiled_create_block_mask()
    return build(
        document_mask_mod(document_ids),
        B=batch_size,
        H=None,
        Q_LEN=seq_len,
        KV_LEN=seq_len,
        device=document_ids.device,
        BLOCK_SIZE=block_size,
    )
