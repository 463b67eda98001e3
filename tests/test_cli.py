"""The public command line, end to end on real data: ``rayjobs run CONFIG ... --json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def test_run_on_real_alpaca_and_chat_with_two_workers(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    command = [
        sys.executable,
        "-m",
        "rayjobs.cli",
        "run",
        str(ROOT / "configs" / "alpaca_chat_gpt2.yaml"),
        "packing.seq_len=256",
        "packing.window=512",
        "train.batch_size=2",
        "train.max_steps=6",
        "train.report_every=3",
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
    assert summary["steps"] == 6 and summary["steps_per_rank"] == [6, 6]
    assert summary["num_packs"] == 6 * 2 * 2
    assert summary["guard_dropped_batches"] == 0
    assert summary["tokens_trained"] > 0 and 0 < summary["packing_efficiency"] <= 1
    assert set(summary["datasets"]) == {"alpaca", "hh_chat"}
    for stats in summary["datasets"].values():
        assert {"samples", "tokens", "truncated_tokens", "dropped_samples", "skipped_rows"} <= set(
            stats
        )
        assert stats["samples"] > 0 and stats["tokens"] > 0
    assert sum(s["truncated_tokens"] for s in summary["datasets"].values()) > 0  # seq_len 256 cuts
    assert os.path.isfile(os.path.join(summary["checkpoint"], "model.pt"))
    assert "packing efficiency" in done.stdout  # the human summary precedes the JSON line


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
