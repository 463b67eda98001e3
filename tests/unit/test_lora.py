"""LoRA through PEFT, bf16 parameters and fp16's loss scaler, without Ray: what ``train.lora``
and ``train.param_dtype`` build, the combinations refused before Ray starts, a LoRA checkpoint
loaded as a user loads it, a restart from its train state taking the step the run would have
taken, and fp16 autocast with a loss scaler (the CUDA path's step, run here on CPU)."""

from __future__ import annotations

import io
import os
import socket

import pytest
import torch
import yaml

from conftest import ALPACA, GPT2
from rayjobs.config import ConfigError, TrainConfig, config_from_dict, load_config
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.train.build import build_model, build_optimizer
from rayjobs.train.checkpoint import full_state, load_state, save_model
from rayjobs.train.collate import collate
from rayjobs.train.lora import parameter_counts
from rayjobs.train.step import train_step
from support.models import tiny_llama

SEQ = 64


def _raw(train: dict, model: dict | None = None) -> dict:
    model = model or {"kind": "hf", "config": tiny_llama(SEQ)}
    return {
        "datasets": [{"name": "alpaca", "source": str(ALPACA), "template": "alpaca"}],
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": SEQ},
        "train": {"model": model, **train},
    }


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(config_from_dict(_raw({})).tokenizer)


def _built(tokenizer, **train):
    config = config_from_dict(_raw(train))
    return config, build_model(config, tokenizer, torch.device("cpu"), "sdpa")


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Two packed rows of two documents each, every position labelled with the next token."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50000, (2, SEQ), generator=generator)
    half = SEQ // 2
    positions = torch.cat([torch.arange(half), torch.arange(half)]).repeat(2, 1)
    documents = (torch.arange(SEQ) >= half).long().repeat(2, 1)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, half - 1] = labels[:, -1] = -100
    rows = {"input_ids": ids, "labels": labels, "position_ids": positions}
    rows["document_ids"] = documents
    rows["num_tokens"] = torch.full((2,), SEQ)
    return collate({k: v.numpy() for k, v in rows.items()})


def _step(model, optimizer, config, batch, scaler=None, fp16=False):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return train_step(
        model, optimizer, scheduler, [batch], fsdp=False, bf16=False, spec=config.train,
        scaler=scaler,
    )  # fmt: skip


# train section → the refusal (exit 2 before Ray starts)
REFUSED = {
    "lora_on_the_demo_decoder": (
        {"lora": {"r": 8}, "model": {"kind": "demo"}},
        "train.lora adapts a Hugging Face model (PEFT): set train.model.kind: hf",
    ),
    "fp16_on_cpu": (
        {"precision": "fp16"},
        "train.precision: fp16 (autocast with a loss scaler) runs on CUDA only",
    ),
    "bf16_parameters_computed_in_fp32": (
        {"param_dtype": "bf16", "precision": "fp32"},
        "train.param_dtype: bf16 computes in bf16, but train.precision is fp32",
    ),
    "an_unknown_lora_key": ({"lora": {"rank": 8}}, "train.lora.rank"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_combinations_that_cannot_train_are_refused_naming_the_keys(case):
    train, message = REFUSED[case]
    raw = _raw({k: v for k, v in train.items() if k != "model"}, train.get("model"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(raw)


def test_lora_freezes_the_base_and_trains_the_adapters(tokenizer):
    """r 8 on q_proj and v_proj of a two-layer Llama (hidden 32, 2 key/value heads of 8):
    8 × (32 + 32) + 8 × (32 + 16) per layer; a bf16 base keeps fp32 adapters."""
    _, model = _built(tokenizer, lora={"r": 8, "target_modules": ["q_proj", "v_proj"]})
    counts = parameter_counts(model)
    assert counts["trainable"] == 2 * (8 * 64 + 8 * 48) == 1792
    assert counts["total"] == 1792 + parameter_counts(_built(tokenizer)[1])["total"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    _, model = _built(tokenizer, lora={"r": 4}, param_dtype="bf16")
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    with pytest.raises(ValueError, match="train.lora: .*nope"):
        _built(tokenizer, lora={"target_modules": ["nope"]})


def test_a_lora_checkpoint_loads_with_peft_and_merged(tokenizer, tmp_path):
    """The adapter (``PeftModel.from_pretrained`` on the saved random base) and the merged model
    (``from_pretrained`` alone) give the trained model's probe logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, model = _built(tokenizer, lora={"r": 8, "lora_alpha": 32})
    optimizer = build_optimizer(model, config.train)
    for seed in range(3):
        _step(model, optimizer, config, _batch(seed))
    save_model(model, tokenizer, str(tmp_path), merged=True)
    probe = torch.load(tmp_path / "probe.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_model")
    loaded = {
        "adapter": PeftModel.from_pretrained(base, tmp_path).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(),
    }
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    for name, loaded_model in loaded.items():
        with torch.no_grad():
            logits = loaded_model(input_ids=probe["input_ids"]).logits
        assert torch.allclose(logits, probe["logits"], atol=1e-4), name
    with loaded["adapter"].disable_adapter(), torch.no_grad():
        logits = loaded["adapter"](input_ids=probe["input_ids"]).logits
    assert (logits - probe["logits"]).abs().max() > 1e-3, "guard: the adapters changed nothing"


def test_a_restart_from_the_train_state_takes_the_runs_next_step(tokenizer):
    """What ``restore`` loads (``full_state`` of model and optimizer) into a freshly built LoRA
    model: its next step equals the uninterrupted run's, parameter for parameter."""
    config, model = _built(tokenizer, lora={"r": 8})
    optimizer = build_optimizer(model, config.train)
    for seed in range(2):
        _step(model, optimizer, config, _batch(seed))
    model_state, optimizer_state = full_state(model, optimizer, False)
    saved = io.BytesIO()  # as TRAIN_STATE is written and read back
    torch.save({"model": model_state, "optimizer": optimizer_state}, saved)
    blob = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    _, restarted = _built(tokenizer, lora={"r": 8})
    restarted_optimizer = build_optimizer(restarted, config.train)
    load_state(restarted, restarted_optimizer, blob, False)
    _step(model, optimizer, config, _batch(2))
    _step(restarted, restarted_optimizer, config, _batch(2))
    after = dict(restarted.named_parameters())
    moved = 0
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, after[name]), name
        moved += parameter.requires_grad
    assert moved == 8, "guard: the adapters of 2 layers' q and v (A and B) were compared"


def test_fp16_autocast_with_a_loss_scaler_trains(tokenizer):
    """fp16's step (``train.precision: fp16``, the CUDA path), on CPU here: the loss is scaled
    before backward, unscaled before clipping, and the step follows the fp32 one closely."""
    config, model = _built(tokenizer)
    config32, reference = _built(tokenizer)
    optimizer, reference_optimizer = build_optimizer(model, config.train), None
    reference_optimizer = build_optimizer(reference, config32.train)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for seed in range(3):
        half = _step(model, optimizer, config, _batch(seed), scaler=scaler)
        full = _step(reference, reference_optimizer, config32, _batch(seed))
        assert abs(half.loss - full.loss) < 0.05 * full.loss, (half, full)
        assert abs(half.grad_norm - full.grad_norm) < 0.1 * full.grad_norm, (half, full)
    assert scaler.get_scale() == 2.0**10, "guard: no step overflowed and was skipped"


# a peer's key (TRL, Axolotl, torchtune, HF) → what the refusal names
PEER_KEYS = {
    "train.adapter=lora": "train.adapter: unknown key; use train.lora (a section of PEFT's keys",
    "train.use_peft=true": "train.use_peft: unknown key; use train.lora",
    "train.peft_config.r=8": "train.peft_config: unknown key; use train.lora",
    "train.lora_r=8": "train.lora_r: unknown key; use train.lora.r",
    "train.lora.lora_r=8": "train.lora.lora_r: unknown key; use train.lora.r",
    "train.lora_alpha=16": "train.lora_alpha: unknown key; use train.lora.lora_alpha",
    "train.lora_dropout=0.1": "train.lora_dropout: unknown key; use train.lora.lora_dropout",
    "train.lora_target_modules=[q_proj]": "use train.lora.target_modules",
    "train.bf16=true": "train.bf16: unknown key; use train.precision (bf16 autocast; bf16 weights",
    "train.fp16=true": "train.fp16: unknown key; use train.precision (fp16: autocast with a loss",
    "train.torch_dtype=bfloat16": "train.torch_dtype: unknown key; use train.param_dtype",
    "train.dtype=bf16": "train.dtype: unknown key; use train.param_dtype",
    "train.lora.load_in_4bit=true": "QLoRA (a 4-bit base) is not supported: it needs CUDA and "
    "bitsandbytes; use train.lora with train.param_dtype: bf16",
}


@pytest.mark.parametrize("override", sorted(PEER_KEYS))
def test_a_peers_lora_and_dtype_keys_name_the_rayjobs_key(override, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_raw({})))
    with pytest.raises(ConfigError) as refused:
        load_config(path, [override])
    assert PEER_KEYS[override] in str(refused.value), str(refused.value)


def _lora_llama(tokenizer: Tokenizer) -> torch.nn.Module:
    """The tiny Llama with adapters on every linear layer, as ``parallelism: fsdp`` builds it,
    their B matrices made non-zero (as after some training)."""
    lora = {"r": 4, "target_modules": "all-linear"}
    _, packed = _built(tokenizer, lora=lora, parallelism="fsdp")
    generator = torch.Generator().manual_seed(1)
    for name, parameter in packed.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(std=0.1, generator=generator)
    return packed


def _fsdp_lora_worker(rank: int, port: int, folder: str) -> None:
    """One rank of a two-process FSDP2 run of ``_lora_llama``: a step on its own batch, the
    final save (merged too) as the loop does it, then a restart from the gathered state,
    written as ``TRAIN_STATE`` and read back by ``restore`` (rank 0 only)."""
    import dataclasses
    import types

    import ray.train
    import torch.distributed as dist

    from rayjobs.train import checkpoint
    from rayjobs.train.build import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    tokenizer = Tokenizer(config_from_dict(_raw({})).tokenizer)
    packed = _lora_llama(tokenizer)
    model = parallelize(packed, "fsdp")
    spec = TrainConfig()
    optimizer = build_optimizer(model, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    result = train_step(
        model, optimizer, scheduler, [_batch(rank)], fsdp=True, bf16=False, spec=spec
    )
    state, optimizer_state = full_state(model, optimizer, fsdp=True)
    final = checkpoint.full_model_state(model)
    save_model(packed, tokenizer, os.path.join(folder, "final"), final, rank == 0, merged=True)
    restart = os.path.join(folder, f"checkpoint_rank{rank}")
    os.makedirs(restart)
    if rank == 0:
        blob = {"model": state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}
        blob["state"] = dataclasses.asdict(checkpoint.TrainState(steps=1))
        torch.save(blob, os.path.join(restart, checkpoint.TRAIN_STATE))
    ray.train.get_checkpoint = lambda: ray.train.Checkpoint.from_directory(restart)
    ray.train.get_context = lambda: types.SimpleNamespace(get_world_rank=lambda: rank)
    fresh = parallelize(_lora_llama(tokenizer), "fsdp")
    fresh_optimizer = build_optimizer(fresh, spec)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda _: 1.0)
    checkpoint.restore(fresh, fresh_optimizer, fresh_scheduler, fsdp=True)
    reloaded, reloaded_optimizer = full_state(fresh, fresh_optimizer, fsdp=True)
    if rank == 0:
        out = {"loss": result.loss, "norm": result.grad_norm, "state": state}
        out |= {"reloaded": reloaded, "optimizer": optimizer_state["state"]}
        out["reloaded_optimizer"] = reloaded_optimizer["state"]
        torch.save(out, os.path.join(folder, "result.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_lora_under_fsdp2_takes_the_single_process_step_and_saves_and_restores(tokenizer, tmp_path):
    """LoRA under FSDP2 on two gloo processes: the step of one process on both ranks' batches
    (loss, gradient norm, every parameter), the final checkpoint's adapter, random base and
    merged model gathered and loadable, and a restart's model and optimizer state exactly what
    was saved."""
    import torch.multiprocessing as mp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.makedirs(tmp_path / "final")
    mp.spawn(_fsdp_lora_worker, args=(port, str(tmp_path)), nprocs=2)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    reference = _lora_llama(tokenizer)
    spec = TrainConfig()
    optimizer = build_optimizer(reference, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    group = [_batch(0), _batch(1)]  # two micro-batches: the step of one batch of both
    expected = train_step(reference, optimizer, scheduler, group, fsdp=False, bf16=False, spec=spec)
    assert result["loss"] == pytest.approx(expected.loss, abs=1e-5)
    assert result["norm"] == pytest.approx(expected.grad_norm, rel=1e-4)
    state = reference.state_dict()
    assert set(result["state"]) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    for name, value in result["state"].items():
        assert torch.equal(result["reloaded"][name], value), name
    assert result["optimizer"].keys() == result["reloaded_optimizer"].keys()
    assert len(result["optimizer"]) == 2 * 7 * 2, "guard: the adapters' AdamW state only"
    for name, value in result["optimizer"].items():
        assert torch.equal(result["reloaded_optimizer"][name]["exp_avg"], value["exp_avg"])
    final = tmp_path / "final"
    probe = torch.load(final / "probe.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(final / "base_model")
    loaded = {
        "adapter": PeftModel.from_pretrained(base, final).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(final / "merged").eval(),
    }
    for name, model in loaded.items():
        with torch.no_grad():
            logits = model(input_ids=probe["input_ids"]).logits
        torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0, msg=name)
