"""Shared fixtures: real data from ../shared/data and one small local Ray per test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
GPT2 = SHARED / "tokenizers" / "gpt2"
ALPACA = SHARED / "sft" / "alpaca_en_demo.json"
GPTEACHER = SHARED / "sft" / "gpteacher_roleplay.json"
HH_CHAT = SHARED / "chat" / "hh_rlhf_harmless_chosen.messages.jsonl"
SHAREGPT = SHARED / "chat" / "glaive_toolcall.sharegpt.json"
SHAKESPEARE = SHARED / "text" / "tinyshakespeare.txt"

# Tests talk to their own throwaway local Ray; no token auth, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Only the GPU checks (tests/test_cuda.py) run where ../shared is absent, with this set explicitly.
if not (SHARED / "SOURCES.md").is_file() and not os.environ.get("RAYJOBS_TESTS_WITHOUT_DATA"):
    raise RuntimeError(f"the real test data is missing: expected {SHARED} (../shared/data from the "
                       "project root). CI always has it; tests never skip it silently.")


@pytest.fixture(scope="module")
def ray_local():
    """A module-scoped local Ray. 4 logical CPUs on this 2-core machine: the job's resource plan
    (read tasks + a 1-CPU Tokenize actor + 0.5-CPU plan-join and assembly actors + two 0.5-CPU trainers) does
    not fit in 2 and would hang (DESIGN.md, "CPU resources deadlock"); logical CPUs only schedule."""
    import ray

    # Workers import this checkout's rayjobs (whatever is pip-installed) and functions defined
    # in test modules (train loops).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}})
    yield ray
    ray.shutdown()
