"""LoRA through PEFT and bf16 parameters, end to end: ``configs/tiny_llama.yaml`` as the issue's
commands run it (fewer steps, no held-out set), its summary and its checkpoints loaded as a user
loads them (``PeftModel.from_pretrained`` on the base; ``from_pretrained`` in bf16)."""

from __future__ import annotations

import json
import os

import torch

from conftest import GPT2, ROOT
from rayjobs.cli import format_summary
from rayjobs.config import load_config
from rayjobs.job.pipeline import run
from support.models import CHATML, pretrained_folder, tiny_qwen2

TINY_LLAMA = ROOT / "configs" / "tiny_llama.yaml"
HELD_OUT = ROOT / "configs" / "data" / "eval" / "alpaca_en_demo.last60.json"
SHORT = ["packing.seq_len=256", "eval.datasets=[]", "eval.every_steps=null"]
"""tiny_llama.yaml at a quarter of its cost: shorter rows, no held-out set."""


def _record(case: str, summary: dict) -> None:
    """The figures docs/training.md quotes, printed for the record."""
    keys = ("steps_per_rank", "loss_first", "loss_last", "parameters", "param_dtype", "precision")
    print(case, json.dumps({key: summary.get(key) for key in keys}))


def _held_out_loss(model, checkpoint: str) -> float:
    """The mean next-token loss of ``model`` over the held-out Alpaca rows, as 512-token rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    records = json.loads(HELD_OUT.read_text())
    ids = tokenizer(" ".join(r["instruction"] + " " + r["output"] for r in records)).input_ids
    rows = torch.tensor(ids[: len(ids) // 512 * 512]).view(-1, 512)
    assert len(rows) >= 4, "guard: several rows of held-out text"
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def _probe_logits(model, checkpoint: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loaded model's logits, the trained model's) on the checkpoint's probe input."""
    probe = torch.load(os.path.join(checkpoint, "probe.pt"), weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    return logits, probe["logits"]


def test_lora_trains_the_adapters_only_and_saves_what_peft_loads(ray_local, tmp_path):
    """Acceptance 2: ``train.lora.r=8 'train.lora.target_modules=[q_proj,v_proj]'`` (a LoRA
    rate, 0.03): equal steps on both ranks, 3,584 trainable parameters of 3,312,512 (q: 8 × (64 +
    64), v: 8 × (64 + 32), two layers), the held-out loss falls, and the final checkpoint is a
    PEFT adapter that ``PeftModel.from_pretrained`` loads on its base (a random init: saved
    beside it) to the trained model's logits; the merged model loads without PEFT to the
    same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = ["train.lora.r=8", "train.lora.target_modules=[q_proj,v_proj]", "train.lr=0.03"]
    steps = ["train.max_steps=8", "train.checkpoint_every=4", "train.lora.save_merged=true"]
    config = load_config(TINY_LLAMA, [*lora, *SHORT, *steps, f"train.storage_path={tmp_path}"])
    summary = run(config)
    _record("lora", summary)
    assert summary["steps_per_rank"] == [8, 8], summary
    assert summary["parameters"] == {"trainable": 3584, "total": 3312512}
    assert summary["lora"]["r"] == 8 and summary["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert "3,584 of 3,312,512 parameters trainable (0.11%, LoRA r 8)" in format_summary(summary)
    checkpoint = summary["checkpoint"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(checkpoint))
    base = AutoModelForCausalLM.from_pretrained(os.path.join(checkpoint, "base_model"))
    adapted = PeftModel.from_pretrained(base, checkpoint).eval()
    logits, trained = _probe_logits(adapted, checkpoint)
    assert torch.allclose(logits, trained, atol=1e-4), (logits - trained).abs().max()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(checkpoint, "merged")).eval()
    logits, _ = _probe_logits(merged, checkpoint)
    assert torch.allclose(logits, trained, atol=1e-4), (logits - trained).abs().max()
    # guard: the adapters moved the model off its base
    with adapted.disable_adapter():
        without, _ = _probe_logits(adapted, checkpoint)
    assert (without - trained).abs().max() > 1e-3
    # The loss falls: on held-out text (the Alpaca rows the run never read), measured whole, as
    # one step's loss on a 3,584-parameter adapter moves less than the batches differ by.
    held_out = _held_out_loss(adapted, checkpoint)
    with adapted.disable_adapter():
        base_loss = _held_out_loss(adapted, checkpoint)
    print("held-out loss: base", base_loss, "adapted", held_out)
    assert held_out < base_loss - 0.01, (base_loss, held_out)
    periodic = [c["step"] for c in summary["checkpoints"]]
    assert 4 in periodic and 8 in periodic, periodic


def test_bf16_parameters_train_and_load_in_bf16(ray_local, tmp_path):
    """Acceptance 3: ``train.param_dtype=bf16`` on CPU: the summary says bf16, the loss falls,
    and the checkpoint loads with ``from_pretrained(..., dtype=torch.bfloat16)`` to the trained
    model's logits (to bf16's precision)."""
    from transformers import AutoModelForCausalLM

    overrides = ["train.param_dtype=bf16", "train.max_steps=6", "train.num_workers=1", *SHORT]
    summary = run(load_config(TINY_LLAMA, [*overrides, f"train.storage_path={tmp_path}"]))
    _record("bf16", summary)
    assert summary["param_dtype"] == "bf16" == summary["precision"], summary
    assert summary["parameters"]["trainable"] == summary["parameters"]["total"] == 3308928
    assert summary["loss_last"] < summary["loss_first"], summary
    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"], dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits, trained = _probe_logits(model.eval(), summary["checkpoint"])
    assert (logits - trained).abs().max() <= 0.05 * trained.abs().max(), "not the trained model"


def test_the_pretrained_example_runs_on_cpu(ray_local, tmp_path):
    """configs/qwen2_5_0_5b_lora.yaml end to end on CPU, its Hub model replaced by a local folder
    of the same architecture (``train.model.path``; its tokenizer and chat template come with
    it): LoRA on every linear layer of a bf16 base, the loss falls, and the adapter loads on that
    base with ``PeftModel.from_pretrained`` to the trained model's logits (to bf16's
    precision); the merged model is written beside it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = pretrained_folder(tmp_path / "qwen", GPT2, tiny_qwen2(), CHATML)
    overrides = [
        f"train.model.path={folder}", "train.use_gpu=false", "train.num_workers=1",
        "train.cpus_per_worker=1", "train.max_steps=4", "train.warmup_steps=0", "train.lr=0.01",
        *SHORT, f"train.storage_path={tmp_path / 'runs'}",
    ]  # fmt: skip
    summary = run(load_config(ROOT / "configs" / "qwen2_5_0_5b_lora.yaml", overrides))
    _record("qwen2_5_0_5b_lora", summary)
    assert summary["steps_per_rank"] == [4] and summary["param_dtype"] == "bf16"
    counts = summary["parameters"]
    assert 0 < counts["trainable"] < 0.05 * counts["total"], counts
    assert summary["loss_last"] < summary["loss_first"], summary
    checkpoint = summary["checkpoint"]
    assert {"adapter_model.safetensors", "merged"} <= set(os.listdir(checkpoint))
    assert "base_model" not in os.listdir(checkpoint)  # the base is train.model.path
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    adapted = PeftModel.from_pretrained(base, checkpoint).eval()
    logits, trained = _probe_logits(adapted, checkpoint)
    assert (logits - trained).abs().max() <= 0.05 * trained.abs().max()
