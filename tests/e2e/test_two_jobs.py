"""Two jobs on one cluster (issue 48, acceptance 6): two ``rayjobs submit`` of different configs
(another dataset, template, ``seq_len`` and model each), started at once on the session's head,
both succeed, each with its own run, its own exact counts (every sample of its own dataset
tokenized and packed once, the same counts as the local runner gives for its config in this
process, no pack lost) and its own metrics (the head's metrics endpoint, by ``run`` label). Each
job is a short run of a tiny demo decoder on a subset of the demo's data: a job on the head costs
mostly its start."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from rayjobs.config import load_config
from rayjobs.job.export import export

DEMO = ROOT / "configs" / "demo"
JOBS = {
    "a": ({"name": "alpaca", "source": "data/alpaca.jsonl", "template": "alpaca"}, 160, 256),
    "b": ({"name": "chat", "source": "data/chat.jsonl", "template": "chat"}, 80, 128),
}
"""Job → its dataset, the rows of the demo's file it holds, its seq_len."""
COUNTS = ("rows", "samples", "tokens", "trained_tokens", "truncated_tokens", "skipped_rows")


def _project(folder: Path, spec: dict, rows: int, seq_len: int) -> Path:
    (folder / "data").mkdir(parents=True)
    lines = (DEMO / Path(spec["source"]).name).read_text().splitlines()[:rows]
    (folder / spec["source"]).write_text("\n".join(lines) + "\n")
    shutil.copy(DEMO / "tokenizer.json", folder / "tokenizer.json")
    config = {
        "datasets": [spec],
        "tokenizer": {"path": "tokenizer.json", "eos_token": "<|endoftext|>",
                      "pad_token": "<|pad|>"},
        "packing": {"seq_len": seq_len},
        "train": {
            "num_workers": 1, "cpus_per_worker": 0.5, "batch_size": 4, "epochs": 1,
            "storage_path": str(folder.parent / "runs"),
            "model": {"dim": 32, "n_layers": 1, "n_heads": 2},
        },
    }  # fmt: skip
    (folder / "cfg.yaml").write_text(yaml.safe_dump(config))
    return folder / "cfg.yaml"


def _series(head_metrics: str, name: str) -> dict[tuple[str, str], float]:
    """Counter ``name``'s samples on the head's metrics endpoint (Ray prefixes ``ray_``, the
    exposition adds ``_total``): (run, dataset) → value."""
    found = {}
    for line in head_metrics.splitlines():
        if re.match(rf"(ray_)?{name}(_total)?{{", line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            found[(labels.get("run"), labels.get("dataset"))] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.fixture(scope="module")
def two_jobs(ray_head, tmp_path_factory):
    """Both submits started at once; each job's ``--json`` record and its config."""
    root = tmp_path_factory.mktemp("two")
    configs = {job: _project(root / job, *spec) for job, spec in JOBS.items()}
    children = {
        job: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rayjobs.cli",
                "submit",
                str(config),
                "--working-dir",
                str(config.parent),
                "--address",
                ray_head.url,
                "--json",
            ],
            env=ray_head.env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for job, config in configs.items()
    }
    records = {}
    for job, child in children.items():
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-4000:] + out[-2000:]
        records[job] = json.loads(out.splitlines()[-1])
    return records, configs


def test_two_jobs_at_once_on_one_head_each_count_exactly_their_own_data(two_jobs, tmp_path):
    records, configs = two_jobs
    names = {records[job]["summary"]["run_name"] for job in JOBS}
    assert len(names) == 2 and len({records[job]["submission_id"] for job in JOBS}) == 2
    for job, (spec, rows, _) in JOBS.items():
        summary = records[job]["summary"]
        assert records[job]["status"] == "SUCCEEDED"
        # what the local runner counts for the same config, in this process (no Ray)
        expected = export(load_config(configs[job]), tmp_path / job, runner="local")
        [name] = summary["datasets"]
        assert name == spec["name"], summary["datasets"]  # nothing of the other job's
        counts = summary["datasets"][name]
        assert counts["rows"] == rows and counts["samples"] > 0  # guard: its rows were read
        assert {k: counts[k] for k in COUNTS} == {k: expected["datasets"][name][k] for k in COUNTS}
        [epoch] = summary["mix"]
        packed = expected["epochs"][0]["mix"][name]["samples"]
        assert epoch["datasets"][name]["samples"] == packed > 0  # each sample in one pack, once
        assert summary["packed"]["num_packs"] == summary["num_packs"] > 0
        assert summary["untrained_packs"] == 0 and summary["attempts"] == 1
        assert summary["steps"] == -(-summary["num_packs"] // 4)  # every pack trained
        assert summary["checkpoint"] and summary["run_name"] in summary["checkpoint"]


def test_each_job_has_its_own_metrics(two_jobs, ray_head):
    records, _ = two_jobs
    wanted = {
        (records[job]["summary"]["run_name"], spec["name"]): float(rows)
        for job, (spec, rows, _) in JOBS.items()
    }
    deadline = time.monotonic() + 30
    while True:  # the head's agent exports what the jobs' ledgers last set
        with urllib.request.urlopen(f"http://127.0.0.1:{ray_head.metrics_port}/metrics") as r:
            samples = _series(r.read().decode(), "rayjobs_samples")
        mine = {key: value for key, value in samples.items() if key in wanted}
        if mine == wanted or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert mine == wanted, samples
