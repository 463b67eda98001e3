"""Experiment trackers (``train.report_to``): TensorBoard, MLflow and Weights & Biases.

Rank 0 logs to them what ``Progress`` computes (the progress line's scalars under ``train/``,
evaluations under ``eval/``) and, at the end, the run's per-dataset counts from its ledger under
``data/``; each run is logged under its own name. Everything works offline and lands in the
run's folder (``train.storage_path``/<run name>): TensorBoard event files in ``tensorboard/``, an
MLflow file store in ``mlruns/`` (unless ``MLFLOW_TRACKING_URI`` names another), a W&B offline
run in ``wandb/`` (unless ``WANDB_MODE`` says otherwise). Each package is an optional extra,
imported on rank 0 only when used; ``check`` refuses a missing one, naming the extra, before Ray
starts (docs/tracking.md).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from rayjobs.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""``train.report_to`` name → the module it imports (the pip extra has the tracker's name)."""

FOLDERS = {"tensorboard": "tensorboard", "mlflow": "mlruns", "wandb": "wandb"}
"""Each tracker's folder in the run's folder."""

TIMERS = ("seconds", "cpu_seconds")


def check(names: list[str], storage_path: str) -> None:
    """Refuse, before Ray starts, a tracker whose package is not installed (naming the extra to
    install) or one that writes files when ``storage_path`` is not a local folder."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"train.report_to: {name} needs the {PACKAGES[name]} package: "
                f"pip install 'rayjobs[{name}]'"
            )
        remote = "://" in storage_path
        if remote and not (name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI")):
            raise ConfigError(
                f"train.report_to: {name} writes its files into the run's folder, and "
                f"train.storage_path {storage_path!r} is not a local folder"
                + (" (or set MLFLOW_TRACKING_URI)" if name == "mlflow" else "")
            )


def tracker_names(scalars: dict[str, float]) -> dict[str, float]:
    """``Progress``' scalars under the trackers' names: ``train/loss``, ``train/dpo/...``,
    ``eval/loss``, ``eval/dpo/...``."""
    named = {}
    for key, value in scalars.items():
        if key == "eval_loss":
            named["eval/loss"] = value
        elif key.startswith("eval/"):
            named[key] = value
        else:
            named[f"train/{key}"] = value
    return named


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted.key: value}`` (lists by index)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return {prefix: value}
    found = {}
    for key, item in items:
        found |= flat(item, f"{prefix}.{key}" if prefix else str(key))
    return found


def dataset_counts(snapshot: dict[str, Any]) -> dict[str, float]:
    """A ledger snapshot's per-dataset counts and pack totals, under ``data/``."""
    counts = {}
    for dataset, values in snapshot.get("tokenize", {}).items():
        for key, value in values.items():
            if key not in TIMERS and isinstance(value, int | float):
                counts[f"data/{dataset}/{key}"] = value
    packs = snapshot.get("pack", {}).values()
    tokens, slots = sum(p["num_tokens"] for p in packs), sum(p["num_slots"] for p in packs)
    counts["data/packs"] = sum(p["num_packs"] for p in packs)
    if slots:
        counts["data/packing_efficiency"] = tokens / slots
    return counts


class Trackers:
    """The run's trackers, opened on rank 0 (``Progress.begin``). ``folder``: the run's folder,
    absolute; ``config``: the run's config as a dict (logged as parameters); ``ledger``: the run's
    ``Ledger`` actor, whose per-dataset counts are logged at the end (None: not logged)."""

    def __init__(self, names: list[str], folder: str, config: dict[str, Any], ledger: Any = None):
        self.names, self.folder, self.config, self.ledger = list(names), folder, config, ledger
        self._open: list[Any] = []

    def open(self, run_name: str, step: int) -> None:
        """Open every tracker under ``run_name``, continuing a run of that name from ``step``
        (a restart or ``--resume``)."""
        if "://" not in self.folder:  # a URI: MLflow to $MLFLOW_TRACKING_URI alone (check)
            Path(self.folder).mkdir(parents=True, exist_ok=True)
        kinds = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}
        self._open = [kinds[n](self.folder, run_name, self.config, step) for n in self.names]

    def log(self, scalars: dict[str, float], step: int) -> None:
        named = tracker_names(scalars)
        for tracker in self._open:
            tracker.log(named, step)

    def close(self, step: int) -> None:
        """Log the run's per-dataset counts (at ``step``) and close every tracker."""
        counts = {}
        if self.ledger is not None and self._open:
            import ray

            counts = dataset_counts(ray.get(self.ledger.snapshot.remote()))
        for tracker in self._open:
            if counts:
                tracker.log(counts, max(step, 0))
            tracker.close()
        self._open = []


class _TensorBoard:
    """Event files in ``<run folder>/tensorboard`` (``torch.utils.tensorboard``); a restart
    hides the events logged past the step it resumes from (``purge_step``): they are logged
    again."""

    def __init__(self, folder: str, run_name: str, config: dict[str, Any], step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=os.path.join(folder, FOLDERS["tensorboard"]),
            purge_step=step + 1 if step else None,
        )
        if not step:
            import json

            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    """An MLflow run named after the run, in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default
    ``rayjobs``) of ``$MLFLOW_TRACKING_URI``, else of a file store in ``<run folder>/mlruns``
    (MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE`` is set: set here, for the
    store rayjobs chose). A run of that name already there is continued."""

    def __init__(self, folder: str, run_name: str, config: dict[str, Any], step: int):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = Path(folder, FOLDERS["mlflow"]).as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rayjobs")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flat(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 a batch
            client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    """A W&B run named (and identified) after the run, in project ``$WANDB_PROJECT`` (default
    ``rayjobs``), its files in ``<run folder>/wandb``; offline (``WANDB_MODE=offline``) unless
    ``WANDB_MODE`` is set, and silent unless ``WANDB_SILENT`` is. ``wandb sync`` uploads an
    offline run. W&B's console capture is off: the worker's output stays Ray's."""

    def __init__(self, folder: str, run_name: str, config: dict[str, Any], step: int):
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rayjobs"),
            name=run_name,
            id=run_name,
            resume="allow",
            dir=folder,
            config=config,
            settings=wandb.Settings(console="off"),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
