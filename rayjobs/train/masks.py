"""Document masks from ``document_ids``: the dense mask (SDPA, CPU) and the BlockMask
(FlexAttention).

A packed row (``rayjobs.data.rows``) holds several documents, recorded as ``document_ids``. The
rule: query q attends key kv iff both are in the same document and q >= kv. Padding is a document
like any other, so every query row attends at least to itself (no NaN rows); its labels are -100, so
it never reaches the loss.

Preference rows (``rayjobs.data.preference``) add one thing: a response document also sees its
prompt, which is a *different* document (chosen and rejected share one prompt, but must not see each
other). So every function here takes an optional ``parent_ids`` [B,S], the one other document a
query's document may attend to, and the rule becomes: q attends kv iff q >= kv and
(``document_ids[q] == document_ids[kv]`` or ``parent_ids[q] == document_ids[kv]``). With
``parent_ids=None`` (or ``parent_ids == document_ids``) that is exactly the rule above, so SFT and
DPO rows share one definition.

Sliding-window attention (Mistral, the sliding layers of Gemma 2/3, Qwen2 with
``use_sliding_window``...) adds one more condition where a ``window`` is given: q attends kv only
if ``position_ids[q] - position_ids[kv] < window``, transformers' own rule (``kv > q - window``)
written with positions rather than row indices. Within a document the two are the same; a
response of a preference row sits after the other response in the row but continues its prompt's
positions, so positions give the distance it has unpacked. Every form below follows the rule:

- ``document_causal_mask``: dense [B,S,S] boolean mask for SDPA (the CPU path; FlexAttention has no
  backward on CPU in torch 2.13).
- ``document_mask_mod`` and ``block_mask``: the same rule for FlexAttention (the CUDA path).
- ``hf_attention_mask``: the form a Hugging Face model's attention backend takes as its
  ``attention_mask``, built from the two above. transformers (5.x, ``masking_utils``) returns a
  4-D ``attention_mask`` (a tensor or a BlockMask) as it is, without building its own causal mask:
  ``sdpa`` takes the boolean [B,1,S,S] mask (True = attend), ``eager`` adds the mask to its
  scores, so it gets an additive float mask (0 where allowed, the dtype's minimum elsewhere), and
  ``flex_attention`` takes the BlockMask.

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
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_parent_ids(document_ids: torch.Tensor, parent_ids: torch.Tensor | None) -> None:
    if parent_ids is not None and parent_ids.shape != document_ids.shape:
        raise ValueError(
            f"parent_ids has shape {tuple(parent_ids.shape)} but document_ids "
            f"{tuple(document_ids.shape)}; give one parent document id per token."
        )


def _check_window(
    document_ids: torch.Tensor, position_ids: torch.Tensor | None, window: int | None
) -> None:
    if window is None:
        return
    if window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}.")
    if position_ids is None or position_ids.shape != document_ids.shape:
        raise ValueError(
            "a sliding window needs position_ids of document_ids' shape "
            f"{tuple(document_ids.shape)}, got "
            f"{None if position_ids is None else tuple(position_ids.shape)}."
        )


def document_causal_mask(
    document_ids: torch.Tensor,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Dense bool [B,S,S]: ``mask[b, q, kv]`` is True iff q >= kv and kv is in q's document (or,
    when ``parent_ids`` [B,S] is given, in q's parent document; see the module note), and, with a
    ``window``, fewer than ``window`` positions (``position_ids`` [B,S]) before q."""
    _check_parent_ids(document_ids, parent_ids)
    _check_window(document_ids, position_ids, window)
    seq_len = document_ids.shape[1]
    allowed = document_ids[:, :, None] == document_ids[:, None, :]
    if parent_ids is not None:
        allowed |= parent_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    allowed &= causal
    if window is not None:
        allowed &= position_ids[:, :, None] - position_ids[:, None, :] < window
    return allowed


def additive_mask(
    document_ids: torch.Tensor,
    dtype: torch.dtype,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Float [B,1,S,S] of ``dtype``: 0 where ``document_causal_mask`` allows attention, the dtype's
    most negative finite value elsewhere (finite, so a softmax over a row never sees inf - inf)."""
    allowed = document_causal_mask(document_ids, parent_ids, position_ids, window)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def document_mask_mod(
    document_ids: torch.Tensor,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> MaskMod:
    """FlexAttention ``mask_mod`` for the document-causal rule over ``document_ids`` [B,S] (and
    ``parent_ids`` [B,S] when given; with a ``window``, over ``position_ids`` [B,S] too)."""
    _check_window(document_ids, position_ids, window)
    unwindowed = _document_mask_mod(document_ids, parent_ids)
    if window is None:
        return unwindowed

    def windowed_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        near = position_ids[b, q_idx] - position_ids[b, kv_idx] < window
        return unwindowed(b, h, q_idx, kv_idx) & near

    return windowed_mask_mod


def _document_mask_mod(document_ids: torch.Tensor, parent_ids: torch.Tensor | None) -> MaskMod:
    _check_parent_ids(document_ids, parent_ids)
    if parent_ids is None:

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

        return mask_mod

    def preference_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        kv_document = document_ids[b, kv_idx]
        visible = (document_ids[b, q_idx] == kv_document) | (parent_ids[b, q_idx] == kv_document)
        return visible & (q_idx >= kv_idx)

    return preference_mask_mod


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    # Built on first use: torch.compile has a start-up cost even before compiling anything.
    return torch.compile(create_block_mask)


def block_mask(
    document_ids: torch.Tensor,
    block_size: int = 128,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> BlockMask:
    """FlexAttention BlockMask for ``document_ids`` [B,S] (and ``parent_ids`` [B,S] when given;
    ``position_ids`` and ``window`` as in ``document_causal_mask``), on ``document_ids.device``,
    one mask per row.

    Call it on the rank, in the step: the result holds a closure over ``document_ids``.
    """
    batch_size, seq_len = document_ids.shape
    build = (
        create_block_mask if document_ids.device.type == "cpu" else _compiled_create_block_mask()
    )
    return build(
        document_mask_mod(document_ids, parent_ids, position_ids, window),
        B=batch_size,
        H=None,
        Q_LEN=seq_len,
        KV_LEN=seq_len,
        device=document_ids.device,
        BLOCK_SIZE=block_size,
    )


HF_ATTENTION = ("sdpa", "eager", "flex_attention")
"""The Hugging Face attention implementations ``hf_attention_mask`` serves."""


def hf_attention_mask(
    document_ids: torch.Tensor,
    implementation: str,
    dtype: torch.dtype = torch.float32,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor | BlockMask:
    """The document-causal mask as a Hugging Face model's ``attention_mask`` for ``implementation``
    (its ``config._attn_implementation``): a bool [B,1,S,S] for ``sdpa``, an additive [B,1,S,S] of
    ``dtype`` (the attention scores' dtype) for ``eager``, a BlockMask for ``flex_attention``;
    ``parent_ids``, ``position_ids`` and ``window`` as in the module note. For a model with
    sliding-window layers, ``hf.hf_model_mask`` gives each kind of layer its mask."""
    if implementation == "sdpa":
        return document_causal_mask(document_ids, parent_ids, position_ids, window)[:, None]
    if implementation == "eager":
        return additive_mask(document_ids, dtype, parent_ids, position_ids, window)
    if implementation == "flex_attention":
        return block_mask(
            document_ids, parent_ids=parent_ids, position_ids=position_ids, window=window
        )
    raise ValueError(
        f"attention implementation {implementation!r} has no document mask here; "
        f"use one of {', '.join(HF_ATTENTION)}"
    )
