"""Where data work runs: the label selector every data task and actor takes, and the CPUs of the
nodes it selects (the actor pools' default ceilings follow them)."""

from __future__ import annotations

from typing import Any

import ray

from rayjobs.config import Config


def on_data_nodes(config: Config) -> dict[str, Any]:
    """Ray Data remote arguments that keep a data task or actor on the nodes
    ``ray.data_label_selector`` names (nothing when it is empty). Every data operator takes the
    same ones: operators whose arguments differ are not fused."""
    selector = config.ray.data_label_selector
    return {"label_selector": dict(selector)} if selector else {}


def cluster_cpus(config: Config | None = None) -> float:
    """Logical CPUs of the running Ray cluster's alive nodes that the data may use (those
    ``ray.data_label_selector`` matches): the actor pools' default ceilings follow it."""
    selector = config.ray.data_label_selector if config is not None else {}
    if not selector:
        return float(ray.cluster_resources().get("CPU", 1.0))
    cpus = sum(
        node["Resources"].get("CPU", 0.0)
        for node in ray.nodes()
        if node.get("Alive") and labels_match(node.get("Labels") or {}, selector)
    )
    return float(cpus) or 1.0


def labels_match(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node's ``labels`` satisfy a Ray label ``selector``: ``value``, ``!value``,
    ``in(a,b)``, ``!in(a,b)`` per key."""
    for key, wanted in selector.items():
        negate = wanted.startswith("!")
        wanted = wanted.removeprefix("!")
        if wanted.startswith("in(") and wanted.endswith(")"):
            values = {v.strip() for v in wanted[3:-1].split(",")}
        else:
            values = {wanted}
        if (labels.get(key) in values) == negate:
            return False
    return True
