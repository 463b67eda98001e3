"""Interrupted commands, as a user interrupts them, and what a running one exposes: a ``rayjobs
export`` subprocess on its embedded Ray listens on loopback only (read from ``/proc/net/tcp*``
while it writes); sent SIGINT it exits 130 with one ``rayjobs:`` line saying what it left where,
and no traceback; it leaves nothing a reader takes for an export, and the next export to the same
``--out`` works without ``--overwrite``. A ``rayjobs run`` sent SIGTERM exits 143 naming where its
checkpoints are."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from rayjobs.bench.train import read_export
from rayjobs.config import load_config
from rayjobs.errors import ConfigError
from rayjobs.job.manifest import MANIFEST, require_finished
from rayjobs.job.runs import RUN_SNAPSHOT, resume_name
from rayjobs.train.names import TRAIN_STATE

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
    """The command's last line on stderr, after checking that it printed no traceback (lines Ray
    forwards from its own processes, prefixed ``(Name pid=…)``, are Ray's)."""
    assert not [line for line in err.splitlines() if line.startswith("Traceback")], err[-3000:]
    return err.strip().splitlines()[-1]


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (by parent id, from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _listening(pids: list[int]) -> list[tuple[str, int, str]]:
    """(address, port, owner's command) of every TCP socket in LISTEN state that one of
    ``pids`` holds open: ``/proc/net/tcp`` and ``tcp6`` rows matched to ``/proc/<pid>/fd`` by
    inode."""
    owners = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        owners[link[len("socket:[") : -1]] = command
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16), owners[fields[9]]))
    return found


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback or address.startswith("::ffff:127.")


@pytest.fixture(scope="module")
def interrupted_export(tmp_path_factory):
    """A ``rayjobs export --runner ray`` of the demo (an embedded Ray: a default export of data
    this small runs in-process, ``--runner auto``), its sockets read once its first Parquet file
    is written, then sent SIGINT: (exit code, stderr, listening sockets, --out)."""
    out = tmp_path_factory.mktemp("export") / "out"
    staging = out.parent / ".out.partial"
    # Many epochs of the demo data: the export is still writing when its first file lands.
    export = _start("export", str(DEMO), "--out", str(out), "train.epochs=30", "--runner", "ray")
    _wait_for(export, lambda: any(staging.glob("train/*.parquet")))
    sockets = _listening(_tree(export.pid))
    code, err = _interrupt(export, signal.SIGINT)
    return code, err, sockets, out


def test_the_embedded_ray_of_a_default_export_listens_on_loopback_only(interrupted_export):
    _, _, sockets, _ = interrupted_export
    commands = " ".join(command for _, _, command in sockets)
    assert "gcs_server" in commands and "raylet" in commands, sockets  # guard: Ray's servers
    assert [s for s in sockets if not _loopback(s[0])] == []


def test_an_interrupted_export_leaves_nothing_finished_and_a_rerun_works(interrupted_export):
    code, err, _, out = interrupted_export
    staging = out.parent / ".out.partial"
    assert code == 130
    assert _last_line(err) == (
        f"rayjobs: interrupted (SIGINT): export not finished: nothing at {out}; its files are "
        f"in {staging}, which the next export to it clears"
    )
    assert not out.exists() and any(staging.glob("train/*.parquet"))  # guard: it had written
    for reader in (require_finished, read_export):
        with pytest.raises(ConfigError, match="is not a finished export"):
            reader(out)
    # The rerun, without --overwrite and by the local runner, clears the staging folder and
    # finishes.
    rerun = _start("export", str(DEMO), "--out", str(out), "train.epochs=1")
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert (out / MANIFEST).is_file() and any(out.glob("train/*.parquet"))
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
    require_finished(out)


def test_a_terminated_run_says_where_its_checkpoints_are_and_can_be_resumed(tmp_path):
    """SIGTERM (a scheduler's stop) during a default ``rayjobs run``, once its first checkpoint
    (after step 1: ``train.checkpoint_every_minutes``) is committed: exit 143, one line naming
    the run's folder, which ``--resume`` finds."""
    runs = tmp_path / "runs"
    argv = [str(DEMO), "train.max_steps=2000", f"train.storage_path={runs}"]
    run = _start("run", *argv)

    def committed() -> bool:
        snapshots = list(runs.glob(f"*/{RUN_SNAPSHOT}"))
        return bool(snapshots) and "checkpoint_step_000001" in snapshots[0].read_text()

    _wait_for(run, committed)
    code, err = _interrupt(run, signal.SIGTERM)
    assert code == 143
    name = next(runs.iterdir()).name
    assert _last_line(err) == (
        f"rayjobs: interrupted (SIGTERM): run {name} stopped; its checkpoints so far are under "
        f"{runs / name} (continue it with `rayjobs run CONFIG --resume {name}`, from a periodic "
        "checkpoint)"
    )
    assert (runs / name / "checkpoint_step_000001" / TRAIN_STATE).is_file()
    assert resume_name(load_config(DEMO, argv[1:]), "latest") == name
