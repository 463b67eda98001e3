"""The dashboard's series: the README's metrics table and the Grafana dashboard in
cluster/ name exactly the series the job exports.
"""

from __future__ import annotations

import json
import re

from conftest import ROOT
from rayjobs.metrics import METRICS


def _exported_name(name: str) -> str:
    return f"ray_{name}_total" if METRICS[name][0] == "counter" else f"ray_{name}"


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
    exported = {_exported_name(name) for name in METRICS}
    assert used and used <= exported, used - exported
    assert {
        "ray_rayjobs_packing_efficiency",
        "ray_rayjobs_pack_tokens_total",
        "ray_rayjobs_tokens_total",
        "ray_rayjobs_mix_share",
    } <= used
