"""Hugging Face datasets (``format: hf``) as users name them: a Hub-layout folder (a dataset
repository: a README with ``configs``, data files in folders) with a ``subset`` (``load_dataset``'s
``name``), ``data_files`` and a ``split``. Data files the job can read (Parquet, JSONL, CSV)
become the dataset's files, read by read tasks in parallel with row numbers of their own: the
driver never materializes the dataset. Offline: the repository is a local folder."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, GPT2
from rayjobs.config import config_from_dict
from rayjobs.data.sources import read_dataset
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
    read = read_dataset(spec)
    assert "ReadRowFile" in str(read._plan._logical_plan.dag)  # one read task per file
    got = read.take_all()
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
