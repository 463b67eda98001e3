"""Ray Train side: equal batches per rank, the collective guard, and the real loop on packed
data."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import ray.data
import torch

from rayjobs.train import rank_batches, resolve_attention

SEQ_LEN = 8


def _packed_rows(num_rows: int, num_blocks: int) -> ray.data.Dataset:
    """Synthetic rows in the packed data contract: two documents of 3 and 5 tokens each."""
    document_ids = np.array([0, 0, 0, 1, 1, 1, 1, 1], dtype=np.int32)
    position_ids = np.array([0, 1, 2, 0, 1, 2, 3, 4], dtype=np.int32)

    def make(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["id"])
        ids = (batch["id"][:, None] + np.arange(SEQ_LEN)).astype(np.int32)
        return {
            "input_ids": ids,
            "labels": ids,
            "position_ids": np.tile(position_ids, (n, 1)),
            "document_ids": np.tile(document_ids, (n, 1)),
            "num_tokens": np.full(n, SEQ_LEN, np.int32),
            "num_documents": np.full(n, 2, np.int32),
        }

    return ray.data.range(num_rows, override_num_blocks=num_blocks).map_batches(make)


def _count_batches(loop_config: dict) -> None:
    import ray.train

    context = ray.train.get_context()
    name = loop_config["dataset_of_rank"][context.get_world_rank()]
    shard = ray.train.get_dataset_shard(name)
    from rayjobs.train import _Guard

    guard = _Guard()
    rows = sum(
        len(b["input_ids"])
        for b in rank_batches(shard, loop_config["batch_size"], torch.device("cpu"), guard)
    )
    import torch.distributed as dist

    counts = [torch.zeros(2, dtype=torch.long) for _ in range(context.get_world_size())]
    dist.all_gather(counts, torch.tensor([rows, guard.dropped]))
    metrics = {"rows": [int(c[0]) for c in counts], "dropped": [int(c[1]) for c in counts]}
    with (
        tempfile.TemporaryDirectory() as directory
    ):  # Result.metrics keeps checkpointed reports only
        checkpoint = (
            ray.train.Checkpoint.from_directory(directory)
            if context.get_world_rank() == 0
            else None
        )
        ray.train.report(metrics, checkpoint=checkpoint)


def _fit(datasets: dict, loop_config: dict, split: bool):
    from ray.train import DataConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _count_batches,
        train_loop_config=loop_config,
        datasets=datasets,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        dataset_config=DataConfig(datasets_to_split="all" if split else []),
    )
    return trainer.fit().metrics


@pytest.mark.parametrize(
    "num_rows,num_blocks,batch_size,expected_batches",
    [
        (
            103,
            7,
            4,
            12,
        ),  # 51 rows per rank (1 tail row dropped), blocks of 14-15 rows; 51 // 4 = 12
        (61, 5, 3, 10),  # 30 rows per rank; 30 // 3 = 10
        (9, 4, 5, 0),  # 4 rows per rank: not one full batch anywhere
    ],
)
def test_equal_batches_per_rank(ray_local, num_rows, num_blocks, batch_size, expected_batches):
    assert num_rows % 2 or num_rows % num_blocks, "guard: rows must not divide evenly"
    metrics = _fit(
        {"train": _packed_rows(num_rows, num_blocks)},
        {"dataset_of_rank": ["train", "train"], "batch_size": batch_size},
        split=True,
    )
    assert metrics["rows"] == [expected_batches * batch_size] * 2
    assert metrics["dropped"] == [0, 0]


def test_guard_stops_every_rank_when_one_runs_out(ray_local):
    # Unsplit datasets of different sizes: rank 0 has 5 batches of 2, rank 1 has 7.
    datasets = {"short": _packed_rows(10, 3), "long": _packed_rows(14, 3)}
    metrics = _fit(datasets, {"dataset_of_rank": ["short", "long"], "batch_size": 2}, split=False)
    assert metrics["rows"] == [10, 10]
    assert metrics["dropped"] == [0, 1]


@pytest.mark.parametrize(
    "requested,device,expected",
    [
        ("auto", "cpu", "sdpa"),
        ("auto", "cuda", "flex"),
        ("sdpa", "cuda", "sdpa"),
        ("flex", "cuda", "flex"),
    ],
)
def test_resolve_attention(requested, device, expected):
    assert resolve_attention(requested, torch.device(device)) == expected


def test_flex_on_cpu_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        resolve_attention("flex", torch.device("cpu"))
