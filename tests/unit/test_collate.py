"""Tests for rayjobs.train.collate: what a train step receives from a batch of packed rows."""

from __future__ import annotations

import numpy as np
import torch

from rayjobs.train.collate import collate


# C1 / C2: collate keeps the streaming path's epoch and the rows' own num_tokens
def test_collate_keeps_epoch_and_num_tokens():
    row = np.array([5, 6, 7, 0], dtype=np.int32)
    batch = {
        "input_ids": np.stack([row, row]),
        "labels": np.array([[6, -100, -100, -100], [6, 7, -100, -100]], dtype=np.int32),
        "position_ids": np.array([[0, 1, 2, 0]] * 2, dtype=np.int32),
        "document_ids": np.array([[0, 0, 0, 1]] * 2, dtype=np.int32),
        "num_tokens": np.array([3, 3], dtype=np.int32),
        "num_documents": np.array([1, 1], dtype=np.int32),
        "epoch": np.array([2, 2]),
    }
    out = collate(batch)
    assert out["num_tokens"].tolist() == [3, 3]  # non-pad tokens, not labelled ones (1, 2)
    assert out["epoch"].tolist() == [2, 2]
    assert out["labels"].dtype == torch.int64 and out["labels"][1].tolist() == [6, 7, -100, -100]
