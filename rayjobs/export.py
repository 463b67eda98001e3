"""``rayjobs export``: run the data side only and write the packed rows as Parquet plus a manifest.

Layout of ``OUT``: ``epoch_<e>/*.parquet`` (the data-contract columns as ``fixed_size_list<int32>``
of ``seq_len``, plus ``num_tokens`` and ``num_documents``) and ``manifest.json``: the validated
config, per-dataset accounting (the same numbers as the run summary), the realized mix and the pack
counts of each epoch, so exported data can be audited and reused by any trainer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rayjobs.collate import PACKED_COLUMNS
from rayjobs.config import Config

MANIFEST = "manifest.json"


def to_arrow(batch: dict[str, np.ndarray]) -> pa.Table:
    """Packed rows (2-D numpy columns) → Arrow with fixed-size list columns."""
    columns = {}
    for name in PACKED_COLUMNS:
        values = np.ascontiguousarray(batch[name], dtype=np.int32)
        columns[name] = pa.FixedSizeListArray.from_arrays(values.reshape(-1), values.shape[1])
    for name in ("num_tokens", "num_documents"):
        columns[name] = pa.array(np.asarray(batch[name], dtype=np.int32))
    return pa.table(columns)


def export(config: Config, out: str | os.PathLike, epochs: int | None = None) -> dict[str, Any]:
    """Write every epoch's packed rows under ``out`` and return the manifest (also written)."""
    import ray

    from rayjobs.metrics import Ledger
    from rayjobs.pipeline import accounting, build_epochs, init_ray

    out = Path(out)
    init_ray(config)
    ledger = Ledger.remote("export")
    planner = build_epochs(config, ledger)
    num_epochs = epochs or config.train.epochs
    mixes = []
    for epoch in range(num_epochs):
        rows = planner.packed(epoch).map_batches(to_arrow, batch_format="numpy")
        rows.write_parquet(str(out / f"epoch_{epoch}"))
        mixes.append(planner.realized_mix(epoch))
    snapshot = ray.get(ledger.snapshot.remote())
    manifest = {
        "config": config.model_dump(mode="json"),
        "seq_len": config.packing.seq_len,
        "columns": list(PACKED_COLUMNS) + ["num_tokens", "num_documents"],
        "epochs": [{"epoch": epoch, "path": f"epoch_{epoch}", "mix": mixes[epoch],
                    "packs": snapshot["pack"][epoch]} for epoch in range(num_epochs)],
        "max_delay_windows": planner.max_delay_windows,
        **accounting(snapshot),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return manifest
