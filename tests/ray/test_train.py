"""Ray Train side: equal batches per rank, the collective guard, and the real loop on packed
data."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import ray.data
import torch

from rayjobs.train.batches import train_batches
from rayjobs.train.build import hf_attention, resolve_attention

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
    """For each (datasets, batch size, drop_last) case: the rows and batches every rank trained
    on and the batches its guard dropped, gathered from all ranks."""
    import ray.train
    import torch.distributed as dist

    from rayjobs.train.batches import Guard

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    metrics = {}
    for case, (names, batch_size, drop_last) in enumerate(loop_config["cases"]):
        guard = Guard()
        batches = train_batches(
            names[rank], batch_size, device=torch.device("cpu"), guard=guard, drop_last=drop_last
        )
        sizes = [len(b["input_ids"]) for b in batches]
        counts = [torch.zeros(3, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(counts, torch.tensor([sum(sizes), len(sizes), guard.dropped]))
        metrics[f"rows_{case}"] = [int(c[0]) for c in counts]
        metrics[f"batches_{case}"] = [int(c[1]) for c in counts]
        metrics[f"dropped_{case}"] = [int(c[2]) for c in counts]
    with tempfile.TemporaryDirectory() as directory:  # Result.metrics keeps checkpointed reports
        checkpoint = ray.train.Checkpoint.from_directory(directory) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)


def _fit(datasets: dict, loop_config: dict, split: list[str], world_size: int = 2):
    from ray.train import DataConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _count_batches,
        train_loop_config=loop_config,
        datasets=datasets,
        scaling_config=ScalingConfig(num_workers=world_size, resources_per_worker={"CPU": 0.5}),
        dataset_config=DataConfig(datasets_to_split=split),
    )
    return trainer.fit().metrics


# Per world size, (rows, blocks, batch size, drop_last, batches and rows every rank gets) of each
# case, rows uneven over the ranks or the blocks. Rows split equally (floor(rows / world) per rank,
# the remainder dropped), then batches, the last short unless drop_last: e.g. 61 rows over 3 ranks
# = 20 each, 6 batches of 3 and one of 2; 9 rows over 2 ranks = 4 each, none for a batch of 5 with
# drop_last. Two cases a world size: each dataset costs the run a split coordinator and its own
# execution. An even and an odd world size: a 4-rank run (103 rows, 7 blocks, batch 4) checked
# nothing these two do not, for ~20 s of the suite.
CASES = {
    2: [(103, 7, 4, False, 13, 51), (9, 4, 5, True, 0, 0)],
    3: [(61, 5, 3, False, 7, 20), (103, 7, 4, True, 8, 32)],
}


@pytest.mark.e2e
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_equal_batches_per_rank_and_the_guard(ray_local, world_size):
    """Uneven rows and blocks, fractional CPUs: every rank gets the same number of batches.
    With 2 ranks the same run also checks the guard: unsplit datasets of different sizes (rank 0
    has 5 batches of 2, rank 1 has 7) stop both ranks after 5, rank 1's extra batch counted."""
    cases_here = CASES[world_size]
    assert all(rows % world_size or rows % blocks for rows, blocks, *_ in cases_here), "guard"
    datasets = {
        f"case_{i}": _packed_rows(rows, blocks) for i, (rows, blocks, *_) in enumerate(cases_here)
    }
    cases = [
        ([f"case_{i}"] * world_size, size, last)
        for i, (_, _, size, last, *_) in enumerate(cases_here)
    ]
    split = list(datasets)
    if world_size == 2:
        datasets |= {"short": _packed_rows(10, 3), "long": _packed_rows(14, 3)}
        cases.append((["short", "long"], 2, False))
    metrics = _fit(datasets, {"cases": cases}, split=split, world_size=world_size)
    for case, (*_, batches, rows) in enumerate(cases_here):
        assert metrics[f"batches_{case}"] == [batches] * world_size, case
        assert metrics[f"rows_{case}"] == [rows] * world_size, case
        assert metrics[f"dropped_{case}"] == [0] * world_size
    if world_size == 2:
        assert metrics[f"rows_{len(cases_here)}"] == [10, 10]
        assert metrics[f"dropped_{len(cases_here)}"] == [0, 1]


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


def test_train_batches_mask_lets_each_response_see_its_prompt():
    """``train_batches(attn_implementation=...)`` on preference rows: the mask comes from
    ``parent_ids`` too, so a response attends to its prompt and itself, never to the other
    response. One literal triple: prompt [5, 6, 7], chosen [8, 9], rejected [10]; the row is
    5 6 | 7 8 9 | 7 10 | padding (the prompt's last token heads each response)."""
    from rayjobs.data import preference
    from rayjobs.train.batches import attention_mask
    from rayjobs.train.collate import collate

    triple = preference.Triple(np.array([5, 6, 7]), np.array([8, 9]), np.array([10]))
    batch = collate(preference.assemble_triples([triple], [np.array([0])], 10, pad_id=0))
    assert batch["input_ids"][0, :7].tolist() == [5, 6, 7, 8, 9, 7, 10]
    sdpa = attention_mask(batch, "sdpa")
    assert sdpa.shape == (1, 1, 10, 10) and sdpa.dtype == torch.bool
    seen = [torch.nonzero(sdpa[0, 0, q]).flatten().tolist() for q in range(7)]
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 5], [0, 1, 5, 6]]
    assert torch.equal(attention_mask(batch, "eager")[0, 0] == 0, sdpa[0, 0])
    sft = {k: v for k, v in batch.items() if k not in ("parent_ids", "response_role")}
    assert attention_mask(sft, "sdpa")[0, 0, 5].nonzero().flatten().tolist() == [5]  # guard


def test_train_batches_masks_follow_a_models_sliding_window_layers():
    """``train_batches(model_config=...)``: a model whose layers all slide (Mistral) gets the
    windowed mask, one with both kinds (Qwen2 here) a mask per kind; window 3, one row of
    documents of 5 and 3 tokens."""
    from transformers import AutoConfig

    from rayjobs.train import masks
    from rayjobs.train.batches import attention_mask

    batch = {
        "document_ids": torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]),
    }
    full = masks.document_causal_mask(batch["document_ids"])[:, None]
    windowed = masks.document_causal_mask(
        batch["document_ids"], position_ids=batch["position_ids"], window=3
    )[:, None]
    assert not torch.equal(full, windowed)  # guard: the window cuts the first document
    mistral = AutoConfig.for_model("mistral", sliding_window=3, attn_implementation="sdpa")
    assert torch.equal(attention_mask(batch, None, model_config=mistral), windowed)
    qwen2 = AutoConfig.for_model(
        "qwen2", num_hidden_layers=2, use_sliding_window=True, max_window_layers=1,
        sliding_window=3, attn_implementation="sdpa",
    )  # fmt: skip
    per_kind = attention_mask(batch, "sdpa", model_config=qwen2)
    assert per_kind.keys() == {"full_attention", "sliding_attention"}
    assert torch.equal(per_kind["full_attention"], full)
    assert torch.equal(per_kind["sliding_attention"], windowed)
    llama = AutoConfig.for_model("llama", attn_implementation="sdpa")
    assert torch.equal(attention_mask(batch, None, model_config=llama), full)


def _hf_config(use_gpu: bool = False, **model):
    from conftest import ALPACA, GPT2
    from rayjobs.config import config_from_dict

    spec = {"kind": "hf", "config": {"model_type": "llama"}, **model}
    return config_from_dict(
        {
            "datasets": [{"name": "a", "source": str(ALPACA), "template": "alpaca"}],
            "tokenizer": {"path": str(GPT2)},
            "train": {"model": spec, "use_gpu": use_gpu},
        }
    )


@pytest.mark.parametrize(
    "chosen,device,expected",
    [
        (None, "cpu", "sdpa"),
        (None, "cuda", "flex_attention"),
        ("eager", "cpu", "eager"),
        ("sdpa", "cuda", "sdpa"),
        ("flex_attention", "cuda", "flex_attention"),
    ],
)
def test_hf_attention_follows_train_attention_unless_set(chosen, device, expected):
    config = _hf_config(use_gpu=device == "cuda", attn_implementation=chosen)
    assert hf_attention(config, torch.device(device)) == expected


def test_hf_flex_attention_on_cpu_is_refused_naming_the_key():
    """A GPU config on a worker without CUDA (a CPU one is refused at load: test_config)."""
    config = _hf_config(use_gpu=True, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="train.model.attn_implementation: flex_attention"):
        hf_attention(config, torch.device("cpu"))
