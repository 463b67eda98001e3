"""Shared fixtures: the bundled real data (configs/data, see its SOURCES.md), one small local Ray
shared by the tests that need it, and the tiers: every test is marked by the folder it lies in
(tests/unit, tests/ray, tests/e2e, tests/gpu; pyproject.toml registers the markers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "configs" / "data"
"""Real public data bundled with the repository (subsets; sources and licences in SOURCES.md)."""
GPT2 = DATA / "tokenizers" / "gpt2"
ALPACA = DATA / "sft" / "alpaca_en_demo.json"
GPTEACHER = DATA / "sft" / "gpteacher_roleplay.json"
HH_CHAT = DATA / "chat" / "hh_rlhf_harmless_chosen.messages.jsonl"
SHAREGPT = DATA / "chat" / "glaive_toolcall.sharegpt.json"
SHAKESPEARE = DATA / "text" / "tinyshakespeare.txt"
DEMO_TOKENIZER = {
    "path": str(ROOT / "configs" / "demo" / "tokenizer.json"),
    "eos_token": "<|endoftext|>",
    "pad_token": "<|pad|>",
}
"""The demo's tokenizer section (configs/demo.yaml): a 4,096-token BPE, so a training step costs
little on a CPU, where GPT-2's 50,257-way projection costs seconds."""

HUB_MODEL_CONFIGS = ("qwen2_5_0_5b_lora.yaml",)
"""Shipped configs whose model, and so tokenizer, is a Hub name (nothing downloads in the tests):
validated and run with ``train.model.path`` overridden to a local folder of the same architecture
(tests/unit/test_pretrained.py, tests/e2e/test_lora_run.py)."""


def alpaca_and_chat(seq_len: int, epochs: int = 1, **patch) -> dict:
    """A config mapping of the bundled alpaca and hh chat sets, GPT-2, ``seq_len``, ``epochs``;
    ``patch``: top-level sections replaced."""
    config = {
        "datasets": [
            {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
            {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
        ],
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": seq_len},
        "train": {"epochs": epochs},
    }
    return config | patch


TIERS = {"ray": "ray", "e2e": "e2e", "gpu": "gpu"}
"""Test folder → the marker each of its tests gets (tests/unit's get none)."""
RAY_FIXTURES = ("ray_local", "ray_head")

WORKER_PATH = [ROOT, ROOT / "tests", *(ROOT / "tests" / tier for tier in ("unit", *TIERS))]
"""What Ray's workers import from: this checkout's rayjobs, and the test modules whose functions
and classes (train loops, callbacks, stage subclasses) they run."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (xdist_group)
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier; a test in tests/unit that asks for a Ray fixture is
    an error (the unit tier runs without Ray). The tiers run in ``ORDER``, then the tests on the
    real head (``ray_head``, in their order): an idle Ray burns CPU (docs/development.md, "Where
    the suite's time goes") and the head, once started, lives to the end of the session; when it
    starts, the shared local Ray stops (``ray_head``)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, TIERS[tier]))
        elif tier == "unit" and set(RAY_FIXTURES) & set(getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid} uses Ray: move it to tests/ray or tests/e2e")
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    items.sort(key=_order)


CLUSTER_GROUP = "ray-and-after"
"""The pytest-xdist group of every test outside tests/unit: one worker runs them all, in
``ORDER``, so one Ray runs at a time (two, each starting under the other's load, timed out);
each unit module is a group of its own, run by the other worker meanwhile."""


def _group(item) -> str:
    tier = item.path.parent.name
    return f"unit-{item.path.stem}" if tier == "unit" else CLUSTER_GROUP


ORDER = ("unit", "ray", "e2e", "gpu")
"""The tiers in the order they run: the fast ones first, so a broken change fails early."""


def _order(item) -> tuple[bool, int]:
    tier = item.path.parent.name
    on_head = "ray_head" in getattr(item, "fixturenames", ())
    return on_head, ORDER.index(tier) if tier in ORDER else len(ORDER)


# Tests talk to their own throwaway local Ray; no token auth, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Metrics reach the node's agent every second, so a run's final flush (Ledger.flush: one report
# interval plus a margin) costs ~2 s instead of ~12 s at Ray's default 10 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# Ray Train's controller polls its workers every 2 s by default: each of the suite's ~15 training
# runs waits for a poll to see its workers start, finish or fail (three training runs: 111 s →
# 103 s at 0.5 s). The polling does not change what a run does.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray Train's preemption watcher, an actor of its own per worker group that polls the nodes' drain
# state, watches for what no test does (a node drained by its cluster); each start is one more
# process importing Ray on a 2-core machine. The runs themselves are the same.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def file_tables(data: bytes, path: str, **options):
    """One file's bytes → the raw-row tables a read task emits (``sources.read_tables``, the
    read task's own code), in-process, without Ray; lazy like a read task, so a bad row's error
    is raised while iterating, after the tables before it."""
    import pyarrow as pa

    from rayjobs.data.sources import read_tables

    return read_tables(pa.BufferReader(data), path, **options)


class _FakeRemote:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return args


class FakeLedger:
    """Stands in for the ledger actor in-process: ``add_tokenize.remote(...)`` and
    ``add_pack.remote(...)`` record their arguments in ``calls``."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.add_tokenize = self.add_pack = _FakeRemote(self.calls)
        self.actors: list[tuple] = []  # report_actor's calls, when a (shared) Ray is running
        self.add_actor = _FakeRemote(self.actors)


@pytest.fixture
def fake_ledger(monkeypatch) -> FakeLedger:
    """A ``FakeLedger``; ``ray.get`` returns what it is given (no Ray needed)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda values: values)
    return FakeLedger()


_shared_tier: list[str] = []
"""The tier whose modules the running shared Ray has served."""


@pytest.fixture(scope="module")
def ray_local(request):
    """A local Ray for the module, shared with the modules before and after it in its tier:
    started on first use and left running (``_stop_ray_at_exit`` stops it), so only a module that
    needs a cluster of its own (``shutdown_shared_ray``) makes the next one start anew. A new
    tier starts it afresh: what a tier's runs leave behind (actors of Ray Train and Ray Data
    that outlive their runs, ledgers) keeps costing CPU while the cluster idles
    (docs/development.md, "Where the suite's time goes"). 4 logical CPUs on this 2-core machine:
    the job's resource plan (read tasks + a 1-CPU Tokenize actor + 0.5-CPU packing actors + two
    0.5-CPU trainers) does not fit in 2 and would hang (docs/design.md); logical CPUs only
    schedule."""
    tier = request.node.path.parent.name
    if _shared_tier and _shared_tier[0] != tier:
        shutdown_shared_ray()
    _shared_tier[:] = [tier]
    return start_shared_ray()


def start_shared_ray(env: dict[str, str] | None = None):
    """The shared local Ray, started if it is not running; its workers also get ``env`` (as a
    job's ``runtime_env`` gives them environment variables). Ray Data is imported here, outside
    any test's ``capsys``: its logging handlers keep the stderr they were set up with, and one
    set up inside a test writes to a closed stream in the next (``--- Logging error ---``)."""
    import ray
    import ray.data  # noqa: F401

    if not ray.is_initialized():
        # Workers import this checkout's rayjobs (whatever is pip-installed) and functions
        # defined in test modules (train loops). address "local": a new Ray even where a
        # `ray start` cluster runs on the machine (joining one refuses num_cpus).
        path = os.pathsep.join(map(str, WORKER_PATH))
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path, **(env or {})}},
        )
    return ray


def shutdown_shared_ray() -> None:
    """Stop the shared local Ray (a module about to start a cluster of its own calls this).
    A session that never imported Ray started none: the GPU checks run where Ray is not
    installed (tests/run_gpu_checks.sh), and their teardown failed importing it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_exit():
    yield
    shutdown_shared_ray()


@pytest.fixture(scope="session")
def ray_head():
    """A real Ray head in a subprocess (``ray_head.start_head``: loopback, token auth, its own
    ports and temp dir), shared by the modules that talk to a cluster as users do; their tests
    run last (``pytest_collection_modifyitems``)."""
    from support.ray_head import start_head

    shutdown_shared_ray()  # the head's tests come last: none after needs it (a test that does
    # starts it again), and an idle Ray costs CPU
    with start_head() as head:
        yield head


# --- process exit -------------------------------------------------------------------------------
# One CI run passed every test (584 passed) and then died with SIGSEGV (exit 139) while the
# interpreter was finalizing: native threads of torch, Ray's core worker and the Rust tokenizers
# outlive Python objects they touch during teardown. By then every result is reported, so the
# session exits with pytest's own status and skips finalization; the threads still alive are
# listed in the summary so a leak that one of our own code paths causes stays visible.


def pytest_sessionfinish(session, exitstatus):
    session.config._rayjobs_exitstatus = int(exitstatus)


def pytest_terminal_summary(terminalreporter):
    import threading

    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if alive:
        terminalreporter.write_line(f"threads alive at exit ({len(alive)}): {', '.join(alive)}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    status = getattr(config, "_rayjobs_exitstatus", None)
    if status is None:  # not a full session (e.g. --collect-only errors): exit as usual
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
