"""Scale-out and placement on a real multi-node Ray cluster (raylets on this machine): a head
with no CPUs, two data nodes labelled ``rayjobs.io/role: data`` and one trainer node holding a
custom resource that stands for GPUs. The data actors of one run land on both data nodes and
place every sample exactly once; with ``ray.data_label_selector`` and
``train.resources_per_worker`` data work stays on the data nodes and train workers on the trainer
node (README, "Run on a cluster")."""

from __future__ import annotations

import os

import pytest

from conftest import DEMO_TOKENIZER, ROOT, shutdown_shared_ray
from rayjobs.config import ConfigError, load_config
from rayjobs.data.placement import labels_match

ROLE = "rayjobs.io/role"
DEMO = ROOT / "configs" / "demo"


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


def test_data_scales_out_on_the_data_nodes_and_trainers_stay_on_the_trainer_node(cluster, tmp_path):
    """One real run (the demo's two datasets and tokenizer, no weights) answers both questions.
    Scale-out (#9, acceptance 4): with 2 Tokenize and 2 packer actors, each pool has an actor on
    both data nodes, and every sample of both datasets is one document of one pack (the run's
    end-of-run check passes and the packs hold 600 + 300 documents). Placement (#10, acceptance
    2): Ray's State API shows every Tokenize / PackStream actor and every read and map task on a
    data node, and every train worker on the trainer node (``train.resources_per_worker``)."""
    from ray.util.state import list_actors, list_tasks

    from rayjobs.config import config_from_dict
    from rayjobs.job.pipeline import run

    _, data_nodes, trainer_node = cluster
    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(DEMO / "alpaca.jsonl"), "template": "alpaca"},
                {"name": "chat", "source": str(DEMO / "chat.jsonl"), "template": "chat"},
            ],
            "tokenizer": DEMO_TOKENIZER,
            "packing": {"seq_len": 512, "window_tokens": 20_000},
            "ray": {
                "min_actors": 2,
                "tokenize_concurrency": 2,
                "pack_concurrency": 2,
                "data_label_selector": {ROLE: "data"},
            },
            "train": {
                "batch_size": 8,
                "resources_per_worker": {"trainer": 1},
                "storage_path": str(tmp_path),
                "model": {"dim": 64, "n_layers": 1, "n_heads": 2},
            },
        },
        base_dir=ROOT,
    )
    summary = run(config)
    assert summary["steps"] > 0 and len(set(summary["steps_per_rank"])) == 1, summary
    assert not summary["stopped_early"]
    assert len(data_nodes) == 2, "guard: two data nodes"
    assert set(summary["actors"]["Tokenize"]) == data_nodes, summary["actors"]
    assert set(summary["actors"]["PackStream"]) == data_nodes, summary["actors"]
    [epoch] = summary["mix"]
    documents = {name: stats["samples"] for name, stats in epoch["datasets"].items()}
    assert documents == {"alpaca": 600, "chat": 300}
    assert {name: s["unpacked_samples"] for name, s in summary["datasets"].items()} == {
        "alpaca": 0,
        "chat": 0,
    }

    actors = list_actors(detail=True, limit=10_000, raise_on_missing_output=False)
    placed: dict[str, set[str]] = {}
    for actor in actors:
        name = f"{actor.class_name} {actor.name or ''} {actor.repr_name or ''}"
        for kind in ("Tokenize", "PackStream", "RayTrainWorker"):
            if kind in name:
                placed.setdefault(kind, set()).add(actor.node_id)
    assert set(placed) == {"Tokenize", "PackStream", "RayTrainWorker"}, placed  # guard
    assert placed["Tokenize"] | placed["PackStream"] <= data_nodes, placed
    assert placed["RayTrainWorker"] == {trainer_node}, placed

    tasks = list_tasks(detail=True, limit=10_000, raise_on_missing_output=False)
    data_tasks = [
        t for t in tasks if t.node_id and any(k in t.name for k in ("ReadRowFile", "MapBatches"))
    ]
    assert data_tasks, sorted({t.name for t in tasks})
    assert {t.node_id for t in data_tasks} <= data_nodes, {
        t.name: t.node_id for t in data_tasks if t.node_id not in data_nodes
    }
