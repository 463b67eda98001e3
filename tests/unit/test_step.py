"""The optimizer step (``step.train_step``), without Ray: gradient accumulation gives the
gradient of one larger batch, clipping bounds the update, bf16 autocast runs on CPU, the LR
schedule's literal values, and FSDP2 over two gloo processes takes the same step as one process
on the whole batch (demo decoder and a tiny Llama)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import socket
import types

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rayjobs.config import TrainConfig
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.train import build, checkpoint, objectives, step
from rayjobs.train.build import lr_lambda, parallelize, transformer_blocks
from rayjobs.train.checkpoint import full_state, save_model
from rayjobs.train.collate import collate
from rayjobs.train.hf import build_hf_model
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM
from rayjobs.train.step import train_step
from support.models import tiny_llama

VOCAB = 97
SEQ = 32
LLAMA = tiny_llama(64, initializer_range=0.02)  # the transformers default


def _rows(num_rows: int, seed: int) -> dict[str, np.ndarray]:
    """Packed rows of 2-3 documents with their labels shifted inside each document; the
    documents' lengths (so the labelled-token counts) differ from row to row."""
    rng = np.random.default_rng(seed)
    columns = {"input_ids": [], "labels": [], "position_ids": [], "document_ids": []}
    for _ in range(num_rows):
        cuts = np.sort(rng.choice(np.arange(4, SEQ - 4), size=rng.integers(1, 3), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [SEQ]]))
        ids = rng.integers(0, VOCAB, SEQ)
        labels = np.full(SEQ, IGNORE_INDEX)
        positions, documents, start = [], [], 0
        for d, n in enumerate(lengths):
            labels[start : start + n - 1] = ids[start + 1 : start + n]
            positions += list(range(n))
            documents += [d] * n
            start += n
        labels[: rng.integers(0, 6)] = IGNORE_INDEX  # an untrained prompt
        for name, value in zip(columns, (ids, labels, positions, documents), strict=True):
            columns[name].append(np.asarray(value, dtype=np.int32))
    out = {name: np.stack(values) for name, values in columns.items()}
    out["num_tokens"] = np.full(num_rows, SEQ, dtype=np.int32)
    return out


def _batch(rows: dict[str, np.ndarray], start: int, stop: int) -> dict[str, torch.Tensor]:
    return collate({k: v[start:stop] for k, v in rows.items()})


def _model(kind: str = "demo") -> PackedLM:
    torch.manual_seed(0)
    if kind == "demo":
        return PackedLM(Decoder(DecoderConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2)))
    model = build_hf_model(
        vocab_size=VOCAB, seq_len=SEQ, overrides=LLAMA, attn_implementation="sdpa"
    )
    return PackedLM(model, loss_chunk_tokens=16)


def _step(model, group, optimizer=None, reference=None, beta=0.1, **train):
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    spec = TrainConfig(**train)
    return train_step(
        model,
        optimizer,
        scheduler,
        group,
        fsdp=False,
        bf16=False,
        spec=spec,
        objective=objectives.objective_for(
            "dpo" if reference is not None else "sft", reference, beta
        ),
    )


def test_accumulating_micro_batches_takes_the_step_of_one_larger_batch():
    rows = _rows(4, seed=1)
    counts = [(rows["labels"][i : i + 2] != IGNORE_INDEX).sum() for i in (0, 2)]
    assert counts[0] != counts[1]  # guard: a per-micro-batch mean would weigh tokens unequally
    whole, accumulated = _model(), _model()
    loss_whole, tokens_whole, norm_whole, *_ = _step(whole, [_batch(rows, 0, 4)])
    loss_acc, tokens_acc, norm_acc, *_ = _step(
        accumulated, [_batch(rows, 0, 2), _batch(rows, 2, 4)], grad_accum_steps=2
    )
    assert tokens_whole == tokens_acc == sum(counts)
    assert loss_acc == pytest.approx(loss_whole, abs=1e-6)
    assert norm_acc == pytest.approx(norm_whole, rel=1e-5)
    for (name, a), b in zip(whole.named_parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


def test_a_step_reports_the_learning_rate_it_used():
    """The ``lr`` a step reports is the one it updated with, not the scheduler's next (with
    ``get_last_lr()`` after ``scheduler.step()`` the first warm-up step reported 2/4 of the
    peak while it had used 1/4). Warm-up over 4 steps, then cosine to 0 at step 8."""
    rows = _rows(2, seed=2)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, build.lr_lambda("cosine", warmup_steps=4, max_steps=8, min_ratio=0.0)
    )
    spec = TrainConfig(max_steps=8, warmup_steps=4)
    used = []
    for _ in range(8):
        result = train_step(
            model, optimizer, scheduler, [_batch(rows, 0, 2)], fsdp=False, bf16=False, spec=spec
        )
        used.append(round(result.lr, 6))
    cosine = [round(0.05 * (1 + math.cos(math.pi * k / 4)), 6) for k in range(4)]
    assert used == [0.025, 0.05, 0.075, 0.1, *cosine]
    assert cosine[0] == 0.1 and optimizer.param_groups[0]["lr"] == 0.0  # guard: the decay's end


def test_clipping_bounds_the_gradient_norm_of_the_update():
    rows = _rows(2, seed=2)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    lr = 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    norm = _step(model, [_batch(rows, 0, 2)], optimizer, max_grad_norm=0.01).grad_norm
    assert norm > 0.1  # guard: clipping was needed
    update = torch.sqrt(
        sum(((b - p.detach()) ** 2).sum() for b, p in zip(before, model.parameters(), strict=True))
    )
    assert float(update) / lr == pytest.approx(0.01, rel=1e-4)


def test_bf16_autocast_runs_on_cpu_and_stays_close_to_fp32():
    rows = _rows(2, seed=3)
    group = [_batch(rows, 0, 2)]
    spec = TrainConfig()
    results = {}
    for bf16 in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        results[bf16] = train_step(
            model, optimizer, scheduler, group, fsdp=False, bf16=bf16, spec=spec
        )[0]
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    assert results[True] != results[False]  # guard: autocast changed the arithmetic
    assert results[True] == pytest.approx(results[False], abs=0.05)


# (schedule, warmup, max_steps, min ratio) → the LR factor after steps 0, 1, 2, 6 and 10
SCHEDULES = [
    ("cosine", 2, 10, 0.1, [0.5, 1.0, 1.0, 0.55, 0.1]),
    ("linear", 2, 10, 0.0, [0.5, 1.0, 1.0, 0.5, 0.0]),
    ("constant", 2, None, 0.0, [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("cosine", 0, 10, 0.0, [1.0, 0.5 * (1 + math.cos(math.pi / 10)), None, None, 0.0]),
]


@pytest.mark.parametrize(("schedule", "warmup", "max_steps", "floor", "expected"), SCHEDULES)
def test_lr_schedule(schedule, warmup, max_steps, floor, expected):
    factor = lr_lambda(schedule, warmup, max_steps, floor)
    for at, value in zip((0, 1, 2, 6, 10), expected, strict=True):
        if value is not None:
            assert factor(at) == pytest.approx(value, abs=1e-12), at


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gathered(module) -> bool:
    """Whether an FSDP2 module's parameters are gathered (unsharded) now."""
    return module._get_fsdp_state()._fsdp_param_group.is_unsharded


def _fsdp_worker(rank: int, port: int, kind: str, rows: dict, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    packed = _model(kind.removesuffix("+ac"))
    if kind.endswith("+ac"):  # activation checkpointing under FSDP2's hooks
        build.enable_activation_checkpointing(packed)
    calls = []  # block forwards (as test_activation_checkpointing_recomputes_each_block_...)
    blocks = transformer_blocks(packed)  # (found by class name, which fully_shard changes)
    for block in blocks:
        next(block.children()).register_forward_pre_hook(lambda *_: calls.append(1))
    full = sum(p.numel() for p in packed.parameters())
    model = parallelize(packed, "fsdp")
    local = sum(p.to_local().numel() for p in model.parameters())
    # SGD: an update linear in the gradient (AdamW's first step, g / |g|, magnifies rounding
    # differences of near-zero gradients into whole learning rates).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    spec = TrainConfig(grad_accum_steps=2)
    half = len(rows["input_ids"]) // 2
    mine = {k: v[rank * half : (rank + 1) * half] for k, v in rows.items()}
    group = [_batch(mine, 0, half // 2), _batch(mine, half // 2, half)]
    loss, _, norm, *_ = train_step(
        model, optimizer, scheduler, group, fsdp=True, bf16=False, spec=spec
    )
    block_calls = len(calls)
    # Evaluation over unequal shares (rows 0-4 and 5-7, batches of 2): rank 1 runs a padding
    # row while rank 0 runs its third batch; FSDP2 needs both in every forward.
    share = {k: v[:5] if rank == 0 else v[5:] for k, v in rows.items()}
    kwargs = {"seq_len": SEQ, "device": torch.device("cpu"), "bf16": False}
    evaluation = step.evaluate(model, _Shard(share), 3, 2, **kwargs)
    state, optimizer_state = full_state(model, optimizer, fsdp=True)
    gathered = []  # FSDP groups gathered at each block's forward in the checkpoint's probe
    if kind == "llama":  # the final model as a checkpoint writes it: every rank, rank 0 writes
        groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for block in blocks:
            block.register_forward_pre_hook(
                lambda *_: gathered.append(sum(_gathered(g) for g in groups)), prepend=False
            )
        checkpoint.save_tokenizer = lambda *_: None  # the tokenizer files: the DDP run's test
        vocab = types.SimpleNamespace(vocab_size=VOCAB)
        final = checkpoint.full_model_state(model)  # the final save's gather (no optimizer state)
        assert final.keys() == state.keys() and all(torch.equal(final[k], state[k]) for k in state)
        save_model(model, vocab, os.path.dirname(out), state_dict=final, write=rank == 0)
    # The checkpoint loads back into a freshly sharded model and optimizer through a restart's
    # ``_restore``: rank 0 alone reads it (rank 1's checkpoint folder is empty: had it read
    # its own, it would have found nothing to resume) and broadcasts it.
    import ray.train

    folder = os.path.join(os.path.dirname(out), f"checkpoint_rank{rank}")
    os.makedirs(folder)
    saved_state = checkpoint.TrainState(steps=5, rows_consumed=7, rows=40)
    if rank == 0:
        blob = {"model": state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}
        blob["state"] = dataclasses.asdict(saved_state)
        torch.save(blob, os.path.join(folder, checkpoint.TRAIN_STATE))
    ray.train.get_checkpoint = lambda: ray.train.Checkpoint.from_directory(folder)
    context = types.SimpleNamespace(get_world_rank=lambda: rank)
    ray.train.get_context = lambda: context
    fresh = parallelize(_model(kind.removesuffix("+ac")), "fsdp")
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda _: 1.0)
    restored = checkpoint.restore(fresh, fresh_optimizer, fresh_scheduler, fsdp=True)
    assert (restored.steps, restored.rows_consumed) == (5, 7), restored
    assert restored.rows == (40 if rank == 0 else 0)  # totals counted once
    assert fresh_scheduler.last_epoch == scheduler.last_epoch == 1
    reloaded, reloaded_optimizer = full_state(fresh, fresh_optimizer, fsdp=True)
    if rank == 0:
        momentum = {k: v["momentum_buffer"] for k, v in optimizer_state["state"].items()}
        result = {"state": state, "momentum": momentum, "loss": loss, "norm": norm}
        result |= {"eval_loss": evaluation.loss, "eval_rows": evaluation.rows}
        result |= {"block_calls": block_calls, "gathered": gathered, "reloaded": reloaded}
        result["reloaded_momentum"] = {
            k: v["momentum_buffer"] for k, v in reloaded_optimizer["state"].items()
        }
        torch.save({**result, "full": full, "local": local}, out)
    dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["demo", "llama", "llama+ac"])
def test_fsdp_over_two_processes_takes_the_single_process_step(kind, tmp_path):
    rows = _rows(8, seed=4)
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_fsdp_worker, args=(_free_port(), kind, rows, out), nprocs=2)
    result = torch.load(out, weights_only=True)
    assert result["local"] < 0.75 * result["full"]  # guard: the parameters were sharded
    # 2 micro-batches through 2 blocks, each recomputed in backward under activation checkpointing
    assert result["block_calls"] == (8 if kind.endswith("+ac") else 4)
    reference = _model(kind.removesuffix("+ac"))
    assert len(transformer_blocks(reference)) == 2
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss, _, norm, *_ = _step(reference, [_batch(rows, 0, 8)], optimizer)
    assert result["loss"] == pytest.approx(loss, abs=1e-5)
    assert result["norm"] == pytest.approx(norm, rel=1e-4)
    kwargs = {"seq_len": SEQ, "device": torch.device("cpu"), "bf16": False}
    evaluation = step.evaluate(reference, _Shard(rows), 4, 2, **kwargs)
    assert result["eval_rows"] == evaluation.rows == 8
    assert result["eval_loss"] == pytest.approx(evaluation.loss, abs=1e-5)
    state = reference.state_dict()
    assert set(result["state"]) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    # The optimizer state gathers too (keyed by parameter name): what a checkpoint saves.
    buffers = dict(zip([n for n, _ in reference.named_parameters()], optimizer.state.values()))
    assert set(result["momentum"]) == set(buffers)
    for name, value in buffers.items():
        torch.testing.assert_close(
            result["momentum"][name], value["momentum_buffer"], atol=1e-6, rtol=1e-5, msg=name
        )
    # What a restart loads is what was saved, exactly, model and optimizer (a fresh model's
    # weights differ from the trained ones: the guard is the step taken above).
    assert set(result["reloaded"]) == set(state) and set(result["reloaded_momentum"]) == set(
        buffers
    )
    for name, value in result["state"].items():
        assert torch.equal(result["reloaded"][name], value), name
    for name, value in result["momentum"].items():
        assert torch.equal(result["reloaded_momentum"][name], value), name
    if kind == "llama":
        # The checkpoint's probe gathers the root group and one block at a time (3 groups: the
        # root's embeddings, norm and head, and 2 blocks), never the whole model at once.
        assert result["gathered"] == [2, 2], result["gathered"]
        # The checkpoint of the sharded model (gathered, saved with save_pretrained) loads with
        # from_pretrained and gives the single-process model's logits, as its probe recorded.
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        probe = torch.load(tmp_path / "probe.pt")
        with torch.no_grad():
            logits = loaded(input_ids=probe["input_ids"]).logits
            expected = reference.eval().model(input_ids=probe["input_ids"]).logits
        torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert not torch.allclose(logits, _model(kind).model(input_ids=probe["input_ids"]).logits)


def _preference_rows(seed: int) -> dict[str, np.ndarray]:
    """Four rows of random triples (1-3 a row) in the preference layout (``dpo``)."""
    from rayjobs.data import preference

    rng = np.random.default_rng(seed)
    triples, bins = [], []
    for count in (1, 2, 3, 2):
        bins.append(np.arange(len(triples), len(triples) + count))
        for _ in range(count):
            parts = [rng.integers(0, VOCAB, rng.integers(1, 4)) for _ in range(3)]
            triples.append(preference.Triple(*parts))
    return preference.assemble_triples(triples, bins, SEQ, pad_id=0)


def test_a_dpo_step_accumulates_like_one_batch_and_scores_like_dpo_loss():
    from rayjobs.train import dpo

    rows = _preference_rows(seed=5)
    reference = _model().eval().requires_grad_(False)
    torch.manual_seed(1)
    with torch.no_grad():  # a policy that already differs from the reference
        policy = _model()
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    whole, accumulated = copy.deepcopy(policy), copy.deepcopy(policy)
    batch = _batch(rows, 0, 4)
    with torch.no_grad():
        expected = dpo.dpo_loss(
            *dpo.packed_logps(policy, batch), *dpo.packed_logps(reference, batch), beta=0.5
        )
    results = []
    for model, group in ((whole, [batch]), (accumulated, [_batch(rows, 0, 1), _batch(rows, 1, 4)])):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results.append(
            _step(model, group, optimizer, reference=reference, beta=0.5, grad_accum_steps=2)
        )
    for result in results:
        assert result.dpo["triples"] == 8
        assert result.loss == pytest.approx(float(expected.loss), abs=1e-6)
        assert result.dpo["reward_margin"] == pytest.approx(float(expected.reward_margin), abs=1e-6)
        assert result.dpo["reward_accuracy"] == float(expected.reward_accuracy)
        for side in ("chosen", "rejected"):
            rewards = getattr(expected, f"{side}_rewards")
            assert result.dpo[f"{side}_reward"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    assert 0 < float(expected.reward_accuracy) < 1  # guard: margins of both signs
    assert float(expected.chosen_rewards.mean()) != float(expected.rejected_rewards.mean())
    for a, b in zip(whole.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


# N4: grad_accum_steps micro-batches per step, the rest last
def test_groups_of_grad_accum_steps():
    from rayjobs.train.loop import _groups

    assert [len(g) for g in _groups(iter(range(7)), 3)] == [3, 3, 1]
    assert list(_groups(iter(range(2)), 1)) == [[0], [1]]


def test_throughput_leaves_out_the_first_tenth_of_the_steps():
    """The summary's ``throughput``: the wall time from the end of the last warm-up step to the
    end of the last step, over the tokens of the steps after it; the first step's wait (start-up,
    the first batch, a compile) is its own figure."""
    from rayjobs.train.loop import throughput, warmup_steps

    assert [warmup_steps(n) for n in (0, 1, 2, 19, 20, 120)] == [0, 1, 1, 1, 2, 12]
    ends = [10.0 + step for step in range(20)]  # 1 s a step, the first ending 10 s after began
    got = throughput(ends, timed_tokens=18 * 500, began=0.0)
    assert got == {
        "warmup_steps": 2,
        "steps": 18,
        "seconds": 18.0,
        "tokens_per_s": 500.0,
        "first_step_s": 10.0,
    }
    assert throughput([], 0, 0.0)["tokens_per_s"] is None  # stopped before any step
    assert throughput([3.0], 0, 1.0) == {
        "warmup_steps": 1,
        "steps": 0,
        "seconds": 0.0,
        "tokens_per_s": None,
        "first_step_s": 2.0,
    }


def _gpt2(template: str = "alpaca", train_keys: dict | None = None, **extra):
    """A run's config training a tiny random GPT-2 (dropout 0.1, biases, LayerNorms) and its
    tokenizer; ``train_keys``: more ``train`` keys, ``extra``: more top-level config keys."""
    from conftest import GPT2
    from rayjobs.config import Config
    from rayjobs.data.tokenizer import Tokenizer

    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128}
    config = Config.model_validate(
        {
            "datasets": [{"name": "d", "source": "x.jsonl", "template": template}],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 64},
            "train": {
                "model": {"kind": "hf", "config": {**gpt2, "initializer_range": 0.3}},
                **(train_keys or {}),
            },
            **extra,
        }
    )
    return config, Tokenizer(config.tokenizer)


@pytest.mark.parametrize("disable_dropout, equal", [(True, True), (False, False)])
def test_dpo_starts_at_log2_for_a_model_with_dropout(disable_dropout, equal):
    """Policy and reference are the same weights at step 0, so every log-ratio is 0 and the loss
    log 2, also for a model with dropout (GPT-2's config: 0.1): with it left on in the training
    policy and off in the eval-mode reference the loss was 0.756 and the margins noise
    (``dpo.disable_dropout``, default true as in TRL)."""
    from rayjobs.data import preference

    config, tokenizer = _gpt2("preference", task="dpo", dpo={"disable_dropout": disable_dropout})
    device = torch.device("cpu")
    policy = build.build_model(config, tokenizer, device, "sdpa")
    reference = build.build_model(config, tokenizer, device, "sdpa").eval().requires_grad_(False)
    rng = np.random.default_rng(0)
    triples = [preference.Triple(*(rng.integers(0, VOCAB, n) for n in (6, 5, 5))) for _ in range(6)]
    batch = collate(preference.assemble_triples(triples, [np.arange(3), np.arange(3, 6)], 64, 0))
    torch.manual_seed(0)
    result = _step(
        policy, [batch], optimizer=torch.optim.SGD(policy.parameters(), lr=0.0), reference=reference
    )
    assert (abs(result.loss - math.log(2)) < 1e-6) is equal
    assert (result.dpo["reward_margin"] == 0.0) is equal


def _fsdp_dpo_worker(rank: int, port: int, rows: dict, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    policy, reference = _dpo_models()
    model = parallelize(policy, "fsdp")
    reference = build.frozen_reference(reference, fsdp=True)  # as train_loop builds it
    local = sum(p.to_local().numel() for p in reference.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = {k: v[rank * 2 : rank * 2 + 2] for k, v in rows.items()}
    result = _step(model, [_batch(mine, 0, 2)], optimizer, reference=reference, beta=0.5)
    groups = [m for m in reference.modules() if isinstance(m, FSDPModule)]
    gathered = [_gathered(group) for group in groups]  # after the reference's forward
    state, _ = full_state(model, optimizer, fsdp=True)
    if rank == 0:
        result = {"state": state, "loss": result.loss, "dpo": result.dpo, "local": local}
        torch.save({**result, "gathered": gathered}, out)
    dist.destroy_process_group()


def _dpo_models() -> tuple[PackedLM, PackedLM]:
    reference = _model()
    policy = copy.deepcopy(reference)
    torch.manual_seed(1)
    with torch.no_grad():  # a policy that already differs from the reference
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return policy, reference


@pytest.mark.e2e
def test_fsdp_dpo_shards_the_reference_and_takes_the_single_process_step(tmp_path):
    """Under FSDP the frozen reference is sharded like the policy (each rank held a whole copy:
    twice a 2-rank policy's parameters) and stays so after its forwards (its root group, the
    embeddings and head, stayed gathered for a backward that never comes), and the DPO step over
    two processes equals one process on both ranks' rows."""
    rows = _preference_rows(seed=5)
    out = str(tmp_path / "fsdp_dpo.pt")
    mp.spawn(_fsdp_dpo_worker, args=(_free_port(), rows, out), nprocs=2)
    result = torch.load(out, weights_only=False)
    policy, reference = _dpo_models()
    full = sum(p.numel() for p in reference.parameters())
    assert result["local"] < 0.75 * full
    assert result["gathered"] == [False] * 3  # the root and 2 blocks, each sharded again
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    expected = _step(policy, [_batch(rows, 0, 4)], optimizer, reference=reference.eval(), beta=0.5)
    assert result["loss"] == pytest.approx(expected.loss, abs=1e-6)
    assert result["dpo"] == pytest.approx(expected.dpo, abs=1e-6)
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_each_rank_draws_its_own_dropout_masks():
    """``build_model`` seeds every rank alike (the same initial weights), so without
    ``seed_rank`` every rank dropped the same activations at every step: one dropout pattern
    for the whole global batch. Per rank and per resumed step, reproducibly."""
    config, tokenizer = _gpt2()
    rows = _batch(_rows(2, seed=5), 0, 2)
    columns = [rows[k] for k in ("input_ids", "position_ids", "document_ids", "labels")]

    def kept(seed_as: tuple[int, int] | None) -> torch.Tensor:
        """What the embedding dropout kept in one training forward on a freshly built model,
        its rank's RNG seeded as ``(rank, step)``."""
        packed = build.build_model(config, tokenizer, torch.device("cpu"), "sdpa")
        if seed_as is not None:
            build.seed_rank(config.seed, *seed_as)
        seen = []
        packed.model.transformer.drop.register_forward_hook(lambda m, i, out: seen.append(out))
        packed(*columns)
        return seen[0] != 0

    assert torch.equal(kept(None), kept(None))  # guard: built alike, the ranks' RNGs are alike
    rank0 = kept((0, 0))
    assert 0.8 < rank0.float().mean() < 0.97  # guard: dropout 0.1 is on
    assert not torch.equal(rank0, kept((1, 0)))
    assert torch.equal(rank0, kept((0, 0)))
    assert not torch.equal(rank0, kept((0, 5)))  # a restart at step 5 draws new masks


def test_weight_decay_spares_biases_and_norm_gains():
    """``build_optimizer``: a step with zero gradients leaves biases and LayerNorm gains as they
    were and shrinks every matrix and embedding by exactly 1 − lr × weight_decay (with one
    group, norm gains were pulled toward 0 like the matrices)."""
    config, tokenizer = _gpt2()
    packed = build.build_model(config, tokenizer, torch.device("cpu"), "sdpa")
    optimizer = build.build_optimizer(packed, TrainConfig(lr=0.01, weight_decay=0.1))
    before = {name: p.detach().clone() for name, p in packed.named_parameters()}
    for p in packed.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    spared = {name for name, p in packed.named_parameters() if torch.equal(p, before[name])}
    vectors = {name for name, p in packed.named_parameters() if p.ndim < 2}
    assert spared == vectors
    assert any(".ln_" in n for n in vectors) and any(n.endswith(".bias") for n in vectors)
    for name, p in packed.named_parameters():
        if name not in vectors:  # wte (tied to the head), wpe, attention and MLP matrices
            torch.testing.assert_close(p, before[name] * (1 - 0.01 * 0.1), msg=name)


@pytest.mark.parametrize("kind", ["demo", "llama", "gpt2"])
def test_activation_checkpointing_recomputes_each_block_for_the_same_gradients(kind):
    """``train.activation_checkpointing``: every block runs twice per training step (its forward
    recomputed in backward) and the gradients are the ones without it, for GPT-2's dropout too
    (the recomputation replays the RNG: a different mask would change the gradient)."""
    rows = _batch(_rows(2, seed=6), 0, 2)
    columns = [rows[k] for k in ("input_ids", "position_ids", "document_ids", "labels")]

    def run(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
        if kind == "gpt2":
            config, tokenizer = _gpt2(train_keys={"activation_checkpointing": checkpointing})
            packed = build.build_model(config, tokenizer, torch.device("cpu"), "sdpa")
        else:
            packed = _model(kind)
            if checkpointing:
                build.enable_activation_checkpointing(packed)
        calls = []
        for block in transformer_blocks(packed):
            # On the block's first submodule, as a pre-hook: HF checkpoints a layer's forward,
            # not its __call__ (its own hooks run once), and the recomputation stops once it has
            # what backward needs (torch's early stop), before a forward hook would fire.
            next(block.children()).register_forward_pre_hook(lambda *_: calls.append(1))
        torch.manual_seed(1)
        loss, _ = packed(*columns)
        loss.backward()
        return {n: p.grad for n, p in packed.named_parameters()}, len(calls)

    (plain, plain_calls), (recomputed, calls) = run(False), run(True)
    assert plain_calls == 2 and calls == 4  # two blocks, each recomputed once in backward
    assert set(plain) == set(recomputed)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


class _Shard:
    """Stands in for a rank's Ray Data iterator: ``iter_torch_batches`` over numpy rows."""

    def __init__(self, rows: dict[str, np.ndarray]):
        self.rows = rows

    def iter_torch_batches(self, batch_size, collate_fn, prefetch_batches):
        num_rows = len(self.rows["input_ids"])
        for start in range(0, num_rows, batch_size):
            yield collate_fn({k: v[start : start + batch_size] for k, v in self.rows.items()})


def test_evaluate_sees_every_row_once_through_padding_and_restores_training():
    rows = _rows(7, seed=3)
    model = _model().train()
    whole = _batch(rows, 0, 7)
    with torch.no_grad():
        total, _ = model(
            whole["input_ids"], whole["position_ids"], whole["document_ids"], whole["labels"]
        )
    tokens = int((whole["labels"] != IGNORE_INDEX).sum())
    # 7 rows in batches of 3: 3 + 3 + 1, then two rows of padding (another rank's share is
    # longer): they add nothing.
    kwargs = {"seq_len": SEQ, "device": torch.device("cpu"), "bf16": False}
    result = step.evaluate(model, _Shard(rows), 5, 3, **kwargs)
    assert (result.rows, result.tokens) == (7, tokens)
    assert result.loss == pytest.approx(float(total) / tokens, rel=1e-6)
    assert model.training and result.dpo is None
    exact = step.evaluate(model, _Shard(rows), 3, 3, **kwargs)  # no padding: the same loss
    assert exact.loss == pytest.approx(result.loss, rel=1e-12)
    with pytest.raises(RuntimeError, match="more than the 2 batches of 3 rows"):
        step.evaluate(model, _Shard(rows), 2, 3, **kwargs)
    assert model.training  # restored after an error too


@pytest.mark.parametrize("preference", [False, True])
def test_a_padding_row_adds_nothing_to_an_evaluation(preference):
    model = _model().eval()
    objective = objectives.objective_for("dpo" if preference else "sft", model)
    row = objective.padding_row(SEQ, torch.device("cpu"))
    with torch.no_grad():
        loss, sums = objective.forward(model, row)
    assert float(loss) == 0.0 and not sums.any()
    assert row["input_ids"].shape == (1, SEQ) and ("response_role" in row) == preference


def test_evaluate_runs_without_dropout_and_leaves_it_on_for_training():
    config, tokenizer = _gpt2()  # dropout 0.1
    packed = build.build_model(config, tokenizer, torch.device("cpu"), "sdpa").train()
    rows = _rows(4, seed=5)
    kwargs = {"seq_len": SEQ, "device": torch.device("cpu"), "bf16": False}
    first = step.evaluate(packed, _Shard(rows), 2, 2, **kwargs)
    second = step.evaluate(packed, _Shard(rows), 2, 2, **kwargs)
    assert first.loss == second.loss  # no dropout: the same forward twice
    assert packed.training
    batch = _batch(rows, 0, 4)
    columns = [batch[k] for k in ("input_ids", "position_ids", "document_ids", "labels")]
    with torch.no_grad():  # guard: in training mode, dropout changes the loss from call to call
        assert float(packed(*columns)[0]) != float(packed(*columns)[0])


@pytest.mark.parametrize(
    "model_type, chosen, built",
    [
        ("gpt2", None, "sdpa"),  # flex by default on a GPU; GPT-2 has none in transformers
        ("llama", None, "flex_attention"),
        ("gpt2", "flex_attention", "refused"),  # asked for by name: transformers says no
    ],
)
def test_default_flex_falls_back_where_the_architecture_has_none(
    monkeypatch, model_type, chosen, built
):
    """On GPUs ``train.attention: auto`` means ``flex_attention`` for an HF model, which
    transformers refuses for some architectures (GPT-2): every rank failed to build the model
    once Ray and the data had started. The default now falls back to ``sdpa`` (the dense
    document mask) where the class has no flex; an explicit ``attn_implementation`` is kept.
    ``hf_attention`` stands in for a CUDA device (flex cannot build or train on CPU here)."""
    from rayjobs.train.hf import supports_flex

    config, tokenizer = _gpt2()
    model = {"attn_implementation": chosen}  # copied past validation: flex needs use_gpu
    if model_type == "llama":
        model["config"] = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "max_position_embeddings": 128}  # fmt: skip
    train_config = config.train.model_copy(
        update={"model": config.train.model.model_copy(update=model)}
    )
    config = config.model_copy(update={"train": train_config})
    monkeypatch.setattr(build, "hf_attention", lambda config, device: "flex_attention")
    # the head check's forward: flex uncompiled on CPU took 20 s, and it is not what is tested
    monkeypatch.setattr(build.PackedLM, "check_head", lambda self: 0.0)
    if built == "refused":
        with pytest.raises(ValueError, match="GPT2LMHeadModel does not support .*flex_attention"):
            build.build_model(config, tokenizer, torch.device("cpu"), "sdpa")
        return
    packed = build.build_model(config, tokenizer, torch.device("cpu"), "sdpa")
    assert packed.attention == built
    assert supports_flex(packed.model.config) == (model_type == "llama")
