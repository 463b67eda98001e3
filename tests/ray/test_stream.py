"""The streaming path: the per-window packer places every sample of every window, the Ray
adapter keeps epochs apart and counts exactly, and weights set each dataset's reads per epoch."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ALPACA, GPT2, GPTEACHER, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.data import estimate, mix, packer, reads, stream
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.data.samples import TOKEN_LIST


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=300),
    strategy=st.sampled_from(["bfd", "ffd", "first_fit", "next_fit"]),
    seed=st.integers(0, 2**16),
)
def test_pack_batch_places_every_sample_once(lengths, strategy, seed):
    lengths = np.array(lengths, dtype=np.int64)
    packs = packer.pack_batch(lengths, 64, strategy, np.random.default_rng(seed))
    placed = np.concatenate(packs) if packs else np.empty(0, dtype=np.int64)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert all(lengths[p].sum() <= 64 and len(p) for p in packs)


def test_pack_batch_is_tight_on_real_lengths():
    """One window of real-like lengths: at most one more row than the lower bound."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / 300, 5000), 2048)
    packs = packer.pack_batch(lengths, 2048, "bfd", rng)
    lower = -(-lengths.sum() // 2048)
    assert lower <= len(packs) <= lower + 1


def _samples(epoch_of: list[int]) -> pa.Table:
    """Tokenized samples as the Tokenize stage emits them, with the stream's epoch tag."""
    rng = np.random.default_rng(1)
    ids = [rng.integers(1, 1000, int(rng.integers(1, 40))).astype(np.int32) for _ in epoch_of]
    labels = [np.append(x[1:], IGNORE_INDEX).astype(np.int32) for x in ids]
    return pa.table(
        {
            "input_ids": pa.array(ids, type=TOKEN_LIST),
            "labels": pa.array(labels, type=TOKEN_LIST),
            "source": ["a" if i % 3 else "b" for i in range(len(ids))],
            "uid": pa.array(np.arange(len(ids)) * 7 + 11, type=pa.int64()),
            "num_tokens": pa.array([len(x) for x in ids], type=pa.int32()),
            "_epoch": pa.array(epoch_of, type=pa.int32()),
        }
    )


def test_pack_stream_keeps_epochs_apart_and_counts_each(fake_ledger):
    """A window that straddles an epoch boundary packs each epoch's samples into its own rows."""
    epoch_of = [0] * 70 + [1] * 50
    batch = _samples(epoch_of)
    rows = packer.PackStream(seq_len=64, strategy="bfd", pad_id=0, seed=0, ledger=fake_ledger)(
        batch
    )
    assert set(rows["epoch"].tolist()) == {0, 1}
    documents = {0: [], 1: []}
    for row in range(len(rows["epoch"])):
        for doc in range(rows["num_documents"][row]):
            where = rows["document_ids"][row] == doc
            documents[int(rows["epoch"][row])].append(tuple(rows["input_ids"][row][where]))
    for epoch in (0, 1):
        mine = batch.filter(pa.compute.equal(batch["_epoch"], epoch))
        assert sorted(documents[epoch]) == sorted(tuple(x) for x in mine["input_ids"].to_pylist())
    counts = {epoch: counts for epoch, counts, _key, _per_pack in fake_ledger.calls}
    assert len({key for _, _, key, _ in fake_ledger.calls}) == 2  # one identity per epoch's part
    for epoch, _, _, per_pack in fake_ledger.calls:  # the samples-per-pack histogram's values
        assert per_pack == rows["num_documents"][rows["epoch"] == epoch].tolist()
        assert sum(per_pack) == counts[epoch].num_documents
    assert sorted(counts) == [0, 1]
    assert counts[0].num_documents == 70 and counts[1].num_documents == 50
    assert counts[1].documents_by_source == {"a": 34, "b": 16}  # b: rows 72, 75, ..., 117
    for epoch, c in counts.items():
        mine = rows["epoch"] == epoch
        assert c.num_packs == mine.sum()
        assert c.num_tokens == rows["num_tokens"][mine].sum()
    assert (rows["num_documents"] >= 2).any(), "guard: rows hold several documents"


def _config(**extra):
    datasets = [
        {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
        {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
        {
            "name": "roleplay",
            "source": str(GPTEACHER),
            "template": "alpaca",
            "column_map": {"output": "response"},
        },
    ]
    weights = extra.pop("weights", None)
    for spec, weight in zip(datasets, weights or [], strict=False):
        spec["weight"] = weight
    return config_from_dict(
        {"datasets": datasets, "tokenizer": {"path": str(GPT2)}, **extra}, base_dir=ROOT
    )


# (weights, mix, sizes (rows, mean tokens) per dataset) → reads per epoch
FRACTIONS = {
    "no_weights": (None, {"by": "tokens"}, [(100, 10.0), (50, 40.0), (10, 1.0)], [1.0, 1.0, 1.0]),
    # by samples: 160 samples, shares 80/48/32 of 100/50/10 rows
    "by_samples": ([0.5, 0.3, 0.2], {"by": "samples"}, [(100, 10.0), (50, 40.0), (10, 1.0)],
                   [0.8, 0.96, 3.2]),
    # by tokens: 1000 + 2000 + 10 = 3010 tokens; shares 1505/903/602 of 1000/2000/10 tokens
    "by_tokens": ([0.5, 0.3, 0.2], {"by": "tokens"}, [(100, 10.0), (50, 40.0), (10, 1.0)],
                  [1.505, 0.4515, 60.2]),
    # an epoch size without weights: every dataset in its natural proportion, 1505 of 3010
    # tokens (once ignored in stream mode: every epoch read everything)
    "epoch_tokens_no_weights": (None, {"by": "tokens", "epoch_tokens": 1505},
                                [(100, 10.0), (50, 40.0), (10, 1.0)], [0.5, 0.5, 0.5]),
    "epoch_samples_no_weights": (None, {"by": "samples", "epoch_samples": 480},
                                 [(100, 10.0), (50, 40.0), (10, 1.0)], [3.0, 3.0, 3.0]),
    "epoch_tokens_weighted": ([0.5, 0.3, 0.2], {"by": "tokens", "epoch_tokens": 301},
                              [(100, 10.0), (50, 40.0), (10, 1.0)], [0.1505, 0.04515, 6.02]),
}  # fmt: skip


@pytest.mark.parametrize(("weights", "mix_config", "sizes", "expected"), FRACTIONS.values(),
                         ids=FRACTIONS)  # fmt: skip
def test_epoch_fractions(weights, mix_config, sizes, expected):
    config = _config(weights=weights, mix=mix_config)
    estimates = {
        spec.name: estimate.Estimate(mean_tokens=mean, rows=rows)
        for spec, (rows, mean) in zip(config.datasets, sizes, strict=True)
    }
    assert mix.epoch_fractions(config, estimates) == pytest.approx(expected)
    assert mix.sized(config) == (expected != [1.0, 1.0, 1.0])  # budgets trim to the shares


def test_a_dataset_of_bad_and_dropped_rows_is_sized_in_samples(tmp_path):
    """Of every 4 raw rows 2 make samples, 1 is torn JSON (skipped by the parser) and 1 has an
    empty output (skipped by the template): 0.5 samples per raw row, measured on the head. A
    weighted mix sizes the dataset by it: in raw rows it was read for 75 samples of its 125."""
    import json

    good = json.dumps({"instruction": "Say hi.", "output": "Hi!"})
    empty = json.dumps({"instruction": "Say hi.", "output": " "})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{good}\n{good}\n{{"torn\n{empty}\n' for _ in range(250)))
    config = config_from_dict(
        {
            "datasets": [
                {"name": "a", "source": str(path), "template": "alpaca", "on_bad_row": "skip"},
                {"name": "b", "source": str(path), "template": "alpaca", "on_bad_row": "skip"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "allow_duplicate_sources": True,
        }
    )
    found = estimate.estimate(config)["a"]
    assert found.samples_per_row == pytest.approx(0.5)
    assert found.rows_per_byte * path.stat().st_size == pytest.approx(1000, rel=0.01)
    weighted = _config(weights=[0.5, 0.25, 0.25], mix={"by": "samples"})
    sized = {  # 100 raw rows each: 50 + 100 + 100 samples, shares 125 / 62.5 / 62.5
        spec.name: estimate.Estimate(1.0, rows=100, samples_per_row=0.5 if i == 0 else 1.0)
        for i, spec in enumerate(weighted.datasets)
    }
    fractions = mix.epoch_fractions(weighted, sized)
    assert fractions == pytest.approx([2.5, 0.625, 0.625])
    budgets = mix.budgets(weighted, sized, fractions)  # what the ledger trims each read to
    shares = [budgets[(0, spec.name)] for spec in weighted.datasets]
    assert shares == pytest.approx([125, 62.5, 62.5])


def test_a_hugging_face_dataset_is_sized_by_its_rows_without_weights(ray_local, tmp_path):
    """Unweighted streams interleave in the ratio of their rows: a Hugging Face dataset (no
    files to size it by) counted as 1 row, and its rows came after the file datasets' whole
    stream, every epoch of it."""
    import datasets

    records = json.loads(ALPACA.read_text())[:120]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    specs = [
        {"name": "file", "source": str(ALPACA), "template": "alpaca"},
        {"name": "hub", "source": str(tmp_path / "hf"), "format": "hf", "template": "alpaca"},
    ]
    config = config_from_dict({"datasets": specs, "tokenizer": {"path": str(GPT2)}})
    estimates = estimate.estimate(config)
    assert estimates["hub"].rows == 120 and estimates["hub"].rows_hint == 120
    assert estimates["file"].rows is None  # a file dataset is sized by its bytes, uncounted
    hint = estimates["file"].rows_hint
    assert hint == pytest.approx(len(json.loads(ALPACA.read_text())), rel=0.2)


def test_a_hugging_face_datasets_uids_and_subsample_do_not_depend_on_its_folder(
    ray_local, tmp_path
):
    """The same saved Hugging Face dataset in two folders: the same sample uids (planned mode's
    mixing plans) and the same rows in a subsampled pass, as for a file dataset. Its rows'
    ``_path`` names the folder, and both once followed it."""
    import datasets

    from rayjobs.data.formats import HF_PLACE
    from rayjobs.data.sources import read_dataset
    from rayjobs.job.pipeline import tokenize

    records = json.loads(ALPACA.read_text())[:50]
    uids, kept, by_path = [], [], []
    for where in ("one", "two"):
        folder = tmp_path / where / "hf"
        datasets.Dataset.from_list(records).save_to_disk(str(folder))
        spec = {"name": "hub", "source": str(folder), "format": "hf", "template": "alpaca"}
        config = config_from_dict({"datasets": [spec], "tokenizer": {"path": str(GPT2)}})
        uids.append(sorted(row["uid"] for row in tokenize(config).take_all()))
        table = pa.Table.from_pylist(read_dataset(config.datasets[0]).take_all())
        kept.append(reads._subsample(table, 0.5, 3, place=HF_PLACE).column("_row").to_pylist())
        by_path.append(reads._subsample(table, 0.5, 3).column("_row").to_pylist())
    assert len(uids[0]) == 50 and uids[0] == uids[1]
    assert 0 < len(kept[0]) < 50 and sorted(kept[0]) == sorted(kept[1])
    assert sorted(by_path[0]) != sorted(by_path[1])  # guard: named by its folder, they differ


def test_a_dataset_whose_head_the_template_skips_whole_is_sized_from_a_longer_one(
    tmp_path, monkeypatch
):
    """A folder whose first file's rows all lack the template's field (skipped, counted) and
    whose second file is good: start-up reads a longer head rather than refusing to stream a
    dataset that planned mode reads, and sizes it from what it found (half its rows make
    samples). A dataset that makes no sample at all is still refused, naming it."""
    monkeypatch.setattr(estimate, "SAMPLE_ROWS", 16)  # the head: 16 good rows, not 2048
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"content": f"r{i}"}) + "\n" for i in range(40))
    )
    (folder / "b.jsonl").write_text(
        "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(40))
    )
    spec = {"name": "d", "source": str(folder), "template": "text", "on_bad_row": "skip"}
    config = config_from_dict({"datasets": [spec], "tokenizer": {"path": str(GPT2)}})
    found = estimate.estimate(config)["d"]
    assert found.samples_per_row == pytest.approx(0.5) and found.mean_tokens > 0
    (folder / "b.jsonl").unlink()
    config = config_from_dict({"datasets": [spec], "tokenizer": {"path": str(GPT2)}})
    with pytest.raises(
        ValueError, match=r"dataset 'd': every row read was bad .*\(missing_field 40\)"
    ):
        estimate.estimate(config)


def _sources_of_documents(config) -> dict[tuple[int, ...], str]:
    """Every sample's token ids → its dataset, from an in-process tokenization of the same rows."""
    from rayjobs.data.sources import read_dataset
    from rayjobs.data.tokenize import Tokenize

    tokenize = Tokenize(config.datasets, config.tokenizer, config.packing.seq_len, "truncate")
    table = pa.Table.from_pylist([r for s in config.datasets for r in read_dataset(s).take_all()])
    samples = tokenize(table)
    return {
        tuple(ids): source
        for ids, source in zip(
            samples["input_ids"].to_pylist(), samples["source"].to_pylist(), strict=True
        )
    }


@pytest.mark.e2e
def test_weighted_stream_realizes_its_shares(ray_local, monkeypatch):
    """0.5/0.3/0.2 by tokens on real data (#9, acceptance 7): each epoch's realized token shares
    within 1 point of the weights, and every tenth of an epoch's packed rows within 5 points,
    though one dataset is repeated and two subsampled. The packed rows arrive in blocks of about
    ``BLOCK_BYTES``, each packer call's rows cut into several (so ``streaming_split`` can hand
    the first rows to a rank at once)."""
    import ray
    from ray.data.block import BlockAccessor

    from rayjobs.job.pipeline import start_job

    monkeypatch.setattr(stream, "BLOCK_BYTES", 1 << 18)  # 16 rows of 1024 tokens a block

    config = _config(
        weights=[0.5, 0.3, 0.2],
        # Tenths of 160k tokens (~800 samples): a tenth's share is a sample of the stream, and
        # smaller tenths would be noisier than the 5 points asked of them.
        mix={"by": "tokens", "epoch_tokens": 1_600_000},
        packing={"seq_len": 1024, "window_tokens": 50_000, "warmup_tokens": 0},
        train={"epochs": 1},
    )
    job = start_job(config, prefix="test")
    blocks = [
        BlockAccessor.for_block(ray.get(entry.ref))
        for bundle in job.rows.iter_internal_ref_bundles()
        for entry in bundle.blocks
        if entry.metadata.num_rows  # (a packer call can hold no row of an epoch)
    ]
    rows = [row for block in blocks for row in block.iter_rows(public_row_format=True)]
    row_bytes = max(block.size_bytes() / block.num_rows() for block in blocks)
    assert max(block.size_bytes() for block in blocks) <= 1.5 * (1 << 18) + row_bytes
    calls = sum(c["calls"] for c in job.snapshot()["pack"].values())
    # uncut, a call's rows would be one block (or none)
    assert len(blocks) > 1.5 * calls, "guard: the packer calls' rows were cut into blocks"
    mixes = job.mixes(job.snapshot())
    assert len(mixes) == 1
    for epoch_mix in mixes:
        shares = [epoch_mix[name]["share"] for name in ("alpaca", "hh_chat", "roleplay")]
        assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.01), epoch_mix
    sources = _sources_of_documents(config)
    for epoch in (0,):
        mine = [r for r in rows if int(r["epoch"]) == epoch]
        for tenth in np.array_split(np.arange(len(mine)), 10):
            tokens = {"alpaca": 0, "hh_chat": 0, "roleplay": 0}
            for row in (mine[i] for i in tenth):
                n = int(row["num_tokens"])
                for doc in np.unique(row["document_ids"][:n]):
                    ids = tuple(row["input_ids"][:n][row["document_ids"][:n] == doc].tolist())
                    tokens[sources[ids]] += len(ids)
            total = sum(tokens.values())
            assert [tokens[name] / total for name in tokens] == pytest.approx(
                [0.5, 0.3, 0.2], abs=0.05
            ), (epoch, tokens)
    fractions = mix.epoch_fractions(config, estimate.estimate(config))
    assert all(f > 1 and not float(f).is_integer() for f in fractions), (
        "guard: every dataset read in whole passes and a subsample"
    )
    trimmed = sum(sum(c["trimmed_by_source"].values()) for c in job.snapshot()["pack"].values())
    assert trimmed > 0, "guard: the margin read beyond the shares was trimmed"


def test_estimate_sizes_datasets_from_their_heads_without_counting(ray_local, monkeypatch):
    """A weighted run starts without reading every row: each dataset is sized from its bytes and
    the rows per byte of its head (here the whole of each small file: the true counts), and no
    Ray dataset is counted."""
    from rayjobs.data import sources

    monkeypatch.setattr(sources.ray.data.Dataset, "count", _never_counted)
    config = _config(weights=[0.5, 0.3, 0.2])
    estimates = estimate.estimate(config)
    hints = {name: round(e.rows_hint) for name, e in estimates.items()}
    assert hints == {"alpaca": 300, "hh_chat": 400, "roleplay": 300}
    assert all(e.rows is None for e in estimates.values())
    assert dataclasses.asdict(estimates["alpaca"])["mean_tokens"] > 50


def _never_counted(self):
    raise AssertionError("a dataset was counted")


def test_subsample_keeps_the_same_rows_whatever_the_blocks():
    """A pass's subsample (``Pass.sample``) decides by (seed, file, row): the rows kept from a
    block are the rows kept from the whole, the fraction is met, and another seed keeps others."""
    table = pa.table({"_path": ["a.jsonl"] * 50_000 + ["b.jsonl"] * 50_000,
                      "_row": list(range(50_000)) * 2})  # fmt: skip
    kept = reads._subsample(table, 0.3, seed=7)
    assert kept.num_rows / table.num_rows == pytest.approx(0.3, abs=0.01)

    def keys(t):
        return set(zip(t["_path"].to_pylist(), t["_row"].to_pylist(), strict=True))

    blocks = [reads._subsample(table.slice(start, 7_001), 0.3, seed=7)
              for start in range(0, table.num_rows, 7_001)]  # fmt: skip
    assert set().union(*map(keys, blocks)) == keys(kept)
    other = keys(reads._subsample(table, 0.3, seed=8))
    assert 0.27 < len(other & keys(kept)) / len(other) < 0.33  # independent: P(kept) = 0.3


def test_subsample_is_the_same_wherever_the_dataset_lies():
    """The same files under two folders (two clones, two machines) keep the same rows for the
    same seed: files are named by their path under the dataset's folder (``files_root``); by
    absolute path (no root) the two would differ (guard)."""

    def kept(folder: str, root: str | None) -> list[tuple[str, int]]:
        files = [f"{folder}/data/part-0.jsonl", f"{folder}/data/sub/part-1.jsonl"]
        table = pa.table({"_path": [files[0]] * 500 + [files[1]] * 500,
                          "_row": list(range(500)) * 2})  # fmt: skip
        out = reads._subsample(table, 0.5, seed=3, root=root and reads.files_root(files))
        return [(p.removeprefix(folder), r) for p, r in zip(*out.to_pydict().values())]

    here, there = kept("/a/clone", "yes"), kept("/elsewhere/b", "yes")
    assert here == there and 400 < len(here) < 600
    assert kept("/a/clone", None) != kept("/elsewhere/b", None)
    assert reads.files_root(["/x/d/a.json", "/x/d/s/b.json"]) == "/x/d"
    assert reads.files_root(["/x/d/a.json"]) == "/x/d" and reads.files_root([]) is None


def test_start_up_parses_the_head_of_a_large_first_file_not_all_of_it(tmp_path, monkeypatch):
    """The driver's length estimate and warm-up split read a file's head a bounded part at a
    time: a torn line deep in a large file (here past the first 20 parts of 16 KiB) is not
    reached at start-up, where a whole-file parse fails on it (guard); the rows per byte come
    from the parts read."""
    import json

    from rayjobs.data.formats import parse_file, registry
    from rayjobs.errors import SourceError

    monkeypatch.setattr(registry, "CHUNK_BYTES", 16 * 1024)
    rows = [{"instruction": f"Say {i}.", "input": "", "output": "ok " * 20} for i in range(6000)]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"instruction": "torn\n')
    config = config_from_dict(
        {
            "datasets": [{"name": "big", "source": str(path), "template": "alpaca"}],
            "tokenizer": {"path": str(GPT2)},
        }
    )
    [spec] = config.datasets
    with pytest.raises(SourceError, match="big.jsonl"):
        parse_file(path.read_bytes(), str(path), format="jsonl", dataset="big")
    table, density, _, _ = estimate._head(spec)
    assert table.num_rows == estimate.SAMPLE_ROWS
    assert table.column("_row").to_pylist() == list(range(1, estimate.SAMPLE_ROWS + 1))
    per_row = len(json.dumps(rows[0])) + 1
    assert density == pytest.approx(1 / per_row, rel=0.05)
    head_rows, _, consumed, _ = estimate._parse_head(spec, str(path), 100)
    assert len(head_rows) > 100 and consumed < path.stat().st_size / 20


def test_a_compressed_first_file_is_parsed_decompressed(tmp_path):
    """A ``.gz`` file (``format: jsonl`` set, as its extension names no format) is decompressed
    at start-up as in the read tasks, and its rows per byte are per byte on disk."""
    import gzip
    import json

    rows = [{"instruction": f"Say {i}.", "input": "", "output": "ok " * 20} for i in range(3000)]
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    config = config_from_dict(
        {
            "datasets": [
                {"name": "big", "source": str(path), "template": "alpaca", "format": "jsonl"}
            ],
            "tokenizer": {"path": str(GPT2)},
        }
    )
    table, density, _, _ = estimate._head(config.datasets[0])
    assert table.num_rows == estimate.SAMPLE_ROWS
    assert json.loads(table.column("_record")[5].as_py()) == rows[5]
    assert density * path.stat().st_size == pytest.approx(len(rows), rel=0.1)


def _jsonl_dataset(tmp_path, rows_per_file: list[int]) -> tuple:
    """A file-based dataset spec of small JSONL files (``a0.jsonl``, ``a1.jsonl``, …)."""
    paths = []
    for i, n in enumerate(rows_per_file):
        path = tmp_path / f"a{i}.jsonl"
        path.write_text("".join(f'{{"text": "file {i} row {r}"}}\n' for r in range(n)))
        paths.append(str(path))
    spec = config_from_dict(
        {"datasets": [{"name": "a", "source": str(tmp_path / "*.jsonl"), "template": "text"}],
         "tokenizer": {"path": str(GPT2)}},
        base_dir=ROOT,
    ).datasets[0]  # fmt: skip
    return spec, paths


def test_a_runs_reads_of_a_dataset_are_its_passes_file_by_file(tmp_path):
    """``pass_reads``: every epoch's passes (here 2.5 reads an epoch: two whole, one half), each
    in its own file order, one read per file; the first epoch's first pass leaves the warm-up
    head out. Read in-process as a read task does (``read_files``), each whole pass holds every
    row once, the half pass about half, and the head's rows are in the warm-up read only."""
    from rayjobs.data.sources import read_files

    spec, paths = _jsonl_dataset(tmp_path, [300, 200])
    epoch_passes = [reads.passes(spec, 0, epoch, 0, 2.5) for epoch in range(2)]
    head = reads.Head(paths[1], below_row=41, rows=40)  # JSONL rows are 1-based line numbers
    plan = reads.pass_reads(spec, epoch_passes, head)
    got = [
        (r.epoch, r.copy, r.path[-8:], r.sample, r.from_row, r.root == str(tmp_path)) for r in plan
    ]
    first = [p[-8:] for p in epoch_passes[0][0].files]
    assert got == [
        (0, 0, first[0], None, 41 if first[0] == "a1.jsonl" else None, True),
        (0, 0, first[1], None, 41 if first[1] == "a1.jsonl" else None, True),
        *[(0, 1, p[-8:], None, None, True) for p in epoch_passes[0][1].files],
        *[(0, 2, p[-8:], 0.5, None, True) for p in epoch_passes[0][2].files],
        *[(1, c, p[-8:], [None, None, 0.5][c], None, True) for c in range(3)
          for p in epoch_passes[1][c].files],
    ]  # fmt: skip
    assert {tuple(r.files) for e in epoch_passes for r in e} == {
        tuple(paths),
        tuple(paths[::-1]),
    }, "guard: passes read the files in different orders"
    options = {"format": "jsonl", "dataset": "a", "text_split": "paragraph"}
    rows = pa.concat_tables(read_files(plan, options)).to_pylist()
    warm = pa.concat_tables(read_files([reads._head_read(spec, head, epoch_passes[0][0])], options))
    keys = {(r["_epoch"], r["_pass"]): [] for r in rows}
    for r in rows:
        keys[(r["_epoch"], r["_pass"])].append((r["_path"], r["_row"]))
    everything = {(p, r) for p, n in zip(paths, [300, 200], strict=True) for r in range(1, n + 1)}
    head_rows = {(paths[1], r) for r in range(1, 41)}
    assert set(warm.column("_row").to_pylist()) == set(range(1, 41))
    assert warm.column("_epoch").to_pylist() == [0] * 40
    assert set(keys) == {(e, c) for e in range(2) for c in range(3)}  # every pass gave rows
    for (epoch, copy), seen in keys.items():
        assert len(seen) == len(set(seen)), "a pass read a row twice"
        if copy < 2:
            expected = everything - head_rows if (epoch, copy) == (0, 0) else everything
            assert set(seen) == expected, (epoch, copy)
        else:
            assert 0.4 < len(seen) / len(everything) < 0.6, (epoch, copy)


def test_a_datasets_whole_run_is_one_read_operator(ray_local, capsys, monkeypatch):
    """However many epochs and passes (three epochs of 2–13 reads each here), each dataset is one
    read operator in the job's plan (plus one for its warm-up head), not one per pass joined by
    unions: Ray Data's scheduling loop costs driver CPU in proportion to its operators. Planning
    it stats each file once (the estimate's sizes serve every read)."""
    from collections import Counter

    from rayjobs.data import files as data_files

    stats = Counter()
    sizes = data_files.sizes

    def counted(paths, storage=None):
        stats.update(map(str, paths))
        return sizes(paths, storage)

    config = _config(
        weights=[0.5, 0.3, 0.2],
        mix={"by": "tokens", "epoch_tokens": 1_600_000},
        packing={"seq_len": 1024, "window_tokens": 50_000, "warmup_tokens": 16_000},
        train={"epochs": 3},
    )
    monkeypatch.setattr(data_files, "sizes", counted)  # (the config listed its files to load)
    rows = stream.packed_rows(config, pad_id=0)
    files = {f for spec in config.datasets for f in spec.files}
    assert {f: stats[f] for f in files} == dict.fromkeys(files, 1)
    rows.explain()
    plan = capsys.readouterr().out.split("-------- Physical Plan (Optimized) --------")[1]
    operators = [line.strip().removeprefix("+- ").split("[")[0] for line in plan.splitlines()]
    reads = [line for line in plan.splitlines() if line.strip().endswith("[ReadRowFile]")]
    assert len(reads) == 3 + 3, plan
    # two unions: the warm-up heads joined, the warm-up lane joined to the main lane
    assert operators.count("UnionOperator") == 2, plan
    # The main lane's packers cut their rows into blocks (``BLOCK_BYTES``): no repartition after
    # them, which copied every packed row once more; only the warm-up lane's few rows are cut
    # again, into blocks every rank gets some of (the plan is printed root first).
    block = packer.lane_block_rows(16_000, 1024, config.train.num_workers)
    lane = f"StreamingRepartition[num_rows_per_block={block},strict=False]"
    root = plan.strip().splitlines()[0]
    assert root == f"UnionOperator[UnionOperator({lane}, MapBatches(PackStream))]", plan
    fractions = mix.epoch_fractions(config, estimate.estimate(config))
    assert min(fractions) > 2, "guard: every dataset read in several passes an epoch"


@pytest.mark.parametrize(
    ("window_tokens", "repartitioned"),
    [(4_194_304, []), (50_000, ["alpaca", "hh_chat", "roleplay"])],
)
def test_mixed_reads_are_repartitioned_only_where_their_blocks_outsize_a_windows_share(
    ray_local, capsys, window_tokens, repartitioned
):
    """At the default window a read block (at most ``BLOCK_BYTES``) is already under a
    ``MIX_BLOCKS``-th of a window: the streams go to the mix as read, no repartition operator (a
    task per block). A small window's share is a few rows: each stream is cut to it first."""
    config = _config(packing={"seq_len": 1024, "window_tokens": window_tokens})
    rows = stream.packed_rows(config, pad_id=0)
    rows.explain()
    plan = capsys.readouterr().out.split("-------- Physical Plan (Optimized) --------")[1]
    estimates = estimate.estimate(config)
    mean = float(np.mean([e.mean_tokens for e in estimates.values()]))
    window = packer.window_rows(window_tokens, mean)
    block = max(stream.MIN_MIX_BLOCK_ROWS, window // stream.MIX_BLOCKS)
    cut = f"StreamingRepartition[num_rows_per_block={block},strict=False]"
    assert plan.count(f"TaskPoolMapOperator[{cut}]") == len(repartitioned), plan
    assert "MixOperator" in plan, plan  # guard: the datasets are mixed
    coarse = [name for name, e in estimates.items() if stream._coarse(e, block)]
    assert coarse == repartitioned


# S2: each epoch reads a dataset's files in another order
def test_each_epoch_reads_files_in_another_order():
    import types

    spec = types.SimpleNamespace(files=[f"f{i}.jsonl" for i in range(20)])
    assert reads.passes(spec, 0, 0, 7, 1.0)[0].files != reads.passes(spec, 0, 1, 7, 1.0)[0].files


# -- guards a mutation run found missing


def test_window_rows_is_at_least_one_sample():
    assert packer.window_rows(4096, 8192.0) == 1  # samples longer than the window: still one
    assert packer.window_rows(4096, 0.25) == 4096  # mean below 1 token counts as 1
    assert packer.window_rows(4096, 100.0) == 40


def test_rows_hint_scales_bytes_by_rows_per_byte():
    """An uncounted dataset is sized from its bytes times rows per byte, not from its bytes."""
    est = estimate.Estimate(10.0, rows=None, rows_per_byte=0.01, file_sizes={"a": 3000, "b": 1000})
    assert est.rows_hint == pytest.approx(40.0)
    assert estimate.Estimate(10.0, rows=50, samples_per_row=0.5).samples_hint == 25.0


def _one_dataset(tmp_path, warmup_tokens):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "x"}\n')
    return config_from_dict(
        {
            "datasets": [{"name": "a", "source": str(path), "template": "text"}],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"warmup_tokens": warmup_tokens},
        }
    ), str(path)


def test_warm_up_head_takes_more_rows_of_a_subsampled_pass(tmp_path, monkeypatch):
    """A pass keeping half the rows needs twice the rows in its head for the same tokens; the
    head ends right below the first row not taken."""
    config, path = _one_dataset(tmp_path, warmup_tokens=1000)
    monkeypatch.setattr(
        reads, "_parse_head", lambda spec, file, wanted: (list(range(0, 2000, 2)), [], 0, 0)
    )
    monkeypatch.setattr(packer, "LANE_MIN_ROWS", 0)  # a lane on 10k tokens
    estimates = {"a": estimate.Estimate(10.0, rows=1000)}
    whole = reads.Pass((path,), 0, None, 0)
    half = reads.Pass((path,), 0, 0.5, 0)
    assert reads.warmup_heads(config, estimates, [1.0], [whole])["a"] == reads.Head(path, 200, 100)
    assert reads.warmup_heads(config, estimates, [0.5], [half])["a"] == reads.Head(path, 400, 200)


# first epoch's raw rows (10 tokens each) → the lane's head under the defaults (seq_len 2048,
# warmup_tokens 262,144): none up to max(4 lanes, 1000 rows) = 2,048,000 tokens
LANE_SCENARIOS = {"1M tokens: no lane": (100_000, None), "3M tokens: a lane": (300_000, 26_215)}


@pytest.mark.parametrize("name", LANE_SCENARIOS)
def test_a_warm_up_lane_only_for_a_first_epoch_it_costs_under_a_tenth_of_a_point(
    name, tmp_path, monkeypatch
):
    raw_rows, lane_rows = LANE_SCENARIOS[name]
    config, path = _one_dataset(tmp_path, warmup_tokens=262_144)
    monkeypatch.setattr(
        reads, "_parse_head", lambda spec, file, wanted: (list(range(wanted + 1)), [], 0, 0)
    )
    estimates = {"a": estimate.Estimate(10.0, rows=raw_rows)}
    heads = reads.warmup_heads(config, estimates, [1.0], [reads.Pass((path,), 0, None, 0)])
    assert heads.get("a") == (lane_rows and reads.Head(path, lane_rows, lane_rows))


def test_pack_counts_count_trimmed_samples_and_tokens_by_source():
    import numpy as np
    import pyarrow as pa

    from rayjobs.data.counts import StageTimer

    kept = pa.table({"source": ["a", "a", "b"], "num_tokens": [3, 4, 5]})
    trimmed = pa.table({"source": ["a", "b", "b"], "num_tokens": [7, 10, 20]})
    rows = {"num_tokens": np.array([7, 5], dtype=np.int32)}
    with StageTimer() as timer:
        pass
    counts = packer.pack_counts(kept, rows, 8, timer, trimmed)
    assert (counts.num_packs, counts.num_tokens, counts.num_slots, counts.num_documents) == (
        2,
        12,
        16,
        3,
    )
    assert counts.documents_by_source == {"a": 2, "b": 1}
    assert counts.tokens_by_source == {"a": 7, "b": 5}
    assert counts.trimmed_by_source == {"a": 1, "b": 2}
    assert counts.trimmed_tokens_by_source == {"a": 7, "b": 30}


def test_budgets_are_in_tokens_by_tokens_and_set_for_every_epoch(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "x"}\n')
    config = config_from_dict(
        {
            "datasets": [
                {"name": "a", "source": str(path), "template": "text", "weight": 0.75},
                {"name": "b", "source": str(path), "template": "text", "weight": 0.25},
            ],
            "tokenizer": {"path": str(GPT2)},
            "allow_duplicate_sources": True,
            "mix": {"by": "tokens"},
            "train": {"epochs": 2},
        }
    )
    estimates = {"a": estimate.Estimate(10.0, rows=100), "b": estimate.Estimate(20.0, rows=50)}
    fractions = mix.epoch_fractions(config, estimates)  # 2000 tokens: 1500 / 500
    assert fractions == pytest.approx([1.5, 0.5])
    assert mix.budgets(config, estimates, fractions) == pytest.approx(
        {(0, "a"): 1500.0, (0, "b"): 500.0, (1, "a"): 1500.0, (1, "b"): 500.0}
    )


def test_size_estimates_count_only_the_share_a_read_keeps():
    """Ray sizes a read task's output by the part of its files the reads keep (a pass's
    subsample), not by the files' bytes."""
    from rayjobs.data.sources import RowFileDatasource

    file_reads = [reads.PassRead("/x/a.jsonl", sample=0.25), reads.PassRead("/x/b.jsonl")]
    source = RowFileDatasource(
        file_reads,
        format="jsonl",
        dataset="a",
        text_split="paragraph",
        sizes={"/x/a.jsonl": 40 << 20, "/x/b.jsonl": 16 << 20},  # (over a read task's 8 MiB)
    )
    assert source.estimate_inmemory_data_size() == (10 << 20) + (16 << 20)
    assert [task.metadata.size_bytes for task in source.get_read_tasks(2)] == [10 << 20, 16 << 20]


def test_a_read_that_keeps_none_of_a_blocks_rows_emits_no_empty_block(tmp_path):
    """A pass's read of a file keeps some of each block's rows (here: from a row on, as the main
    lane's read of the warm-up head's file): a block it keeps none of is left out, not emitted
    empty."""
    from rayjobs.data.sources import FileRead, read_files

    _, [path] = _jsonl_dataset(tmp_path, [2500])
    options = {"format": "jsonl", "dataset": "a", "text_split": "paragraph"}

    def blocks(read):
        return [table.num_rows for table in read_files([read], options)]

    assert blocks(FileRead(path)) == [1024, 1024, 452]  # guard: rows 1-1024, 1025-2048, 2049-
    assert blocks(reads.PassRead(path, from_row=1100)) == [949, 452]
    assert blocks(reads.PassRead(path, from_row=3000)) == []
