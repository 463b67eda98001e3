"""rayjobs inspect: its figures are export's on the same config, its length percentiles a numpy
reference's, its PNG has a panel per dataset plus the fill panel, its preview marks exactly the
trained tokens, and --limit reads exactly the first N rows of each dataset.

Three data-side runs on one local Ray (real Alpaca, hh-rlhf chat and a small file of Alpaca rows
with bad ones, GPT-2, seq_len 256, one epoch): ``rayjobs inspect --json --plot`` through the CLI,
``export`` of the same config, and ``inspect --limit``. The config has no warm-up lane and one
packer window per epoch, so packing is the same in every run (bins depend only on the lengths)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ALPACA, GPT2, HH_CHAT, ROOT
from rayjobs.config import config_from_dict, load_config
from rayjobs.data.formats import parse_rows
from rayjobs.data.tokenize import Tokenize
from rayjobs.job import inspection
from rayjobs.job import limit as limits
from rayjobs.job import report as reports
from rayjobs.job.export import export

SEQ_LEN = 256
LIMIT = 40
HELD_OUT = ROOT / "configs" / "data" / "eval" / "hh_rlhf_harmless_chosen.last60.messages.jsonl"
"""The config's eval set (60 rows): packed and reported apart from the training datasets."""
TIMERS = ("seconds", "cpu_seconds")


def _bad_file(path: Path) -> dict[int, str]:
    """30 JSONL rows of real Alpaca records (reworded, so no sample equals one of the alpaca
    dataset), 4 of them bad: two torn lines (bad to the parser), an empty and a missing output (bad
    to the template). Returns the rows that parse, by line number."""
    records = [
        {**r, "instruction": f"Briefly: {r['instruction']}"}
        for r in json.loads(ALPACA.read_text())[:26]
    ]
    lines, good = [], {}
    bad = {3: '{"instruction": "torn', 10: '{"instruction": ', 17: None, 25: None}
    for number in range(1, 31):
        if number in bad:
            if bad[number] is not None:
                lines.append(bad[number])
                continue
            record = {"instruction": "Say hi.", "input": ""}
            if number == 17:
                record["output"] = "   "
            lines.append(json.dumps(record))  # empty_field (17), missing_field (25)
        else:
            record = records.pop()
            lines.append(json.dumps(record))
        good[number] = lines[-1]
    path.write_text("\n".join(lines) + "\n")
    return good


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inspect")
    good = _bad_file(folder / "bad.jsonl")
    raw = {
        "datasets": [
            {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
            {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            {
                "name": "bad",
                "source": str(folder / "bad.jsonl"),
                "template": "alpaca",
                "on_bad_row": "skip",
            },
        ],
        "eval": {"datasets": [{"name": "held_out", "source": str(HELD_OUT), "template": "chat"}]},
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": SEQ_LEN, "warmup_tokens": 0},
        "train": {"epochs": 1},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))
    return folder, config_from_dict(raw, base_dir=ROOT), good


@pytest.fixture(scope="module")
def inspected(ray_local, setup):
    """``rayjobs inspect CONFIG --json --plot OUT.png`` through the CLI: (stdout, report)."""
    from rayjobs.cli import main

    folder, _, _ = setup
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["inspect", str(folder / "config.yaml"), "--json", "--plot", str(folder / "plot.png")]
        )
    assert code == 0
    stdout = out.getvalue()
    return stdout, json.loads(stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def exported(ray_local, setup):
    folder, config, _ = setup
    return export(config, folder / "export"), folder / "export"


@pytest.mark.e2e
def test_inspect_json_equals_export(inspected, exported):
    stdout, report = inspected
    manifest, _ = exported
    lines = stdout.splitlines()  # the text report, then the JSON object as the last line
    assert lines[0].startswith("inspect: 1 epoch(s), seq_len 256") and len(lines) > 10
    assert any(line.startswith("packs ") and "packing efficiency" in line for line in lines)
    assert set(report["datasets"]) == set(manifest["datasets"]) == {"alpaca", "hh_chat", "bad"}
    for name, counts in manifest["datasets"].items():
        assert {key: report["datasets"][name][key] for key in counts} == counts, name
    assert {key: report["packed"][key] for key in manifest["packed"]} == manifest["packed"]
    assert len(report["epochs"]) == len(manifest["epochs"]) == 1
    for mine, theirs in zip(report["epochs"], manifest["epochs"]):
        assert mine["mix"] == theirs["mix"]
        assert mine["packs"] == {k: v for k, v in theirs["packs"].items() if k not in TIMERS}
    # guards: the comparison covers real work, skips by reason and truncation included
    bad = report["datasets"]["bad"]
    assert (bad["rows"], bad["skipped_rows"], bad["samples"]) == (30, 4, 26)
    assert bad["skipped_by_reason"] == {"invalid_json": 2, "empty_field": 1, "missing_field": 1}
    assert report["datasets"]["alpaca"]["truncated_tokens"] > 0
    # samples per pack from the rows read back agree with the ledger's documents and packs
    packed = report["packed"]
    documents = sum(s["samples"] for s in report["datasets"].values())
    assert packed["samples_per_pack"]["mean"] == pytest.approx(documents / packed["num_packs"])
    assert packed["fill"]["mean"] == pytest.approx(packed["efficiency"])
    # the encoder tokenizer.backend auto came to at start-up, reported by both and shown
    assert report["tokenizer"]["backend"] == manifest["tokenizer"]["backend"] == "fastokens"
    assert report["tokenizer"]["rows"] > 0
    assert "tokenizer: encoded by fastokens (fastokens is installed, loads" in stdout


@pytest.mark.e2e
def test_eval_sets_are_packed_apart_reported_and_exported_whole(inspected, exported, setup):
    """``eval.datasets``: inspect reports them apart from the training datasets (their own
    counts and packs, never in the training figures) and export writes their packed rows to
    ``_validation/`` with the same counts in its manifest; every held-out sample is in those rows
    exactly once, as the Tokenize stage makes it in-process."""
    from conftest import file_tables

    stdout, report = inspected
    manifest, out = exported
    _, config, _ = setup
    evaluation = manifest["eval"]
    assert evaluation["path"] == "_validation"
    assert report["eval"]["datasets"] == evaluation["datasets"]
    assert {k: report["eval"]["packed"][k] for k in evaluation["packed"]} == evaluation["packed"]
    assert "held_out" not in report["datasets"] and "held_out" not in manifest["datasets"]
    assert any(line.startswith("eval (held out): packs ") for line in stdout.splitlines())
    table = pq.read_table(out / "_validation")
    assert "epoch" not in table.column_names
    assert table.num_rows == evaluation["packed"]["num_packs"] >= 2
    assert sum(table.column("num_tokens").to_pylist()) == evaluation["packed"]["num_tokens"]
    packed = []
    for ids, documents, used in zip(
        table.column("input_ids").to_pylist(),
        table.column("document_ids").to_pylist(),
        table.column("num_tokens").to_pylist(),
    ):
        ids, documents = np.asarray(ids[:used]), np.asarray(documents[:used])
        packed += [tuple(ids[documents == d].tolist()) for d in np.unique(documents)]
    tokenize = Tokenize(config.eval.datasets, config.tokenizer, SEQ_LEN, "truncate")
    tables = file_tables(HELD_OUT.read_bytes(), str(HELD_OUT), format="jsonl", dataset="held_out")
    samples = tokenize(pa.concat_tables(list(tables))).column("input_ids").to_pylist()
    assert len(samples) == evaluation["datasets"]["held_out"]["samples"] == 60
    assert sorted(packed) == sorted(tuple(ids) for ids in samples)  # each exactly once
    assert len(packed) > table.num_rows  # guard: rows hold several held-out samples


def _document_lengths(out: Path) -> np.ndarray:
    """Every packed document's length in an export, from document_ids (padding left out)."""
    table = pq.read_table(out / "train")
    documents = np.stack(table.column("document_ids").to_numpy(zero_copy_only=False))
    tokens = table.column("num_tokens").to_numpy()
    lengths = []
    for row, used in zip(documents, tokens):
        lengths += np.bincount(row[:used]).tolist()
    return np.array(lengths)


def _reference_lengths(config, good_bad_rows: dict[int, str]) -> dict[str, np.ndarray]:
    """Each dataset's sample lengths, tokenized in-process (no Ray, no rayjobs reader)."""
    tokenize = Tokenize(config.datasets, config.tokenizer, SEQ_LEN, "truncate")
    records = {
        "alpaca": [json.dumps(r) for r in json.loads(ALPACA.read_text())],
        "hh_chat": HH_CHAT.read_text().splitlines(),
        "bad": list(good_bad_rows.values()),
    }
    lengths = {}
    for name, rows in records.items():
        table = pa.table(
            {
                "_dataset": [name] * len(rows),
                "_path": ["reference"] * len(rows),
                "_row": list(range(len(rows))),
                "_record": rows,
                "_skip": pa.nulls(len(rows), pa.string()),
            }
        )
        lengths[name] = tokenize(table).column("num_tokens").to_numpy()
    return lengths


@pytest.mark.e2e
def test_length_percentiles_equal_a_numpy_reference(inspected, exported, setup):
    _, report = inspected
    _, out = exported
    _, config, good = setup
    reference = _reference_lengths(config, good)
    # the reference lengths are the packed documents' lengths, all datasets together
    packed = np.sort(_document_lengths(out))
    assert np.array_equal(np.sort(np.concatenate(list(reference.values()))), packed)
    for name, lengths in reference.items():
        stats = report["datasets"][name]["length"]
        p50, p95 = np.percentile(lengths, [50, 95])
        assert stats["samples"] == len(lengths) == report["datasets"][name]["samples"]
        assert (stats["p50"], stats["p95"], stats["max"]) == (p50, p95, lengths.max()), name
    assert report["datasets"]["alpaca"]["length"]["max"] == SEQ_LEN  # truncated samples count
    assert report["datasets"]["bad"]["length"]["samples"] == 26  # good rows only


def _panels(png: Path, least: int = 20) -> int:
    """Panels in a PNG written by ``reports.plot``: rectangles of the axes' background
    colour, counted band by band (a band of image rows, then runs of columns within it), at least
    ``least`` pixels each way."""
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB"))
    colour = np.array([int(reports.AXES_COLOR[i : i + 2], 16) for i in (1, 3, 5)])
    mask = (image == colour).all(axis=-1)

    def runs(flags: np.ndarray) -> list[tuple[int, int]]:
        edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(int), [0]])))
        return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= least]

    return sum(len(runs(mask[top:bottom].any(axis=0))) for top, bottom in runs(mask.any(axis=1)))


@pytest.mark.e2e
def test_png_has_one_panel_per_dataset_plus_the_fill_panel(inspected, setup):
    from PIL import Image

    _, report = inspected
    folder, _, _ = setup
    png = folder / "plot.png"
    assert report["plot"]["path"] == str(png)
    titles = ["alpaca: sample length", "hh_chat: sample length", "bad: sample length", "pack fill"]
    assert report["plot"]["panels"] == titles
    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG"
    with Image.open(png) as image:
        assert image.size == (3 * 420, 2 * 320)  # 4 panels: 3 columns, 2 rows
    assert _panels(png) == 4


@pytest.mark.parametrize("datasets", [1, 5])
def test_plot_draws_one_panel_per_dataset_and_the_fill(tmp_path, datasets):
    lengths = {f"set{i}": np.arange(1, 50 + 10 * i) for i in range(datasets)}
    titles = reports.plot(lengths, np.array([0.5, 0.9, 1.0]), 64, tmp_path / "p.png")
    assert titles == [f"set{i}: sample length" for i in range(datasets)] + ["pack fill"]
    assert _panels(tmp_path / "p.png") == datasets + 1


def test_preview_marks_the_trained_tokens():
    vocab = {1: "Q:", 2: " hi", 3: " A:", 4: " yo", 5: "<eos>", 6: "text", 7: " more", 0: "<pad>"}
    row = {  # two documents and padding; labels shifted per document (labels[t] targets t + 1)
        "input_ids": np.array([1, 2, 3, 4, 5, 6, 7, 5, 0, 0]),
        "labels": np.array([-100, -100, 4, 5, -100, 7, 5, -100, -100, -100]),
        "document_ids": np.array([0, 0, 0, 0, 0, 1, 1, 1, 2, 2]),
        "num_tokens": 8,
        "epoch": 0,
    }
    shown = reports.preview(row, lambda ids: "".join(vocab[i] for i in ids), [["alpaca"], ["c4"]])
    assert reports.format_preview(shown) == (
        "── document 0 (alpaca): 5 tokens, 2 trained\n"
        "Q: hi A:⟦ yo<eos>⟧\n"
        "── document 1 (c4): 3 tokens, 2 trained\n"
        "text⟦ more<eos>⟧\n"
        "── padding: 2 tokens"
    )
    assert shown["trained_tokens"] == 4 == (row["labels"] != -100).sum()


@pytest.mark.e2e
def test_preview_of_a_real_packed_row(inspected):
    _, report = inspected
    shown = report["preview"]
    assert shown["num_documents"] == report["packed"]["samples_per_pack"]["max"] >= 2
    assert shown["trained_tokens"] == sum(d["trained_tokens"] for d in shown["documents"]) > 0
    assert shown["num_tokens"] + shown["padding"] == SEQ_LEN
    checked = []
    for document in shown["documents"]:
        assert len(document["source"]) == 1, document  # found among the tokenized samples
        if document["source"] == ["hh_chat"]:
            assert "<|im_start|>assistant\n⟦" in document["text"]
            checked.append("hh_chat")
        elif "### Response:\n" in document["text"] and document["tokens"] < SEQ_LEN:
            assert "### Response:\n⟦" in document["text"]  # the prompt is not trained
            assert document["text"].endswith("<|endoftext|>⟧")  # the response and EOS are
            checked.append("alpaca")
    assert checked, "guard: the preview held a document whose trained span was checked"


@pytest.mark.e2e
def test_limit_reads_exactly_the_first_rows_of_each_dataset(ray_local, setup):
    _, config, _ = setup
    report = inspection.inspect(config, limit=LIMIT)
    rows = {name: stats["rows"] for name, stats in report["datasets"].items()}
    assert rows == {"alpaca": LIMIT, "hh_chat": LIMIT, "bad": 30}  # bad has 30 rows in all
    assert report["eval"]["datasets"]["held_out"]["rows"] == LIMIT  # of its 60
    for stats in report["datasets"].values():
        assert stats["samples"] + stats["skipped_rows"] == stats["rows"]
        assert stats["length"]["samples"] == stats["samples"]
    assert report["limit"] == LIMIT
    assert report["packed"]["num_tokens"] == sum(s["tokens"] for s in report["datasets"].values())


def _first_rows(path: Path, fmt: str, count: int | None = None, text_split="paragraph"):
    data = pa.input_stream(str(path), compression="detect").read()  # decompressed by extension
    parsed = parse_rows(
        data, str(path), format=fmt, dataset="d", text_split=text_split, on_bad_row="skip",
    )  # fmt: skip
    rows = sorted(
        [(row, record) for row, record in zip(parsed.rows, parsed.records)]
        + [(bad.row, bad.reason) for bad in parsed.bad]
    )
    return rows[:count] if count is not None else rows


def _formats(folder: Path) -> dict[str, tuple[Path, str]]:
    """One small file per format, each with 9 rows (some bad where the format can have them)."""
    records = [{"text": f"row {i}", "n": str(i)} for i in range(9)]
    files = {
        "jsonl": "\n".join(json.dumps(r) if i != 4 else "{torn" for i, r in enumerate(records)),
        "json": json.dumps(records),
        "csv": "\n\ntext,n\n"  # blank lines before the header are passed over
        + "".join(f'"{r["text"]}\nline two",{r["n"]}\n' for r in records[:5])
        + "a,b,c\n"
        + "".join(f"{r['text']},{r['n']}\n\n" for r in records[6:]),
        "text": "\n\n".join(f"{r['text']}\nsecond line" for r in records) + "\n",
    }
    out = {}
    for fmt, text in files.items():
        (folder / f"data.{fmt if fmt != 'text' else 'txt'}").write_text(text)
        out[fmt] = (folder / f"data.{fmt if fmt != 'text' else 'txt'}", fmt)
    pq.write_table(pa.Table.from_pylist(records), folder / "data.parquet")
    out["parquet"] = (folder / "data.parquet", "parquet")
    # compressed files are read decompressed (cut into a decompressed copy): a gzip file's bytes
    # were once counted as its "lines"
    for name, codec, suffix in (("jsonl", "gzip", ".gz"), ("csv", "zstd", ".zst"),
                                ("text", "bz2", ".bz2"), ("parquet", "gzip", ".gz")):  # fmt: skip
        plain, fmt = out[name]
        packed = plain.with_name(plain.name + suffix)
        with pa.output_stream(str(packed), compression=codec) as stream:
            stream.write(plain.read_bytes())
        out[f"{name}_{codec}"] = (packed, fmt)
    return out


@pytest.mark.parametrize("limit", [1, 5, 9, 20])
def test_limit_cuts_every_format_at_exactly_the_first_rows(tmp_path, limit):
    files = _formats(tmp_path)
    raw = {
        "datasets": [
            {"name": fmt, "source": str(path), "template": "text", "on_bad_row": "skip"}
            for fmt, (path, _) in files.items()
        ],
        "tokenizer": {"path": str(GPT2)},
    }
    config = config_from_dict(raw, base_dir=ROOT)
    limited = limits.limit_config(config, limit, tmp_path / "limited")
    for spec in limited.datasets:
        original, fmt = files[spec.name]
        assert len(_first_rows(original, fmt)) == 9, "guard: 9 rows in every file"
        (path,) = spec.files
        if limit >= 9:
            assert path == str(original)  # the whole file, read in place
        assert _first_rows(Path(path), fmt) == _first_rows(original, fmt, limit), fmt


def test_limit_cuts_a_json_list_keeping_its_bad_text_bad(tmp_path):
    """An escaped lone surrogate (once a UnicodeEncodeError) and a byte that is not UTF-8 stay
    the same bad rows in the cut file."""
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"text": "a\\ud800"}, {"text": "caf\xe9"}, {"text": "ok"}, {"text": "x"}]')
    raw = {
        "datasets": [{"name": "j", "source": str(path), "template": "text", "on_bad_row": "skip"}],
        "tokenizer": {"path": str(GPT2)},
    }
    limited = limits.limit_config(config_from_dict(raw, base_dir=ROOT), 3, tmp_path / "cut")
    (cut,) = limited.datasets[0].files
    assert _first_rows(Path(cut), "json") == _first_rows(path, "json", 3)
    assert [row[1] for row in _first_rows(path, "json", 2)] == ["invalid_utf8"] * 2, "guard"


def test_limit_takes_whole_files_then_cuts_one(tmp_path):
    for part in range(3):
        lines = [json.dumps({"text": f"file {part} row {i}"}) for i in range(4)]
        (tmp_path / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    raw = {
        "datasets": [{"name": "d", "source": str(tmp_path / "*.jsonl"), "template": "text"}],
        "tokenizer": {"path": str(GPT2)},
    }
    config = config_from_dict(raw, base_dir=ROOT)
    files = limits.limit_config(config, 6, tmp_path / "limited").datasets[0].files
    assert files[0] == str(tmp_path / "part-0.jsonl") and len(files) == 2
    assert Path(files[1]).read_text().splitlines() == [
        json.dumps({"text": "file 1 row 0"}),
        json.dumps({"text": "file 1 row 1"}),
    ]


def test_limit_cuts_a_hugging_face_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(10)]}).save_to_disk(
        str(tmp_path / "hf")
    )
    raw = {
        "datasets": [
            {"name": "d", "source": str(tmp_path / "hf"), "format": "hf", "template": "text"}
        ],
        "tokenizer": {"path": str(GPT2)},
    }
    config = config_from_dict(raw, base_dir=ROOT)
    spec = limits.limit_config(config, 3, tmp_path / "limited").datasets[0]
    assert datasets.load_from_disk(spec.source)["text"] == ["row 0", "row 1", "row 2"]


def test_length_and_pack_stats_are_numpy_percentiles():
    lengths = np.array([5, 1, 9, 3, 7, 256, 2])
    assert reports.length_stats(lengths) == {
        "samples": 7,
        "mean": float(lengths.mean()),
        "p50": float(np.percentile(lengths, 50)),
        "p95": float(np.percentile(lengths, 95)),
        "max": 256,
    }
    stats = reports.pack_stats(np.array([8, 6, 8, 2]), np.array([3, 1, 2, 1]), seq_len=8)
    assert stats["samples_per_pack"] == {"mean": 1.75, "p50": 1.5, "max": 3}
    assert stats["fill"]["min"] == 0.25 and stats["fill"]["mean"] == 0.75


def test_cli_refuses_a_bad_limit_or_plot_before_any_job(tmp_path, monkeypatch, capsys):
    import sys

    from rayjobs.cli import main

    def no_job(*args, **kwargs):
        raise AssertionError("the job started")

    monkeypatch.setattr("rayjobs.job.inspection.inspect", no_job)
    config = str(ROOT / "configs" / "demo.yaml")
    assert main(["inspect", config, "--limit", "0"]) == 2
    assert "--limit must be a positive number of rows" in capsys.readouterr().err
    assert main(["inspect", config, "--plot", str(tmp_path / "missing" / "p.png")]) == 2
    assert "no such folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["inspect", config, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'rayjobs[plot]'" in capsys.readouterr().err


def test_overrides_reach_inspect(monkeypatch):
    from rayjobs.cli import main

    seen = {}

    def fake_inspect(config, limit=None, plot_path=None, runner="auto"):
        seen.update(config=config, limit=limit, runner=runner)
        raise SystemExit(0)

    monkeypatch.setattr("rayjobs.job.inspection.inspect", fake_inspect)
    argv = ["--limit", "7", "train.epochs=1", "--runner", "local"]
    with pytest.raises(SystemExit):
        main(["inspect", str(ROOT / "configs" / "demo.yaml"), *argv])
    assert seen["limit"] == 7 and seen["config"].train.epochs == 1 and seen["runner"] == "local"
    expected = load_config(ROOT / "configs" / "demo.yaml", ["train.epochs=1"])
    assert seen["config"] == expected
