"""Sources: every supported format → rows of one schema that know their file and row."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, ROOT, SHAKESPEARE
from rayjobs.config import config_from_dict
from rayjobs.data import sources
from rayjobs.data.formats import HF
from rayjobs.data.sources import FileRead, RowFileDatasource, load_huggingface, read_dataset

ROWS = [
    {"instruction": "Add", "input": "1 2", "output": "3"},
    {"instruction": "Greet", "input": "", "output": "Hello"},
]


def _spec(tmp_path, source, **extra):
    config = config_from_dict(
        {
            "datasets": [{"name": "d", "source": str(source), "template": "alpaca", **extra}],
            "tokenizer": {"path": str(ROOT / "configs/demo/tokenizer.json")},
        },
        base_dir=tmp_path,
    )
    return config.datasets[0]


def _write(tmp_path, fmt):
    path = tmp_path / f"rows.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "jsonl":
        path.write_text("\n\n".join(json.dumps(r) for r in ROWS))  # a blank line between rows
    elif fmt == "csv":
        pacsv.write_csv(pa.Table.from_pylist(ROWS), path)
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize(
    "fmt,expected_rows",
    [
        ("json", [0, 1]),
        ("jsonl", [1, 3]),
        ("csv", [0, 1]),
        ("parquet", [0, 1]),
    ],
)
def test_formats_give_records_with_file_and_row(ray_local, tmp_path, fmt, expected_rows):
    path = _write(tmp_path, fmt)
    rows = sorted(read_dataset(_spec(tmp_path, path)).take_all(), key=lambda r: r["_row"])
    assert [r["_row"] for r in rows] == expected_rows
    assert {r["_path"] for r in rows} == {str(path)} and {r["_dataset"] for r in rows} == {"d"}
    assert {r["_skip"] for r in rows} == {None}
    # every format gives the rows as written: CSV cells are text, an empty one ""
    assert [json.loads(r["_record"]) for r in rows] == ROWS


@pytest.mark.parametrize(
    "text_split,expected",
    [
        ("line", [(1, "first line"), (2, "second line"), (4, "after blank")]),
        ("paragraph", [(1, "first line\nsecond line"), (4, "after blank")]),
        ("file", [(1, "first line\nsecond line\n\nafter blank\n")]),
    ],
)
def test_text_documents(ray_local, tmp_path, text_split, expected):
    path = tmp_path / "doc.txt"
    path.write_text("first line\nsecond line\n\nafter blank\n")
    rows = read_dataset(_spec(tmp_path, path, template="text", text_split=text_split)).take_all()
    got = sorted((r["_row"], json.loads(r["_record"])["text"]) for r in rows)
    assert got == expected


def test_real_files_keep_every_row(ray_local, tmp_path):
    alpaca = read_dataset(_spec(tmp_path, ALPACA)).take_all()
    assert sorted(r["_row"] for r in alpaca) == list(range(len(json.loads(ALPACA.read_text()))))
    shakespeare = read_dataset(_spec(tmp_path, SHAKESPEARE, template="text")).take_all()
    # Speeches are separated by blank lines; an independent split finds the same documents.
    speeches = [p.strip("\n") for p in SHAKESPEARE.read_text().split("\n\n") if p.strip()]
    assert len(speeches) > 500, "guard: many speeches"
    assert sorted(json.loads(r["_record"])["text"] for r in shakespeare) == sorted(speeches)


def test_huggingface_saved_dataset(ray_local, tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    rows = read_dataset(_spec(tmp_path, "hf", format="hf")).take_all()
    assert sorted(json.loads(r["_record"])["output"] for r in rows) == ["3", "Hello"]
    assert sorted(r["_row"] for r in rows) == [0, 1]


def test_huggingface_binary_column_is_refused_or_decoded(ray_local, tmp_path):
    import datasets

    rows = [{**r, "output": r["output"].encode()} for r in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    spec = _spec(tmp_path, "hf", format="hf")
    named = re.escape(f"dataset 'd', {spec.source}[train]: ")  # which dataset and split
    with pytest.raises(Exception, match=named + r"column\(s\) \['output'\] hold binary"):
        read_dataset(spec).take_all()
    decoded = read_dataset(_spec(tmp_path, "hf", format="hf", binary="utf8")).take_all()
    assert sorted(json.loads(r["_record"])["output"] for r in decoded) == ["3", "Hello"]


def test_invalid_json_names_dataset_file_and_line(ray_local, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(Exception) as error:
        read_dataset(_spec(tmp_path, path)).take_all()
    assert "dataset 'd'" in str(error.value) and str(path) in str(error.value)
    assert "line 2 is not valid JSON" in str(error.value)


def test_jsonl_saved_as_json_gets_a_hint(ray_local, tmp_path):
    path = tmp_path / "lines.json"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    with pytest.raises(Exception, match="set format: jsonl"):
        read_dataset(_spec(tmp_path, path)).take_all()


# -- guards a mutation run found missing


def test_no_read_task_without_a_read_however_much_parallelism_ray_asks():
    """Ray may ask for more read tasks than there are reads (or a dataset may have none left):
    one task per read, no empty ones."""
    paths = ["/x/a.jsonl", "/x/b.jsonl"]

    def read_tasks(reads):
        sizes = dict.fromkeys(paths, sources.READ_TASK_BYTES)
        source = RowFileDatasource(
            reads, format="jsonl", dataset="d", text_split="paragraph", sizes=sizes
        )
        return source.get_read_tasks(8)

    tasks = read_tasks([FileRead(p) for p in paths])
    assert [task.metadata.input_files for task in tasks] == [(paths[0],), (paths[1],)]
    assert read_tasks([]) == []


MIB = 1 << 20


@pytest.mark.parametrize(
    ("file_mib", "parallelism", "files_per_task"),
    [
        ([0.25] * 64, 200, [32, 32]),  # small files: 8 MiB a task, not a task a file
        ([0.25] * 65, 200, [22, 22, 21]),  # 16.25 MiB: 3 tasks, a third each
        ([0.25] * 64, 1, [64]),  # Ray asks for fewer: fewer
        ([0.25], 200, [1]),
        ([20, 20, 20], 200, [1, 1, 1]),  # files over 8 MiB: a task each, never more than reads
        ([30, 1, 1, 1, 1], 200, [1, 4]),  # a large file a task; the small ones share one
        ([3, 3, 3], 200, [1, 2]),  # 9 MiB: 2 tasks
    ],
)
def test_read_tasks_take_about_8_mib_of_consecutive_reads(file_mib, parallelism, files_per_task):
    """A read task reads about ``READ_TASK_BYTES`` (8 MiB) of consecutive reads: Ray's own
    sizing (1 MiB) made a task of every small file. Fewer tasks where Ray asks for fewer, never
    more than reads, and the reads in their order."""
    paths = [f"/x/{i:03d}.jsonl" for i in range(len(file_mib))]
    sizes = {path: int(mib * MIB) for path, mib in zip(paths, file_mib, strict=True)}
    source = RowFileDatasource(
        [FileRead(p) for p in paths], format="jsonl", dataset="d", text_split="paragraph",
        sizes=sizes,
    )  # fmt: skip
    tasks = source.get_read_tasks(parallelism)
    assert [len(task.metadata.input_files) for task in tasks] == files_per_task
    assert [f for task in tasks for f in task.metadata.input_files] == paths


def test_an_order_seed_reads_the_files_in_a_seeded_random_order(monkeypatch):
    """``order_seed`` (each stream pass's own) permutes the files read, the same for the same
    seed; without one they are read as listed."""
    files = tuple(f"/x/{i}.jsonl" for i in range(8))
    orders = []
    monkeypatch.setattr(
        sources, "read_file_list", lambda spec, reads, **_: orders.append([r.path for r in reads])
    )
    for seed in (None, 1, 1, 2):
        read_dataset(SimpleNamespace(format="jsonl", files=files), order_seed=seed)
    plain, one, again, two = orders
    assert plain == list(files) and sorted(one) == list(files)
    assert one == again and one != plain and two != one


def test_an_order_seed_shuffles_a_hugging_face_datasets_blocks(monkeypatch):
    seeds = []

    class Rows:
        def randomize_block_order(self, seed):
            seeds.append(seed)
            return "shuffled"

    monkeypatch.setattr(sources, "_read_huggingface", lambda spec: Rows())
    spec = SimpleNamespace(format=HF)
    assert isinstance(read_dataset(spec), Rows) and seeds == []
    assert read_dataset(spec, order_seed=7) == "shuffled" and seeds == [7]


def test_a_saved_dataset_dict_gives_the_configured_split(tmp_path):
    import datasets

    train, test = (datasets.Dataset.from_list(rows) for rows in (ROWS, ROWS[:1]))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "hf"))
    loaded = load_huggingface(_spec(tmp_path, "hf", format="hf", split="test"))
    assert isinstance(loaded, datasets.Dataset) and loaded.to_list() == ROWS[:1]
