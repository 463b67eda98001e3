"""The dashboard's series: the README's metrics table names exactly the series the job
exports, and the Grafana dashboard in cluster/ queries only those, by labels they have; the ledger
and the train workers export every counter at 0 before any work; the end-of-run accounting check.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT
from rayjobs.data.counts import TokenizeCounts, _merge, check_accounting, unpacked
from rayjobs.job.ledger import Ledger
from rayjobs.metrics import METRICS
from rayjobs.train.metrics import TrainMetrics

DASHBOARD = ROOT / "cluster" / "grafana" / "rayjobs.json"


def _exported_names(name: str) -> set[str]:
    """Prometheus names of a series: counters get ``_total``, histograms ``_bucket``, ``_sum``
    and ``_count``."""
    kind = METRICS[name][0]
    if kind == "histogram":
        return {f"ray_{name}_{part}" for part in ("bucket", "sum", "count")}
    return {f"ray_{name}_total" if kind == "counter" else f"ray_{name}"}


def test_the_metrics_docs_name_exactly_the_exported_series():
    section = (ROOT / "docs" / "metrics.md").read_text()
    assert set(re.findall(r"`(rayjobs_[a-z_]+)`", section)) == set(METRICS)


def test_grafana_dashboard_queries_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    used = set(re.findall(r"\bray_rayjobs_[a-z_]+", " ".join(queries)))
    exported = set().union(*(_exported_names(name) for name in METRICS))
    assert used and used <= exported, used - exported
    assert {
        "ray_rayjobs_sample_tokens_bucket",
        "ray_rayjobs_samples_per_pack_bucket",
        "ray_rayjobs_packing_efficiency",
        "ray_rayjobs_pack_tokens_total",
        "ray_rayjobs_tokens_total",
        "ray_rayjobs_mix_share",
    } <= used


def _series_of(exported: str) -> str:
    """The ``METRICS`` name of an exported name (``ray_rayjobs_packs_total``: ``rayjobs_packs``)."""
    for name in METRICS:
        if exported in _exported_names(name):
            return name
    raise AssertionError(f"{exported}: not an exported series")


def test_grafana_dashboard_groups_and_labels_only_by_tag_keys_of_its_series():
    """A ``by (...)`` label, a legend's ``{{label}}`` or a ``label_values`` label that a series
    lacks gives an empty or merged panel without an error in Grafana or Prometheus: each must be
    a tag key (``METRICS``) of every series the query reads (``le`` too for ``_bucket``), a legend
    label one the query's outer aggregation keeps, and every selector picks the ``$run``."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [t for panel in dashboard["panels"] for t in panel.get("targets", [])]
    problems = []
    for target in targets:
        expr, legend = target["expr"], target.get("legendFormat", "")
        exported = re.findall(r"\bray_rayjobs_[a-z_]+", expr)
        keys = set.intersection(*(set(METRICS[_series_of(name)][1]) for name in exported))
        if all(name.endswith("_bucket") for name in exported):
            keys.add("le")
        grouped = [
            label.strip()
            for clause in re.findall(r"\bby \(([^)]*)\)", expr)
            for label in clause.split(",")
        ]
        outer = re.match(r"\w+ by \(([^)]*)\)", expr)
        kept = {label.strip() for label in outer.group(1).split(",")} if outer else set()
        legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        if not set(grouped) <= keys:
            problems.append(f"{expr}: by {set(grouped) - keys}, not a tag key of {exported}")
        if not legend_labels <= kept:
            problems.append(f"{expr}: legend {legend!r} names {legend_labels - kept}, not kept")
        selectors = re.findall(r"\bray_rayjobs_[a-z_]+(\{[^}]*\})?", expr)
        if not all('run=~"$run"' in selector for selector in selectors):
            problems.append(f'{expr}: a selector without run=~"$run"')
    for variable in dashboard["templating"]["list"]:
        if "definition" in variable:
            [(exported, label)] = re.findall(
                r"label_values\((\w+), (\w+)\)", variable["definition"]
            )
            if label not in METRICS[_series_of(exported)][1]:
                problems.append(f"{variable['definition']}: {label} is not a tag key")
    assert targets and not problems, "\n".join(problems)


class _Recorded:
    """Stands in for ``ray.util.metrics``'s classes: every record as (name, value, tags)."""

    records: list[tuple[str, float, dict]] = []

    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name = name

    def _record(self, value, tags=None):
        self.records.append((self.name, value, dict(tags or {})))

    def inc(self, value, tags=None):
        assert value > 0
        self._record(value, tags)

    set = observe = _record


def test_counters_are_exported_at_0_before_any_work(monkeypatch):
    """Prometheus's ``increase()`` and ``rate()`` count from a series' first sample: a counter
    first exported at its first batch's value (one torn line: skipped rows 1) loses that value
    to them. So a fresh ledger records every per-dataset counter of every configured dataset,
    and the pack counters, at 0, and a train worker its counters, before any batch or step."""
    from ray.util import metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, _Recorded)
    monkeypatch.setattr(_Recorded, "records", [])
    Ledger.__ray_actor_class__("r", datasets=["a", "b"])
    TrainMetrics("r", rank=0)
    TrainMetrics("r", rank=1)
    recorded = {
        (name, tuple(sorted(tags.items()))): value for name, value, tags in _Recorded.records
    }
    expected = {}
    for name, (kind, tag_keys, _) in METRICS.items():
        if kind != "counter":
            continue
        for dataset in ("a", "b") if "dataset" in tag_keys else (None,):
            tags = {"run": "r"} | ({"dataset": dataset} if dataset else {})
            expected[name, tuple(sorted(tags.items()))] = 0
    assert recorded == expected


def _snapshot(rows=10, samples=9, split=1, dropped=1, skipped=1, tokens=100, packed=(9, 100)):
    return {
        "tokenize": {
            "a": {
                "rows": rows,
                "samples": samples,
                "split_samples": split,
                "dropped_samples": dropped,
                "skipped_rows": skipped,
                "tokens": tokens,
            }
        },
        "pack": {
            0: {"documents_by_source": {"a": packed[0] - 4}, "tokens_by_source": {"a": 60}},
            1: {"documents_by_source": {"a": 4}, "tokens_by_source": {"a": packed[1] - 60}},
        },
    }


@pytest.mark.parametrize(
    ("snapshot", "streamed", "problem"),
    [
        (_snapshot(), True, None),  # 9 − 1 + 1 + 1 = 10 rows; 9 / 100 packed over two epochs
        (
            _snapshot(rows=11),
            True,
            "11 rows read but samples − split pieces + dropped + skipped = 10",
        ),
        (_snapshot(skipped=0), True, "10 rows read but"),
        (
            _snapshot(packed=(8, 100)),
            True,
            "tokenized 9 samples / 100 tokens but the packs hold (or trimmed) 8 / 100",
        ),
        (_snapshot(packed=(9, 99)), True, "the packs hold (or trimmed) 9 / 99"),
        (_snapshot(packed=(8, 99)), False, None),  # planned: the plan repeats or subsamples
        # stopped early (max_steps): what was in flight may be missing from the packs, no more
        (_snapshot(packed=(8, 99)), "early", None),
        (_snapshot(packed=(9, 101)), "early", "the packs hold (or trimmed) 9 / 101 (more than"),
        (_snapshot(packed=(10, 99)), "early", "the packs hold (or trimmed) 10 / 99 (more than"),
        (_snapshot(rows=11, packed=(8, 99)), "early", "11 rows read but"),
    ],
)
def test_the_accounting_check(snapshot, streamed, problem):
    complete = streamed != "early"
    problems = check_accounting(snapshot, streamed=bool(streamed), complete=complete)
    if streamed == "early" and problem is None:
        assert unpacked(snapshot) == {"a": {"samples": 1, "tokens": 1}}
    if problem is None:
        assert problems == []
    else:
        [found] = problems
        assert problem in found and found.startswith("dataset 'a': ")


# -- guards a mutation run found missing


def _trimmed_snapshot(trimmed_tokens=40):
    """9 samples / 100 tokens tokenized: 6 / 60 packed, 3 / 40 trimmed to the dataset's share."""
    return {
        "tokenize": {
            "a": {
                "rows": 9,
                "samples": 9,
                "split_samples": 0,
                "dropped_samples": 0,
                "skipped_rows": 0,
                "tokens": 100,
            }
        },
        "pack": {
            0: {
                "documents_by_source": {"a": 6},
                "tokens_by_source": {"a": 60},
                "trimmed_by_source": {"a": 3},
                "trimmed_tokens_by_source": {"a": trimmed_tokens},
            },
        },
    }


def test_trimmed_samples_and_tokens_balance_the_books():
    assert check_accounting(_trimmed_snapshot(), streamed=True) == []
    assert unpacked(_trimmed_snapshot()) == {"a": {"samples": 0, "tokens": 0}}
    [problem] = check_accounting(_trimmed_snapshot(trimmed_tokens=39), streamed=True)
    assert "the packs hold (or trimmed) 9 / 99" in problem


def test_a_dataset_packed_but_never_tokenized_is_a_problem():
    snapshot = {
        "tokenize": {},
        "pack": {0: {"documents_by_source": {"ghost": 2}, "tokens_by_source": {"ghost": 5}}},
    }
    assert check_accounting(snapshot, streamed=True) == [
        "dataset 'ghost': packed but never tokenized"
    ]
    assert check_accounting(snapshot, streamed=False) == []


def _bad(file: str, row: int) -> str:
    return f"dataset 'd', file {file}, row {row}: not JSON [invalid_json]"


def test_skipped_examples_are_the_first_five_in_the_data_whatever_the_batches_order():
    """Batches reach the ledger in any order (parallel reads, several Tokenize actors): the five
    listed are the first in the data, by file and row (row 10 after row 9, not before it), so an
    inspect and an export of the same data list the same rows."""
    batches = [[("b.jsonl", 1)], [("a.jsonl", 10), ("a.jsonl", 12)], [("a.jsonl", 9)],
               [("a.jsonl", 2), ("a.jsonl", 30)], [("a.jsonl", 11)]]  # fmt: skip
    listed = []
    for order in (batches, batches[::-1]):
        total = TokenizeCounts()
        for batch in order:
            examples = [_bad(*place) for place in batch]
            _merge(total, TokenizeCounts(skipped_rows=len(batch), skipped_examples=examples))
        assert total.skipped_rows == 7
        listed.append(total.skipped_examples)
    expected = [_bad("a.jsonl", row) for row in (2, 9, 10, 11, 12)]
    assert listed == [expected, expected]


def test_skipped_examples_list_a_row_reread_each_epoch_once():
    """Stream mode re-reads (and re-skips) a bad row every epoch: counted each time, listed once,
    so the other bad rows still get their places in the five."""
    total = TokenizeCounts()
    for epoch in range(3):
        examples = [_bad("a.jsonl", 7), _bad("b.jsonl", epoch)]
        _merge(total, TokenizeCounts(skipped_rows=2, skipped_examples=examples))
    assert total.skipped_rows == 6
    assert total.skipped_examples == [_bad("a.jsonl", 7), *(_bad("b.jsonl", e) for e in range(3))]


def test_admit_grants_each_dataset_its_share_to_the_nearest_sample():
    ledger = Ledger.__ray_actor_class__()
    ledger.set_budgets({(0, "a"): 10.0, (0, "b"): 5.0})
    # a: 4 + 4 = 8 fits, 8 + 4 = 12 is 2 over vs 2 under: not nearer, stays at 2
    # b: 3 fits, 3 + 3 = 6 is 1 over vs 2 under: one more comes nearer the share
    # c: no budget: every sample
    assert ledger.admit("w1", 0, {"a": [4, 4, 4], "b": [3, 3, 3], "c": [1, 1]}) == {
        "a": 2,
        "b": 2,
        "c": 2,
    }
    # a window Ray runs again gets the same answer, and uses no budget twice
    assert ledger.admit("w1", 0, {"a": [4, 4, 4], "b": [3, 3, 3], "c": [1, 1]}) == {
        "a": 2,
        "b": 2,
        "c": 2,
    }
    # a: 2 left: 1 fits, then 1 + 1.5 = 2.5 is 0.5 over vs 1 under: one more
    assert ledger.admit("w2", 0, {"a": [1, 1.5, 1]}) == {"a": 2}
    # b: 6 used of 5: nothing left
    assert ledger.admit("w3", 0, {"b": [1]}) == {"b": 0}
    # another epoch has its own budget (none set: everything)
    assert ledger.admit("w4", 1, {"a": [4, 4, 4]}) == {"a": 3}


def test_a_restarted_worker_group_reads_its_shares_afresh():
    """Ray Train restarting the workers (``train.max_failures``) re-reads the stream against the
    same ledger: each epoch's weighted shares are granted again, not left used up by the first
    attempt (the re-read windows were trimmed to nothing)."""
    ledger = Ledger.__ray_actor_class__()
    ledger.set_budgets({(0, "a"): 100.0})
    assert ledger.start_attempt() == 1
    assert ledger.admit("k1", 0, {"a": [10] * 12}) == {"a": 10}
    assert ledger.admit("k2", 0, {"a": [10] * 12}) == {"a": 0}  # guard: the share is used up
    assert ledger.start_attempt() == 2
    assert ledger.admit("k2", 0, {"a": [10] * 12}) == {"a": 10}
    assert ledger.admit("k1", 0, {"a": [10] * 12}) == {"a": 0}


def test_batch_key_tells_where_one_column_ends_and_the_next_begins():
    from rayjobs.data.counts import batch_key

    assert batch_key("tokenize", ["ab"], ["c"]) != batch_key("tokenize", ["a"], ["bc"])
    assert batch_key("tokenize", ["ab"], ["c"]) == batch_key("tokenize", ["ab"], ["c"])


def test_dpo_steps_set_the_dpo_gauges_on_rank_0_only(monkeypatch):
    from ray.util import metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, _Recorded)
    monkeypatch.setattr(_Recorded, "records", [])
    dpo = {
        "reward_accuracy": 0.75,
        "reward_margin": 0.5,
        "chosen_reward": 0.25,
        "rejected_reward": -0.25,
        "chosen_logps": -40.0,
        "rejected_logps": -42.0,
        "triples": 8,
    }
    for rank in (0, 1):
        series = TrainMetrics("r", rank=rank)
        series.step(0.6, 100, dpo)
        series.step(0.5, 100)  # an SFT step sets none
    gauges = [(n, v, t) for n, v, t in _Recorded.records if n.startswith("rayjobs_dpo_")]
    assert gauges == [
        ("rayjobs_dpo_reward_accuracy", 0.75, {"run": "r"}),
        ("rayjobs_dpo_reward_margin", 0.5, {"run": "r"}),
        ("rayjobs_dpo_chosen_reward", 0.25, {"run": "r"}),
        ("rayjobs_dpo_rejected_reward", -0.25, {"run": "r"}),
    ]


def test_evaluations_set_the_eval_loss_on_rank_0_only(monkeypatch):
    from ray.util import metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, _Recorded)
    monkeypatch.setattr(_Recorded, "records", [])
    for rank in (0, 1):
        series = TrainMetrics("r", rank=rank)
        series.step(0.6, 100)  # a step sets no eval loss
        series.evaluation(2.5)
    gauges = [(n, v, t) for n, v, t in _Recorded.records if n.startswith("rayjobs_eval_")]
    assert gauges == [("rayjobs_eval_loss", 2.5, {"run": "r"})]


def test_a_steps_tokens_per_second_leave_out_the_evaluation_and_checkpoint_before_it(monkeypatch):
    from ray.util import metrics

    from rayjobs.train import metrics as rayjobs_metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, _Recorded)
    monkeypatch.setattr(_Recorded, "records", [])
    # start, step (2 s), evaluation (10 s), step (2 s), checkpoint (5 s), step (4 s)
    clock = iter([0.0, 2.0, 12.0, 14.0, 19.0, 23.0])
    monkeypatch.setattr(rayjobs_metrics.time, "monotonic", lambda: next(clock))
    series = TrainMetrics("r", rank=0)
    series.step(0.6, 100)
    series.evaluation(2.5)
    series.step(0.5, 100)
    series.paused()  # the train loop, after a checkpoint's save or a report
    series.step(0.4, 100)
    speeds = [v for n, v, _ in _Recorded.records if n == "rayjobs_train_tokens_per_s"]
    assert speeds == [50.0, 50.0, 25.0]  # not 100 tokens over 12 s, nor over 9 s


@pytest.mark.parametrize(
    "rereads, samples, repeated", [(True, 4, 1), (False, 2, 2)], ids=["stream", "planned"]
)
def test_a_restart_re_read_counts_once_more_in_stream_mode(rereads, samples, repeated):
    """A Tokenize batch Ray runs again (its actor died) counts once; the same rows read again by a
    restarted worker group count again in stream mode (``rereads``), where the packs they make,
    mixed anew, count again too, so the books balance; planned mode tokenizes once."""
    from rayjobs.data.counts import PackCounts

    ledger = Ledger.__ray_actor_class__("r", ["a"], rereads)
    batch = {"a": TokenizeCounts(rows=2, samples=2, tokens=20)}
    ledger.start_attempt()
    ledger.add_tokenize(batch, key="t1")
    ledger.add_tokenize(batch, key="t1")  # Ray ran it again
    ledger.add_pack(0, PackCounts(1, 20, 32, 2, {"a": 2}, {"a": 20}), key="p1")
    ledger.start_attempt()
    ledger.add_tokenize(batch, key="t1")  # the re-read's first block: the same rows
    if rereads:
        ledger.add_pack(0, PackCounts(1, 20, 32, 2, {"a": 2}, {"a": 20}), key="p2")
    snapshot = ledger.snapshot()
    assert snapshot["tokenize"]["a"]["samples"] == samples
    assert snapshot["repeated_reports"] == repeated
    assert check_accounting(snapshot, streamed=rereads) == []
