"""A run's folder under ``train.storage_path``: where it lies, and which run ``--resume`` names.

Ray Train keeps a run's checkpoints in ``<storage_path>/<run name>``; a run started again under
the same name resumes from them (docs/resume.md).
"""

from __future__ import annotations

import os

from rayjobs.config import Config
from rayjobs.errors import ConfigError
from rayjobs.train.names import FINAL_SUMMARY

RUN_SNAPSHOT = "checkpoint_manager_snapshot.json"
"""The file Ray Train keeps in a run's storage folder listing its checkpoints: a run that has one
can be resumed (Ray Train v2 resumes a run started again under the same name)."""


def resume_name(config: Config, resume: str) -> str:
    """The run ``--resume`` names: ``resume`` itself, or with ``latest`` the most recently
    changed run under ``train.storage_path`` that has checkpoints and did not finish (a finished
    run's final checkpoint holds its summary and nothing to resume from). Raises ``ConfigError``
    when a local storage folder holds no such run."""
    if config.train.num_workers == 0:
        raise ConfigError(
            "--resume: train.num_workers 0 runs the loop in the driver, which Ray Train does "
            "not restart or resume; its checkpoints hold the model (train.model.path can start "
            "a new run from one), or run with train.num_workers of 1 or more to resume"
        )
    storage = storage_folder(config.train.storage_path)
    if "://" in storage:
        if resume == "latest":
            raise ConfigError("--resume: name the run (latest needs a local train.storage_path)")
        return resume
    if resume != "latest":
        if not os.path.exists(os.path.join(storage, resume, RUN_SNAPSHOT)):
            raise ConfigError(f"--resume: no run {resume!r} with checkpoints under {storage}")
        return resume
    runs = [
        entry
        for entry in (os.scandir(storage) if os.path.isdir(storage) else ())
        if os.path.exists(os.path.join(entry.path, RUN_SNAPSHOT)) and not _finished(entry.path)
    ]
    if not runs:
        raise ConfigError(f"--resume latest: no unfinished run with checkpoints under {storage}")
    return max(runs, key=lambda e: os.path.getmtime(os.path.join(e.path, RUN_SNAPSHOT))).name


def _finished(run_folder: str) -> bool:
    """Whether a run folder holds a finished run's final checkpoint (``FINAL_SUMMARY``)."""
    return any(
        os.path.exists(os.path.join(entry.path, FINAL_SUMMARY))
        for entry in os.scandir(run_folder)
        if entry.is_dir()
    )


def storage_folder(path: str) -> str:
    """Ray Train's storage: a URI (``s3://…``, ``gs://…``) as is, a folder made absolute."""
    return path if "://" in path else os.path.abspath(path)
