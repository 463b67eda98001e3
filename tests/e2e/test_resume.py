"""Checkpoints and resume: train workers killed mid-run (a callback SIGKILLs a rank after a given
step, not timing luck) and a run resumed by name continue from the last checkpoint: model,
optimizer, LR schedule, step and the rows each rank had consumed, with what a restart re-sees or
skips measured against the bound the README states."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import ray.train

from conftest import DEMO_TOKENIZER, ROOT
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.errors import RunFailed
from rayjobs.job.pipeline import run
from rayjobs.job.runs import resume_name
from rayjobs.train.callbacks import Callback

DEMO = ROOT / "configs" / "demo"
BATCH = 2
WORLD = 2


def _config(storage, **train):
    return config_from_dict(_raw(storage, **train))


def _raw(storage, **train):
    return {
        "datasets": [
            {"name": "alpaca", "source": str(DEMO / "alpaca.jsonl"), "template": "alpaca"},
            {"name": "chat", "source": str(DEMO / "chat.jsonl"), "template": "chat"},
        ],
        "tokenizer": DEMO_TOKENIZER,
        "packing": {"seq_len": 256, "window": 256},
        "train": {
            "num_workers": WORLD,
            "batch_size": BATCH,
            "epochs": 1,
            "lr": 3e-3,
            "max_steps": 12,
            "checkpoint_every": 3,
            "report_every": 100,
            "storage_path": str(storage),
            "model": {"dim": 64, "n_layers": 1, "n_heads": 2},
            **train,
        },
        "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
    }


class Trace(Callback):
    """Appends ``what attempt step fingerprint`` for every row a rank trains on or skips when
    resuming, and ``loss attempt step value`` after each step, to ``<folder>/rank<r>.txt``: what
    a restart re-sees, skips and continues."""

    def __init__(self, folder):
        self.folder = str(folder)

    def _write(self, context, text):
        with open(os.path.join(self.folder, f"rank{context.rank}.txt"), "a") as f:
            f.write(text)

    def on_batch(self, context, state, batch, skipped):
        what = "skip" if skipped else "train"
        lines = [
            f"{what} {context.attempt} {state.steps + 1} "
            f"{hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest()}\n"
            for row in batch["input_ids"].cpu().numpy()
        ]
        self._write(context, "".join(lines))

    def on_step(self, context, state, result):
        self._write(context, f"loss {context.attempt} {state.steps} {state.losses[-1]!r}\n")


class Kill(Callback):
    """SIGKILLs a rank after a given step, once per marker file: a worker dying the way a lost
    node's do. It first waits until Ray Train has committed the run's latest checkpoint (listed it
    in the run's snapshot), so which checkpoint a restart finds does not depend on timing."""

    def __init__(self, faults):
        self.faults = faults

    def on_step(self, context, state, result):
        for fault in self.faults:
            if (fault["rank"], fault["step"]) != (context.rank, state.steps):
                continue
            if os.path.exists(fault["marker"]):
                continue
            if state.checkpoints:
                name = os.path.basename(state.checkpoints[-1]["path"])
                storage = ray.train.get_context().get_storage()
                snapshot = storage.checkpoint_manager_snapshot_path
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if os.path.exists(snapshot) and name in Path(snapshot).read_text():
                        break
                    time.sleep(0.1)
            with open(fault["marker"], "w") as f:
                f.write(str(state.steps))
            os.kill(os.getpid(), signal.SIGKILL)


def _trace(folder):
    """Per attempt: rows trained and skipped (digest → count, all ranks) and losses by step."""
    rows = {}
    losses = {}
    for path in folder.glob("rank*.txt"):
        for line in path.read_text().splitlines():
            what, attempt, step, value = line.split()
            attempt, step = int(attempt), int(step)
            if what == "loss":
                losses.setdefault(attempt, {})[step] = float(value)
            else:
                rows.setdefault((what, attempt), []).append((step, value))
    return rows, losses


def test_killed_workers_and_a_resumed_run_continue_from_the_last_checkpoint(ray_local, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    faults = [
        # rank 1 dies after step 4: Ray Train restarts both workers from checkpoint_step_3
        {"rank": 1, "step": 4, "marker": str(tmp_path / "fault1")},
        # rank 0 dies after step 6 (just checkpointed): a second failure, over max_failures
        {"rank": 0, "step": 6, "marker": str(tmp_path / "fault2")},
    ]
    # keep_checkpoints: the restarts need only the latest; older ones are deleted as they go
    config = _config(tmp_path / "runs", max_failures=1, keep_checkpoints=2)
    with pytest.raises(RunFailed) as caught:
        run(config, callbacks=[Trace(trace), Kill(faults)])
    assert (tmp_path / "fault1").exists() and (tmp_path / "fault2").exists()
    # Past max_failures: one message saying why, after how many worker groups, and where the
    # checkpoints are (``rayjobs run`` prints it as its one ``rayjobs:`` line, exit 1).
    name = resume_name(config, "latest")
    message = str(caught.value)
    assert message.startswith("training failed (rank 0: WorkerHealthCheckFailedError: ")
    assert message.endswith(
        f"after 2 worker group(s) (train.max_failures: 1); run {name} stopped; its checkpoints so "
        f"far are under {tmp_path / 'runs' / name} (continue it with `rayjobs run CONFIG "
        f"--resume {name}`, from a periodic checkpoint)"
    )
    # The stopped run is resumed by name (``rayjobs run CONFIG --resume``: the latest run). In
    # it rank 0 dies after the last step, 12 = max_steps, just checkpointed: the workers restart
    # from checkpoint_step_12 with nothing left to train (they used to train a 13th step).
    last = {"rank": 0, "step": 12, "marker": str(tmp_path / "fault3")}
    summary = run(config, resume="latest", callbacks=[Trace(trace), Kill([last])])
    assert summary["run_name"] == name
    assert (tmp_path / "fault3").exists()
    # Two worker groups started in this run (the restart after step 12): its stream was read
    # again, so the packs made say nothing of what went untrained.
    assert summary["attempts"] == 2 and summary["untrained_packs"] is None

    resumes = summary["resumes"]
    assert [r["step"] for r in resumes] == [3, 6, 12]
    assert [r["rows_skipped_per_rank"] for r in resumes] == [3 * BATCH, 6 * BATCH, 12 * BATCH]
    rows, losses = _trace(trace)
    # What the final model trained on: each attempt's steps up to the checkpoint the next one
    # resumed from (the steps after it were rolled back with the model).
    ends = {0: 3, 1: 6, 2: None}
    history = {
        attempt: [(s, d) for s, d in rows[("train", attempt)] if end is None or s <= end]
        for attempt, end in ends.items()
    }
    total_steps = summary["steps"]
    assert total_steps == 12 and summary["steps_per_rank"] == [12] * WORLD  # max_steps
    assert sum(len(h) for h in history.values()) == total_steps * BATCH * WORLD
    # The resumed run re-read its stream, skipping the rows consumed before its checkpoint.
    assert len(rows[("skip", 2)]) == 6 * BATCH * WORLD
    assert len(rows[("train", 2)]) == (12 - 6) * BATCH * WORLD
    assert ("train", 3) not in rows and ("skip", 3) not in rows  # restarted at max_steps

    # Re-seen and never-seen packs per restart, against the bound: at most the rows skipped.
    measured = []
    for attempt, checkpoint_step in ((1, 3), (2, 6)):
        before = Counter(d for a in range(attempt) for s, d in history[a] if s <= checkpoint_step)
        skipped = Counter(d for _, d in rows[("skip", attempt)])
        trained = Counter(d for _, d in rows[("train", attempt)])
        assert sum(before.values()) == sum(skipped.values()) == checkpoint_step * BATCH * WORLD
        reseen = sum((before & trained).values())
        never = sum((skipped - before).values())
        measured.append((attempt, reseen, never))
        assert reseen <= sum(skipped.values()) and never <= sum(skipped.values())
    print("restart, packs re-seen, packs never seen:", measured)

    # The loss continues: each attempt's first step after its checkpoint starts near the
    # checkpoint's loss, far below the initial loss.
    initial = losses[0][1]
    for attempt, checkpoint_step in ((1, 3), (2, 6)):
        at_checkpoint = losses[attempt - 1][checkpoint_step]
        first = losses[attempt][checkpoint_step + 1]
        assert first < initial - 0.5 * (initial - at_checkpoint), (attempt, losses)
    assert summary["loss_last"] < summary["loss_first"]
    assert [c["step"] for c in summary["checkpoints"]] == [9, 12]  # the latest 2 of 3, 6, 9, 12
    run_folder = tmp_path / "runs" / name
    saved = sorted(p.name for p in run_folder.glob("checkpoint_step_*"))
    assert saved == ["checkpoint_step_000009", "checkpoint_step_000012"]
    assert os.path.isdir(summary["checkpoint"])  # the final one, besides them


def test_resume_names_a_run_that_has_checkpoints(tmp_path):
    config = _config(tmp_path / "runs")
    with pytest.raises(ConfigError, match="no unfinished run with checkpoints"):
        resume_name(config, "latest")
    for name in ("older", "newer", "no-checkpoints"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    for when, name in enumerate(("older", "newer")):
        snapshot = tmp_path / "runs" / name / "checkpoint_manager_snapshot.json"
        snapshot.write_text("{}")
        os.utime(snapshot, (1e9 + when, 1e9 + when))
    assert resume_name(config, "older") == "older"
    assert resume_name(config, "latest") == "newer"
    # A finished run (its final checkpoint holds the summary) has nothing to resume: latest
    # passes over it, though it is newer; named, it is still found (and refused by the workers).
    (tmp_path / "runs" / "newer" / "checkpoint_final").mkdir()
    (tmp_path / "runs" / "newer" / "checkpoint_final" / "summary.json").write_text("{}")
    assert resume_name(config, "latest") == "older"
    assert resume_name(config, "newer") == "newer"
    with pytest.raises(ConfigError, match="no run 'no-checkpoints' with checkpoints"):
        resume_name(config, "no-checkpoints")


def test_a_run_in_the_driver_writes_its_checkpoints_under_storage_path(ray_local, tmp_path):
    """``train.num_workers: 0`` (Ray Train's local mode, which keeps a reported checkpoint in
    the temporary folder it was written to): every path the summary names exists after the run,
    under ``storage_path/<run>``, and ``keep_checkpoints`` holds as on workers."""
    config = _config(
        tmp_path / "runs", num_workers=0, max_steps=3, checkpoint_every=1, keep_checkpoints=2
    )
    summary = run(config)
    assert summary["world_size"] == 1 and summary["steps"] == 3  # guard: it ran in the driver
    run_folder = tmp_path / "runs" / summary["run_name"]
    paths = [summary["checkpoint"], *(c["path"] for c in summary["checkpoints"])]
    assert [c["step"] for c in summary["checkpoints"]] == [2, 3]
    for path in paths:
        assert Path(path).is_dir() and Path(path).parent == run_folder, path
    assert {p.name for p in run_folder.glob("checkpoint_*")} == {Path(p).name for p in paths}
    assert (Path(summary["checkpoint"]) / "summary.json").is_file()
    assert (Path(summary["checkpoints"][-1]["path"]) / "train_state.pt").is_file()
    # Ray Train does not restart or resume a loop in the driver: --resume says so.
    with pytest.raises(ConfigError, match="train.num_workers 0 runs the loop in the driver"):
        resume_name(config, "latest")


def test_under_the_defaults_a_killed_worker_costs_a_restart_not_the_run(ray_local, tmp_path):
    """No recovery setting in the config: a worker SIGKILLed after step 4 of 8 restarts the
    worker group (``train.max_failures`` 3), which continues from the checkpoint of step 1
    (``train.checkpoint_every_minutes``: the first step's), and the run ends with its 8 steps."""
    raw = _raw(tmp_path / "runs", max_steps=8)
    del raw["train"]["checkpoint_every"], raw["train"]["report_every"]
    config = config_from_dict(raw)
    train = config.train
    assert (train.max_failures, train.checkpoint_every, train.checkpoint_every_minutes) == (
        3, None, 30
    )  # fmt: skip
    fault = {"rank": 1, "step": 4, "marker": str(tmp_path / "fault")}
    summary = run(config, callbacks=[Kill([fault])])
    assert (tmp_path / "fault").exists()  # guard: the worker was killed
    assert summary["attempts"] == 2 and [r["step"] for r in summary["resumes"]] == [1]
    assert summary["steps"] == 8 and summary["steps_per_rank"] == [8] * WORLD
    assert [c["step"] for c in summary["checkpoints"]] == [1]


def test_a_bad_row_in_a_worker_ends_the_run_at_once_despite_max_failures(
    ray_local, tmp_path, monkeypatch
):
    """A rayjobs error raised in a worker (here a torn last JSONL line under ``on_bad_row:
    error``, past what the driver parses ahead) would fail every restart alike: under the
    default ``max_failures`` (3) the run ends at the first, through Ray Train's controller
    (``NoRetryOnUserError``), not after 3 retries."""
    from ray.train import ControllerError

    from rayjobs.data import estimate
    from rayjobs.errors import SourceError, user_error

    lines = (DEMO / "alpaca.jsonl").read_text().splitlines()[:20]
    (tmp_path / "z.jsonl").write_text("\n".join([*lines, '{"torn']) + "\n")
    raw = _raw(tmp_path / "runs")
    del raw["train"]["max_steps"]  # every row is read: the bad one too
    # A second file, past the head of the first that the driver parses to estimate lengths.
    raw["datasets"][0]["source"] = [str(DEMO / "alpaca.jsonl"), str(tmp_path / "z.jsonl")]
    monkeypatch.setattr(estimate, "SAMPLE_ROWS", 40)
    raw["packing"]["warmup_tokens"] = 0  # (the warm-up lane's heads are parsed there too)
    config = config_from_dict(raw)
    assert config.train.max_failures == 3  # guard: retries are on
    with pytest.raises(ControllerError) as caught:  # a worker group error, had it been retried
        run(config)
    found = user_error(caught.value)
    assert isinstance(found, SourceError) and "z.jsonl, row 21:" in str(found)
