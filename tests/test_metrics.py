"""The dashboard's series: the README's metrics table and the Grafana dashboard in
cluster/ name exactly the series the job exports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ALPACA, GPT2, HH_CHAT, ROOT
from rayjobs.config import config_from_dict
from rayjobs.metrics import METRICS
from rayjobs.pipeline import run

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(port: int, run: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted rayjobs tags): value} of this run's series, summed over workers."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_rayjobs_") and sample.labels.get("run") == run:
                tags = tuple(sorted((k, v) for k, v in sample.labels.items() if k in ("dataset", "epoch")))
                values[sample.name, tags] = values.get((sample.name, tags), 0.0) + sample.value
    return values


def _exported_name(name: str) -> str:
    return f"ray_{name}_total" if METRICS[name][0] == "counter" else f"ray_{name}"


def test_readme_metrics_table_lists_exactly_the_exported_series():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Metrics"):readme.index("## Benchmarks")]
    assert set(re.findall(r"`(rayjobs_[a-z_]+)`", section)) == set(METRICS)


def test_grafana_dashboard_queries_only_exported_series():
    dashboard = json.loads((ROOT / "cluster" / "grafana" / "rayjobs.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = set(re.findall(r"\bray_rayjobs_[a-z_]+", " ".join(queries)))
    exported = {_exported_name(name) for name in METRICS}
    assert used and used <= exported, used - exported
    assert {"ray_rayjobs_packing_efficiency", "ray_rayjobs_pack_tokens_total",
            "ray_rayjobs_tokens_total", "ray_rayjobs_mix_share"} <= used
