"""Exclusive outputs (``job.claim``): two exports started at once into one ``--out`` leave one
whole export and one refusal naming the holder; a crashed holder's claim is taken over; the same
on an object store (moto's S3 server)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ALPACA, DEMO_TOKENIZER, GPT2, ROOT
from rayjobs.cli import main
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.job import claim
from rayjobs.job import export as export_module
from rayjobs.job.export import export, to_arrow
from rayjobs.job.manifest import MANIFEST
from support.s3 import s3_server


def _config(seq_len: int) -> dict:
    return {
        "datasets": [{"name": "alpaca", "source": str(ALPACA), "template": "alpaca"}],
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": seq_len},
    }


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _plant(where, **holder) -> None:
    holder = {"started": "2026-01-01T00:00:00+00:00", "command": "rayjobs export x", **holder}
    with open(where, "w") as stream:
        json.dump({"token": "planted", **holder}, stream)


def test_two_exports_at_once_one_finishes_the_other_is_refused_naming_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(512)))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "rayjobs", "export", str(config), "--out", str(out)]
    children = [
        subprocess.Popen(
            [*command, "--runner", "local", f"packing.seq_len={seq_len}", "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seq_len in (1024, 512)
    ]
    results = [(child.pid, child.wait(120), *child.communicate()) for child in children]
    assert sorted(rc for _, rc, _, _ in results) == [0, 2], results
    (winner, *_), (_, _, _, refused) = sorted(results, key=lambda r: r[1])
    lines = [line for line in refused.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"rayjobs: --out {out} is in use"), refused
    assert f"pid {winner} on {socket.gethostname()}" in lines[0]  # guard: the claim refused it
    manifest = json.loads((out / MANIFEST).read_text())
    table = pq.read_table(out)  # the whole folder, as a user reads it: the one epoch's rows
    packs = manifest["epochs"][0]["packs"]
    assert manifest["epochs"] == [manifest["epochs"][0]] and set(
        table.column("epoch").to_pylist()
    ) == {0}
    assert table.num_rows == packs["num_packs"] > 0
    assert sum(table.column("num_tokens").to_pylist()) == packs["num_tokens"]
    assert table.schema.field("input_ids").type.list_size == manifest["seq_len"]
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "out"]  # no claim, no staging left


def test_a_dead_holders_claim_is_taken_over(tmp_path, caplog):
    out = tmp_path / "out"
    _plant(tmp_path / ".out.claim", host=socket.gethostname(), pid=_dead_pid())
    manifest = export(config_from_dict(_config(512), base_dir=ROOT), out, runner="local")
    assert pq.read_table(out).num_rows == manifest["packed"]["num_packs"]
    assert "taking over the claim of pid" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize(
    ("holder", "age", "taken"),
    [
        ({"host": "self", "pid": "self"}, 0, False),  # this very process: alive
        ({"host": "self", "pid": "dead"}, 0, True),
        ({"host": "elsewhere", "pid": 1}, 0, False),  # cannot be checked: fresh, so held
        ({"host": "elsewhere", "pid": 1}, claim.STALE_AFTER + 60, True),  # not refreshed
        ({}, 0, False),  # unreadable, fresh: held
    ],
)
def test_who_holds_a_local_claim(tmp_path, holder, age, taken):
    where = tmp_path / ".out.claim"
    names = {"self": socket.gethostname(), "elsewhere": "another-host"}
    pids = {"self": os.getpid(), "dead": _dead_pid()}
    if holder:
        _plant(where, host=names[holder["host"]], pid=pids.get(holder["pid"], holder["pid"]))
    else:
        where.write_text("{not json")
    then = time.time() - age
    os.utime(where, (then, then))
    if not taken:
        with pytest.raises(claim.Claimed, match=r"is in use: held by .* delete .*\.out\.claim"):
            claim.take(str(tmp_path / "out"), "--out out")
        return
    with claim.take(str(tmp_path / "out"), "--out out") as held:
        assert json.loads(where.read_text())["token"] == held.holder["token"]
    assert not where.exists()


def test_a_claim_is_released_however_the_holder_ends(tmp_path):
    out = str(tmp_path / "out")

    def failing_export() -> None:
        with claim.take(out, "--out out"):
            with pytest.raises(claim.Claimed, match=f"held by pid {os.getpid()} "):
                claim.take(out, "--out out")
            raise RuntimeError("the export failed")

    with pytest.raises(RuntimeError, match="the export failed"):
        failing_export()
    claim.take(out, "--out out").release()  # free again
    assert os.listdir(tmp_path) == []


def test_an_object_store_claim_refuses_a_second_writer_and_a_missing_bucket(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(claim, "SETTLE", 0.1)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(512)))
    with s3_server() as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        s3.filesystem().create_dir("bucket")
        with claim.take("s3://bucket/exports/out", "--out s3://bucket/exports/out") as held:
            assert s3.filesystem().get_file_info("bucket/exports/.out.claim").size > 0
            with pytest.raises(claim.Claimed, match=f"pid {os.getpid()} .* s3://bucket/exports"):
                claim.take("s3://bucket/exports/out", "--out s3://bucket/exports/out")
            assert held.holder["token"]
        assert s3.filesystem().get_file_info("bucket/exports/.out.claim").type.name == "NotFound"
        dead = {"host": socket.gethostname(), "pid": _dead_pid(), "token": "planted"}
        s3.put("bucket/exports/.out.claim", json.dumps(dead).encode())
        claim.take("s3://bucket/exports/out", "--out s3://bucket/exports/out").release()
        with pytest.raises(ConfigError, match="s3://missing-bucket/x: no such bucket"):
            claim.take("s3://missing-bucket/x", "--out s3://missing-bucket/x")
        capsys.readouterr()
        assert main(["export", str(config), "--out", "s3://missing-bucket/x"]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert said == ["rayjobs: --out s3://missing-bucket/x: no such bucket"]


def test_a_run_folder_in_use_is_refused_before_ray_starts(tmp_path):
    import ray

    from rayjobs.job.pipeline import run
    from rayjobs.job.runs import RUN_SNAPSHOT

    (tmp_path / "runs" / "rayjobs-held").mkdir(parents=True)
    (tmp_path / "runs" / "rayjobs-held" / RUN_SNAPSHOT).write_text("{}")
    config = _config(128) | {
        "tokenizer": DEMO_TOKENIZER,
        "train": {"storage_path": str(tmp_path / "runs"), "num_workers": 1},
    }
    folder = str(tmp_path / "runs" / "rayjobs-held")
    refused = pytest.raises(claim.Claimed, match="run rayjobs-held .* is in use: held by pid")
    with claim.take(folder, "run rayjobs-held"), refused:
        run(config_from_dict(config, base_dir=ROOT), resume="latest")
    assert not ray.is_initialized()


def test_the_store_going_down_while_an_export_writes_is_one_line_and_exit_1(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(claim, "SETTLE", 0.1)
    retries = pafs.AwsStandardS3RetryStrategy
    monkeypatch.setattr(pafs, "AwsStandardS3RetryStrategy", lambda max_attempts: retries(1))
    config = tmp_path / "config.yaml"
    packing = {"packing": {"seq_len": 512, "window_tokens": 4096}}  # several windows
    config.write_text(yaml.safe_dump(_config(512) | packing))
    windows = []

    def down_at_the_second_window(*args, **kwargs):
        windows.append(1)
        if len(windows) == 2:
            s3.stop()
        return to_arrow(*args, **kwargs)

    with s3_server() as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        s3.filesystem().create_dir("bucket")
        monkeypatch.setattr(export_module, "to_arrow", down_at_the_second_window)
        code = main(["export", str(config), "--out", "s3://bucket/out", "--runner", "local"])
        err = capsys.readouterr().err
    assert len(windows) == 2  # guard: it went down while the export wrote
    lines = [line for line in err.splitlines() if line.startswith("rayjobs: --out")]
    assert code == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(
        "rayjobs: --out s3://bucket/out: the export stopped on a storage error: "
    )
    assert lines[0].endswith(
        "nothing finished there (no _manifest.json): run it again once the store answers (it "
        "clears what this one left)"
    )
