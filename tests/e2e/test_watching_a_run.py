"""A run you can watch (issue 35, acceptance 1 and 2), end to end.

``rayjobs run configs/demo.yaml --json`` in a process of its own, with warnings and prints forced
from inside the run (a Python warning, a Ray logger warning, a handler holding the original stdout,
a print, a write to file descriptor 1): stderr holds the data side's lines and rank 0's progress
lines before the summary, and stdout is exactly one JSON object. Its ``train.report_to`` writes
TensorBoard event files, an MLflow file store and a W&B offline run into the run folder, read back
with TensorBoard's and MLflow's own readers. A submitted job's log (what the dashboard shows) is
checked on the job ``test_prometheus`` submits, the suite's one job on a real head.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

OVERRIDES = ["train.epochs=1", "train.max_steps=12", "train.report_every=5"]
"""12 steps, fewer than 20: the summary's loss_last (the mean of the last tenth) is the last
step's loss; lines at steps 5 and 10 and at the last step, which is not a multiple of 5."""

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"rayjobs: step (\d+)/12  epoch 0/1  loss (\d+\.\d+)  lr \S+  grad_norm \S+  ")
DATA = re.compile(r"rayjobs: data: rows (\d+)  samples (\d+)  tokens (\d+) \(\d+/s\)  packs (\d+)")

NOISY = """\
import logging, os, sys, warnings

kept = logging.StreamHandler(sys.stdout)  # made before the run: it holds the original stdout
noisy = logging.getLogger("noisy")
noisy.addHandler(kept)
noisy.propagate = False

import rayjobs.job.pipeline as pipeline
from rayjobs.cli import main

train = pipeline._train


def noisy_train(config, job, callbacks):
    warnings.warn("forced: a Python warning during the run")
    logging.getLogger("ray").warning("forced: a Ray logger warning during the run")
    noisy.warning("forced: a handler holding the original stdout")
    print("forced: a print during the run")
    os.write(1, b"forced: a write to file descriptor 1 during the run\\n")
    return train(config, job, callbacks)


pipeline._train = noisy_train
sys.exit(main(sys.argv[1:]))
"""

FORCED = [
    "forced: a Python warning during the run",
    "forced: a Ray logger warning during the run",
    "forced: a handler holding the original stdout",
    "forced: a print during the run",
    "forced: a write to file descriptor 1 during the run",
]


@dataclass
class Run:
    stdout: str
    stderr: str
    summary: dict
    folder: Path
    """The run's folder: train.storage_path/<run name>."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("progress")
    script = tmp / "noisy_run.py"
    script.write_text(NOISY)
    drop = ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = ["run", str(ROOT / "configs" / "demo.yaml"), *OVERRIDES, "--json"]
    argv += [f"train.storage_path={tmp / 'runs'}", "train.report_to=[tensorboard,mlflow,wandb]"]
    done = subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    summary = json.loads(done.stdout)  # the whole of stdout: one JSON object
    return Run(done.stdout, ANSI.sub("", done.stderr), summary, tmp / "runs" / summary["run_name"])


def test_json_stdout_is_the_summary_alone_whatever_the_run_printed(run):
    assert isinstance(run.summary, dict) and run.stdout.count("\n") == 1
    assert run.summary["steps"] == 12 and run.summary["stopped_early"]
    for message in FORCED:  # guard: each was printed, and landed on stderr
        assert message in run.stderr and message not in run.stdout
    assert "steps 12 per rank [12, 12]" in run.stderr  # the text summary, on stderr


def test_progress_lines_come_before_the_summary_on_stderr(run):
    steps = [(int(m[1]), float(m[2]), m.start()) for m in STEP.finditer(run.stderr)]
    assert [step for step, _, _ in steps] == [5, 10, 12]  # every report_every steps, the last
    assert all(line_at < run.stderr.index("steps 12 per rank") for *_, line_at in steps)
    assert steps[-1][1] == pytest.approx(run.summary["loss_last"], abs=1e-4)
    timing = (
        r"rayjobs: step 5/12 .* tokens/s \d+  packing [01]\.\d+  elapsed \S+  eta \S+  params fp32"
    )
    assert re.search(timing, run.stderr)
    assert "rayjobs: data: stdlib_alpaca: estimating sample lengths" in run.stderr
    assert "rayjobs: data: first packed rows after" in run.stderr
    data = [tuple(map(int, m.groups())) for m in DATA.finditer(run.stderr)]
    assert data and all(line[2] > 0 for line in data), data  # tokens counted
    assert data[-1][3] > 0  # and packs


def test_tensorboard_event_files_end_at_the_summarys_last_loss(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.folder / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in loss] == [5, 10, 12]
    assert loss[-1] == (12, pytest.approx(run.summary["loss_last"], rel=1e-6))  # float32 there
    assert "train/tokens_per_s" in events.Tags()["scalars"]
    samples = events.Scalars("data/stdlib_alpaca/samples")
    assert 0 < samples[-1].value <= run.summary["datasets"]["stdlib_alpaca"]["samples"]


def test_the_mlflow_file_store_holds_the_same_series(run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run.folder / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("rayjobs").experiment_id])
    assert found.info.run_name == run.summary["run_name"] and found.info.status == "FINISHED"
    loss = [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert sorted(loss)[-1] == (12, pytest.approx(run.summary["loss_last"], rel=1e-12))
    assert found.data.params["train.max_steps"] == "12"


def test_wandb_writes_its_offline_run_folder(run):
    name = run.summary["run_name"]
    (offline,) = (run.folder / "wandb").glob(f"offline-run-*-{name}")
    record = (offline / f"run-{name}.wandb").read_bytes()
    assert b"train/loss" in record and b"data/stdlib_chat/samples" in record
