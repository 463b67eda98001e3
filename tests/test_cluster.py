"""Scale-out on a real multi-node Ray cluster (two raylets on this machine): the data actors of
one run land on both nodes, and the run still places every sample exactly once."""

from __future__ import annotations

import os

import pytest

from conftest import ALPACA, GPT2, HH_CHAT, ROOT


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    env = {"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}}
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_tokenize_and_pack_actors_run_on_both_nodes(two_nodes):
    import ray

    from rayjobs.config import config_from_dict
    from rayjobs.pipeline import start_job

    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 512, "window_tokens": 20_000},
            "ray": {"min_actors": 2, "tokenize_concurrency": 2, "pack_concurrency": 2},
        },
        base_dir=ROOT,
    )
    job = start_job(config, prefix="cluster")
    rows = job.rows.take_all()
    snapshot = job.snapshot()
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2, "guard: a two-node cluster"
    assert set(snapshot["actors"]["Tokenize"]) == nodes
    assert set(snapshot["actors"]["PackStream"]) == nodes
    # every sample of both datasets is one document of one row
    assert sum(int(r["num_documents"]) for r in rows) == 300 + 400
    assert snapshot["pack"][0]["documents_by_source"] == {"alpaca": 300, "hh_chat": 400}
