"""End to end, data side: real files → Ray Data (read → tokenize → pack) → packed rows, checked
against an in-process tokenization of the same rows and against the run's Ledger."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import ALPACA, GPT2, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.data.sources import read_dataset
from rayjobs.data.tokenize import Tokenize
from rayjobs.errors import AccountingError
from rayjobs.job.pipeline import accounting, start_job, untrained_packs

SEQ_LEN = 512  # short enough that some real samples are truncated


def _config(**packing):
    return config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            # Windows of ~20k tokens: several packer calls per epoch, on two packer actors; a
            # warm-up lane of 16k tokens: part of each dataset's file, the rest in the main lane.
            "packing": {
                "seq_len": SEQ_LEN,
                "window_tokens": 20_000,
                "warmup_tokens": 16_000,
                **packing,
            },
            "ray": {"min_actors": 2, "tokenize_concurrency": 2, "pack_concurrency": 2},
        },
        base_dir=ROOT,
    )


def _documents(row: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input_ids, labels) of each non-pad document of a packed row."""
    documents = []
    num_tokens = int(row["num_tokens"])
    ids, labels, doc = row["input_ids"], row["labels"], row["document_ids"]
    for document in np.unique(doc[:num_tokens]):
        where = doc[:num_tokens] == document
        documents.append((tuple(ids[:num_tokens][where]), tuple(labels[:num_tokens][where])))
    return documents


@pytest.fixture(scope="module", autouse=True)
def _a_lane_on_small_sets():
    """The warm-up lane on these ~150k tokens (the job gives one only to an epoch of 1000 rows
    or more, ``packer.LANE_MIN_ROWS``): the lane and the main lane both carry rows here."""
    from rayjobs.data import packer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packer, "LANE_MIN_ROWS", 0)
        yield


@pytest.fixture(scope="module")
def packed_run(ray_local):
    config = _config(overflow="truncate")
    job = start_job(config, prefix="test")
    rows = job.rows.take_all()
    snapshot = job.snapshot()
    raw = [row for spec in config.datasets for row in read_dataset(spec).take_all()]
    table = pa.Table.from_pylist(raw)
    reference = Tokenize(config.datasets, config.tokenizer, SEQ_LEN, "truncate")(table)
    untruncated = Tokenize(config.datasets, config.tokenizer, 10**9, "truncate")(table)
    return config, rows, snapshot, reference, untruncated


def test_every_packed_document_is_exactly_one_tokenized_sample(packed_run):
    _, rows, _, reference, _ = packed_run
    packed = Counter(doc for row in rows for doc in _documents(row))
    expected = Counter(
        (tuple(ids), tuple(labels))
        for ids, labels in zip(
            reference.column("input_ids").to_pylist(), reference.column("labels").to_pylist()
        )
    )
    assert (
        sum(expected.values()) == 300 + 400
    )  # every real row (configs/data subsets) became one sample
    assert packed == expected


def test_tokens_conserved_minus_counted_truncation(packed_run):
    _, rows, snapshot, _, untruncated = packed_run
    summary = accounting(snapshot)["datasets"]
    truncated = sum(stats["truncated_tokens"] for stats in summary.values())
    assert truncated > 0, "guard: the real data must contain samples longer than seq_len"
    packed_tokens = Counter()
    for row in rows:
        packed_tokens.update(row["input_ids"][: int(row["num_tokens"])].tolist())
    all_tokens = Counter(t for ids in untruncated.column("input_ids").to_pylist() for t in ids)
    assert sum(packed_tokens.values()) == sum(all_tokens.values()) - truncated
    assert not packed_tokens - all_tokens  # nothing appears that was not tokenized
    assert sum(s["tokens"] for s in summary.values()) == sum(packed_tokens.values())


def test_labels_never_cross_a_document(packed_run):
    _, rows, _, _, _ = packed_run
    multi_document_rows = 0
    for row in rows:
        ids, labels, doc, pos = (
            row[k] for k in ("input_ids", "labels", "document_ids", "position_ids")
        )
        assert len(ids) == len(labels) == len(doc) == len(pos) == SEQ_LEN
        trained = np.flatnonzero(labels[:-1] != -100)
        assert (doc[trained] == doc[trained + 1]).all()
        assert (labels[trained] == ids[trained + 1]).all()
        assert labels[-1] == -100
        starts = np.flatnonzero(np.diff(doc, prepend=-1) != 0)
        assert (pos[starts] == 0).all()
        multi_document_rows += len(starts) > 2
    assert multi_document_rows > 0.25 * len(rows), "guard: many rows hold several documents"


def test_ledger_matches_the_rows(packed_run):
    _, rows, snapshot, reference, _ = packed_run
    pack = snapshot["pack"][0]
    assert pack["num_packs"] == len(rows)
    assert pack["num_tokens"] == sum(int(r["num_tokens"]) for r in rows)
    assert pack["documents_by_source"] == {"alpaca": 300, "hh_chat": 400}
    assert pack["num_slots"] == len(rows) * SEQ_LEN
    lower_bound = -(-pack["num_tokens"] // SEQ_LEN)
    assert pack["calls"] >= 4, "guard: several packer calls (windows of 20k tokens)"
    # guard: the exactly-once checks above ran with two tokenize and two packer actors
    assert sum(snapshot["actors"]["Tokenize"].values()) >= 2
    assert sum(snapshot["actors"]["PackStream"].values()) >= 2
    # Each call packs its window alone: its own rounding up (under a row) and, now and then, a
    # second part-filled row where best fit could not merge two tails (12 or 13 rows over the
    # bound in 12 calls, in eight runs); a row per document would be 700.
    assert lower_bound <= len(rows) <= lower_bound + 1.5 * pack["calls"]


@pytest.mark.e2e
def test_overflow_drop_counts_and_split_keeps_every_token(ray_local):
    counts = {}
    for policy in ("drop", "split"):
        job = start_job(_config(overflow=policy), prefix="test")
        rows = job.rows.take_all()
        summary = accounting(job.snapshot())
        counts[policy] = (summary["datasets"], sum(int(r["num_tokens"]) for r in rows))
    dropped = sum(s["dropped_samples"] for s in counts["drop"][0].values())
    split = sum(s["split_samples"] for s in counts["split"][0].values())
    assert dropped > 0 and split >= dropped
    assert all(s["truncated_tokens"] == 0 for policy in counts for s in counts[policy][0].values())
    assert counts["split"][1] > counts["drop"][1]


def test_bad_row_error_names_dataset_file_row_and_field(ray_local, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"instruction": "a", "output": "b"},
                {"instruction": "c"},
                {"instruction": "d", "output": "e"},
            ]
        )
    )
    config = config_from_dict(
        {
            "datasets": [{"name": "broken", "source": str(data), "template": "alpaca"}],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 64},
        },
        base_dir=ROOT,
    )
    with pytest.raises(Exception) as error:
        start_job(config).rows.take_all()
    message = str(error.value)
    assert "dataset 'broken'" in message and str(data) in message
    assert "row 2" in message and "'output'" in message


def test_bad_rows_skipped_are_counted(ray_local, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"instruction": "a", "output": "b"}, {"instruction": "c"}, {"text": "d"}]
        )
    )
    config = config_from_dict(
        {
            "datasets": [
                {"name": "broken", "source": str(data), "template": "alpaca", "on_bad_row": "skip"}
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 64},
        },
        base_dir=ROOT,
    )
    job = start_job(config, prefix="test")
    rows = job.rows.take_all()
    stats = accounting(job.snapshot())["datasets"]["broken"]
    assert (stats["samples"], stats["skipped_rows"]) == (1, 2)
    assert sum(int(r["num_documents"]) for r in rows) == 1
    examples = sorted(stats["skipped_examples"])  # blocks arrive in any order
    assert "row 2:" in examples[0] and "row 3:" in examples[1]


def test_the_warm_up_lane_takes_part_of_each_dataset():
    """Guard for the tests above: both lanes carry rows of both datasets, so "every sample
    exactly once" covers the split between them."""
    from rayjobs.data import estimate, mix, reads
    from rayjobs.data.formats import parse_file

    config = _config()
    estimates = estimate.estimate(config)
    fractions = mix.epoch_fractions(config, estimates)
    first = [reads.passes(s, i, 0, config.seed, 1.0)[0] for i, s in enumerate(config.datasets)]
    heads = reads.warmup_heads(config, estimates, fractions, first)
    assert set(heads) == {"alpaca", "hh_chat"}
    for spec in config.datasets:
        path = spec.files[0]  # each dataset is one file
        rows = len(parse_file(Path(path).read_bytes(), path, format=spec.format, dataset="d")[0])
        assert 10 < heads[spec.name].rows < rows / 2
    tokens = sum(heads[n].rows * estimates[n].mean_tokens for n in heads)
    assert tokens == pytest.approx(16_000, rel=0.05)


def test_planned_mode_keeps_every_data_operator_on_the_data_nodes(monkeypatch):
    """``ray.data_label_selector`` reaches planned mode's operators as stream mode's: each read,
    the Tokenize pool, ``ExpandPlan`` and ``AssemblePacks`` ask Ray for a node with the label
    (they ran anywhere: a packer could land beside a trainer). Checked on the arguments each
    operator is built with, no cluster needed."""
    from conftest import ALPACA, GPT2, HH_CHAT
    from rayjobs.config import config_from_dict
    from rayjobs.data import planned as epochs
    from rayjobs.job import pipeline

    selector = {"rayjobs.io/role": "data"}
    config = config_from_dict(
        {
            "datasets": [
                {"name": "a", "source": str(ALPACA), "template": "alpaca"},
                {"name": "b", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"mode": "planned"},
            "ray": {"data_label_selector": selector},
        }
    )
    calls = []

    class Operator:  # stands in for a lazy Ray dataset: records each operator's arguments
        def union(self, *others):
            return self

        def map_batches(self, fn, **kwargs):
            calls.append((getattr(fn, "__name__", fn), kwargs.get("label_selector")))
            return self

        def groupby(self, key):
            return self

        def map_groups(self, fn, **kwargs):
            return self.map_batches(fn, **kwargs)

        def set_name(self, name):
            names.append(name)

    reads, names = [], []
    monkeypatch.setattr(
        pipeline,
        "read_dataset",
        lambda spec, **kw: reads.append(kw.get("label_selector")) or Operator(),
    )
    monkeypatch.setattr("rayjobs.data.stream.cluster_cpus", lambda config=None: 4.0)
    pipeline.tokenize(config)
    planned = epochs.Epochs.__new__(epochs.Epochs)
    planned.config, planned.ledger, planned.pad_id, planned.tokenized = config, None, 0, Operator()
    planned.run = "r"
    monkeypatch.setattr(planned, "pack_plan", lambda epoch: {}, raising=False)
    planned.packed(0)
    assert reads == [selector, selector]
    assert names == ["r.train.epoch-0"]  # what the dashboard's Ray Data Overview lists
    assert calls == [("Tokenize", selector), ("ExpandPlan", selector), ("AssemblePacks", selector)]


# (packed, trained, workers, batch size, drop_last, datasets, guard-dropped batches, stopped
# early, resumed from a checkpoint, worker-group attempts) → untrained_packs, or None where the
# count means nothing, or "error" beyond what the equal split (and drop_last's short batches, and
# the guard) may leave over.
UNTRAINED = [
    (103, 102, 2, 4, False, 1, 0, False, False, 1, 1),  # the split's remainder: 1 of 103 rows
    (103, 101, 2, 4, False, 1, 0, False, False, 1, "error"),  # more than the split may drop
    (103, 96, 2, 4, True, 1, 0, False, False, 1, 7),  # 51 a rank, 12 batches of 4
    (103, 95, 2, 4, True, 1, 0, False, False, 1, "error"),
    (450, 444, 2, 3, True, 2, 0, False, False, 1, 6),  # planned, 2 epochs of 225: 3 each
    (450, 439, 2, 3, True, 2, 0, False, False, 1, "error"),  # over 2 × (2 × 3 − 1)
    (60, 50, 2, 2, False, 1, 1, False, False, 1, 10),  # the guard stopped a rank: no bound
    (60, 61, 2, 2, False, 1, 1, False, False, 1, "error"),  # never more trained than made
    (60, 60, 1, 4, False, 1, 0, False, False, 1, 0),
    (61, 60, 0, 4, False, 1, 0, False, False, 1, "error"),  # num_workers 0: one process, no split
    (200, 64, 2, 4, False, 1, 0, True, False, 1, None),  # max_steps: the stream ran ahead
    (200, 64, 2, 4, False, 1, 0, False, True, 1, None),  # --resume: its stream was read again
    (200, 150, 2, 4, False, 1, 0, False, False, 2, None),  # a restart without a checkpoint
]


@pytest.mark.parametrize(
    "packed,trained,workers,batch,drop_last,datasets,guard,early,resumed,attempts,expected",
    UNTRAINED,
)
def test_untrained_packs(
    packed, trained, workers, batch, drop_last, datasets, guard, early, resumed, attempts, expected
):
    config = config_from_dict(
        {
            "datasets": [{"name": "a", "source": str(ALPACA), "template": "alpaca"}],
            "tokenizer": {"path": str(GPT2)},
            "train": {"num_workers": workers, "batch_size": batch, "drop_last": drop_last},
        }
    )
    summary = {
        "packed": {"num_packs": packed},
        "num_packs": trained,
        "guard_dropped_batches": guard,
        "stopped_early": early,
        "resumes": [{"step": 3}] if resumed else [],
        "attempts": attempts,
    }
    if expected == "error":
        with pytest.raises(AccountingError, match=f"{packed} packs made, {trained} trained"):
            untrained_packs(config, summary, datasets)
    else:
        assert untrained_packs(config, summary, datasets) == expected


EMBEDDED = {"address": "local", "num_cpus": 6, "dashboard_host": "127.0.0.1"}


@pytest.mark.parametrize(
    "address, env, interval, expected",
    [
        # a Ray of its own (not a `ray start`), its dashboard on loopback, metrics every 2 s
        (None, None, None, {**EMBEDDED, "_system_config": {"metrics_report_interval_ms": 2000}}),
        (None, None, "5000", EMBEDDED),  # the environment's interval: Ray reads it itself
        (None, "ray://head:10001", None, {"address": "ray://head:10001"}),
        ("auto", "ray://head:10001", None, {"address": "auto"}),  # the config's address first
    ],
)
def test_init_ray_joins_the_named_cluster_or_starts_its_own(
    monkeypatch, address, env, interval, expected
):
    import ray

    from rayjobs.job import pipeline

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: 3)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    if interval is None:
        monkeypatch.delenv("RAY_metrics_report_interval_ms", raising=False)
    else:
        monkeypatch.setenv("RAY_metrics_report_interval_ms", interval)
    config = _config().model_copy()
    config = config.model_copy(update={"ray": config.ray.model_copy(update={"address": address})})
    pipeline.init_ray(config)
    assert calls == [{**expected, "log_to_driver": True}]
