"""The dashboard's series: the README's metrics table and the Grafana dashboard in
cluster/ name exactly the series the job exports.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT
from rayjobs.metrics import METRICS, check_accounting, unpacked


def _exported_names(name: str) -> set[str]:
    """Prometheus names of a series: counters get ``_total``, histograms ``_bucket``, ``_sum``
    and ``_count``."""
    kind = METRICS[name][0]
    if kind == "histogram":
        return {f"ray_{name}_{part}" for part in ("bucket", "sum", "count")}
    return {f"ray_{name}_total" if kind == "counter" else f"ray_{name}"}


def test_readme_metrics_table_lists_exactly_the_exported_series():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Metrics") : readme.index("## Benchmarks")]
    assert set(re.findall(r"`(rayjobs_[a-z_]+)`", section)) == set(METRICS)


def test_grafana_dashboard_queries_only_exported_series():
    dashboard = json.loads((ROOT / "cluster" / "grafana" / "rayjobs.json").read_text())
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
