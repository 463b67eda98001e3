"""Interrupted commands, as a user interrupts them: a ``rayjobs`` subprocess sent SIGINT or
SIGTERM mid-work exits 130 or 143 with one ``rayjobs:`` line saying what it left where, and no
traceback; an interrupted export leaves nothing a reader takes for an export, and the next export
to the same ``--out`` works without ``--overwrite``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from rayjobs.bench.train import read_export
from rayjobs.errors import ConfigError
from rayjobs.job.manifest import MANIFEST, require_finished

DEMO = ROOT / "configs" / "demo.yaml"


def _start(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)  # an embedded Ray of its own, not the tests' shared one
    return subprocess.Popen(
        [sys.executable, "-m", "rayjobs.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its Ray processes in its own group, killed at the end
    )


def _wait_for(process: subprocess.Popen, found, timeout: float = 300) -> None:
    """Wait until ``found()`` holds while ``process`` still runs (the interesting moment)."""
    deadline = time.monotonic() + timeout
    while not found():
        assert process.poll() is None, f"ended first: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.2)


def _interrupt(process: subprocess.Popen, signum: int) -> tuple[int, str]:
    process.send_signal(signum)
    try:
        _, err = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # what is left of its own group
    return process.returncode, err


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def test_an_interrupted_export_leaves_nothing_finished_and_a_rerun_works(tmp_path):
    out = tmp_path / "out"
    staging = tmp_path / ".out.partial"
    # Many epochs of the demo data: the export is still writing when its first file lands.
    export = _start("export", str(DEMO), "--out", str(out), "train.epochs=30")
    _wait_for(export, lambda: any(staging.glob("epoch=*/*.parquet")))
    code, err = _interrupt(export, signal.SIGINT)
    assert code == 130
    assert _last_line(err) == (
        f"rayjobs: interrupted (SIGINT): export not finished: nothing at {out}; its files are "
        f"in {staging}, which the next export to it clears"
    )
    assert not out.exists() and any(staging.glob("epoch=*/*.parquet"))  # guard: it had written
    for reader in (require_finished, read_export):
        with pytest.raises(ConfigError, match="is not a finished export"):
            reader(out)
    # The rerun, without --overwrite, clears the staging folder and finishes.
    rerun = _start("export", str(DEMO), "--out", str(out), "train.epochs=1")
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert (out / MANIFEST).is_file() and any(out.glob("epoch=0/*.parquet"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    require_finished(out)
