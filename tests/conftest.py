"""Shared fixtures: the bundled real data (configs/data, see its SOURCES.md) and one small local
Ray per test module."""

from __future__ import annotations

import os
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

# Tests talk to their own throwaway local Ray; no token auth, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Metrics reach the node's agent every second, so a run's final flush (Ledger.flush: one report
# interval plus a margin) costs ~2 s instead of ~12 s at Ray's default 10 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")


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


@pytest.fixture
def fake_ledger(monkeypatch) -> FakeLedger:
    """A ``FakeLedger``; ``ray.get`` returns what it is given (no Ray needed)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda values: values)
    return FakeLedger()


@pytest.fixture(scope="module")
def ray_local():
    """A module-scoped local Ray. 4 logical CPUs on this 2-core machine: the job's resource plan
    (read tasks + a 1-CPU Tokenize actor + 0.5-CPU plan-join and assembly actors + two 0.5-CPU
    trainers) does not fit in 2 and would hang (README, "Design: CPU resources"); logical CPUs only
    schedule."""
    import ray

    # Workers import this checkout's rayjobs (whatever is pip-installed) and functions defined
    # in test modules (train loops).
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}},
    )
    yield ray
    ray.shutdown()
