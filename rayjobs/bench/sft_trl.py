"""The TRL side of ``rayjobs bench sft``: ``python -m rayjobs.bench.sft_trl ...`` trains the bench's
model folder with TRL's ``SFTTrainer`` on its JSONL shards, as a TRL user would on one CPU machine.

- Data: ``datasets.load_dataset("json", data_files=...)`` of each set, ``.map`` to ``input_ids``
  and ``labels`` by ``peers.tokenize_batch`` (each row rendered by rayjobs' own template, the
  trained spans' tokens as labels, -100 elsewhere, EOS appended: the samples ``rayjobs run``
  trains on, token for token), ``concatenate_datasets``. A tokenized dataset is one
  ``SFTTrainer`` takes as is (it keeps a given ``labels`` column), then packs itself.
- ``SFTConfig``: ``packing=True`` with ``packing_strategy="bfd"`` (best-fit decreasing, overflow
  truncated, as ``packing.overflow: truncate``) and ``padding_free=True`` (a step's packed rows
  flattened into one sequence with ``position_ids`` restarting at each document: SDPA masks
  attention at the boundaries), ``max_length`` the seq_len, the same rows per step, steps, lr
  (linear decay to 0, no warm-up), clipping at 1.0 and seed; fp32 (``bf16=False``: rayjobs'
  ``precision: auto`` on CPU), no gradient checkpointing (SFTConfig's default is on; rayjobs'
  ``activation_checkpointing`` is off), no checkpoints; every other setting TRL's default.
- A ``TrainerCallback`` writes the ``time.time()`` and the input tokens seen at the end of every
  optimizer step, and the loss TRL logs for it (``logging_steps=1``), to ``--timeline`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import concatenate_datasets, load_dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from rayjobs.bench.peers import tokenize_batch


class Timeline(TrainerCallback):
    """Every optimizer step's end (``time.time()``, input tokens seen) and its logged loss."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[dict[str, float]] = []
        self.losses: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(
            {"step": state.global_step, "at": time.time(), "tokens": state.num_input_tokens_seen}
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])

    def on_train_end(self, args, state, control, **kwargs):
        for step in self.steps:
            step["loss"] = self.losses.get(step["step"])
        self.path.write_text(json.dumps(self.steps))


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rayjobs.bench.sft_trl")
    for name in ("--alpaca", "--chat", "--model", "--tokenizer", "--out", "--timeline"):
        parser.add_argument(name, type=Path, required=True)
    for name in ("--seq-len", "--batch-size", "--steps", "--seed", "--threads", "--num-proc"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    return parser


def main(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)  # as rayjobs' train worker: its train.cpus_per_worker
    parts = []
    for folder, template in ((args.alpaca, "alpaca"), (args.chat, "chat")):
        files = sorted(str(f) for f in folder.glob("*.jsonl"))
        dataset = load_dataset("json", data_files=files, split="train")
        parts.append(dataset.map(
            tokenize_batch, batched=True, num_proc=args.num_proc,
            remove_columns=dataset.column_names,
            fn_kwargs={"template": template, "tokenizer": str(args.tokenizer)},
        ))  # fmt: skip
    config = SFTConfig(
        output_dir=str(args.out),
        max_length=args.seq_len,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=args.seed,
        dataset_num_proc=args.num_proc,
        include_num_input_tokens_seen="all",  # padding-free: a batch holds no padding
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=str(args.model),
        args=config,
        train_dataset=concatenate_datasets(parts),
        processing_class=AutoTokenizer.from_pretrained(str(args.tokenizer)),
        callbacks=[Timeline(args.timeline)],
    )
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
