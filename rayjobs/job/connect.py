"""``init_ray``: join the cluster a config or ``$RAY_ADDRESS`` names, or start an embedded local
Ray that listens on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import ray

from rayjobs.config import Config


def init_ray(config: Config) -> None:
    """Connect to ``ray.address`` / ``$RAY_ADDRESS``, or start an embedded local Ray."""
    if ray.is_initialized():
        return
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        with _own_sigterm():
            ray.init(address=address, log_to_driver=True)
        return
    num_cpus = config.ray.num_cpus or max(4, 2 * (os.cpu_count() or 1))
    # address "local": a new Ray of its own even where a `ray start` cluster runs on the machine
    # (ray.init() alone would join that one and refuse num_cpus).
    with _own_sigterm(), _loopback_only():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            log_to_driver=True,
            dashboard_host="127.0.0.1",  # the dashboard: metrics, and Ray's default
            **_embedded_system_config(),
        )


REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
EMBEDDED_REPORT_INTERVAL_MS = 2000
"""How often the embedded Ray's processes export their metrics to its agent. A run ends by
waiting for its final values to be exported, one interval in its train workers and one in its
ledger (docs/metrics.md, "Final values are exported before the job exits"); at Ray's default
(10 s, sized for clusters) those waits are most of the time between a local run's last step and
its summary. One machine's few processes export every 2 s at little cost."""


def _embedded_system_config() -> dict:
    """``ray.init``'s ``_system_config`` for the embedded Ray: ``EMBEDDED_REPORT_INTERVAL_MS``,
    unless ``$RAY_metrics_report_interval_ms`` sets the interval (``_system_config`` would
    override the environment)."""
    if os.environ.get(REPORT_INTERVAL_ENV):
        return {}
    return {"_system_config": {"metrics_report_interval_ms": EMBEDDED_REPORT_INTERVAL_MS}}


SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch of single-machine mode (its default on macOS and Windows): ``0`` takes 127.0.0.1
as the node's address, which every Ray server of the node then binds to."""


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """While the embedded Ray starts, Ray's single-machine mode: every server it starts (GCS,
    raylet, object manager, each worker's gRPC, the dashboard agent, the runtime-env agent)
    listens on 127.0.0.1 only, not on every interface of a shared network (docs/cluster.md,
    "Network exposure"). The node's processes take it from the environment; this process read
    it when it imported Ray, so it is set there too, for ``ray.init`` only: a later connection to a
    cluster needs this machine's own address. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` in the
    environment keeps Ray's default."""
    from ray._private import ray_constants

    if os.environ.get(SINGLE_MACHINE, "0") not in ("0", "false", "False"):
        yield
        return
    saved = os.environ.get(SINGLE_MACHINE), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[SINGLE_MACHINE] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(SINGLE_MACHINE, None)
        else:
            os.environ[SINGLE_MACHINE] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


@contextlib.contextmanager
def _own_sigterm() -> Iterator[None]:
    """Keep the caller's SIGTERM handler (the command line's: say what was left where, exit
    143) across ``ray.init``, which installs its own (``sys.exit(15)``); a process that set none
    keeps Ray's."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
