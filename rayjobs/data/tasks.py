"""What each task (``config.task``) makes of the data: its samples, its packed rows.

One record per task, so nothing downstream branches on a column name: the Tokenize actor encodes
templated rows with ``encode``, the packer lays packs out with ``assemble``, and a packed row's
samples are its documents over ``documents_per_sample``. The train side's loss for each task is
``rayjobs.train.objectives``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rayjobs.data.flat import encode_flat
from rayjobs.data.preference import (
    DPO_COLUMNS,
    TRIPLE_COLUMNS,
    assemble_triple_rows,
    encode_triples,
)
from rayjobs.data.rows import PACKED_COLUMNS
from rayjobs.data.samples import assemble_samples


@dataclass(frozen=True)
class Task:
    name: str
    sample_columns: tuple[str, ...]
    """A tokenized sample's token columns (list<int32> each)."""
    row_columns: tuple[str, ...]
    """A packed row's per-token columns."""
    documents_per_sample: int
    """Documents a sample becomes in a packed row (a preference triple: 3)."""
    encode: Callable
    """(tokenizer, templated rows, counts, ``samples.Fit``) → (sample columns, row of each)."""
    assemble: Callable
    """(samples, packs, seq_len, pad_id) → packed rows."""
    overflow: tuple[str, ...]
    """The ``packing.overflow`` policies the task allows."""


TASKS = {
    "sft": Task(
        "sft", ("input_ids", "labels"), PACKED_COLUMNS, 1, encode_flat, assemble_samples,
        ("truncate", "drop", "split"),
    ),
    "dpo": Task(
        "dpo", TRIPLE_COLUMNS, DPO_COLUMNS, 3, encode_triples, assemble_triple_rows,
        ("truncate", "drop"),
    ),
}  # fmt: skip
