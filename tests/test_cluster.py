"""Scale-out and placement on a real multi-node Ray cluster (raylets on this machine): a head
with no CPUs, two data nodes labelled ``rayjobs.io/role: data`` and one trainer node holding a
custom resource that stands for GPUs. The data actors of one run land on both data nodes and
place every sample exactly once; with ``ray.data_label_selector`` and
``train.resources_per_worker`` data work stays on the data nodes and train workers on the trainer
node (README, "Run on a cluster")."""

from __future__ import annotations

import os

import pytest

from conftest import ALPACA, GPT2, HH_CHAT, ROOT, shutdown_shared_ray
from rayjobs.config import ConfigError, load_config
from rayjobs.stream import labels_match

ROLE = "rayjobs.io/role"


@pytest.mark.parametrize(
    ("labels", "selector", "matches"),
    [
        ({ROLE: "data"}, {}, True),
        ({ROLE: "data"}, {ROLE: "data"}, True),
        ({ROLE: "train"}, {ROLE: "data"}, False),
        ({}, {ROLE: "data"}, False),
        ({ROLE: "train"}, {ROLE: "!data"}, True),
        ({}, {ROLE: "!data"}, True),
        ({ROLE: "data"}, {ROLE: "!data"}, False),
        ({ROLE: "b"}, {ROLE: "in(a, b)"}, True),
        ({ROLE: "c"}, {ROLE: "in(a,b)"}, False),
        ({ROLE: "c"}, {ROLE: "!in(a,b)"}, True),
        ({ROLE: "data", "zone": "x"}, {ROLE: "data", "zone": "y"}, False),
    ],
)
def test_label_selector_matching(labels, selector, matches):
    """Which nodes' CPUs size the data pools by default (Ray's selector syntax)."""
    assert labels_match(labels, selector) is matches


def test_train_resources_are_custom_resources_only():
    config = ROOT / "configs" / "demo.yaml"
    with pytest.raises(ConfigError, match="CPU: set CPUs with cpus_per_worker"):
        load_config(config, ["train.resources_per_worker={CPU: 1}"])
    with pytest.raises(ConfigError, match="trainer: amounts must be positive"):
        load_config(config, ["train.resources_per_worker={trainer: 0}"])


@pytest.fixture(scope="module")
def cluster():
    """(cluster, data node ids, trainer node id); the driver connected."""
    import ray
    from ray.cluster_utils import Cluster

    shutdown_shared_ray()
    store = 200 * 1024**2
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": store, "include_dashboard": True},
    )
    data_nodes = [
        cluster.add_node(num_cpus=3, labels={ROLE: "data"}, object_store_memory=store)
        for _ in range(2)
    ]
    trainer = cluster.add_node(num_cpus=2, resources={"trainer": 2}, object_store_memory=store)
    cluster.wait_for_nodes()
    env = {"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}}
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    yield cluster, {node.node_id for node in data_nodes}, trainer.node_id
    ray.shutdown()
    cluster.shutdown()


def test_tokenize_and_pack_actors_run_on_both_data_nodes(cluster):
    from rayjobs.config import config_from_dict
    from rayjobs.pipeline import start_job

    _, data_nodes, _ = cluster
    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 512, "window_tokens": 20_000},
            "ray": {
                "min_actors": 2,
                "tokenize_concurrency": 2,
                "pack_concurrency": 2,
                "data_label_selector": {ROLE: "data"},
            },
        },
        base_dir=ROOT,
    )
    job = start_job(config, prefix="cluster")
    rows = job.rows.take_all()
    snapshot = job.snapshot()
    assert len(data_nodes) == 2, "guard: two data nodes"
    assert set(snapshot["actors"]["Tokenize"]) == data_nodes
    assert set(snapshot["actors"]["PackStream"]) == data_nodes
    # every sample of both datasets is one document of one row
    assert sum(int(r["num_documents"]) for r in rows) == 300 + 400
    assert snapshot["pack"][0]["documents_by_source"] == {"alpaca": 300, "hh_chat": 400}


def test_data_on_data_nodes_and_trainers_on_the_trainer_node(cluster, tmp_path):
    """Acceptance 2 of the cluster issue: the job completes on 2 data nodes + 1 trainer node, and
    Ray's State API shows every Tokenize / PackStream actor and every read and map task on a
    data node, every train worker on the trainer node."""
    from ray.util.state import list_actors, list_tasks

    from rayjobs.pipeline import run

    cluster, data_nodes, trainer_node = cluster
    overrides = [
        f"ray.address={cluster.address}",
        f"ray.data_label_selector={{{ROLE}: data}}",
        "train.resources_per_worker={trainer: 1}",
        "train.epochs=1",
        "train.max_steps=4",
        f"train.storage_path={tmp_path}",
    ]
    summary = run(load_config(ROOT / "configs" / "demo.yaml", overrides))
    assert summary["steps"] > 0 and len(set(summary["steps_per_rank"])) == 1, summary

    actors = list_actors(detail=True, limit=10_000, raise_on_missing_output=False)
    placed: dict[str, set[str]] = {}
    for actor in actors:
        name = f"{actor.class_name} {actor.name or ''} {actor.repr_name or ''}"
        for kind in ("Tokenize", "PackStream", "RayTrainWorker"):
            if kind in name:
                placed.setdefault(kind, set()).add(actor.node_id)
    # guard: every kind ran, and the data nodes both took work (the interesting case)
    assert set(placed) == {"Tokenize", "PackStream", "RayTrainWorker"}, placed
    assert placed["Tokenize"] | placed["PackStream"] <= data_nodes, placed
    assert placed["RayTrainWorker"] == {trainer_node}, placed
    ledger_nodes = {node for nodes in summary["actors"].values() for node in nodes}
    assert ledger_nodes <= data_nodes, summary["actors"]

    tasks = list_tasks(detail=True, limit=10_000, raise_on_missing_output=False)
    data_tasks = [
        t for t in tasks if t.node_id and any(k in t.name for k in ("ReadRowFile", "MapBatches"))
    ]
    assert data_tasks, sorted({t.name for t in tasks})
    assert {t.node_id for t in data_tasks} <= data_nodes, {
        t.name: t.node_id for t in data_tasks if t.node_id not in data_nodes
    }
