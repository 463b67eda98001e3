"""Progress without Ray: rank 0's line (``rayjobs.train.progress``) driven through the callback
hooks as the loop calls them, the trackers' own files read back with each tracker's reader, the
data side's line from a ledger snapshot (``rayjobs.job.monitor``), and the command line's
logging: ``rayjobs: ...`` progress, ``--quiet``, a missing tracker refused before Ray starts.
A real run, and a submitted job's log, are in tests/e2e/test_watching_a_run.py."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from conftest import ROOT
from rayjobs.job import monitor, watch
from rayjobs.train import trackers
from rayjobs.train.callbacks import LoopContext
from rayjobs.train.checkpoint import TrainState
from rayjobs.train.progress import Progress, duration, format_line, planned_steps
from rayjobs.train.step import StepResult

DEMO = ROOT / "configs" / "demo.yaml"


class Lines(Progress):
    """Progress keeping its lines (``emit`` is the documented way to send them elsewhere)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lines: list[str] = []

    def emit(self, line: str) -> None:
        self.lines.append(line)


class Recorder(trackers.Trackers):
    """Trackers that record what they are given."""

    def __init__(self):
        super().__init__([], "", {})
        self.logged: list[tuple[int, dict]] = []
        self.events: list[str] = []

    def open(self, run_name: str, step: int) -> None:
        self.events.append(f"open {run_name} {step}")

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((step, dict(scalars)))

    def close(self, step: int) -> None:
        self.events.append(f"close {step}")


def _batch(epoch: int, tokens: int, seq_len: int = 16) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.zeros(2, seq_len, dtype=torch.long),
        "num_tokens": torch.tensor([tokens, tokens]),
        "epoch": torch.tensor([epoch, epoch]),
    }


def _drive(progress: Progress, steps: int, rank: int = 0, evals: dict[int, float] | None = None,
           start: int = 0) -> TrainState:  # fmt: skip
    """Call the hooks as ``train_loop`` does: two rows of 12 tokens (of 16) a step."""
    context = LoopContext(rank, 2, "rayjobs-test", 0)
    state = TrainState(steps=start)
    progress.on_train_begin(context, state)
    for step in range(start + 1, start + steps + 1):
        batch = _batch(epoch=(step - 1) // 5, tokens=12)
        progress.on_batch(context, state, batch, False)
        result = StepResult(10.0 / step, 24, 0.5, None, 1e-3, global_tokens=48)
        state.losses.append(result.loss)
        state.steps, state.rows, state.pack_tokens = step, state.rows + 2, state.pack_tokens + 24
        if evals and step in evals:
            progress.on_report(context, state, {"step": step, "eval_loss": evals[step]})
        progress.on_step(context, state, result)
    summary = {"steps": state.steps}
    if evals:
        summary["eval"] = {"history": [{"step": s, "loss": evals[s]} for s in sorted(evals)]}
    progress.on_train_end(context, state, summary)
    return state


def test_rank_0_prints_a_line_every_report_every_steps_and_at_the_last_step():
    progress = Lines(every=4, total_steps=10, epochs=2)
    _drive(progress, 10)
    assert [line.split()[1] for line in progress.lines] == ["4/10", "8/10", "10/10"]
    first = progress.lines[0]
    assert re.fullmatch(
        r"step 4/10  epoch 0/2  loss 2\.5000  lr 0\.001  grad_norm 0\.500  tokens/s \d+  "
        r"packing 0\.750  elapsed \d+:\d\d  eta \d+:\d\d",
        first,
    ), first
    assert "epoch 1/2" in progress.lines[1]  # the epoch of the step's last batch
    assert progress.lines[-1].endswith("eta 0:00")


def test_other_ranks_print_nothing_and_an_unknown_total_has_no_eta():
    quiet = Lines(every=2)
    _drive(quiet, 4, rank=1)
    assert quiet.lines == []
    alone = Lines(every=2)
    _drive(alone, 4)
    assert [line.split()[1] for line in alone.lines] == ["2", "4"]  # no total
    assert all("eta" not in line for line in alone.lines)


def test_a_restart_counts_its_eta_from_the_step_it_resumed_at():
    progress = Lines(every=5, total_steps=20)
    _drive(progress, 10, start=10)
    assert [line.split()[1] for line in progress.lines] == ["15/20", "20/20"]


def test_trackers_get_the_lines_scalars_and_the_evaluations():
    recorder = Recorder()
    progress = Lines(every=4, total_steps=10, show=False, trackers=recorder)
    _drive(progress, 10, evals={6: 3.25, 10: 2.5})
    assert progress.lines == []  # show=False: the trackers alone
    assert recorder.events == ["open rayjobs-test 0", "close 10"]
    steps = [step for step, _ in recorder.logged]
    assert steps == [4, 6, 8, 10]  # every 4 steps, a step with an evaluation, the last step
    scalars = dict(recorder.logged)
    assert scalars[4]["loss"] == 2.5 and scalars[4]["lr"] == 1e-3
    assert scalars[4]["packing_efficiency"] == 0.75 and scalars[4]["epoch"] == 0
    assert set(scalars[4]) == {
        "loss", "lr", "grad_norm", "tokens_per_s", "packing_efficiency", "epoch"
    }  # fmt: skip
    assert scalars[6]["eval_loss"] == 3.25 and "eval_loss" not in scalars[8]
    assert scalars[10]["eval_loss"] == 2.5  # reported at the last step: logged once
    assert trackers.tracker_names(scalars[6])["eval/loss"] == 3.25
    assert trackers.tracker_names(scalars[6])["train/loss"] == scalars[6]["loss"]


def test_the_closing_evaluation_reaches_the_trackers():
    """The loop's last evaluation runs after the last step, without a report."""
    recorder = Recorder()
    progress = Progress(every=5, show=False, trackers=recorder)
    context = LoopContext(0, 1, "r", 0)
    state = TrainState()
    progress.on_train_begin(context, state)
    progress.on_batch(context, state, _batch(0, 12), False)
    state.steps = 1
    progress.on_step(context, state, StepResult(4.0, 12, None, None, 1e-3, global_tokens=12))
    summary = {"eval": {"history": [{"step": 1, "loss": 3.5, "reward_accuracy": 0.75}]}}
    progress.on_train_end(context, state, summary)
    assert recorder.logged == [
        (1, recorder.logged[0][1]),
        (1, {"eval_loss": 3.5, "eval/dpo/reward_accuracy": 0.75}),
    ]
    assert "grad_norm" not in recorder.logged[0][1]  # max_grad_norm: null


def test_durations_and_planned_totals():
    assert [duration(s) for s in (0, 59.6, 61, 3600, 3725)] == [
        "0:00", "1:00", "1:01", "1:00:00", "1:02:05"
    ]  # fmt: skip
    from rayjobs.config import load_config

    spec = load_config(DEMO, ["train.batch_size=4", "train.grad_accum_steps=2"]).train
    # 2 workers: 101 packs → 50 rows each → 13 batches → 7 steps; 40 → 20 → 5 → 3
    assert planned_steps([101, 40], 2, spec) == 10
    drop = spec.model_copy(update={"drop_last": True})
    assert planned_steps([101, 40], 2, drop) == 6 + 3  # 12 whole batches, 5
    assert planned_steps([101, 40], 2, spec.model_copy(update={"max_steps": 4})) == 4
    line = format_line(3, {"loss": 1.0, "lr": 0.1, "dpo/reward_accuracy": 0.5}, None, None, 1, None)
    assert line == "step 3  loss 1.0000  lr 0.1  reward_accuracy 0.500  elapsed 0:01"


def test_run_gives_its_progress_a_planned_runs_total(caplog):
    """``rayjobs run``'s own callback: a planned run's steps from its planned packs, and none
    at all when neither the lines nor a tracker want it."""
    from types import SimpleNamespace

    from rayjobs.config import load_config
    from rayjobs.job.pipeline import builtin_callbacks

    config = load_config(DEMO, ["packing.mode=planned"])
    job = SimpleNamespace(epochs=SimpleNamespace(num_packs={0: 101, 1: 40, 2: 40}), name="r")
    caplog.set_level(logging.WARNING, logger="rayjobs")
    assert builtin_callbacks(config, job) == []
    caplog.set_level(logging.INFO, logger="rayjobs")
    [progress] = builtin_callbacks(config, job)
    assert progress.total == planned_steps([101, 40, 40], 2, config.train) == 13 + 5 + 5
    assert (progress.epochs, progress.every, progress.show) == (3, 10, True)


def _read_tensorboard(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _read_mlflow(folder, run_name: str):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("rayjobs")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_name
    return client, run


def test_each_tracker_writes_its_own_files_offline(tmp_path, monkeypatch):
    """TensorBoard event files, an MLflow file store and a W&B offline run in the run folder,
    read back with TensorBoard's and MLflow's own readers; a second ``open`` under the same
    name (a restart, ``--resume``) continues the run."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # dir= wins
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"train": {"lr": 0.003}, "datasets": [{"name": "a"}]}
    chosen = trackers.Trackers(["tensorboard", "mlflow", "wandb"], str(tmp_path), config)
    chosen.open("rayjobs-unit", 0)
    for step, loss in ((5, 3.0), (10, 2.0)):
        chosen.log({"loss": loss, "lr": 0.003, "eval_loss": loss + 1}, step)
    chosen.close(10)
    again = trackers.Trackers(["tensorboard", "mlflow"], str(tmp_path), config)
    again.open("rayjobs-unit", 10)  # resumed at step 10
    again.log({"loss": 1.5}, 15)
    again.close(15)

    scalars = _read_tensorboard(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(5, 3.0), (10, 2.0), (15, 1.5)]
    assert scalars["eval/loss"] == [(5, 4.0), (10, 3.0)]
    client, run = _read_mlflow(tmp_path, "rayjobs-unit")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(5, 3.0), (10, 2.0), (15, 1.5)]
    assert run.data.params["train.lr"] == "0.003" and run.data.params["datasets.0.name"] == "a"
    assert run.info.status == "FINISHED"
    (offline,) = (tmp_path / "wandb").glob("offline-run-*-rayjobs-unit")
    record = (offline / "run-rayjobs-unit.wandb").read_bytes()
    assert b"train/loss" in record and b"eval/loss" in record
    assert not (tmp_path / "elsewhere").exists()
    import wandb

    wandb.teardown()  # its service's threads, which a train worker's exit ends


def test_per_dataset_counts_from_a_ledger_snapshot():
    snapshot = {
        "tokenize": {"a": {"samples": 3, "tokens": 30, "seconds": 0.5}, "b": {"samples": 1}},
        "pack": {0: {"num_packs": 2, "num_tokens": 30, "num_slots": 32}},
    }
    assert trackers.dataset_counts(snapshot) == {
        "data/a/samples": 3,
        "data/a/tokens": 30,
        "data/b/samples": 1,
        "data/packs": 2,
        "data/packing_efficiency": 30 / 32,
    }


def test_a_missing_tracker_or_a_remote_folder_is_refused_naming_what_to_do(monkeypatch):
    trackers.check(["tensorboard", "mlflow", "wandb"], "/tmp/runs")  # installed (test extra)
    monkeypatch.setitem(trackers.PACKAGES, "wandb", "rayjobs_no_such_package")
    with pytest.raises(trackers.ConfigError, match=r"pip install 'rayjobs\[wandb\]'"):
        trackers.check(["wandb"], "/tmp/runs")
    with pytest.raises(trackers.ConfigError, match="is not a local folder"):
        trackers.check(["tensorboard"], "s3://bucket/runs")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    trackers.check(["mlflow"], "s3://bucket/runs")  # MLflow's own server: no files here


SNAPSHOT = {
    "tokenize": {
        "a": {"rows": 10, "samples": 9, "tokens": 900},
        "b": {"rows": 5, "samples": 5, "tokens": 100},
    },
    "pack": {
        0: {"num_packs": 4, "num_tokens": 900, "num_slots": 1024,
            "documents_by_source": {"a": 8, "b": 4}, "tokens_by_source": {"a": 800, "b": 100}},
        1: {"num_packs": 1, "num_tokens": 96, "num_slots": 256,
            "documents_by_source": {"a": 1, "b": 1}, "tokens_by_source": {"a": 50, "b": 46}},
    },
}  # fmt: skip


def test_the_data_line_holds_exact_counts_and_the_mix_being_packed():
    now = monitor.totals(SNAPSHOT)
    assert now == {"rows": 15, "samples": 14, "tokens": 1000, "packs": 5, "efficiency": 996 / 1280}
    assert monitor.mix_so_far(SNAPSHOT, "samples") == (1, {"a": 0.5, "b": 0.5})
    assert monitor.mix_so_far(SNAPSHOT | {"pack": {}}, "tokens") is None
    line = monitor.format_line(now, 250.0, monitor.mix_so_far(SNAPSHOT, "tokens"))
    assert line == (
        "data: rows 15  samples 14  tokens 1000 (250/s)  packs 5  packing 0.778  "
        "mix (epoch 1) a 0.521 b 0.479"
    )


class _Ledger:
    """A ledger whose snapshot moves when told; ``snapshot.remote()`` returns it (``ray.get``
    is patched to pass it through)."""

    def __init__(self):
        self.value = {"tokenize": {}, "pack": {}}
        self.snapshot = self

    def remote(self):
        return self.value


def test_the_data_monitor_logs_when_counts_move_and_once_more_at_stop(monkeypatch, caplog):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    ledger = _Ledger()
    caplog.set_level(logging.INFO, logger="rayjobs.data")
    watcher = monitor.DataMonitor(ledger, interval=3600).start()  # no tick of its own
    assert watcher.tick()
    assert caplog.messages == []  # nothing read yet
    ledger.value = SNAPSHOT
    assert watcher.tick() and watcher.tick()  # the second: nothing moved
    assert caplog.messages[0].startswith("data: first packed rows after")
    assert caplog.messages[1].startswith("data: rows 15  samples 14  tokens 1000 (")
    assert len(caplog.messages) == 2
    watcher.stop()  # nothing moved since: no line
    assert len(caplog.messages) == 2
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: 1 / 0)
    assert not watcher.tick()  # the ledger is gone: the thread ends


def test_the_data_monitor_does_not_poll_unless_info_is_on(caplog):
    caplog.set_level(logging.WARNING, logger="rayjobs")
    watcher = monitor.DataMonitor(_Ledger()).start()
    assert watcher._thread is None


def test_the_cli_prints_progress_lines_unless_quiet(monkeypatch, capsys):
    """``rayjobs: ...`` for the data side's INFO lines, ``rayjobs: warning: ...`` for warnings,
    on stderr; ``--quiet`` keeps the warnings only; and ``run`` builds its progress callback
    only when the lines are shown."""
    import rayjobs.job.pipeline
    from rayjobs.cli import main

    seen = {}

    def fake_run(config, resume=None):
        logging.getLogger("rayjobs.data").info("data: rows 1")
        logging.getLogger("rayjobs").warning("a column no template reads")
        seen["train"] = logging.getLogger("rayjobs.train").isEnabledFor(logging.INFO)
        raise SystemExit(0)

    monkeypatch.setattr(rayjobs.job.pipeline, "run", fake_run)
    with pytest.raises(SystemExit):
        main(["run", str(DEMO)])
    out, err = capsys.readouterr()
    assert err == "rayjobs: data: rows 1\nrayjobs: warning: a column no template reads\n"
    assert out == "" and seen["train"]
    with pytest.raises(SystemExit):
        main(["run", str(DEMO), "--quiet"])
    assert capsys.readouterr().err == "rayjobs: warning: a column no template reads\n"
    assert not seen["train"]
    assert logging.getLogger("rayjobs").level == logging.NOTSET  # restored after the command


def test_a_missing_tracker_exits_2_naming_the_extra_before_ray_starts(monkeypatch, capsys):
    import rayjobs.job.pipeline
    from rayjobs.cli import main

    started = []
    monkeypatch.setattr(rayjobs.job.pipeline, "start_job", lambda *a, **k: started.append(a))
    monkeypatch.setitem(trackers.PACKAGES, "mlflow", "rayjobs_no_such_package")
    assert main(["run", str(DEMO), "train.report_to=[tensorboard,mlflow]"]) == 2
    err = capsys.readouterr().err
    assert "train.report_to: mlflow needs" in err and "pip install 'rayjobs[mlflow]'" in err
    assert started == []  # refused before start_job (which starts or joins Ray)


@pytest.mark.parametrize(
    ("rate", "mix", "expected"),
    [
        (
            250.0,
            (1, {"a": 0.5, "b": 0.5}),
            {"tokens_per_s": 250, "mix": {"epoch": 1, "shares": {"a": 0.5, "b": 0.5}}},
        ),
        (None, (0, {"a": 1.0}), {"tokens_per_s": None}),  # one dataset: no mix on the line
        (None, None, {"tokens_per_s": None}),
    ],
)
def test_a_progress_line_reads_back_as_its_counts(rate, mix, expected):
    """``rayjobs status`` reads a running job's counts from the ledger's last line, as printed
    (``rayjobs: `` prefix and all): what ``format_line`` wrote comes back, efficiency rounded as
    shown."""
    now = {"rows": 15, "samples": 14, "tokens": 1000, "packs": 5, "efficiency": 0.77777}
    line = "rayjobs: " + monitor.format_line(now, rate, mix)
    counts = {"rows": 15, "samples": 14, "tokens": 1000, "packs": 5, "efficiency": 0.778}
    assert monitor.parse_line(line) == counts | expected
    assert monitor.parse_line("rayjobs: data: first packed rows after 1.0 s") is None


def test_status_of_an_ended_run_gives_the_summarys_totals():
    summary = {
        "run_name": "rayjobs-1",
        "datasets": {
            "a": {"rows": 10, "samples": 9, "tokens": 900},
            "b": {"rows": 5, "samples": 5, "tokens": 100},
        },
        "packed": {"num_packs": 4, "num_tokens": 1000, "efficiency": 0.9765625},
    }
    counts = watch.final_counts(summary)
    assert counts == {
        "rows": 15,
        "samples": 14,
        "tokens": 1000,
        "packs": 4,
        "efficiency": 0.9765625,
    }
    assert watch.counts_line(counts) == (
        "data: rows 15  samples 14  tokens 1000  packs 4  packing 0.977"
    )
    assert watch.counts_line(None).startswith("data: no counts yet")
