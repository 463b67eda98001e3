"""``rayjobs validate``: a config checked in seconds without Ray (keys, files and sizes, the
tokenizer, the templates on each dataset's first rows), and ``rayjobs --version``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import HUB_MODEL_CONFIGS, ROOT
from rayjobs.cli import main

DEMO = ROOT / "configs" / "demo.yaml"
SHIPPED = sorted(
    p
    for p in (ROOT / "configs").glob("*.yaml")
    if "s3" not in p.name and p.name not in HUB_MODEL_CONFIGS
)

NO_RAY = """
import sys

import ray


def refuse(*args, **kwargs):
    raise SystemExit("ray.init was called")


ray.init = refuse  # every way into Ray (ray.get, Ray Data, auto-init) goes through it
from rayjobs.cli import main

code = main(["validate", *sys.argv[1:]])
print("ray initialized:", ray.is_initialized())
sys.exit(code)
"""


def test_validate_the_demo_config_without_starting_ray():
    """Acceptance 7: exit 0 on configs/demo.yaml in under 15 s (the issue's limit for the
    command, a new interpreter included) with ``ray.init`` made to fail, and Ray still not
    initialized at the end. The wall time is printed for the record too."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", NO_RAY, str(DEMO)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.perf_counter() - began
    print(f"rayjobs validate configs/demo.yaml: {wall:.1f} s wall, {done.stdout.splitlines()[-2]}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "ray initialized: False"
    assert wall < 15, f"rayjobs validate configs/demo.yaml took {wall:.1f} s"
    out = done.stdout
    for part in (
        "config: task sft, seq_len 512, stream mode, 2 dataset(s)",
        "tokenizer: ",
        "eos_token '<|endoftext|>'",
        "dataset stdlib_alpaca: template alpaca, jsonl, 1 file(s), ",
        "dataset stdlib_chat: template chat, jsonl, 1 file(s), ",
        "  first 32 rows: 32 samples, ",
        "valid: ",
        "(no Ray started, ",
    ):
        assert part in out, out
    assert "Started a local Ray instance" not in done.stderr


def test_the_no_ray_check_sees_ray_start(tmp_path):
    """Guard for the test above: a command that starts Ray fails under the same patch."""
    code = NO_RAY.replace('main(["validate", *sys.argv[1:]])', "ray.get(ray.put(1))")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "ray.init was called" in done.stderr


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("validate started Ray")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_validates(path, capsys, no_ray):
    assert len(SHIPPED) >= 7, "guard: configs found"
    assert main(["validate", str(path), "--rows", "8"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.count("  first ") >= 1 and "valid: " in out


# overrides, exit code, fragments of stderr
REFUSED = {
    "peer_key": (
        ["train.learning_rate=1e-3"],
        2,
        ["train.learning_rate: unknown key; use train.lr"],
    ),
    "missing_field": (
        ["datasets.0.template=chat"],
        1,
        ["dataset 'stdlib_alpaca'", "row 1", "[missing_field]"],
    ),
    "nothing_trained": (
        ["packing.seq_len=8"],
        1,
        ["the first rows of every dataset has nothing to train", "32 with none left to train"],
    ),
    "rows_zero": (["--rows", "0"], 2, ["--rows must be a positive number of rows, got 0"]),
}


@pytest.mark.parametrize("overrides, code, expected", list(REFUSED.values()), ids=list(REFUSED))
def test_validate_refuses_what_the_run_would(capsys, no_ray, overrides, code, expected):
    assert main(["validate", str(DEMO), *overrides]) == code
    err = capsys.readouterr().err
    for fragment in expected:
        assert fragment in err, err


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "rayjobs.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == f"rayjobs {version('rayjobs')}\n"


def test_a_file_whose_every_row_is_bad_is_reported_not_a_traceback(tmp_path, capsys, no_ray):
    """A dataset whose head holds no readable row (under skip) beside one that trains: validate
    passes, says which reasons, and counts them; alone, it is the one-line refusal."""
    (tmp_path / "bad.jsonl").write_text('{"instruction": broken\n' * 4)
    config = [
        "datasets.1.source=" + str(tmp_path / "bad.jsonl"),
        "datasets.1.template=alpaca",
        "datasets.1.on_bad_row=skip",
    ]
    assert main(["validate", str(DEMO), *config]) == 0
    out, err = capsys.readouterr()
    reasons = next(line for line in out.splitlines() if "first 4 rows" in line)
    assert reasons.endswith(": 0 samples, 0 tokens, 0 trained, 4 skipped (invalid_json 4)")
    assert f"every row read from the head of {tmp_path / 'bad.jsonl'} is bad" in err
    alone = tmp_path / "alone.yaml"
    spec = {"name": "bad", "source": "bad.jsonl", "template": "alpaca", "on_bad_row": "skip"}
    tokenizer = {"path": str(ROOT / "configs" / "demo" / "tokenizer.json")}
    tokenizer |= {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    alone.write_text(json.dumps({"datasets": [spec], "tokenizer": tokenizer}))
    assert main(["validate", str(alone)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "has nothing to train: dataset 'bad'" in err
