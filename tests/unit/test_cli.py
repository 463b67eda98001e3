"""The public command line: how it reads its arguments, where Ray's lines go, the README's usage
block, the human summary. A real ``rayjobs run configs/tiny_llama.yaml ... --json`` runs as the
job ``test_prometheus`` submits to a real head (one end-to-end run for both)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


def test_overrides_may_follow_options(tmp_path, monkeypatch):
    import rayjobs.job.pipeline

    seen = {}

    def fake_run(config, resume=None):
        seen["config"], seen["resume"] = config, resume
        raise SystemExit(0)

    monkeypatch.setattr(rayjobs.job.pipeline, "run", fake_run)
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

    from rayjobs.console import ray_output_to_stderr

    line = {"ip": "127.0.0.1", "pid": "raylet", "is_err": False, "job": "01000000"}
    line |= {"task_name": None, "actor_name": None}
    with ray_output_to_stderr():
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

    from rayjobs import cli
    from rayjobs.bench import sft as bench_sft
    from rayjobs.bench import train as bench_train

    usage = _usage_lines()
    assert cli.__doc__.split("\n\n", 1)[1] == "".join(usage.values())
    subcommands = next(
        a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    checked = {name: subparser for name, subparser in subcommands.items() if name != "bench"} | {
        "bench": subcommands["bench"],
        "bench train": bench_train.make_parser(),
        "bench sft": bench_sft.make_parser(),
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
    # run export inspect validate init submit status logs stop, bench, bench train, bench sft
    assert len(checked) == 12


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


def test_python_dash_m_rayjobs_is_the_command_line():
    """``python -m rayjobs`` runs the CLI as ``python -m rayjobs.cli`` (and the ``rayjobs``
    script) does: same exit code, same output."""

    def version(module):
        return subprocess.run(
            [sys.executable, "-m", module, "--version"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    package, cli = version("rayjobs"), version("rayjobs.cli")
    assert cli.returncode == 0 and cli.stdout.startswith("rayjobs "), cli.stderr
    assert package.returncode == 0, package.stderr
    assert package.stdout == cli.stdout
