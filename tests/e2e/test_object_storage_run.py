"""``rayjobs run`` on data in a bucket: a training job whose datasets are ``s3://`` URIs on a real
S3-protocol server on loopback, credentials and endpoint from the environment as on a cluster
node. Its per-dataset counts are those of the same rows tokenized here from the same bytes: the
first 100 rows of two bundled files, an epoch of a few steps, with the demo's 4,096-token
vocabulary (a step at GPT-2's 50,257 costs seconds on a CPU and tests nothing more here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import yaml

from conftest import ALPACA, DEMO_TOKENIZER, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.data.formats import parse_file
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
from support.s3 import s3_server


def _datasets(root: str) -> list[dict]:
    return [
        {"name": "alpaca", "source": f"{root}/sft/", "format": "json", "template": "alpaca"},
        {"name": "chat", "source": f"{root}/chat/*.jsonl", "template": "chat"},
    ]


def _files() -> dict[str, tuple[str, bytes]]:
    """What the bucket holds: the first 100 rows of the bundled alpaca (JSON) and hh chat (JSONL)
    files, by the key each is put at."""
    alpaca = json.dumps(json.loads(ALPACA.read_text())[:100]).encode()
    chat = b"".join(HH_CHAT.read_bytes().splitlines(keepends=True)[:100])
    return {"alpaca": ("sft/alpaca_en_demo.json", alpaca), "chat": ("chat/hh.jsonl", chat)}


def _expected(seq_len: int, files: dict[str, tuple[str, bytes]]) -> dict[str, dict[str, int]]:
    """The counts of one epoch of the bucket's files, tokenized here from their bytes (no Ray)."""
    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": DEMO_TOKENIZER,
        }
    )
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for spec in config.datasets:
        tokenize = Tokenize([spec], config.tokenizer, seq_len, "truncate")
        key, data = files[spec.name]
        rows, records = parse_file(data, key, format=spec.format, dataset=spec.name)
        table = tokenize(record_table(spec.name, [key] * len(rows), rows, records))
        counts[spec.name]["rows"] += len(rows)
        counts[spec.name]["samples"] += table.num_rows
        counts[spec.name]["tokens"] += int(sum(table.column("num_tokens").to_pylist()))
    return counts


def test_a_run_on_s3_data_trains_and_counts_what_the_files_hold(tmp_path):
    seq_len = 512
    files = _files()
    with s3_server() as s3:
        for key, data in files.values():
            s3.put(f"data/{key}", data)
        config = {
            "datasets": _datasets("s3://data"),
            "tokenizer": DEMO_TOKENIZER,
            "packing": {"seq_len": seq_len},
            "train": {
                "num_workers": 2,
                "batch_size": 4,
                "max_steps": None,
                "epochs": 1,
                "storage_path": str(tmp_path / "runs"),
                "model": {"dim": 32, "n_layers": 1, "n_heads": 2},
            },  # fmt: skip
        }
        path = tmp_path / "s3.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "rayjobs.cli", "run", str(path), "--json"],
            capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] > 0 and summary["tokens_trained"] > 0
    expected = _expected(seq_len, files)
    assert {name: c["rows"] for name, c in expected.items()} == {"alpaca": 100, "chat": 100}
    for name, counts in summary["datasets"].items():
        assert {k: counts[k] for k in ("rows", "samples", "tokens")} == dict(expected[name]), name
