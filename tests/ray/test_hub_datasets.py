"""Hugging Face datasets (``format: hf``) as users name them: a Hub-layout folder (a dataset
repository: a README with ``configs``, data files in folders) with a ``subset`` (``load_dataset``'s
``name``), ``data_files`` and a ``split``, or a Hub name with a ``revision``. Data files the job
can read (Parquet, JSONL, CSV) become the dataset's files, read by read tasks in parallel with row
numbers of their own: the driver never materializes the dataset. Offline: the repository is a
local folder, or a Hub cache as ``huggingface_hub`` downloads one (``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, GPT2
from rayjobs.config import config_from_dict
from rayjobs.data import sources
from rayjobs.data.sources import FileRead, read_dataset, read_files
from rayjobs.errors import ConfigError

README = """---
configs:
- config_name: short
  data_files:
  - split: train
    path: short/train-*.parquet
  - split: test
    path: short/test.parquet
- config_name: long
  data_files:
  - split: train
    path: long/*.jsonl
---
# A Hub-layout dataset for the tests
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A dataset repository on disk: ``short`` (Alpaca's short answers: two Parquet shards and
    a test file), ``long`` (its long answers, JSONL), and the rows of each."""
    root = tmp_path_factory.mktemp("hub") / "alpaca-split"
    rows = json.loads(ALPACA.read_text())
    short = [r for r in rows if len(r["output"]) < 200]
    long = [r for r in rows if len(r["output"]) >= 200]
    for folder in ("short", "long"):
        (root / folder).mkdir(parents=True)
    half = len(short) // 2
    pq.write_table(pa.Table.from_pylist(short[:half]), root / "short/train-00000-of-00002.parquet")
    pq.write_table(
        pa.Table.from_pylist(short[half:-10]), root / "short/train-00001-of-00002.parquet"
    )
    pq.write_table(pa.Table.from_pylist(short[-10:]), root / "short/test.parquet")
    (root / "long" / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long))
    (root / "README.md").write_text(README)
    return root, {"short": short, "long": long}


def _spec(root, **hf):
    return config_from_dict(
        {
            "datasets": [
                {"name": "a", "source": str(root), "format": "hf", "template": "alpaca", **hf}
            ],
            "tokenizer": {"path": str(GPT2)},
        }
    ).datasets[0]


def test_a_subset_and_split_resolve_to_the_repositorys_data_files(repository):
    root, _ = repository
    train = _spec(root, subset="short")
    assert train.format == "parquet"
    assert [f.split("/")[-1] for f in train.files] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert [f.split("/")[-1] for f in _spec(root, subset="short", split="test").files] == [
        "test.parquet"
    ]
    assert _spec(root, subset="long").format == "jsonl"
    chosen = _spec(root, data_files={"train": "short/train-00001-of-00002.parquet"})
    assert [f.split("/")[-1] for f in chosen.files] == ["train-00001-of-00002.parquet"]


def _read(spec) -> list[dict]:
    """The rows the dataset's read tasks give, read here as each one reads (no Ray)."""
    tables = read_files([FileRead(f) for f in spec.files], {"format": spec.format,
                                                            "dataset": spec.name})  # fmt: skip
    return [json.loads(record) for t in tables for record in t.column("_record").to_pylist()]


def test_data_files_read_the_files_they_name_and_only_those(repository):
    root, rows = repository
    half = len(rows["short"]) // 2
    chosen = _spec(root, data_files={"train": "short/train-00001-of-00002.parquet"})
    assert _read(chosen) == rows["short"][half:-10]
    swapped = {"train": "short/test.parquet", "test": "short/train-00000-of-00002.parquet"}
    assert _read(_spec(root, data_files=swapped)) == rows["short"][-10:]
    assert _read(_spec(root, data_files=swapped, split="test")) == rows["short"][:half]


def _blob(cache, data: bytes) -> str:
    """``data`` stored as a Hub cache blob (named by its hash); the snapshot's files link here."""
    name = hashlib.sha256(data).hexdigest()
    (cache / "blobs").mkdir(parents=True, exist_ok=True)
    (cache / "blobs" / name).write_bytes(data)
    return name


def _parquet(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``org/alpaca-split`` in a Hub cache as ``huggingface_hub`` lays one out offline: commit
    ``v1`` (tag ``v1.0``) with the short answers in two shards, commit ``v2`` (``main``) with the
    long ones in one, each a snapshot folder of links to blobs; and the rows of each."""
    from huggingface_hub import constants

    rows = json.loads(ALPACA.read_text())
    short = [r for r in rows if len(r["output"]) < 200][:60]
    long = [r for r in rows if len(r["output"]) >= 200][:40]
    readme = "---\nconfigs:\n- config_name: answers\n  data_files:\n  - split: train\n" \
             "    path: data/train-*.parquet\n---\n"  # fmt: skip
    commits = {
        "1" * 40: {"data/train-00000-of-00002.parquet": _parquet(short[:30]),
                   "data/train-00001-of-00002.parquet": _parquet(short[30:])},
        "2" * 40: {"data/train-00000-of-00001.parquet": _parquet(long)},
    }  # fmt: skip
    repo = tmp_path / "hub" / "datasets--org--alpaca-split"
    for sha, held in commits.items():
        for relative, data in {"README.md": readme.encode(), **held}.items():
            link = repo / "snapshots" / sha / relative
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(repo / "blobs" / _blob(repo, data))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2" * 40)
    (repo / "refs" / "v1.0").write_text("1" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: as if set before
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return {"v1.0": short, "main": long}


@pytest.mark.parametrize("revision", ["v1.0", "1" * 40, "main", None])
def test_a_revision_reads_that_revisions_files_from_the_hub_cache(hub_cache, revision):
    spec = _spec("org/alpaca-split", subset="answers", revision=revision)
    sha, expected = ("1" * 40, hub_cache["v1.0"]) if revision in ("v1.0", "1" * 40) else (
        "2" * 40, hub_cache["main"])  # fmt: skip
    assert spec.format == "parquet"
    assert [f.split(f"/snapshots/{sha}/")[1] for f in spec.files] == (
        ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
        if sha == "1" * 40
        else ["data/train-00000-of-00001.parquet"]
    )
    assert _read(spec) == expected


def test_a_revision_the_hub_cache_lacks_is_refused_offline(hub_cache):
    with pytest.raises(ConfigError, match=r"dataset 'a'\): cannot load .*org/alpaca-split"):
        _spec("org/alpaca-split", subset="answers", revision="v9.9")


HF_REFUSED = {
    "unknown_split": (
        {"subset": "long", "split": "test"},
        "has no split 'test' (it has ['train'])",
    ),
    "unknown_subset": ({"subset": "medium"}, "cannot load the Hugging Face dataset"),
    "revision_of_a_folder": ({"revision": "v1.0"}, "revision applies to a dataset on the Hub"),
}


@pytest.mark.parametrize("case", HF_REFUSED)
def test_a_hub_dataset_that_cannot_be_read_is_refused_naming_the_dataset(repository, case):
    root, _ = repository
    options, said = HF_REFUSED[case]
    with pytest.raises(ConfigError, match=r"datasets\.0\.source \(dataset 'a'\): ") as caught:
        _spec(root, **options)
    assert said in str(caught.value)


def test_hub_options_belong_to_format_hf_only(repository):
    with pytest.raises(ConfigError, match="subset apply to format: hf only"):
        config_from_dict(
            {
                "datasets": [
                    {"name": "a", "source": str(ALPACA), "template": "alpaca", "subset": "short"}
                ],  # fmt: skip
                "tokenizer": {"path": str(GPT2)},
            }
        )


def test_a_parquet_subset_is_read_by_read_tasks_not_loaded_in_the_driver(
    repository, ray_local, monkeypatch
):
    import datasets

    root, rows = repository
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("materialized"))
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: pytest.fail("materialized"))
    spec = _spec(root, subset="short")
    # shards of a read task's size each (these are a few KiB: they would share one task)
    monkeypatch.setattr(sources, "READ_TASK_BYTES", 1)
    read = read_dataset(spec).materialize()
    # Ray Data's own account of the read: a read task per shard, run in parallel by its workers
    operator = next(line for line in read.stats().splitlines() if "ReadRowFile" in line)
    assert int(re.search(r"(\d+) tasks executed", operator).group(1)) == len(spec.files) == 2
    got = read.take_all()  # rows from read tasks name their files (not "a[train]")
    assert sorted(json.loads(r["_record"])["output"] for r in got) == sorted(
        r["output"] for r in rows["short"][:-10]
    )
    by_file = {}
    for r in got:
        by_file.setdefault(r["_path"].split("/")[-1], []).append(r["_row"])
    half = len(rows["short"]) // 2
    assert sorted(by_file["train-00000-of-00002.parquet"]) == list(range(half))
    assert sorted(by_file["train-00001-of-00002.parquet"]) == list(
        range(len(rows["short"]) - 10 - half)
    )


# A ``.json`` data file on the Hub holds JSON lines or one JSON list (``datasets``' JSON builder
# reads both): (what the split's files hold, the format they are read as; None: by ``datasets``
# in the driver, where the files disagree).
JSON_FILES = {
    "lines": (["lines", "lines"], "jsonl"),
    "list": (["list", "list"], "json"),
    "lines_after_a_byte_order_mark": (["bom_lines"], "jsonl"),
    "gzipped_list": (["list.gz"], "json"),
    "mixed": (["lines", "list"], None),
}


def _json_repository(root, kinds: list[str], rows: list[dict]):
    """A Hub-layout folder whose train split is ``data/train-<i>.json`` (``.json.gz`` for a
    ``.gz`` kind), one file per kind, the rows shared out between them in order."""
    (root / "data").mkdir(parents=True)
    share = -(-len(rows) // len(kinds))
    for i, kind in enumerate(kinds):
        part = rows[i * share : (i + 1) * share]
        lines = "".join(json.dumps(r) + "\n" for r in part)
        text = {"lines": lines, "list": json.dumps(part, indent=1), "bom_lines": "\ufeff" + lines}
        if kind.endswith(".gz"):
            data = gzip.compress(text[kind.removesuffix(".gz")].encode(), mtime=0)
            (root / "data" / f"train-{i}.json.gz").write_bytes(data)
        else:
            (root / "data" / f"train-{i}.json").write_text(text[kind])


@pytest.mark.parametrize("case", JSON_FILES)
def test_json_data_files_are_read_as_the_json_they_hold(tmp_path, case):
    kinds, expected = JSON_FILES[case]
    rows = json.loads(ALPACA.read_text())[:40]
    _json_repository(tmp_path / "repo", kinds, rows)
    spec = _spec(tmp_path / "repo")
    assert spec.format == (expected or "hf")
    if expected:
        suffixes = [".json.gz" if kind.endswith(".gz") else ".json" for kind in kinds]
        assert [f.split("/")[-1] for f in spec.files] == [
            f"train-{i}{suffix}" for i, suffix in enumerate(suffixes)
        ]
        assert _read(spec) == rows


def test_a_folder_of_files_the_job_cannot_read_itself_is_loaded_by_datasets(
    tmp_path, ray_local, monkeypatch
):
    """A Hub-layout folder that is not a ``save_to_disk`` folder, with data files the read tasks
    do not take (here JSON lines and a JSON list side by side): ``load_dataset`` loads its split
    in the driver, once (not again by its Hub name, to look for the Hub's Parquet export), every
    row once."""
    import datasets

    rows = json.loads(ALPACA.read_text())[:40]
    _json_repository(tmp_path / "repo", JSON_FILES["mixed"][0], rows)
    spec = _spec(tmp_path / "repo")
    assert spec.format == "hf" and not spec.files  # guard: the driver's path
    loads = []
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *a, **k: loads.append(a) or load_dataset(*a, **k)
    )
    read = read_dataset(spec).take_all()
    assert loads == [(str(tmp_path / "repo"),)]
    assert sorted(r["_row"] for r in read) == list(range(len(rows)))
    assert [json.loads(r["_record"]) for r in sorted(read, key=lambda r: r["_row"])] == rows
