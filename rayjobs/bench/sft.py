"""``rayjobs bench sft``: ``rayjobs run`` beside TRL's ``SFTTrainer`` on the same model, data,
seq_len, rows per step and steps, on one machine's CPUs.

What both sides share comes from ``configs/tiny_llama.yaml``: the tiny Llama (its
``train.model.config``), ``packing.seq_len``, ``train.batch_size`` (rows per step: the batch
tokens are rows × seq_len), ``train.lr`` and ``seed``. The bench builds that model once
(``AutoModelForCausalLM.from_config`` after ``torch.manual_seed(seed)``, the GPT-2 tokenizer's
vocabulary and special ids) and saves it with ``save_pretrained``: both sides load the same
weights from that folder. For each scale it writes the bundled alpaca and hh chat sets repeated
``scale`` times as JSONL shards (``pipeline.write_shards``, as ``bench peers``) and runs each side
as a fresh process (imports and start-up included, for both):

- ``rayjobs``: ``rayjobs run CONFIG --json --quiet``, CONFIG being tiny_llama.yaml's ``train``
  section with the two sets, ``train.model.path`` the folder, ``max_steps`` the steps,
  ``lr_schedule: linear`` (TRL's default schedule), no evaluation, no periodic checkpoint,
  ``train.num_workers`` (``--num-workers``: 1, one Ray Train worker; 0, the loop in the driver)
  with ``cpus_per_worker`` the ``--threads`` (torch's threads; the data side's Ray tasks take the
  machine's other CPUs). The times come from the summary's ``throughput.first_step_at`` and
  ``last_step_at``;
- ``trl``: ``python -m rayjobs.bench.sft_trl`` (see there): the same samples through
  ``datasets`` and ``SFTTrainer`` (``packing=True``, BFD, ``padding_free=True``), torch on
  ``--threads`` threads, ``dataset_num_proc`` the machine's CPUs; its times from a
  ``TrainerCallback``.

Reported for each (scale, side), from the moment the bench started the process:

- ``first_step_s``, ``last_step_s``: until the first and the last optimizer step ended;
  ``exit_s``: until the process ended;
- ``tokens_per_s``: the steady rate, the tokens in the steps after the first tenth (at least one;
  as the summary's ``throughput``) over the time from the end of the first tenth to the end of
  the last step. A step's tokens are its packed rows' tokens (no padding on either side);
- ``peak_pss_mb`` and ``peak_rss_mb``: the process tree's peaks (``peers.run_tree``: PSS counts a
  page shared between processes once), and CPU seconds by kind of process;
- ``loss_first``, ``loss_last``: the mean loss of the first and the last tenth of the steps.

The sides of a scale run back to back, their order alternating between repeats (``--repeats``):
other work on the host slows whichever side runs at the time, and the ratios are per scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rayjobs.bench.packing import DEFAULT_DATA_DIR
from rayjobs.bench.peers import TreeFigures, child_env, failure, missing_extras, run_tree

SIDES = ("rayjobs", "trl")
TINY_LLAMA = Path(__file__).resolve().parents[2] / "configs" / "tiny_llama.yaml"
"""The config whose model, seq_len, rows per step, lr and seed both sides share."""


@dataclass
class SftRun:
    scale: int
    side: str
    first_step_s: float
    last_step_s: float
    tokens_per_s: float | None
    steps: int
    loss_first: float
    loss_last: float
    tree: TreeFigures
    """The process tree's exit time, peak memory and CPU (``peers.run_tree``)."""
    repeat: int = 0


@dataclass(frozen=True)
class Shared:
    """What both sides train with (module note)."""

    seq_len: int
    batch_size: int
    lr: float
    seed: int
    steps: int
    threads: int
    num_workers: int


def tiny_llama() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(TINY_LLAMA.read_text())


def tenth_means(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last tenth (at least one) of ``values``, as the run
    summary's ``loss_first`` and ``loss_last``.

    >>> tenth_means([4.0, 3.0, 2.0, 1.0])
    (4.0, 1.0)
    >>> tenth_means([float(v) for v in range(20)])
    (0.5, 18.5)
    """
    tenth = max(1, len(values) // 10)
    return statistics.fmean(values[:tenth]), statistics.fmean(values[-tenth:])


def steady_rate(ends: list[float], tokens_seen: list[int]) -> float | None:
    """Tokens per second after the first tenth of the steps (at least one), from each step's end
    time and the tokens seen by then: the summary's ``throughput.tokens_per_s``.

    >>> steady_rate([1.0, 2.0, 4.0], [100, 200, 400])
    100.0
    >>> steady_rate([1.0], [100]) is None
    True
    """
    skip = min(len(ends), max(1, len(ends) // 10))
    if skip >= len(ends) or ends[-1] <= ends[skip - 1]:
        return None
    return (tokens_seen[-1] - tokens_seen[skip - 1]) / (ends[-1] - ends[skip - 1])


def make_model(folder: Path, tokenizer: Path, seed: int) -> None:
    """tiny_llama.yaml's model with the tokenizer's vocabulary and special ids, its weights drawn
    after ``torch.manual_seed(seed)``, saved to ``folder`` (both sides load it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rayjobs.config import TokenizerConfig
    from rayjobs.data.tokenizer import Tokenizer
    from rayjobs.train.hf import hf_config

    ours = Tokenizer(TokenizerConfig(path=str(tokenizer)))
    token_ids = {"eos_token_id": ours.eos_id, "pad_token_id": ours.pad_id}
    if (bos := ours.backend.token_to_id(ours.special_tokens.get("bos_token", ""))) is not None:
        token_ids["bos_token_id"] = bos  # (TRL sets the model's to the tokenizer's)
    config = hf_config(
        vocab_size=ours.vocab_size,
        overrides=tiny_llama()["train"]["model"]["config"],
        token_ids=token_ids,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def run_config(folders: dict[str, Path], tokenizer: Path, model: Path, storage: Path,
               shared: Shared) -> dict[str, Any]:  # fmt: skip
    """The rayjobs side's config: tiny_llama.yaml's, on the shards, from the model folder."""
    base = tiny_llama()
    train = {k: v for k, v in base["train"].items() if k not in ("checkpoint_every", "model")}
    train |= {
        "num_workers": shared.num_workers,
        "cpus_per_worker": shared.threads,
        "batch_size": shared.batch_size,
        "max_steps": shared.steps,
        "lr": shared.lr,
        "lr_schedule": "linear",
        "report_every": shared.steps,
        "checkpoint_every_minutes": 0,
        "storage_path": str(storage),
        "model": {"kind": "hf", "path": str(model)},
    }
    return {
        "datasets": [
            {"name": "alpaca", "source": str(folders["alpaca"]), "template": "alpaca"},
            {"name": "hh_chat", "source": str(folders["hh_chat"]), "template": "chat"},
        ],
        "tokenizer": {"path": str(tokenizer)},
        "packing": base["packing"] | {"seq_len": shared.seq_len},
        "train": train,
        "seed": shared.seed,
    }


def side_command(side: str, work: Path, folders: dict[str, Path], tokenizer: Path, model: Path,
                 shared: Shared) -> list[str]:  # fmt: skip
    """The command of one side (it writes what the bench reads into ``work``)."""
    if side == "rayjobs":
        import yaml

        config = work / "run.yaml"
        config.write_text(yaml.safe_dump(run_config(folders, tokenizer, model, work, shared)))
        return [sys.executable, "-m", "rayjobs.cli", "run", str(config), "--json", "--quiet"]
    return [
        sys.executable, "-m", "rayjobs.bench.sft_trl", "--alpaca", str(folders["alpaca"]),
        "--chat", str(folders["hh_chat"]), "--model", str(model), "--tokenizer", str(tokenizer),
        "--out", str(work / "trl-out"), "--timeline", str(work / "timeline.json"),
        "--seq-len", str(shared.seq_len), "--batch-size", str(shared.batch_size),
        "--steps", str(shared.steps), "--seed", str(shared.seed), "--lr", str(shared.lr),
        "--threads", str(shared.threads), "--num-proc", str(os.cpu_count() or 1),
    ]  # fmt: skip


def rayjobs_result(summary: dict[str, Any], started: float) -> dict[str, Any]:
    """A ``rayjobs run --json`` summary's figures, its step times from ``started``."""
    throughput = summary["throughput"]
    return {
        "first_step_s": throughput["first_step_at"] - started,
        "last_step_s": throughput["last_step_at"] - started,
        "tokens_per_s": throughput["tokens_per_s"],
        "steps": summary["steps"],
        "loss_first": summary["loss_first"],
        "loss_last": summary["loss_last"],
    }


def trl_result(timeline: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """The TRL side's figures from its ``Timeline`` (``sft_trl``), its step times from
    ``started``."""
    ends = [step["at"] for step in timeline]
    loss_first, loss_last = tenth_means([step["loss"] for step in timeline])
    return {
        "first_step_s": ends[0] - started,
        "last_step_s": ends[-1] - started,
        "tokens_per_s": steady_rate(ends, [step["tokens"] for step in timeline]),
        "steps": len(timeline),
        "loss_first": loss_first,
        "loss_last": loss_last,
    }


def run_side(side: str, work: Path, command: list[str]) -> dict[str, Any]:
    """Run one side's ``command`` and read its figures (module note)."""
    log, stdout = work / "log.txt", work / "stdout.txt"
    code, started, measured = run_tree(command, log, child_env(), stdout=stdout)
    if code != 0:
        raise failure(command, code, log)
    if side == "rayjobs":
        return rayjobs_result(json.loads(stdout.read_text()), started) | {"tree": measured}
    return trl_result(json.loads((work / "timeline.json").read_text()), started) | {
        "tree": measured
    }


def bench_sft(data_dir: Path, scales: list[int], shared: Shared, repeats: int = 1,
              sides: tuple[str, ...] = SIDES) -> list[SftRun]:  # fmt: skip
    """Every side at every scale, ``repeats`` times, the order of the sides alternating."""
    from rayjobs.bench.pipeline import write_shards

    tokenizer = data_dir / "tokenizers" / "gpt2"
    runs = []
    with tempfile.TemporaryDirectory(prefix="rayjobs-sft-") as tmp:
        model = Path(tmp) / "model"
        make_model(model, tokenizer, shared.seed)
        for scale in scales:
            folders = write_shards(data_dir, Path(tmp) / f"{scale}x-data", scale)
            for repeat in range(repeats):
                for side in sides if repeat % 2 == 0 else tuple(reversed(sides)):
                    work = Path(tmp) / f"{scale}x-{side}-{repeat}"
                    work.mkdir()
                    command = side_command(side, work, folders, tokenizer, model, shared)
                    print(f"{scale}x {side} (repeat {repeat})...", file=sys.stderr, flush=True)
                    figures = run_side(side, work, command)
                    runs.append(SftRun(scale, side, repeat=repeat, **figures))
                    shutil.rmtree(work)
            shutil.rmtree(folders["alpaca"].parent)
    return runs


def _median(runs: list[SftRun], name: str) -> float | None:
    """The median of a figure of the runs, theirs or their process tree's."""
    values = [getattr(r, name, None) for r in runs] + [getattr(r.tree, name, None) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(runs: list[SftRun]) -> str:
    """The table (the median of the repeats in each cell), then per scale the ratios rayjobs /
    TRL and whether rayjobs reached its first step first and trained at least TRL's tokens/s,
    then each run's load and where its CPU went."""
    header = (
        f"{'scale':>6}  {'side':<9}{'first step s':>13}{'last step s':>12}{'exit s':>8}"
        f"{'tokens/s':>10}{'peak MB':>9}{'(RSS)':>8}{'CPU s':>8}{'steps':>6}  loss first -> last"
    )
    lines = [header, "-" * len(header)]
    keys = dict.fromkeys((r.scale, r.side) for r in runs)  # in the order they ran
    groups = {key: [r for r in runs if (r.scale, r.side) == key] for key in keys}
    for (scale, side), group in groups.items():
        m = {name: _median(group, name) for name in (
            "first_step_s", "last_step_s", "exit_s", "tokens_per_s", "peak_pss_mb",
            "peak_rss_mb", "cpu_s", "loss_first", "loss_last")}  # fmt: skip
        lines.append(
            f"{scale:>5}x  {side:<9}{m['first_step_s']:>13.1f}{m['last_step_s']:>12.1f}"
            f"{m['exit_s']:>8.1f}{_cell(m['tokens_per_s'], ',.0f'):>10}"
            f"{m['peak_pss_mb']:>9,.0f}{m['peak_rss_mb']:>8,.0f}{m['cpu_s']:>8.1f}"
            f"{group[0].steps:>6}  {m['loss_first']:.3f} -> {m['loss_last']:.3f}"
        )
    lines.append("")
    for scale in dict.fromkeys(r.scale for r in runs):
        ours, theirs = groups.get((scale, "rayjobs")), groups.get((scale, "trl"))
        if not ours or not theirs:
            continue
        ratio = {}
        for name in ("first_step_s", "last_step_s", "tokens_per_s", "peak_pss_mb"):
            a, b = _median(ours, name), _median(theirs, name)
            ratio[name] = a / b if a is not None and b else None
        each = [a.first_step_s / b.first_step_s for a, b in zip(ours, theirs, strict=False)]
        spread = f" (each repeat: {', '.join(f'{x:.2f}x' for x in each)})" if len(each) > 1 else ""
        lines.append(
            f"{scale}x rayjobs / trl: first step {_cell(ratio['first_step_s'], '.2f')}x{spread}, "
            f"last step {_cell(ratio['last_step_s'], '.2f')}x, tokens/s "
            f"{_cell(ratio['tokens_per_s'], '.2f')}x, peak memory "
            f"{_cell(ratio['peak_pss_mb'], '.2f')}x"
        )
        first = ratio["first_step_s"] is not None and ratio["first_step_s"] < 1
        rate = ratio["tokens_per_s"] is not None and ratio["tokens_per_s"] >= 1
        lines.append(
            f"{scale}x: rayjobs reached its first step {'before' if first else 'after'} TRL; "
            f"its steady tokens/s is {'at least' if rate else 'below'} TRL's"
        )
    lines += [f"{r.scale}x {r.side} #{r.repeat}: {r.tree.describe()}" for r in runs]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    base = tiny_llama()
    parser = argparse.ArgumentParser(
        prog="rayjobs bench sft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument(
        "--scales",
        type=int,
        nargs="+",
        default=[1, 30],
        help="copies of the bundled sets (default: 1 30)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=base["train"]["max_steps"],
        help="optimizer steps of each side (default: tiny_llama.yaml's)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side per scale")
    parser.add_argument(
        "--num-workers",
        type=int,
        choices=(0, 1),
        default=1,
        help="rayjobs' train.num_workers (TRL trains in its one process)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each side's training (default: 1)"
    )
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--json", metavar="OUT", help="also write the runs as JSON to OUT")
    return parser


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's arguments, naming the argument, or None."""
    if not Path(args.data_dir).is_dir():
        return f"--data-dir {args.data_dir} is not a folder (the bench reads real data there)"
    for flag, values in (("--scales", args.scales), ("--steps", [args.steps]),
                         ("--repeats", [args.repeats]), ("--threads", [args.threads])):  # fmt: skip
        if any(value < 1 for value in values):
            return f"{flag} must be positive, got {' '.join(map(str, values))}"
    return None


def main(argv: list[str] | None = None) -> int:
    """``rayjobs bench sft``."""
    args = make_parser().parse_args(argv)
    error = argument_error(args)
    if error is None and (missing := missing_extras()):
        error = (
            f"bench sft needs {', '.join(missing)} (the TRL side and the memory sampler): "
            "pip install 'rayjobs[bench]'"
        )
    if error:
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    base = tiny_llama()
    shared = Shared(
        seq_len=base["packing"]["seq_len"],
        batch_size=base["train"]["batch_size"],
        lr=base["train"]["lr"],
        seed=base["seed"],
        steps=args.steps,
        threads=args.threads,
        num_workers=args.num_workers,
    )
    runs = bench_sft(args.data_dir, args.scales, shared, args.repeats, tuple(args.sides))
    print(
        f"machine: {os.cpu_count()} CPUs; {shared.steps} steps of {shared.batch_size} rows x "
        f"{shared.seq_len} tokens, torch threads {shared.threads}, rayjobs train.num_workers "
        f"{shared.num_workers}; load average at the end {os.getloadavg()}"
    )
    print(format_table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
    steps = {r.steps for r in runs}
    return 0 if steps == {shared.steps} else 1
