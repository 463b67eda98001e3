"""The local runner (``rayjobs export --runner local``, ``data.local``): the data path in this
process, no Ray. Its exports are whole (every sample packed once per epoch, counts exact), the same
on every run, weighted to their shares; bad rows are counted or refused as on the Ray path; and
``--runner auto`` takes it only where nothing calls for Ray. Its rows against the Ray path's, on
the same config: tests/ray/test_export.py."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, GPTEACHER, HH_CHAT, HUB_MODEL_CONFIGS, ROOT, alpaca_and_chat
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.data.tasks import TASKS
from rayjobs.errors import DataError
from rayjobs.job import export as export_module
from rayjobs.job.export import choose_runner, export
from rayjobs.job.manifest import MANIFEST
from support.packed import exported_documents

SEQ_LEN = 512


def _config(**patch) -> dict:
    # windows of 64 K tokens: several per epoch, so windows and the mix are exercised
    packing = {"packing": {"seq_len": SEQ_LEN, "window_tokens": 1 << 16}}
    return alpaca_and_chat(SEQ_LEN, epochs=2, **(packing | patch))


def _export(tmp_path, name="out", **patch):
    out = tmp_path / name
    manifest = export(config_from_dict(_config(**patch), base_dir=ROOT), out, runner="local")
    return out, manifest


def test_a_local_export_packs_every_sample_once_an_epoch_and_its_counts_add_up(tmp_path):
    import ray

    out, manifest = _export(tmp_path)
    assert manifest["runner"]["name"] == "local" and not ray.is_initialized()
    assert json.loads((out / MANIFEST).read_text())["packed"] == manifest["packed"]
    samples = sum(d["samples"] for d in manifest["datasets"].values())
    tokens = sum(d["tokens"] for d in manifest["datasets"].values())
    assert manifest["datasets"]["alpaca"]["truncated_tokens"] > 0, "guard: seq_len truncates"
    documents = []
    for epoch in (0, 1):
        table = pq.read_table(out / "train", filters=[("epoch", "==", epoch)])
        packs = manifest["epochs"][epoch]["packs"]
        assert len(list((out / "train").glob(f"epoch-{epoch:04d}-*"))) > 2, "guard: windows"
        assert packs["num_packs"] == table.num_rows
        assert packs["num_tokens"] == sum(table.column("num_tokens").to_pylist()) == tokens // 2
        assert sum(table.column("num_documents").to_pylist()) == samples // 2
        assert table.schema.metadata[b"rayjobs.labels"] == b"hf"
        assert set(table.column("epoch").to_pylist()) == {epoch}
        documents.append(exported_documents(table))
    assert documents[0] == documents[1]  # the same samples each epoch, packed anew
    assert sum(documents[0].values()) == samples // 2
    assert 0.97 < manifest["packed"]["efficiency"] <= 1.0


def test_the_same_config_exports_the_same_rows(tmp_path):
    tables = [pq.read_table(_export(tmp_path, name)[0] / "train") for name in ("a", "b")]
    assert tables[0].num_rows > 50 and tables[0].equals(tables[1])


def test_weighted_shares_hold_within_a_point_each_epoch(tmp_path):
    roleplay = {"template": "alpaca", "column_map": {"output": "response"}}
    datasets = [
        {"name": "alpaca", "source": str(ALPACA), "template": "alpaca", "weight": 0.5},
        {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat", "weight": 0.3},
        {"name": "roleplay", "source": str(GPTEACHER), **roleplay, "weight": 0.2},
    ]
    _, manifest = _export(tmp_path, datasets=datasets, mix={"by": "tokens"})
    for epoch in manifest["epochs"]:
        shares = {name: stats["share"] for name, stats in epoch["mix"].items()}
        assert shares == pytest.approx({"alpaca": 0.5, "hh_chat": 0.3, "roleplay": 0.2}, abs=0.01)
    packs = [epoch["packs"] for epoch in manifest["epochs"]]
    trimmed = sum(sum(p["trimmed_by_source"].values()) for p in packs)
    read = sum(d["samples"] for d in manifest["datasets"].values())
    packed = sum(p["num_documents"] for p in packs)
    assert trimmed > 0, "guard: read a margin more than the shares, trimmed to them"
    assert packed + trimmed == read  # every sample read is packed or counted as trimmed


BAD_ROW = '{"messages": 5}\n'


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("skip", "skipped"),
        (
            "error",
            r"dataset 'bad', file .*bad\.jsonl, row 21: field 'messages': expected a",
        ),
    ],
)
def test_a_bad_row_is_counted_or_refused_with_its_place(tmp_path, policy, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text((HH_CHAT.read_text().splitlines(keepends=True)[0] * 20) + BAD_ROW)
    datasets = [
        {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
        {"name": "bad", "source": str(path), "template": "chat", "on_bad_row": policy},
    ]
    if policy == "error":
        with pytest.raises(DataError, match=expected):
            _export(tmp_path, datasets=datasets)
        return
    _, manifest = _export(tmp_path, datasets=datasets)
    bad = manifest["datasets"]["bad"]
    assert bad["skipped_rows"] == 2 and bad["rows"] == 2 * 21  # two epochs of 21 rows
    assert any("bad.jsonl" in example for example in bad["skipped_examples"])


def _with_hf(config):
    """``config`` with its first dataset as one ``datasets`` loads in the driver (a Hub split
    whose files the read tasks cannot take: tests/ray/test_hub_datasets.py)."""
    hub = config.datasets[0].model_copy(update={"name": "hub", "format": "hf", "files": ()})
    return config.model_copy(update={"datasets": [hub, *config.datasets[1:]]})


@pytest.mark.parametrize(
    "runner, env, patch, limit, expected",
    [
        ("auto", {}, None, None, ("local", "no Ray cluster named, about")),
        ("auto", {}, None, 1000, ("ray", "more than the local runner takes (1,000)")),
        ("auto", {"RAY_ADDRESS": "10.0.0.1:6379"}, None, None, ("ray", "(10.0.0.1:6379)")),
        ("auto", {}, "hub", None, ("ray", "'hub' is a Hugging Face dataset")),
        ("auto", {}, {"packing": {"mode": "planned"}}, None, ("ray", "planned is the Ray path's")),
        ("ray", {}, None, None, ("ray", "--runner ray")),
        ("local", {"RAY_ADDRESS": "10.0.0.1:6379"}, None, None, ("local", "--runner local")),
    ],
)
def test_the_runner_an_export_takes(monkeypatch, runner, env, patch, limit, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if limit is not None:
        monkeypatch.setattr(export_module, "LOCAL_MAX_TOKENS", limit)
    config = config_from_dict(_config(**(patch if isinstance(patch, dict) else {})), ROOT)
    config = _with_hf(config) if patch == "hub" else config
    name, reason, estimates = choose_runner(config, runner)
    assert (name, expected[1] in reason) == (expected[0], True), reason
    assert (estimates is not None) == (name == "local" and runner == "auto")


def test_the_local_runner_refuses_what_it_cannot_read():
    config = _with_hf(config_from_dict(_config(), ROOT))
    with pytest.raises(ConfigError, match="--runner local: dataset 'hub' is a Hugging Face"):
        choose_runner(config, "local")


def test_an_interrupted_local_export_leaves_nothing_finished(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which the command line turns into the same) after the first window
    is written: ``Interrupted`` says where the files are, ``--out`` holds nothing, and the next
    export to it clears them and finishes."""
    from rayjobs.data import local
    from rayjobs.errors import Interrupted

    packed_rows = local.packed_rows

    def interrupted(*args, **kwargs):
        rows = packed_rows(*args, **kwargs)
        yield next(rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "packed_rows", interrupted)
    out, staging = tmp_path / "out", tmp_path / ".out.partial"
    with pytest.raises(Interrupted, match=f"export not finished: nothing at {out}; its files"):
        _export(tmp_path)
    assert not out.exists() and len(list(staging.glob("train/*.parquet"))) == 1
    monkeypatch.setattr(local, "packed_rows", packed_rows)
    _, manifest = _export(tmp_path)
    assert (out / MANIFEST).exists() and not staging.exists() and manifest["packed"]["num_packs"]


SHIPPED = sorted(
    p.name
    for p in (ROOT / "configs").glob("*.yaml")
    if "s3" not in p.name and p.name not in HUB_MODEL_CONFIGS
)
"""Every example config but the one on a bucket (its export: tests/ray/test_object_storage.py)."""


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_exports_with_the_local_runner(tmp_path, name):
    """SFT, chat, tool calls, text, DPO triples, weights, eval sets: one epoch of each, its
    counts checked as the run summary's are (``Job.accounting`` raises when they do not add
    up), every packed document in the files."""
    from rayjobs.config import load_config

    config = load_config(ROOT / "configs" / name, ["train.epochs=1"])
    manifest = export(config, tmp_path / "out", runner="local")
    table = pq.read_table(tmp_path / "out" / "train")
    assert table.num_rows == manifest["packed"]["num_packs"] > 0
    per_sample = TASKS[config.task].documents_per_sample  # a DPO triple: three documents
    documents = sum(table.column("num_documents").to_pylist())
    assert documents == per_sample * manifest["epochs"][0]["packs"]["num_documents"]
    if config.eval.datasets:
        held_out = pq.read_table(tmp_path / "out" / "_validation")
        assert held_out.num_rows == manifest["eval"]["packed"]["num_packs"] > 0
    if config.task == "dpo":
        assert {"parent_ids", "response_role"} <= set(table.column_names)


def test_inspect_by_the_local_runner_reports_what_its_export_writes(tmp_path):
    """``rayjobs inspect --runner local`` on a config with eval sets: the figures of the export
    of the same config (the local runner is deterministic, so they are equal, not close), each
    dataset's sample lengths from one more read, a preview row, and no Ray."""
    import ray

    from rayjobs.config import load_config
    from rayjobs.job.inspection import inspect

    config = load_config(ROOT / "configs" / "tiny_llama.yaml", ["train.epochs=1"])
    report = inspect(config, runner="local")
    manifest = export(config, tmp_path / "out", runner="local")
    assert report["runner"]["name"] == "local" and not ray.is_initialized()
    timers = ("seconds", "cpu_seconds")
    for name, counts in manifest["datasets"].items():
        shown = {k: v for k, v in report["datasets"][name].items() if k in counts}
        assert {k: v for k, v in shown.items() if k not in timers} == {
            k: v for k, v in counts.items() if k not in timers
        }, name
        assert report["datasets"][name]["length"]["samples"] == counts["samples"] > 100
    assert {k: report["packed"][k] for k in manifest["packed"]} == manifest["packed"]
    assert report["eval"]["packed"]["num_packs"] == manifest["eval"]["packed"]["num_packs"] > 0
    assert report["preview"] is not None and report["packed"]["fill"]["mean"] == pytest.approx(
        manifest["packed"]["efficiency"]
    )
