"""Collate: a batch of packed rows (numpy, from Ray Data) → torch tensors on the rank's device.

Packed rows already hold ``position_ids`` and ``document_ids``; masks are built later, inside the
model's forward on the rank's device (a BlockMask never travels through a DataLoader or pickle).
``cu_seqlens``/``max_seqlen`` come from the same ``document_ids`` through ``masks.cu_seqlens`` for
kernels that take variable-length batches.
"""

from __future__ import annotations

import numpy as np
import torch

from rayjobs import masks

PACKED_COLUMNS = ("input_ids", "labels", "position_ids", "document_ids")


def collate(batch: dict[str, np.ndarray], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Stack the data-contract columns into int64 [B, seq_len] tensors on ``device``.

    Also returns ``num_tokens`` (non-pad tokens per row), ``cu_seqlens`` and ``max_seqlen``.
    """
    out = {name: torch.as_tensor(np.stack(list(batch[name])).astype(np.int64), device=device)
           for name in PACKED_COLUMNS}
    out["num_tokens"] = torch.as_tensor(np.asarray(batch["num_tokens"], dtype=np.int64), device=device)
    out["cu_seqlens"], max_seqlen = masks.cu_seqlens(out["document_ids"])
    out["max_seqlen"] = torch.tensor(max_seqlen)
    return out
