"""``rayjobs bench train``: what packing buys a training step, packed rows vs the same samples
unpacked and padded.

It reads an export (``rayjobs export CONFIG --out DIR``: the job's own packed rows, through the
real tokenizer, template and packer) and trains one decoder per variant over the same steps:

- ``padded_sdpa``: each step's documents unpacked, one per row, right-padded to the step's
  longest, plain causal SDPA (``attention="causal"``: no mask, flash kernels on GPU). The
  baseline a trainer without packing runs (dynamic padding, as ``DataCollatorWithPadding``).
- ``packed_sdpa``: the step's packed rows, the dense document mask through SDPA.
- ``packed_flex``: the same rows, FlexAttention with the BlockMask (CUDA only; no backward on CPU).

Design note: a step of every variant holds exactly the same documents (the documents of
``--rows`` consecutive packed rows), so the variants do the same training, only laid out
differently: same optimizer steps per epoch, same tokens per step and, from the same initial
weights, the same loss at every step up to rounding. The bench checks that (``max_loss_diff``)
before it reports any speed: a layout that changed what is trained would show here. Sorting
documents by length before padding would waste less, but changes which documents share a step,
so it is not the same training; it is left out.

Each variant's model is the demo decoder (``rayjobs.train.model``; the default shape has about 114M
parameters with the GPT-2 vocabulary), AdamW, gradient clipping at 1.0, bf16 autocast on CUDA and
the chunked loss: the job's training step for one micro-batch on one rank. The vocabulary is the
largest token id + 1 rounded up to a multiple of 128, or ``--vocab-size`` (a run's model has its
tokenizer's). Needs only torch, numpy and pyarrow, so it runs on a GPU machine without Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from rayjobs.data.rows import IGNORE_INDEX, PACKED_COLUMNS, export_convention, shifted_labels
from rayjobs.errors import ConfigError
from rayjobs.job.manifest import TRAIN, manifest_path, require_finished
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM

VARIANTS = ("padded_sdpa", "packed_sdpa", "packed_flex")
ATTENTION = {"padded_sdpa": "causal", "packed_sdpa": "sdpa", "packed_flex": "flex"}


@dataclass(frozen=True)
class TrainRow:
    """One variant's figures over the timed steps."""

    variant: str
    steps: int
    """Timed steps (after the warm-up steps)."""
    rows_per_step: float
    """Mean rows per step (padded: the step's documents)."""
    slots_per_step: float
    """Mean token slots per step, padding included."""
    padding: float
    """Share of the slots that are padding."""
    ms_per_step: float
    tokens_per_s: float
    """Non-pad tokens (prompts included) per second."""
    trained_tokens_per_s: float
    """Labelled tokens per second."""
    speedup_vs_padded: float
    peak_gib: float
    """Peak allocated accelerator memory (0 on CPU)."""
    losses: list[float]
    """Loss of every step, warm-up included (mean cross entropy per labelled token)."""
    max_loss_diff: float
    """Largest |loss - padded loss| over the steps (0 for the baseline itself)."""


def read_export(folder: str | Path) -> tuple[dict[str, np.ndarray], int]:
    """The packed rows of a finished export (all epochs, in order) as [rows, seq_len] int64
    arrays, and ``seq_len``; labels shifted, as rayjobs trains on them, whatever convention the
    export states (``rows.export_convention``: an ``hf`` export is converted back).

    Raises:
        ConfigError: no finished export there (no manifest, or no Parquet files).
        ValueError: the export does not say how its labels are laid out, or says two things."""
    require_finished(folder)
    found = manifest_path(str(folder))
    manifest = json.loads(Path(found).read_text()) if found else None
    folder = Path(folder)
    # the epochs in order: the files of each (an epoch column; epoch=<e>/ in the layout before)
    files = sorted(folder.glob(f"{TRAIN}/*.parquet")) or sorted(
        folder.glob("epoch=*/*.parquet"), key=lambda p: (len(p.parent.name), str(p))
    )
    if not files:
        raise ConfigError(
            f"{folder}: an export without packed rows (no {TRAIN}/*.parquet files); make one "
            f"with `rayjobs export CONFIG --out {folder}`"
        )

    columns: dict[str, list[np.ndarray]] = {name: [] for name in (*PACKED_COLUMNS, "num_tokens")}
    epochs = []
    for path in files:
        table = pq.read_table(path, columns=list(columns))
        epoch = (
            pq.read_table(path, columns=["epoch"])
            if "epoch" in pq.read_schema(path).names
            else None
        )
        epochs.append(
            np.zeros(table.num_rows, np.int64) if epoch is None else epoch.column(0).to_numpy()
        )
        convention = export_convention(manifest, table.schema.metadata, str(path))
        read = {}
        for name in PACKED_COLUMNS:
            array = table.column(name).combine_chunks()
            width = array.type.list_size
            read[name] = array.values.to_numpy().reshape(-1, width).astype(np.int64)
        if convention == "hf":
            read["labels"] = shifted_labels(read["labels"], read["document_ids"])
        for name in PACKED_COLUMNS:
            columns[name].append(read[name])
        columns["num_tokens"].append(table.column("num_tokens").to_numpy().astype(np.int64))
    order = np.argsort(np.concatenate(epochs), kind="stable")  # a Ray export's files mix epochs
    rows = {name: np.concatenate(parts)[order] for name, parts in columns.items()}
    return rows, rows["input_ids"].shape[1]


def vocab_size_of(rows: dict[str, np.ndarray]) -> int:
    """The decoder's vocabulary for ``rows``: the largest token id + 1, rounded up to 128."""
    return -(-(int(rows["input_ids"].max()) + 1) // 128) * 128


def unpack(rows: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, np.ndarray]:
    """The documents of packed ``rows``, one per row, right-padded to the longest: the columns
    an unpacked trainer would see (``labels`` are each document's own, already shifted;
    ``position_ids`` 0..n-1; padding has labels -100 and ``document_ids`` 1)."""
    documents = []
    for r in range(len(rows["input_ids"])):
        ids = rows["document_ids"][r, : rows["num_tokens"][r]]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        for start, end in zip(starts, np.r_[starts[1:], len(ids)], strict=True):
            documents.append((r, start, end))
    longest = max(end - start for _, start, end in documents)
    out = {
        "input_ids": np.full((len(documents), longest), pad_id, np.int64),
        "labels": np.full((len(documents), longest), IGNORE_INDEX, np.int64),
        "position_ids": np.tile(np.arange(longest), (len(documents), 1)),
        "document_ids": np.ones((len(documents), longest), np.int64),
    }
    for i, (r, start, end) in enumerate(documents):
        out["input_ids"][i, : end - start] = rows["input_ids"][r, start:end]
        out["labels"][i, : end - start] = rows["labels"][r, start:end]
        out["document_ids"][i, : end - start] = 0
    return out


def step_batches(
    rows: dict[str, np.ndarray], rows_per_step: int, variant: str
) -> list[tuple[dict[str, np.ndarray], int]]:
    """Every full step of ``rows_per_step`` consecutive packed rows, as ``variant`` lays it out,
    with its count of non-pad tokens."""
    steps = []
    for start in range(0, len(rows["input_ids"]) - rows_per_step + 1, rows_per_step):
        step = {name: values[start : start + rows_per_step] for name, values in rows.items()}
        real = int(step["num_tokens"].sum())
        if variant == "padded_sdpa":
            step = unpack(step)
            assert int((step["document_ids"] == 0).sum()) == real
        steps.append(({name: step[name] for name in PACKED_COLUMNS}, real))
    return steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_variant(
    variant: str,
    steps: list[tuple[dict[str, np.ndarray], int]],
    config: DecoderConfig,
    device: torch.device,
    seed: int = 0,
    lr: float = 3e-4,
    bf16: bool | None = None,
) -> tuple[list[float], list[float], int]:
    """Train a fresh decoder (seeded, so every variant starts from the same weights) over
    ``steps``; returns each step's loss and wall time (s), and the peak memory (bytes).
    ``bf16``: autocast (default: on CUDA GPUs that support it)."""
    torch.manual_seed(seed)
    model = PackedLM(Decoder(config).to(device), ATTENTION[variant])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if bf16 is None:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step, _ in steps:
        batch = {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in step.items()}
        _sync(device)
        began = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            total, count = model(
                batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"]
            )
        loss = total.float() / count.clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a device sync, timed, as a logged loss is
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses, times, peak


def bench_train(export: str | Path, **options: Any) -> list[TrainRow]:
    """``bench_rows`` (``options``: its keyword arguments) over the packed rows in ``export``."""
    return bench_rows(read_export(export)[0], **options)


def bench_rows(
    rows: dict[str, np.ndarray],
    rows_per_step: int = 4,
    variants: tuple[str, ...] | None = None,
    config: DecoderConfig | None = None,
    max_steps: int | None = None,
    warmup: int = 3,
    device: torch.device | None = None,
    bf16: bool | None = None,
) -> list[TrainRow]:
    """One ``TrainRow`` per variant, the baseline ``padded_sdpa`` first (default variants: all
    three on CUDA, the two SDPA ones on CPU), for ``rows`` as ``read_export`` returns them;
    ``bf16`` as in ``train_variant``."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if variants is None:
        variants = VARIANTS if device.type == "cuda" else VARIANTS[:2]
    variants = ("padded_sdpa", *(v for v in variants if v != "padded_sdpa"))
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    config = config or DecoderConfig(
        vocab_size=vocab_size_of(rows), dim=768, n_layers=8, n_heads=12
    )
    if config.vocab_size <= (largest := int(rows["input_ids"].max())):
        raise ValueError(f"vocab_size {config.vocab_size} holds no token id {largest}")
    results: list[TrainRow] = []
    baseline: list[float] = []
    for variant in variants:
        steps = step_batches(rows, rows_per_step, variant)[:max_steps]
        if len(steps) <= warmup:
            raise ValueError(
                f"the export makes {len(steps)} steps of {rows_per_step} rows, not more than "
                f"--warmup {warmup}; export more epochs or lower --rows"
            )
        losses, times, peak = train_variant(variant, steps, config, device, bf16=bf16)
        timed = steps[warmup:]
        seconds = sum(times[warmup:])
        slots = sum(s["input_ids"].size for s, _ in timed)
        real = sum(count for _, count in timed)
        trained = sum(int((s["labels"] != IGNORE_INDEX).sum()) for s, _ in timed)
        if variant == "padded_sdpa":
            baseline = losses
        tokens_per_s = real / seconds
        results.append(
            TrainRow(
                variant=variant,
                steps=len(timed),
                rows_per_step=float(np.mean([len(s["input_ids"]) for s, _ in timed])),
                slots_per_step=slots / len(timed),
                padding=1 - real / slots,
                ms_per_step=1000 * seconds / len(timed),
                tokens_per_s=tokens_per_s,
                trained_tokens_per_s=trained / seconds,
                speedup_vs_padded=tokens_per_s / results[0].tokens_per_s if results else 1.0,
                peak_gib=peak / 2**30,
                losses=losses,
                max_loss_diff=max(abs(a - b) for a, b in zip(losses, baseline, strict=True)),
            )
        )
    return results


def format_table(rows: list[TrainRow]) -> str:
    lines = [
        f"{'variant':<12} {'steps':>5} {'rows':>6} {'slots':>7} {'padding':>7} {'ms/step':>8} "
        f"{'tokens/s':>10} {'trained/s':>10} {'vs padded':>9} {'peak GiB':>8} {'Δloss':>8}"
    ]
    for row in rows:
        lines.append(
            f"{row.variant:<12} {row.steps:>5} {row.rows_per_step:>6.1f} "
            f"{row.slots_per_step:>7.0f} {row.padding:>7.1%} {row.ms_per_step:>8.1f} "
            f"{row.tokens_per_s:>10.0f} {row.trained_tokens_per_s:>10.0f} "
            f"{row.speedup_vs_padded:>8.2f}x {row.peak_gib:>8.2f} {row.max_loss_diff:>8.1e}"
        )
    return "\n".join(lines)


LOSS_TOLERANCE = 1e-3
"""The largest ``max_loss_diff`` a variant may show in fp32: far above fp32 rounding, far below
what a packed row trained with a plain causal mask shows after a few steps. On CUDA the timed runs
use bf16 autocast, where each kernel rounds its own way and the runs drift apart, so the check is a
short fp32 run of its own (``CHECK_STEPS``) before them; the table's Δloss column is then
informative only."""

CHECK_STEPS = 4
"""Steps of the fp32 check on CUDA."""


def make_parser() -> argparse.ArgumentParser:
    """``rayjobs bench train``'s arguments (the README's usage block lists every flag)."""
    parser = argparse.ArgumentParser(prog="rayjobs bench train", description=__doc__.split("\n")[0])
    parser.add_argument("--export", required=True, help="folder written by `rayjobs export`")
    parser.add_argument("--rows", type=int, default=4, help="packed rows per step")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS)
    parser.add_argument("--steps", type=int, help="at most this many steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="the decoder's vocabulary (default: the export's largest token id + 1, rounded up "
        "to 128; a run's model has its tokenizer's, e.g. 50257 for GPT-2)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    return parser


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, naming the argument, or None. Checked before the
    export is read: ``--rows 0`` failed in ``range``, and a negative ``--warmup`` or ``--steps``
    slice from the end (``--warmup -1`` timed the last step only, ``--steps -1`` dropped it)."""
    for flag in ("rows", "dim", "layers", "heads"):
        if getattr(args, flag) < 1:
            return f"--{flag} must be positive, got {getattr(args, flag)}"
    if args.vocab_size is not None and args.vocab_size < 1:
        return f"--vocab-size must be positive, got {args.vocab_size}"
    if args.warmup < 0:
        return f"--warmup must be 0 or more steps, got {args.warmup}"
    if args.steps is not None and args.steps <= args.warmup:
        return (
            f"--steps {args.steps} must be more than --warmup {args.warmup} (the steps after the "
            "warm-up are the timed ones)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if error := argument_error(args):
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    try:
        rows, seq_len = read_export(args.export)
    except (ConfigError, ValueError) as error:  # a usage error: no traceback
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    vocab_size = args.vocab_size or vocab_size_of(rows)
    if vocab_size <= (largest := int(rows["input_ids"].max())):
        print(f"rayjobs: --vocab-size {vocab_size} holds no token id {largest}", file=sys.stderr)
        return 2
    config = DecoderConfig(
        vocab_size=vocab_size, dim=args.dim, n_layers=args.layers, n_heads=args.heads
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):  # shapes only: no weights allocated to count them
        parameters = sum(p.numel() for p in Decoder(config).parameters())
    check = None
    if device.type == "cuda":  # fp32 first: a mask or layout error shows before any speed
        check = bench_rows(
            rows, args.rows, args.variants, config, CHECK_STEPS + 1, 1, device, bf16=False
        )
    results = bench_rows(rows, args.rows, args.variants, config, args.steps, args.warmup, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"{name}, torch {torch.__version__}, decoder {parameters / 1e6:.0f}M parameters "
        f"(dim {args.dim}, {args.layers} layers, vocab {vocab_size}), seq_len {seq_len}, "
        f"{args.rows} packed rows per step, {args.warmup} warm-up steps"
    )
    print(format_table(results))
    checked = check or results  # fp32 either way
    if check:
        diffs = ", ".join(f"{r.variant} {r.max_loss_diff:.1e}" for r in check)
        print(f"fp32 check over {CHECK_STEPS + 1} steps, Δloss vs padded_sdpa: {diffs}")
    if args.json:
        rows_out = {"bench": [asdict(r) for r in results]}
        if check:
            rows_out["fp32_check"] = [asdict(r) for r in check]
        Path(args.json).write_text(json.dumps(rows_out, indent=1))
    wrong = [
        r.variant
        for r in checked
        if r.variant != "padded_sdpa" and r.max_loss_diff > LOSS_TOLERANCE
    ]
    if wrong:  # the speeds above are of some other training: say so, and fail
        print(
            f"FAILED: {', '.join(wrong)} trained unlike padded_sdpa (fp32 Δloss above "
            f"{LOSS_TOLERANCE:g}): a layout or mask changed what is trained, so its speed is no "
            "comparison"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
