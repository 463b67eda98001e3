"""Collate: a batch of packed rows (numpy, from Ray Data) → torch tensors on the rank's device.

Packed rows (``rayjobs.data.rows``) already hold ``position_ids`` and ``document_ids``; masks are
built later, inside the model's forward on the rank's device (a BlockMask never travels through a
DataLoader or pickle). Nothing here reads values back to the host, so a GPU step never waits on it.
"""

from __future__ import annotations

import numpy as np
import torch

from rayjobs.data.preference import PREFERENCE_COLUMNS
from rayjobs.data.rows import PACKED_COLUMNS


def collate(
    batch: dict[str, np.ndarray], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The packed-row columns as int64 [B, seq_len] tensors on ``device`` (with ``parent_ids`` and
    ``response_role`` for preference rows), plus ``num_tokens`` [B] (non-pad tokens per row)."""
    out = {
        name: torch.as_tensor(np.stack(list(batch[name])).astype(np.int64), device=device)
        for name in PACKED_COLUMNS
    }
    for name in PREFERENCE_COLUMNS:  # task: dpo rows (rayjobs.data.preference)
        if name in batch:
            out[name] = torch.as_tensor(np.stack(list(batch[name])).astype(np.int64), device=device)
    out["num_tokens"] = torch.as_tensor(
        np.asarray(batch["num_tokens"], dtype=np.int64), device=device
    )
    if "epoch" in batch:  # the streaming path's rows say which epoch they belong to
        out["epoch"] = torch.as_tensor(np.asarray(batch["epoch"], dtype=np.int64))
    return out
