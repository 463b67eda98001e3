"""rayjobs export: Parquet re-read with plain pyarrow satisfies the data contract, and the
manifest's token accounting is exact."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, GPT2, HH_CHAT, ROOT, alpaca_and_chat
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.job.export import export, prepare_out
from rayjobs.job.manifest import MANIFEST, require_finished
from support.packed import exported_documents

SEQ_LEN = 512


@pytest.fixture(scope="module")
def exported(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": SEQ_LEN, "window": 1024},
            "train": {"epochs": 2},
        },
        base_dir=ROOT,
    )
    manifest = export(config, out)
    return out, manifest


def _epoch(out, epoch):
    return pq.read_table(out / "train", filters=[("epoch", "==", epoch)])


def test_parquet_rows_keep_the_data_contract(exported):
    out, _ = exported
    table = _epoch(out, 0)
    column_type = table.schema.field("input_ids").type
    assert (column_type.list_size, column_type.value_type) == (SEQ_LEN, pa.int32())
    ids, labels, positions, documents = (
        np.stack(table.column(name).to_numpy(zero_copy_only=False))
        for name in ("input_ids", "labels", "position_ids", "document_ids")
    )
    assert (
        ids.shape == labels.shape == positions.shape == documents.shape == (table.num_rows, SEQ_LEN)
    )
    # labels in the Hugging Face convention (the default), as the file and the manifest say
    assert table.schema.metadata[b"rayjobs.labels"] == b"hf"
    assert json.loads((out / MANIFEST).read_text())["labels"] == "hf"
    trained = labels != -100
    assert (labels[trained] == ids[trained]).all() and trained.sum() > 1000
    starts = np.diff(documents, axis=1, prepend=-1) != 0
    assert (labels[starts] == -100).all()  # the model's own shift never crosses a document
    assert (positions[starts] == 0).all()
    assert (positions[~starts] == np.roll(positions, 1, axis=1)[~starts] + 1).all()
    assert (table.column("num_documents").to_numpy() >= 2).mean() > 0.25, "guard: packed rows"


def test_manifest_accounting_is_exact(exported):
    out, manifest = exported
    assert json.loads((out / MANIFEST).read_text())["packed"] == manifest["packed"]
    tokenized = sum(d["tokens"] for d in manifest["datasets"].values())
    truncated = sum(d["truncated_tokens"] for d in manifest["datasets"].values())
    assert truncated > 0, "guard: seq_len 512 truncates real samples"
    for epoch in (0, 1):
        table = _epoch(out, epoch)
        packs = manifest["epochs"][epoch]["packs"]
        assert packs["num_packs"] == table.num_rows
        assert packs["num_tokens"] == int(table.column("num_tokens").to_numpy().sum())
        # no weights: every sample once per epoch, tokenized again each epoch (stream mode)
        assert packs["num_tokens"] * 2 == tokenized
        assert packs["documents_by_source"] == {"alpaca": 300, "hh_chat": 400}
        assert sum(m["tokens"] for m in manifest["epochs"][epoch]["mix"].values()) * 2 == tokenized
    assert manifest["packed"]["num_tokens"] == tokenized
    assert manifest["packed"]["efficiency"] > 0.98


def test_epochs_differ(exported):
    out, _ = exported
    first, second = (_epoch(out, e).column("input_ids").to_pylist()[:20] for e in (0, 1))
    assert first != second


def _earlier_export(out):
    (out / "train").mkdir(parents=True)
    (out / "train" / "part-0.parquet").write_bytes(b"PAR1")
    (out / MANIFEST).write_text("{}")


class _Started(Exception):
    pass


def _no_job(config, prefix="rayjobs"):
    raise _Started


def test_export_into_a_non_empty_folder_is_refused_without_overwrite(tmp_path, monkeypatch):
    monkeypatch.setattr("rayjobs.job.pipeline.load_tokenizer", _no_job)
    _earlier_export(tmp_path)
    with pytest.raises(ConfigError, match="is not empty; .* pass --overwrite"):
        export(None, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "train"]


def test_overwrite_keeps_the_earlier_export_until_the_new_one_is_whole(tmp_path, monkeypatch):
    """A local export is written beside ``--out`` and renamed into place: one that fails (here
    its job cannot start) leaves the earlier export as it was, and no staging folder."""
    monkeypatch.setattr("rayjobs.job.pipeline.load_tokenizer", _no_job)
    out = tmp_path / "out"
    _earlier_export(out)
    (out / "_validation").mkdir()  # an earlier export's eval sets
    (out / "_validation" / "part-0.parquet").write_bytes(b"PAR1")
    with pytest.raises(_Started):
        export(None, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "_validation", "train"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_finished_local_export_replaces_the_earlier_one_and_clears_a_stale_staging(tmp_path):
    """``prepare_out`` clears what an interrupted export left (its staging folder, without
    --overwrite), ``commit`` renames the new export into place over an earlier one; a staging
    folder holding anything an export does not write is left alone and refused."""
    out = tmp_path / "out"
    staging = tmp_path / ".out.partial"
    _earlier_export(staging)  # an interrupted export's (its manifest never written)
    (staging / MANIFEST).unlink()
    target = prepare_out(out)
    assert target.writing == str(staging) and list(staging.iterdir()) == []  # cleared, made
    _earlier_export(staging)  # the new export's files
    (staging / MANIFEST).write_text('{"new": 1}')
    target.commit()
    assert json.loads((out / MANIFEST).read_text()) == {"new": 1} and not staging.exists()
    # --overwrite: the earlier export stays until commit, then the new one takes its place.
    target = prepare_out(out, overwrite=True)
    assert (out / MANIFEST).exists()
    _earlier_export(staging)
    (staging / MANIFEST).write_text('{"newer": 1}')
    target.commit()
    assert json.loads((out / MANIFEST).read_text()) == {"newer": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / ".other.partial").mkdir()
    (tmp_path / ".other.partial" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"staging folder .*\.other\.partial holds \['notes"):
        prepare_out(tmp_path / "other")
    assert (tmp_path / ".other.partial" / "notes.txt").exists()


def test_readers_refuse_a_folder_without_a_manifest_naming_it(tmp_path):
    from rayjobs.bench.train import read_export

    _earlier_export(tmp_path / "out")
    require_finished(tmp_path / "out")  # guard: with its manifest it passes
    (tmp_path / "out" / MANIFEST).unlink()
    for read in (require_finished, read_export):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'out'} is not a finished export"):
            read(tmp_path / "out")


def test_overwrite_never_deletes_what_no_export_writes(tmp_path, monkeypatch):
    monkeypatch.setattr("rayjobs.job.pipeline.load_tokenizer", _no_job)
    _earlier_export(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds \['notes.txt'\], which no export writes"):
        export(None, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "notes.txt", "train"]


@pytest.mark.parametrize(
    "name, files",
    [
        ("epoch=2024", ["notes.csv"]),
        ("epoch=0", ["part-0.parquet", "notes.txt"]),
        ("epoch=x", []),
        ("eval", ["part-0.parquet", "notes.txt"]),
        ("train", ["part-0.parquet", "notes.txt"]),
        ("_validation", ["notes.txt"]),
    ],
)
def test_overwrite_keeps_epoch_folders_an_export_did_not_write(tmp_path, monkeypatch, name, files):
    """Only ``train`` and ``_validation`` (``epoch=<number>`` and ``eval`` of the layout
    before) folders of Parquet files count as an earlier export's: a user's own Hive-partitioned
    folder (``epoch=2024/notes.csv``) was emptied with the export."""
    monkeypatch.setattr("rayjobs.job.pipeline.load_tokenizer", _no_job)
    (tmp_path / name).mkdir()
    for file in files:
        (tmp_path / name / file).write_text("mine")
    with pytest.raises(ConfigError, match=rf"holds \['{name}'\], which no export writes"):
        export(None, tmp_path, overwrite=True)
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(files)


@pytest.mark.parametrize("epochs", [0, -1])
def test_export_epochs_below_one_are_refused_before_anything_is_emptied(tmp_path, epochs):
    _earlier_export(tmp_path)
    with pytest.raises(ConfigError, match=f"--epochs must be at least 1, got {epochs}"):
        export(None, tmp_path, epochs, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "train"]


@pytest.mark.parametrize(
    "flag, overwrite, runner",
    [([], False, "auto"), (["--overwrite"], True, "auto"), (["--runner", "local"], False, "local")],
)
def test_cli_passes_overwrite_and_runner_to_export(tmp_path, monkeypatch, flag, overwrite, runner):
    import rayjobs.job.export
    from rayjobs.cli import main

    seen = {}

    def fake_export(config, out, epochs=None, overwrite=False, labels="hf", runner="auto"):
        seen.update(out=out, overwrite=overwrite, runner=runner)
        return {"packed": {"num_packs": 0, "efficiency": 0.0}, "epochs": []}

    monkeypatch.setattr(rayjobs.job.export, "export", fake_export)
    config = str(ROOT / "configs" / "demo.yaml")
    assert main(["export", config, "--out", str(tmp_path), *flag]) == 0
    assert seen == {"out": str(tmp_path), "overwrite": overwrite, "runner": runner}


def test_preference_rows_export_their_mask_columns():
    """task: dpo rows keep parent_ids and response_role in the Parquet export (without them the
    shared-prompt mask could not be rebuilt); SFT rows do not grow them."""
    import numpy as np

    from rayjobs.data import preference
    from rayjobs.job.export import to_arrow

    triples = [preference.Triple(np.array([1, 2]), np.array([3]), np.array([4, 5]))]
    rows = preference.assemble_triples(triples, [np.array([0])], seq_len=8, pad_id=0)
    table = to_arrow(rows)
    stats = ["num_tokens", "num_documents", "seq_lengths"]
    assert table.column_names == [*preference.DPO_COLUMNS, *stats]
    assert table.column("parent_ids").to_pylist() == [[0, 0, 0, 0, 0, 0, 3, 3]]
    assert table.column("response_role").to_pylist() == [[0, 1, 1, 2, 2, 2, 0, 0]]
    sft = {k: v for k, v in rows.items() if k not in preference.PREFERENCE_COLUMNS}
    assert "parent_ids" not in to_arrow(sft).column_names


ONE_WINDOW = {"mode": "stream", "window_tokens": 1 << 22, "warmup_tokens": 0}
"""One packing window, no warm-up lane: the same samples pack the same way (docs/cli.md)."""


def test_fastokens_and_tokenizers_export_the_same_packed_rows(ray_local, tmp_path):
    """tokenizer.backend auto (fastokens, decided at start-up on the heads) and tokenizers give
    the same packed rows, and each manifest says which library encoded. Stream mode only: the
    backend is decided in ``start_job`` and encodes in the same Tokenize actors in either mode
    (planned mode runs under ``auto`` in test_mix and test_object_storage)."""
    rows, encoders = {}, {}
    for backend in ("auto", "tokenizers"):
        config = config_from_dict(
            {
                "datasets": [
                    {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                    {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
                ],
                "tokenizer": {"path": str(GPT2), "backend": backend},
                "packing": {"seq_len": SEQ_LEN, **ONE_WINDOW},
                "train": {"epochs": 1},
            },
            base_dir=ROOT,
        )
        manifest = export(config, tmp_path / backend)
        encoders[backend] = manifest["tokenizer"]
        table = _epoch(tmp_path / backend, 0)
        columns = [table.column(name).to_pylist() for name in ("input_ids", "labels")]
        rows[backend] = sorted(map(tuple, zip(*columns, strict=True)))
    assert encoders["auto"]["backend"] == "fastokens" and encoders["auto"]["rows"] > 0
    assert encoders["tokenizers"]["backend"] == "tokenizers"
    assert len(rows["auto"]) > 50, "guard: a real epoch of packs"
    assert rows["auto"] == rows["tokenizers"]


def test_the_local_runner_packs_the_same_documents_as_the_ray_path(ray_local, tmp_path):
    """``--runner local`` against the job's Ray path on one config (two datasets, two epochs,
    several windows): the same counts per dataset and, every epoch, the same documents (each
    sample's tokens and labels) packed, each once; only the rows they are packed into differ
    (windows form as blocks arrive, and the Ray path's first rows come from its warm-up lane)."""
    packing = {"seq_len": SEQ_LEN, "window_tokens": 1 << 16}
    config = config_from_dict(alpaca_and_chat(SEQ_LEN, 2, packing=packing), base_dir=ROOT)
    manifests = {runner: export(config, tmp_path / runner, runner=runner) for runner in RUNNERS}
    assert {m["runner"]["name"] for m in manifests.values()} == set(RUNNERS)
    timings = ("seconds", "cpu_seconds")  # the work's own time, not a count
    counts = {
        runner: {name: {k: v for k, v in d.items() if k not in timings} for name, d in ds.items()}
        for runner, ds in ((r, m["datasets"]) for r, m in manifests.items())
    }
    assert counts["local"] == counts["ray"] and counts["ray"]["hh_chat"]["samples"] > 500
    for epoch in (0, 1):
        found = {r: exported_documents(_epoch(tmp_path / r, epoch)) for r in RUNNERS}
        assert found["local"] == found["ray"] and found["ray"].total() == 700
    efficiency = {runner: m["packed"]["efficiency"] for runner, m in manifests.items()}
    assert efficiency["local"] >= efficiency["ray"] - 0.002, efficiency


RUNNERS = ("local", "ray")
