"""A real Ray head in a subprocess, for the tests that talk to a cluster the way users do
(``rayjobs submit`` in test_submit.py, the Prometheus scrape in test_prometheus.py). One per test
session (``conftest.ray_head``): a head start costs ~20 s here, and both modules need the same
kind of head.

The head is started as ``cluster/start-head.sh`` starts one: loopback only
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), dashboard on 127.0.0.1, token auth on with a token of its
own, metrics exported on a port of its own and listed in Ray's service-discovery file under its
temp dir. Every port is free and the temp dir short and its own (Ray's socket paths must stay
short), so other Ray instances on the machine are left alone; ``ray start --block`` stops its
node on SIGTERM and anything left is killed by id, never ``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DISCOVERY = "prom_metrics_service_discovery.json"
"""Ray's service-discovery file for Prometheus, in the head's temp dir."""


@dataclass
class Head:
    url: str
    """Dashboard and Jobs API (``rayjobs submit --address``)."""
    address: str
    """GCS address (``rayjobs run --address``)."""
    metrics_port: int
    temp: Path
    env: dict[str, str]
    """Environment of a client with the head's token auth and single-machine mode."""

    @property
    def discovery(self) -> Path:
        return self.temp / DISCOVERY


def rayjobs(head: Head, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m rayjobs.cli ARGV`` from the checkout, with ``head``'s environment (its token
    auth), as a user's shell runs it; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rayjobs.cli", *argv],
        capture_output=True,
        text=True,
        env=head.env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=timeout,
    )


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def kill_leftovers(marker: str) -> None:
    """SIGKILL every process of this head: its command line or working directory names our temp
    dir (job drivers run in their own session, inside it). Nothing else is touched."""
    import psutil

    for process in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            if process.pid != os.getpid() and (
                marker in cmdline or (process.info["cwd"] or "").startswith(marker)
            ):
                process.kill()
        except (psutil.Error, OSError):
            pass


PORTS = [
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
]


@contextlib.contextmanager
def start_head(timeout: float = 120) -> Iterator[Head]:
    """Start a head (see module note); ready once its Jobs API answers with the token and the
    discovery file lists its metrics endpoint."""
    import pytest

    temp = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    drop = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops it now, not after 30 s
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    ray_cli = Path(sys.executable).parent / "ray"
    command = [
        str(ray_cli if ray_cli.exists() else shutil.which("ray")),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=8",  # two runs at once (test_dashboard, test_two_jobs), as a local Ray declares
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        *(f"--{name}={port}" for name, port in ports.items()),
    ]
    log = open(temp / "ray-start.log", "w")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    head = Head(url, f"127.0.0.1:{ports['port']}", ports["metrics-export-port"], temp, env)
    try:
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(
            f"{url}/api/version", headers={"Authorization": f"Bearer {token.read_text()}"}
        )
        target = f"127.0.0.1:{head.metrics_port}"
        while True:
            reason = "the Jobs API does not answer"
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                urllib.request.urlopen(request, timeout=5).read()
                reason = "the discovery file does not list the metrics endpoint"
                if target in json.loads(head.discovery.read_text())[0]["targets"]:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text()[-3000:]
                pytest.fail(f"the Ray head did not start ({reason}):\n{tail}")
            time.sleep(1)
        yield head
    finally:
        process.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=45)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its process group, nothing else
        kill_leftovers(str(temp))
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
