"""An export as the ecosystem reads it, each reader as written in docs/cli.md ("Reading an
export"): ``datasets.load_dataset`` and pyarrow open the folder as it is (train and validation
splits, the tokenizer inside, no absolute path), and three trainers train on whole packed rows
with the loss of each document alone: Hugging Face's ``Trainer`` (``position_ids``,
``use_cache=False``), TRL's ``SFTTrainer`` with its padding-free collator (``seq_lengths``) and a
plain torch loop with a document mask. A tiny Llama built here, the export made in-process by the
local runner (no Ray)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from datasets import load_dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import ALPACA, GPT2, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.job.export import export
from support.models import tiny_llama

SEQ_LEN = 256
ROWS = 4
"""Rows per batch: one batch of the ``ROWS`` training rows holding the most documents."""
STEPS = 3
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An export of the bundled alpaca and hh chat subsets with eval sets (their first rows),
    two epochs, by the local runner."""
    folder = tmp_path_factory.mktemp("consumers")
    heldout = folder / "heldout.jsonl"
    heldout.write_text("".join(HH_CHAT.read_text().splitlines(keepends=True)[-30:]))
    raw = {
        "datasets": [
            {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
            {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
        ],
        "eval": {"datasets": [{"name": "held", "source": str(heldout), "template": "chat"}]},
        "allow_duplicate_sources": True,
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": SEQ_LEN, "overflow": "truncate"},
        "train": {"epochs": 2},
    }
    out = folder / "export"
    manifest = export(config_from_dict(raw, base_dir=ROOT), out, runner="local")
    return out, manifest


def test_datasets_and_pyarrow_open_the_export_as_it_is(exported):
    out, manifest = exported
    splits = load_dataset(str(out))
    packs = manifest["packed"]["num_packs"]
    validation = manifest["eval"]["packed"]["num_packs"]
    assert {name: split.num_rows for name, split in splits.items()} == {
        "train": packs,
        "validation": validation,
    }
    assert validation > 0 and len(manifest["epochs"]) == 2  # guard: both splits, two epochs
    epochs = splits["train"]["epoch"]
    assert [epochs.count(e) for e in (0, 1)] == [
        e["packs"]["num_packs"] for e in manifest["epochs"]
    ]
    by_dir = load_dataset("parquet", data_dir=str(out))
    assert {name: split.num_rows for name, split in by_dir.items()} == {
        "train": packs,
        "validation": validation,
    }
    table = pq.read_table(out)  # the training rows alone: _validation, _tokenizer... skipped
    assert table.num_rows == packs and sorted(set(table.column("epoch").to_pylist())) == [0, 1]
    metadata = table.schema.metadata
    info = manifest["tokenizer"]
    assert metadata[b"rayjobs.pad_id"] == str(info["pad_id"]).encode() == b"50256"
    assert metadata[b"rayjobs.vocab_size"] == b"50257" and metadata[b"rayjobs.tokenizer"] == (
        b"_tokenizer"
    )
    # the export decodes on its own: its tokenizer gives the original ids
    tokenizer = AutoTokenizer.from_pretrained(out / info["path"])
    original = AutoTokenizer.from_pretrained(GPT2)
    text = "Below is an instruction that describes a task. ### Response: ok"
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert tokenizer.eos_token_id == info["eos_id"] and tokenizer.pad_token_id == info["pad_id"]
    written = (out / "_manifest.json").read_text()
    assert str(ROOT) not in written and str(out) not in written
    assert not [v for v in _strings(json.loads(written)) if os.path.isabs(v)]
    card = (out / "_README.md").read_text()
    assert "split: validation\n    path: _validation/*.parquet" in card and "use_cache" in card


def _strings(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


def _model(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**tiny_llama(SEQ_LEN), vocab_size=vocab_size)
    return LlamaForCausalLM(config).eval()


def _chosen(out) -> list[int]:
    """The ``ROWS`` training rows with the most documents (as ``datasets`` and pyarrow order
    the split's files)."""
    documents = pq.read_table(out / "train", columns=["num_documents"]).column(0).to_numpy()
    chosen = np.argsort(-documents, kind="stable")[:ROWS]
    assert documents[chosen].min() >= 3, "guard: rows of several documents"
    return chosen.tolist()


def _rows(out) -> dict[str, np.ndarray]:
    table = pq.read_table(out / "train").take(_chosen(out))
    return {
        name: np.stack(table.column(name).to_numpy(zero_copy_only=False)).astype(np.int64)
        for name in ("input_ids", "labels", "position_ids", "document_ids")
    } | {"num_tokens": table.column("num_tokens").to_numpy()}


def per_document_loss(model, rows: dict[str, np.ndarray]) -> float:
    """The loss of every document of ``rows`` run alone through ``model``: the summed cross
    entropy of their trained tokens over their count (labels in the ``hf`` convention)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in range(len(rows["input_ids"])):
            used = rows["num_tokens"][r]
            documents = rows["document_ids"][r, :used]
            for d in np.unique(documents):
                ids = torch.tensor(rows["input_ids"][r, :used][documents == d])[None]
                labels = torch.tensor(rows["labels"][r, :used][documents == d])[None]
                logits = model(input_ids=ids, use_cache=False).logits.double()
                total += torch.nn.functional.cross_entropy(
                    logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
                ).item()
                count += int((labels[0, 1:] != -100).sum())
    assert count > 0
    return total / count


def _setup(exported, columns: list[str]):
    """The chosen rows, a fresh model, their per-document loss and the split's rows with
    ``columns``, for a trainer."""
    out, manifest = exported
    rows = _rows(out)
    model = _model(manifest["tokenizer"]["vocab_size"])
    expected = per_document_loss(model, rows)
    model.config.use_cache = False  # with a cache, the packed rows' documents see each other
    train = load_dataset(str(out), split="train").select(_chosen(out)).select_columns(columns)
    return rows, model, expected, train


def _train(trainer_class, expected: float, **kwargs) -> None:
    """``trainer_class(**kwargs).train()``: its first step's loss (as computed, not the rounded
    log) is the per-document loss ``expected``, and the loss falls."""
    losses = []

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, *args, **kw):
            loss = super().compute_loss(model, inputs, *args, **kw)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    Recording(**kwargs).train()
    assert len(losses) == STEPS
    assert abs(losses[0] - expected) < TOLERANCE, (losses[0], expected)
    assert losses[-1] < losses[0]  # it trains


TRAINING = {
    "per_device_train_batch_size": ROWS, "max_steps": STEPS, "learning_rate": 1e-3,
    "report_to": [], "save_strategy": "no", "use_cpu": True, "logging_steps": 1,
}  # fmt: skip


def test_hf_trainer_on_whole_rows_trains_on_each_document_alone(exported, tmp_path):
    from transformers import Trainer, TrainingArguments, default_data_collator

    rows, model, expected, train = _setup(exported, ["input_ids", "labels", "position_ids"])
    arguments = TrainingArguments(output_dir=str(tmp_path), **TRAINING)
    _train(Trainer, expected, model=model, args=arguments, train_dataset=train,
           data_collator=default_data_collator)  # fmt: skip
    # guard: with the cache on, the same rows give another loss (documents see each other)
    batch = {k: torch.tensor(v) for k, v in rows.items() if k in ("input_ids", "position_ids")}
    fresh = _model(exported[1]["tokenizer"]["vocab_size"])
    with torch.no_grad():
        cached = fresh(**batch, labels=torch.tensor(rows["labels"]), use_cache=True).loss.item()
    assert abs(cached - expected) > 1e-4


def test_trl_padding_free_on_seq_lengths_trains_on_each_document_alone(exported, tmp_path):
    from trl import SFTConfig, SFTTrainer

    _, model, expected, train = _setup(exported, ["input_ids", "labels", "seq_lengths"])
    # bf16=False: TRL's default bf16 moves the loss by 4e-5 on this CPU
    arguments = SFTConfig(
        output_dir=str(tmp_path), padding_free=True, max_length=None, bf16=False,
        gradient_checkpointing=False, **TRAINING,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(exported[0] / "_tokenizer")
    _train(SFTTrainer, expected, model=model, args=arguments, train_dataset=train,
           processing_class=tokenizer)  # fmt: skip


def test_a_torch_loop_with_a_document_mask_trains_on_each_document_alone(exported):
    out, manifest = exported
    rows = _rows(out)
    model = _model(manifest["tokenizer"]["vocab_size"])
    expected = per_document_loss(model, rows)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    table = pq.read_table(out).take(_chosen(out))  # the folder as pyarrow reads it: training rows
    batch = {
        name: torch.tensor(
            np.stack(table.column(name).to_numpy(zero_copy_only=False)), dtype=torch.long
        )
        for name in ("input_ids", "labels", "position_ids", "document_ids")
    }
    documents = batch["document_ids"]
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    mask = (documents[:, :, None] == documents[:, None, :]) & causal  # [rows, query, key]
    losses = []
    for _ in range(STEPS):
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"],
            attention_mask=mask[:, None], use_cache=False,
        ).logits  # fmt: skip
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - expected) < TOLERANCE, (losses[0], expected)
    assert losses[-1] < losses[0]
    # guard: the same rows without the document mask give another loss
    fresh = _model(manifest["tokenizer"]["vocab_size"])
    with torch.no_grad():
        leaky = fresh(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    assert abs(leaky.loss.item() - expected) > 1e-4
