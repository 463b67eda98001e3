"""rayjobs bench peers: the TRL side encodes the same samples as the job (token for token, trained
token for trained token), the process-tree sampler measures a real tree, the counts are read back
from both layouts of Parquet, and the command refuses what it cannot run, in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, DATA, GPT2, HH_CHAT
from rayjobs.bench import peers
from rayjobs.cli import main


def test_doctests():
    import doctest

    results = doctest.testmod(peers)
    assert results.attempted >= 8 and results.failed == 0


def _columns(rows: list[dict]) -> dict[str, list]:
    """Rows as ``datasets``' batched ``map`` gives them: one list per column, None where a row
    lacks the key."""
    keys = sorted({key for row in rows for key in row})
    return {key: [row.get(key) for row in rows] for key in keys}


def test_the_trl_side_encodes_the_jobs_samples():
    """On the bundled alpaca and hh chat sets, the TRL side's ``map`` function gives every sample
    the job's length and the job's trained tokens (``labels`` that are not -100 against the job's
    shifted labels that are not -100: one per trained token after the first position)."""
    from rayjobs.config import DatasetConfig, TokenizerConfig
    from rayjobs.data.formats import parse_file
    from rayjobs.data.sources import record_table
    from rayjobs.data.tokenize import Tokenize

    sets = {"alpaca": (ALPACA, "json", "alpaca"), "hh_chat": (HH_CHAT, "jsonl", "chat")}
    specs = [DatasetConfig(name=n, source=str(p), format=f, template=t)
             for n, (p, f, t) in sets.items()]  # fmt: skip
    job = Tokenize(specs, TokenizerConfig(path=str(GPT2)), seq_len=1 << 30, overflow="truncate")
    for name, (path, fmt, template) in sets.items():
        rows, records = parse_file(path.read_bytes(), str(path), format=fmt, dataset=name)
        theirs = job(record_table(name, [str(path)] * len(rows), rows, records))
        raw = [json.loads(r) for r in records]
        ours = peers.tokenize_batch(_columns(raw), template, str(GPT2))
        lengths = np.array([len(ids) for ids in ours["input_ids"]])
        assert len(lengths) == theirs.num_rows > 100
        assert np.array_equal(np.sort(lengths), np.sort(theirs.column("num_tokens").to_numpy()))
        trained = sum(int((np.array(labels) != -100).sum()) for labels in ours["labels"])
        job_trained = sum(int((np.array(x) != -100).sum()) for x in theirs["labels"].to_pylist())
        assert trained == job_trained > 0
        assert all(ids[-1] == 50256 for ids in ours["input_ids"])  # EOS closes every sample


def test_packed_counts_read_both_layouts(tmp_path):
    """rayjobs' rows carry ``num_tokens`` (padded to seq_len); TRL's are their tokens."""
    pq.write_table(pa.table({"num_tokens": [8, 6], "input_ids": [[1] * 10, [2] * 10]}),
                   tmp_path / "ours.parquet")  # fmt: skip
    pq.write_table(pa.table({"input_ids": [[1] * 8, [2] * 6, [3]]}), tmp_path / "theirs.parquet")
    assert peers.packed_counts([tmp_path / "ours.parquet"], 10) == (2, 14, 0.7)
    assert peers.packed_counts([tmp_path / "theirs.parquet"], 10) == (3, 15, 0.5)


CHILD = """
import subprocess, sys, time
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
held = "import time; x = b'1' * (120 * 2**20); time.sleep(2)"
worker = subprocess.Popen([sys.executable, "-c", held])
time.sleep(0.6)
out = Path(sys.argv[1]); out.mkdir()
pq.write_table(pa.table({"input_ids": [[1, 2]]}), out / "a.parquet")
time.sleep(0.6)
pq.write_table(pa.table({"input_ids": [[3]]}), out / "b.parquet")
sys.exit(worker.wait())
"""


def test_run_measured_samples_the_whole_process_tree(tmp_path):
    """A process that starts a worker holding 120 MiB and writes two Parquet files: the tree's
    peak memory holds the worker's, the first file is written before the last, and CPU
    time is labelled by process."""
    out = tmp_path / "out"
    measured = peers.run_measured([sys.executable, "-c", CHILD, str(out)], out,
                                  tmp_path / "log.txt", peers.child_env())  # fmt: skip
    assert measured["peak_pss_mb"] > 120 and measured["peak_rss_mb"] >= measured["peak_pss_mb"]
    assert 0 < measured["first_output_s"] < measured["wall_s"] <= measured["exit_s"]
    assert "main process" in measured["cpu_by_process"] and measured["processes"] >= 2
    assert max(measured["peak_by_process"].values()) > 110  # the worker, under its own label
    assert peers.packed_counts(peers._parquet_files(out), 4) == (2, 3, 3 / 8)


def test_run_measured_names_the_log_of_a_failed_path(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited 3; its log .*log.txt:\n.*boom"):
        peers.run_measured(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
            tmp_path / "out", tmp_path / "log.txt", peers.child_env(),
        )  # fmt: skip


def test_the_paths_run_this_checkout_on_their_own_local_machine(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")
    env = peers.child_env()
    assert "RAY_ADDRESS" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(Path(peers.__file__).resolve().parents[2])


def _run(path: str, tokens: int, wall: float, efficiency: float, repeat: int = 0):
    return peers.PeerRun(1, path, wall, wall + 1, None if path == "trl" else 2.0, 800.0, 900.0,
                         7, tokens, efficiency, repeat, (8.0, 9.0), 0.01,
                         {"main process": 500.0}, {"main process": 3.0})  # fmt: skip


def test_the_table_states_ratios_and_the_token_check():
    runs = [_run("rayjobs", 100, 30.0, 0.99), _run("trl", 100, 20.0, 0.98),
            _run("trl", 100, 10.0, 0.98, 1), _run("rayjobs", 100, 30.0, 0.99, 1)]  # fmt: skip
    table = peers.format_table(runs)
    lines = table.splitlines()
    assert lines[2].split() == ["1x", "rayjobs", "30.0", "2.0", "31.0", "3.0", "800", "900",
                                "0.9900", "7", "100"]  # fmt: skip
    assert lines[3].split()[:4] == ["1x", "trl", "15.0", "-"]  # the median of the repeats
    assert "1x rayjobs / trl: wall 2.00x (each repeat: 1.50x, 3.00x)" in table
    assert "exit 1.94x, CPU 1.00x, peak memory 1.00x, efficiency +1.00 points" in table
    assert "token totals: identical on every path at every scale" in table
    assert "1x trl #1: load 8.0 -> 9.0, steal 1.0%; 0 processes, CPU s 3.0" in table
    runs[1].tokens = 99
    assert "token totals differ, so the paths did not pack the same samples: 1x: rayjobs " \
           "100, trl 99/100" in peers.format_table(runs)  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scales", "0"], "--scales must be positive"),
        (["--num-proc", "0"], "--num-proc must be positive, got 0"),
        (["--repeats", "0"], "--repeats must be positive, got 0"),
        (["--data-dir", "/no/such/folder"], "--data-dir /no/such/folder is not a folder"),
        (["--seq-len", "4096"], "bench peers does not take --seq-len"),
    ],
)
def test_argument_errors_exit_2_before_anything_runs(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(peers, "bench_peers", lambda *a: pytest.fail("the bench ran"))
    assert main(["bench", "peers", *argv]) == 2
    assert message in capsys.readouterr().err


def test_without_the_bench_extra_it_refuses_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(peers, "missing_extras", lambda: ["trl"])
    monkeypatch.setattr(peers, "bench_peers", lambda *a: pytest.fail("the bench ran"))
    assert main(["bench", "peers", "--scales", "1", "--data-dir", str(DATA)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rayjobs: bench peers needs trl")
    assert "pip install 'rayjobs[bench]'" in err
