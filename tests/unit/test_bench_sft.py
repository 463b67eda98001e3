"""rayjobs bench sft without running either side: its arguments (defaults from tiny_llama.yaml,
refusals before any work), the rayjobs side's config, the figures read from each side's output,
and the table from a fake result (the whole bench runs in tests/e2e/test_sft_against_trl.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import ROOT
from rayjobs.bench import sft as bench_sft
from rayjobs.bench.peers import TreeFigures
from rayjobs.bench.sft import (
    SftRun,
    Shared,
    format_table,
    rayjobs_result,
    run_config,
    steady_rate,
    trl_result,
)
from rayjobs.cli import main as cli_main
from rayjobs.config import Config

SHARED = Shared(seq_len=512, batch_size=2, lr=0.003, seed=0, steps=40, threads=1, num_workers=1)


def _never(*args, **kwargs):
    raise AssertionError("the bench ran")


def test_the_defaults_are_tiny_llamas_shape():
    tiny = yaml.safe_load((ROOT / "configs" / "tiny_llama.yaml").read_text())
    args = bench_sft.make_parser().parse_args([])
    assert (args.steps, args.scales, args.repeats) == (tiny["train"]["max_steps"], [1, 30], 1)
    assert (args.num_workers, args.threads, args.sides) == (1, 1, ["rayjobs", "trl"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be positive, got 0"),
        (["--scales", "1", "0"], "--scales must be positive, got 1 0"),
        (["--repeats", "-1"], "--repeats must be positive, got -1"),
        (["--threads", "0"], "--threads must be positive, got 0"),
        (["--data-dir", "no/such/folder"], "--data-dir no/such/folder is not a folder"),
    ],
)
def test_a_bad_argument_is_refused_before_any_run(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(bench_sft, "bench_sft", _never)
    assert cli_main(["bench", "sft", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"rayjobs: {message}")


def test_sft_options_before_the_bench_name_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_sft, "bench_sft", _never)
    assert cli_main(["bench", "--json", "out.json", "sft"]) == 2
    assert "bench sft takes its options after `bench sft`" in capsys.readouterr().err


def test_num_workers_is_zero_or_one(monkeypatch):
    monkeypatch.setattr(bench_sft, "bench_sft", _never)
    with pytest.raises(SystemExit) as exited:
        bench_sft.main(["--num-workers", "2"])
    assert exited.value.code == 2


def test_the_rayjobs_side_runs_tiny_llama_from_the_shared_model_folder(tmp_path):
    folders = {"alpaca": tmp_path / "alpaca", "hh_chat": tmp_path / "hh_chat"}
    raw = run_config(folders, tmp_path / "gpt2", tmp_path / "model", tmp_path / "runs", SHARED)
    config = Config.model_validate(raw)  # a config rayjobs takes, unchanged
    train = config.train
    assert (train.max_steps, train.batch_size, train.lr, config.packing.seq_len) == (
        40,
        2,
        0.003,
        512,
    )
    assert (train.num_workers, train.cpus_per_worker, train.lr_schedule) == (1, 1, "linear")
    assert (train.model.kind, train.model.path) == ("hf", str(tmp_path / "model"))
    assert (train.checkpoint_every, train.checkpoint_every_minutes, config.eval.datasets) == (
        None, 0, [],
    )  # fmt: skip
    assert [(d.name, d.template) for d in config.datasets] == [
        ("alpaca", "alpaca"), ("hh_chat", "chat"),
    ]  # fmt: skip


def test_each_sides_figures_are_timed_from_the_command_start():
    summary = json.loads(json.dumps({
        "steps": 3, "loss_first": 10.5, "loss_last": 9.0,
        "throughput": {"tokens_per_s": 800.0, "first_step_at": 1012.5, "last_step_at": 1020.0},
    }))  # fmt: skip
    assert rayjobs_result(summary, started=1000.0) == {
        "first_step_s": 12.5, "last_step_s": 20.0, "tokens_per_s": 800.0, "steps": 3,
        "loss_first": 10.5, "loss_last": 9.0,
    }  # fmt: skip
    timeline = [
        {"step": 1, "at": 1030.0, "tokens": 1000, "loss": 10.8},
        {"step": 2, "at": 1032.0, "tokens": 2000, "loss": 10.2},
        {"step": 3, "at": 1036.0, "tokens": 3024, "loss": 9.6},
    ]
    # steady: the steps after the first (a tenth, at least one): 2024 tokens in 6 s
    assert trl_result(timeline, started=1000.0) == {
        "first_step_s": 30.0, "last_step_s": 36.0, "tokens_per_s": 2024 / 6, "steps": 3,
        "loss_first": 10.8, "loss_last": 9.6,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("ends", "seen", "rate"),
    [
        ([1.0, 2.0, 4.0], [100, 200, 400], 100.0),  # steps 2 and 3: 300 tokens in 3 s
        ([float(s) for s in range(1, 21)], [100 * s for s in range(1, 21)], 100.0),  # skips 2
        ([1.0], [100], None),  # one step: nothing after the warm-up
    ],
)
def test_the_steady_rate_leaves_out_the_first_tenth(ends, seen, rate):
    assert steady_rate(ends, seen) == rate


def _tree(exit_s, pss, rss, cpu, load=(2.0, 3.0), steal=None, processes=3):
    return TreeFigures(exit_s, pss, rss, load, steal, {}, cpu, processes)


def test_the_table_shows_each_side_and_the_ratios():
    ours = _tree(70.0, 3000.0, 5000.0, {"RayTrainWorker": 30.0, "main process": 10.0}, processes=30)
    theirs = _tree(155.0, 1500.0, 1600.0, {"main process": 80.0}, (3.0, 2.5), 0.01)
    runs = [
        SftRun(30, "rayjobs", 20.0, 60.0, 1000.0, 40, 10.8, 9.5, ours),
        SftRun(30, "trl", 50.0, 150.0, 500.0, 40, 10.8, 9.75, theirs),
    ]
    lines = format_table(runs).splitlines()
    assert lines[2:] == [
        "   30x  rayjobs           20.0        60.0    70.0     1,000    3,000   5,000    40.0"
        "    40  10.800 -> 9.500",
        "   30x  trl               50.0       150.0   155.0       500    1,500   1,600    80.0"
        "    40  10.800 -> 9.750",
        "",
        "30x rayjobs / trl: first step 0.40x, last step 0.40x, tokens/s 2.00x, peak memory 2.00x",
        "30x: rayjobs reached its first step before TRL; its steady tokens/s is at least TRL's",
        "30x rayjobs #0: load 2.0 -> 3.0; 30 processes, CPU s 40.0: RayTrainWorker 30.0, "
        "main process 10.0; MB at the peak: ",
        "30x trl #0: load 3.0 -> 2.5, steal 1.0%; 3 processes, CPU s 80.0: main process 80.0; "
        "MB at the peak: ",
    ]


def test_the_table_says_when_rayjobs_is_behind_and_the_spread_of_repeats():
    def run(side, repeat, first, rate):
        tree = _tree(first + 12, 100.0, 100.0, {"main process": 1.0})
        return SftRun(1, side, first, first + 10, rate, 4, 10.0, 9.0, tree, repeat=repeat)

    runs = [run("rayjobs", 0, 30.0, 90.0), run("trl", 0, 20.0, 100.0),
            run("trl", 1, 20.0, 100.0), run("rayjobs", 1, 50.0, 90.0)]  # fmt: skip
    text = format_table(runs)
    # medians: rayjobs 40 s to its first step, TRL 20 s; each repeat's own ratio beside
    assert "1x rayjobs / trl: first step 2.00x (each repeat: 1.50x, 2.50x)" in text
    assert (
        "1x: rayjobs reached its first step after TRL; its steady tokens/s is below TRL's" in text
    )
