"""The public command line, end to end on real data: ``rayjobs run CONFIG ... --json`` (a real
run of configs/tiny_llama.yaml) and how it reads its arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def test_run_trains_a_tiny_llama_on_real_data_and_saves_checkpoints_from_pretrained_loads(
    tmp_path,
):
    """``rayjobs run configs/tiny_llama.yaml ... --json`` as a user types it (an embedded local
    Ray in its own process), on real alpaca + hh chat through the GPT-2 tokenizer. One run
    answers the command line (exit 0, the human summary, then the JSON summary as stdout's very
    last line; counts per dataset, truncation at seq_len 256) and the model issue's acceptance 2
    and 4: a Hugging Face Llama trains with 2 workers (equal steps, loss falls), checkpoints every
    4 steps (listed in the summary), and its final checkpoint loads with ``from_pretrained`` and
    gives the trained model's logits (``probe.pt``, computed in the run through the training
    path) on the probe input; the step-4 checkpoint does not (guard). Under DDP; the same save
    path under FSDP2 (sharded parameters gathered, then ``save_model``) is checked on two gloo
    processes by ``test_step.test_fsdp_over_two_processes_takes_the_single_process_step``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import GPT2
    from rayjobs.config import TokenizerConfig
    from rayjobs.tokenize import Tokenizer

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    command = [
        sys.executable,
        "-m",
        "rayjobs.cli",
        "run",
        str(ROOT / "configs" / "tiny_llama.yaml"),
        "packing.seq_len=256",
        "train.max_steps=8",
        "train.checkpoint_every=4",
        "train.report_every=4",
        "eval.every_steps=4",
        f"train.storage_path={tmp_path}",
        "--json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The summary is the very last line: Ray is shut down before it is printed, so no raylet
    # warning or log line can follow it (not even a blank one).
    summary = json.loads(done.stdout.splitlines()[-1])
    assert "packing efficiency" in done.stdout  # the human summary precedes the JSON line
    assert summary["steps"] == 8 and summary["steps_per_rank"] == [8, 8]
    assert summary["attempts"] == 1 and summary["untrained_packs"] is None  # max_steps stopped it
    assert summary["num_packs"] == 8 * 2 * 2
    assert summary["guard_dropped_batches"] == 0
    assert summary["tokens_trained"] > 0 and 0 < summary["packing_efficiency"] <= 1
    assert set(summary["datasets"]) == {"alpaca", "hh_chat"}
    for stats in summary["datasets"].values():
        assert {"samples", "tokens", "truncated_tokens", "dropped_samples", "skipped_rows"} <= set(
            stats
        )
        assert stats["samples"] > 0 and stats["tokens"] > 0
    assert sum(s["truncated_tokens"] for s in summary["datasets"].values()) > 0  # seq_len 256 cuts

    assert summary["parallelism"] == "ddp"
    assert (summary["model"], summary["attention"]) == ("hf", "sdpa")
    assert summary["loss_last"] < summary["loss_first"] - 0.5, summary
    assert [c["step"] for c in summary["checkpoints"]] == [4, 8]
    for checkpoint in summary["checkpoints"]:
        assert os.path.basename(checkpoint["path"]) == f"checkpoint_step_{checkpoint['step']:06d}"
        assert os.path.isfile(os.path.join(checkpoint["path"], "config.json"))
    final = summary["checkpoint"]
    assert os.path.isfile(os.path.join(final, "summary.json"))
    probe = torch.load(os.path.join(final, "probe.pt"))
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 50257
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        earlier = AutoModelForCausalLM.from_pretrained(summary["checkpoints"][0]["path"]).eval()
        earlier_logits = earlier(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
    assert not torch.allclose(earlier_logits, probe["logits"], atol=1e-3)  # guard: it trained

    tokenizer = AutoTokenizer.from_pretrained(final)
    reference = Tokenizer(TokenizerConfig(path=str(GPT2)))
    text = "Describe a process of making crepes."
    assert tokenizer(text)["input_ids"] == reference.encode_batch([text])[0]
    assert tokenizer.eos_token_id == reference.eos_id == model.config.eos_token_id
    _check_eval(summary, model)


def _check_eval(summary: dict, model) -> None:
    """The held-out loss (eval.datasets) at steps 4 and 8 counts every held-out labelled token
    exactly once over the 2 workers, and the final one equals the loss of the loaded checkpoint
    on each held-out sample run alone (unpacked, no document mask: packing changes nothing)."""
    import pyarrow as pa
    import torch

    from conftest import file_tables
    from rayjobs.config import load_config
    from rayjobs.tokenize import Tokenize

    evaluation = summary["eval"]
    assert [e["step"] for e in evaluation["history"]] == [4, 8]
    held_out = evaluation["datasets"]
    assert set(held_out) == {"alpaca_heldout", "hh_chat_heldout"}
    assert [s["samples"] for s in held_out.values()] == [60, 60]
    trained = sum(s["trained_tokens"] for s in held_out.values())
    for entry in evaluation["history"]:
        assert entry["rows"] == evaluation["packed"]["num_packs"] > 2  # guard: both ranks' shares
        assert entry["tokens"] == trained
    assert evaluation["history"][1]["loss"] < evaluation["history"][0]["loss"]
    assert evaluation["loss"] == evaluation["history"][-1]["loss"]

    config = load_config(ROOT / "configs" / "tiny_llama.yaml", ["packing.seq_len=256"])
    tokenize = Tokenize(config.eval.datasets, config.tokenizer, 256, "truncate")
    total, count = 0.0, 0
    for spec in config.eval.datasets:
        [path] = spec.files
        data = Path(path).read_bytes()
        tables = file_tables(data, path, format=spec.format, dataset=spec.name)
        samples = tokenize(pa.concat_tables(list(tables)))
        for ids, labels in zip(
            samples.column("input_ids").to_pylist(), samples.column("labels").to_pylist()
        ):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0]
            labels = torch.tensor(labels)
            total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            count += int((labels != -100).sum())
    assert count == trained
    assert abs(evaluation["loss"] - total / count) < 1e-4, (evaluation["loss"], total / count)


def test_overrides_may_follow_options(tmp_path, monkeypatch):
    import rayjobs.pipeline

    seen = {}

    def fake_run(config, resume=None):
        seen["config"], seen["resume"] = config, resume
        raise SystemExit(0)

    monkeypatch.setattr(rayjobs.pipeline, "run", fake_run)
    from rayjobs.cli import main

    with pytest.raises(SystemExit):
        main(
            [
                "run",
                str(ROOT / "configs" / "demo.yaml"),
                "packing.seq_len=256",
                "--address",
                "auto",
                "train.epochs=1",
            ]
        )
    config = seen["config"]
    assert (config.packing.seq_len, config.train.epochs, config.ray.address) == (256, 1, "auto")
    assert seen["resume"] is None
    # --resume: the latest run under train.storage_path, or the run it names
    for flags, expected in ((["--resume"], "latest"), (["--resume", "rayjobs-1a2b3c4d"], None)):
        expected = expected or flags[-1]
        with pytest.raises(SystemExit):
            main(["run", str(ROOT / "configs" / "demo.yaml"), *flags])
        assert seen["resume"] == expected


def test_ray_log_lines_go_to_stderr_while_a_job_runs(capsys):
    """What Ray prints in the driver (workers' lines, raylet warnings) goes to stderr while
    ``run``/``inspect`` work, through Ray's own printer: stdout holds the report alone."""
    from ray._private.worker import print_to_stdstream

    from rayjobs.cli import _ray_output_to_stderr

    line = {"ip": "127.0.0.1", "pid": "raylet", "is_err": False, "job": "01000000"}
    line |= {"task_name": None, "actor_name": None}
    with _ray_output_to_stderr():
        print_to_stdstream({**line, "lines": ["WARNING: 12 PYTHON worker processes"]}, False)
    print("the report")
    out, err = capsys.readouterr()
    assert out == "the report\n"
    assert "12 PYTHON worker processes" in err
    print_to_stdstream({**line, "lines": ["WARNING: again"]}, False)  # guard: stdout otherwise
    assert "again" in capsys.readouterr().out


def _usage_lines() -> dict[str, str]:
    """README's "Command line" block, each command's lines joined: ``{"run": "rayjobs run ...",
    "bench train": ..., ...}`` (``bench`` commands keyed by their second word too)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Command line\n\n```\n") + len("## Command line\n\n```\n")
    commands: dict[str, str] = {}
    key = ""
    for line in readme[start : readme.index("```", start)].splitlines():
        if line.startswith("rayjobs "):
            words = line.split()
            key = " ".join(words[1:3]) if words[1] == "bench" else words[1]
        commands[key] = commands.get(key, "") + line + "\n"
    return commands


def test_readme_usage_is_the_help_text_and_lists_every_flag():
    """The usage block in README.md is what ``rayjobs --help`` prints, and every flag each
    command accepts appears on that command's lines (``bench`` flags on the bench lines;
    ``bench train``'s own parser on its lines), so a flag added to the code without the README
    fails here."""
    import argparse

    from rayjobs import bench_train, cli

    usage = _usage_lines()
    assert cli.__doc__.split("\n\n", 1)[1] == "".join(usage.values())
    subcommands = next(
        a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    checked = {name: subparser for name, subparser in subcommands.items() if name != "bench"} | {
        "bench": subcommands["bench"],
        "bench train": bench_train.make_parser(),
    }
    missing = []
    for name, subparser in checked.items():
        lines = (
            "".join(v for k, v in usage.items() if k.startswith("bench "))
            if name == "bench"
            else usage[name]
        )
        for action in subparser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and flag not in lines:
                    missing.append(f"{name} {flag}")
    assert missing == []
    assert len(checked) == 9  # run export inspect submit status logs stop, bench, bench train


SUMMARY = {
    "steps": 2,
    "steps_per_rank": [2, 2],
    "loss_first": 5.0,
    "loss_last": 4.0,
    "num_packs": 16,
    "packing_efficiency": 0.97,
    "tokens_trained": 900,
    "datasets": {},
    "run_name": "r",
    "checkpoint": None,
}
"""A run summary's keys that ``format_summary`` always prints."""


@pytest.mark.parametrize("untrained, note", [(0, False), (None, False), (3, True)])
def test_the_human_summary_says_when_packs_went_untrained(untrained, note):
    from rayjobs.cli import format_summary

    line = format_summary({**SUMMARY, "untrained_packs": untrained}).splitlines()[1]
    assert line.startswith("packs 16  packing efficiency 0.9700  tokens trained 900")
    assert ("(3 packs made, not trained: untrained_packs)" in line) is note


def test_the_human_summary_shows_an_evaluation_history_without_its_eval_set():
    """A run resumed without the eval.datasets it was started with keeps the evaluations its
    checkpoint holds, but has no eval set of its own to count: the summary still prints."""
    from rayjobs.cli import format_summary

    history = [{"step": 2, "loss": 4.5, "rows": 10, "tokens": 300, "packs": 10}]
    text = format_summary({**SUMMARY, "eval": {"loss": 4.5, "history": history}})
    assert "eval: loss 4.5000 (step 2)  over 10 packs, 300 tokens" in text
