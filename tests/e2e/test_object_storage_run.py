"""``rayjobs run`` on data in a bucket: a training job whose datasets are ``s3://`` URIs on a real
S3-protocol server on loopback, credentials and endpoint from the environment as on a cluster
node, one dataset per way a source names its files and per kind of file (a JSON file under a
prefix, JSONL files matched by a glob, a gzipped JSONL file, a Parquet file). Its per-dataset
counts are those of the same rows tokenized here from the same bytes: 50 rows of a bundled file
each (200 in all), an epoch of a few steps, with the demo's 4,096-token vocabulary (a step at
GPT-2's 50,257 costs seconds on a CPU and tests nothing more here)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conftest import ALPACA, DEMO_TOKENIZER, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.data.formats import parse_file
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
from support.s3 import s3_server

SOURCES = {
    # dataset: (its source under the bucket, template, the key each of its files is put at)
    "alpaca": ("sft/", "alpaca", "sft/alpaca_en_demo.json"),
    "alpaca_parquet": ("parquet/alpaca.parquet", "alpaca", "parquet/alpaca.parquet"),
    "chat": ("chat/*.jsonl", "chat", "chat/hh.jsonl"),
    "chat_gz": ("gz/hh.jsonl.gz", "chat", "gz/hh.jsonl.gz"),
}


def _datasets(root: str) -> list[dict]:
    return [
        {"name": name, "source": f"{root}/{source}", "template": template}
        | ({"format": "json"} if name == "alpaca" else {})
        for name, (source, template, _) in SOURCES.items()
    ]


def _files() -> dict[str, tuple[str, bytes, bytes, str]]:
    """What the bucket holds, by dataset: (its key, its bytes, what they decompress to, the
    format they parse as), 50 rows each of the bundled alpaca (JSON) and hh chat (JSONL) files,
    no row in two datasets."""
    alpaca = json.loads(ALPACA.read_text())
    chat = HH_CHAT.read_bytes().splitlines(keepends=True)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(alpaca[50:100]), sink)
    parquet, jsonl = sink.getvalue().to_pybytes(), b"".join(chat[50:100])
    held = {
        "alpaca": (json.dumps(alpaca[:50]).encode(), "json"),
        "alpaca_parquet": (parquet, "parquet"),
        "chat": (b"".join(chat[:50]), "jsonl"),
        "chat_gz": (gzip.compress(jsonl, mtime=0), "jsonl"),
    }
    return {
        name: (SOURCES[name][2], data, jsonl if name == "chat_gz" else data, fmt)
        for name, (data, fmt) in held.items()
    }


def _expected(seq_len: int, files: dict) -> dict[str, dict[str, int]]:
    """The counts of one epoch of the bucket's files, tokenized here from their bytes (no Ray)."""
    config = config_from_dict(
        {
            "datasets": [
                {
                    "name": name,
                    "source": str(ALPACA if template == "alpaca" else HH_CHAT),
                    "template": template,
                }
                for name, (_, template, _) in SOURCES.items()
            ],  # fmt: skip
            "tokenizer": DEMO_TOKENIZER,
            "allow_duplicate_sources": True,  # each stands for its own file here
        }
    )
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for spec in config.datasets:
        tokenize = Tokenize([spec], config.tokenizer, seq_len, "truncate")
        key, _, data, fmt = files[spec.name]
        rows, records = parse_file(data, key, format=fmt, dataset=spec.name)
        table = tokenize(record_table(spec.name, [key] * len(rows), rows, records))
        counts[spec.name]["rows"] += len(rows)
        counts[spec.name]["samples"] += table.num_rows
        counts[spec.name]["tokens"] += int(sum(table.column("num_tokens").to_pylist()))
    return counts


def test_a_run_on_s3_data_trains_and_counts_what_the_files_hold(tmp_path):
    seq_len = 512
    files = _files()
    with s3_server() as s3:
        for key, data, _, _ in files.values():
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
    assert {name: c["rows"] for name, c in expected.items()} == dict.fromkeys(SOURCES, 50)
    assert summary["datasets"].keys() == expected.keys()
    for name, counts in summary["datasets"].items():
        assert {k: counts[k] for k in ("rows", "samples", "tokens")} == dict(expected[name]), name
