"""The deployment files in cluster/: every YAML parses; the KubeRay RayCluster and RayJob have a
head, a CPU and a GPU worker group with resources, GPUs only where they belong and one shared
checkpoint claim; the RayJob's entrypoint is a real `rayjobs` command whose config validates; the
cluster launcher passes Ray's own schema check; Prometheus reads Ray's service-discovery file; and
start-head.sh, run against a stand-in `ray`, starts a head bound to loopback without touching the
auth mode. Nothing here starts Ray, Kubernetes or a cloud.

Each check is a function returning the problems it finds. The tests run it on the real files
(no problems) and on broken copies (the expected problem), so every check is seen failing.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from conftest import ROOT
from rayjobs.cli import _parser
from rayjobs.config import ConfigError, load_config
from rayjobs.data.placement import labels_match

CLUSTER = ROOT / "cluster"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
LAUNCHER = CLUSTER / "cluster-launcher.yaml"
PROMETHEUS = CLUSTER / "prometheus.yml"
START_HEAD = CLUSTER / "start-head.sh"
GPU = "nvidia.com/gpu"
WORKER_GROUPS = {"cpu-workers": False, "gpu-workers": True}  # group name → asks for a GPU
RAY = version("ray")
IMAGE = f"rayproject/ray:{RAY}-py{sys.version_info.major}{sys.version_info.minor}"
"""The image the project runs on: this Ray and this Python (rayproject/ray's tag scheme)."""


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _by_name(*cases: tuple) -> list:
    """Scenario rows (mutation, expected problem), each named after its mutation."""
    return [pytest.param(*case, id=case[0].__name__.strip("_")) for case in cases]


def _cluster_spec() -> dict:
    return _load(RAYCLUSTER)["spec"]


def _rayjob() -> dict:
    return _load(RAYJOB)


# --- every YAML parses ---------------------------------------------------------------------------


def test_every_yaml_under_cluster_parses_to_a_mapping():
    files = sorted(p for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".yml"))
    names = {p.relative_to(CLUSTER).as_posix() for p in files}
    assert {
        "kuberay/raycluster.yaml",
        "kuberay/rayjob.yaml",
        "cluster-launcher.yaml",
        "prometheus.yml",
    } <= names, "guard: the files this test is about are all seen"
    for path in files:
        assert isinstance(_load(path), dict), path


# --- KubeRay: the cluster spec -------------------------------------------------------------------


def _container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def group_problems(name: str, group: dict, *, gpu: bool) -> list[str]:
    """What is wrong with one head or worker group: resources, GPU, image, metrics port."""
    problems = []
    container = _container(group)
    resources = container.get("resources", {})
    for kind in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(resources.get(kind) or {})
        if missing:
            problems.append(f"{name}: resources.{kind} lacks {sorted(missing)}")
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if gpu:
        if int(limits.get(GPU, 0)) < 1:
            problems.append(f"{name}: no {GPU} limit")
        if GPU in requests and requests[GPU] != limits.get(GPU):
            problems.append(f"{name}: {GPU} request differs from its limit")
    elif GPU in limits or GPU in requests:
        problems.append(f"{name}: asks for {GPU}")
    image = container.get("image", "")
    expected = IMAGE + ("-gpu" if gpu else "")
    if image != expected:
        problems.append(f"{name}: image {image!r}, expected {expected!r}")
    params = group.get("rayStartParams") or {}
    port = params.get("metrics-export-port")
    exposed = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if port is None or exposed.get("metrics") != int(port):
        problems.append(
            f"{name}: metrics-export-port {port!r} is not the exposed 'metrics' port "
            f"{exposed.get('metrics')!r}"
        )
    if "num-cpus" not in params:
        problems.append(f"{name}: rayStartParams has no num-cpus")
    return problems


def spec_problems(spec: dict) -> list[str]:
    """What is wrong with a RayCluster spec (also a RayJob's rayClusterSpec)."""
    problems = []
    if spec.get("rayVersion") != RAY:
        problems.append(f"rayVersion {spec.get('rayVersion')!r} is not Ray {RAY}")
    if (spec.get("authOptions") or {}).get("mode") != "token":
        problems.append("authOptions.mode is not token")
    head = spec.get("headGroupSpec")
    if head is None:
        return [*problems, "no headGroupSpec"]
    problems += group_problems("head", head, gpu=False)
    if head.get("rayStartParams", {}).get("num-cpus") != "0":
        problems.append("head: num-cpus is not 0 (the head runs drivers only)")
    env = {e["name"] for e in _container(head).get("env", [])}
    for setting in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"):
        if setting not in env:
            problems.append(f"head: no {setting}")
    groups = {g.get("groupName"): g for g in spec.get("workerGroupSpecs", [])}
    if set(groups) != set(WORKER_GROUPS):
        problems.append(f"worker groups {sorted(groups)}, expected {sorted(WORKER_GROUPS)}")
    for name, gpu in WORKER_GROUPS.items():
        if name in groups:
            problems += group_problems(name, groups[name], gpu=gpu)
    return problems


def _claims(group: dict) -> dict[str, str]:
    """claim name → mount path in the group's Ray container."""
    pod = group["template"]["spec"]
    volumes = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    mounts = _container(group).get("volumeMounts", [])
    return {volumes[m["name"]]: m["mountPath"] for m in mounts if m["name"] in volumes}


def test_raycluster_is_a_ray_io_v1_raycluster():
    manifest = _load(RAYCLUSTER)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")


@pytest.mark.parametrize(
    "where", ["raycluster.yaml spec", "rayjob.yaml rayClusterSpec"], ids=["raycluster", "rayjob"]
)
def test_cluster_specs_have_head_cpu_and_gpu_groups_with_resources(where):
    spec = (
        _cluster_spec() if where.startswith("raycluster") else _rayjob()["spec"]["rayClusterSpec"]
    )
    assert spec_problems(spec) == []


def _groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _without_gpu(spec):
    for kind in ("limits", "requests"):
        _container(_groups(spec)["gpu-workers"])["resources"][kind].pop(GPU)


def _cpu_group_with_gpu(spec):
    _container(_groups(spec)["cpu-workers"])["resources"]["limits"][GPU] = "1"


def _head_without_limits(spec):
    del _container(spec["headGroupSpec"])["resources"]["limits"]


def _cpu_group_without_memory_request(spec):
    del _container(_groups(spec)["cpu-workers"])["resources"]["requests"]["memory"]


def _gpu_image_on_cpu_group(spec):
    _container(_groups(spec)["cpu-workers"])["image"] = IMAGE + "-gpu"


def _cpu_image_on_gpu_group(spec):
    _container(_groups(spec)["gpu-workers"])["image"] = IMAGE


def _metrics_port_moved(spec):
    _groups(spec)["gpu-workers"]["rayStartParams"]["metrics-export-port"] = "9999"


def _no_gpu_group(spec):
    spec["workerGroupSpecs"] = [
        g for g in spec["workerGroupSpecs"] if g["groupName"] != "gpu-workers"
    ]


def _auth_disabled(spec):
    spec["authOptions"] = {"mode": "disabled"}


def _head_takes_work(spec):
    spec["headGroupSpec"]["rayStartParams"]["num-cpus"] = "4"


def _no_grafana_host(spec):
    container = _container(spec["headGroupSpec"])
    container["env"] = [e for e in container["env"] if e["name"] != "RAY_GRAFANA_HOST"]


def _other_ray(spec):
    spec["rayVersion"] = "2.9.0"


@pytest.mark.parametrize(
    "mutate, problem",
    _by_name(
        (_without_gpu, f"gpu-workers: no {GPU} limit"),
        (_cpu_group_with_gpu, f"cpu-workers: asks for {GPU}"),
        (_head_without_limits, "head: resources.limits lacks ['cpu', 'memory']"),
        (_cpu_group_without_memory_request, "cpu-workers: resources.requests lacks ['memory']"),
        (_gpu_image_on_cpu_group, "cpu-workers: image"),
        (_cpu_image_on_gpu_group, "gpu-workers: image"),
        (_metrics_port_moved, "gpu-workers: metrics-export-port '9999'"),
        (_no_gpu_group, "worker groups ['cpu-workers'], expected"),
        (_auth_disabled, "authOptions.mode is not token"),
        (_head_takes_work, "head: num-cpus is not 0"),
        (_no_grafana_host, "head: no RAY_GRAFANA_HOST"),
        (_other_ray, "rayVersion '2.9.0'"),
    ),
)
def test_spec_check_catches_a_broken_spec(mutate, problem):
    spec = copy.deepcopy(_cluster_spec())
    mutate(spec)
    problems = spec_problems(spec)
    assert any(p.startswith(problem) for p in problems), problems


def test_rayjob_runs_on_the_same_cluster_spec_as_raycluster():
    """One cluster spec in two files: a change to one must be made to the other."""
    assert _rayjob()["spec"]["rayClusterSpec"] == _cluster_spec()


# --- KubeRay: shared checkpoint storage ----------------------------------------------------------


def _readme_claim() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", (CLUSTER / "README.md").read_text(), re.DOTALL)
    claims = [d for d in map(yaml.safe_load, blocks) if d.get("kind") == "PersistentVolumeClaim"]
    assert len(claims) == 1, "guard: cluster/README.md shows one PersistentVolumeClaim"
    return claims[0]


def test_every_pod_mounts_the_shared_claim_that_the_readme_creates():
    claim = _readme_claim()
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "pods on many nodes share it"
    spec = _cluster_spec()
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert claim["metadata"]["name"] in _claims(group), group.get("groupName", "head")


# --- KubeRay: the RayJob -------------------------------------------------------------------------


def test_rayjob_is_a_ray_io_v1_rayjob_that_cleans_up():
    job = _rayjob()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert isinstance(job["spec"]["ttlSecondsAfterFinished"], int)
    assert job["spec"]["ttlSecondsAfterFinished"] >= 0


def _listed(source: str, accept, options=None) -> list:
    """``files.resolve`` without a store: the source as its one file."""
    from rayjobs.data.files import Found

    return [Found(source.rstrip("/") + ("/part-0.json" if source.endswith("/") else ""), 1)]


def entrypoint_problems(entrypoint: str, spec: dict) -> list[str]:
    """Runs a RayJob entrypoint's arguments through the real CLI parser and config loader, and
    checks that the run fits the cluster: GPUs for every trainer, checkpoints on the shared claim.

    The job's working directory is the repository (runtimeEnvYAML.working_dir), so the config path
    is resolved against the repository root."""
    words = shlex.split(entrypoint)
    if not words or words[0] != "rayjobs":
        return [f"entrypoint does not run the rayjobs command: {words[:1]}"]
    try:
        args = _parser().parse_args(words[1:])
    except SystemExit:
        return [f"rayjobs rejects the arguments {words[1:]}"]
    if args.command != "run":
        return [f"rayjobs {args.command} is not a training run"]
    path = Path(args.config)
    if path.is_absolute() or ".." in path.parts or not (ROOT / path).is_file():
        return [f"config {args.config} is not a file of the repository"]
    try:  # object-store sources are listed as named (no store here); the rest as the job would
        with mock.patch("rayjobs.data.files.resolve", _listed):
            config = load_config(ROOT / path, args.overrides)
    except ConfigError as error:
        return [f"config does not validate: {error}"]
    problems = []
    gpu_group = _groups(spec)["gpu-workers"]
    gpus = gpu_group["replicas"] * int(_container(gpu_group)["resources"]["limits"][GPU])
    if not config.train.use_gpu:
        problems.append("train.use_gpu is off: the trainers would not use gpu-workers")
    elif config.train.num_workers > gpus:
        problems.append(f"{config.train.num_workers} trainers, {gpus} GPUs in gpu-workers")
    for key, selector, home in (
        ("ray.data_label_selector", config.ray.data_label_selector, "cpu-workers"),
        ("train.label_selector", config.train.label_selector, "gpu-workers"),
    ):
        if not selector:
            if key.startswith("ray."):
                problems.append(f"{key} is empty: data tasks may land on gpu-workers")
            continue
        matched = sorted(
            name
            for name, group in _groups(spec).items()
            if labels_match(group.get("labels") or {}, selector)
        )
        if matched != [home]:
            problems.append(f"{key} {selector} matches worker groups {matched}, not [{home!r}]")
    mounts = _claims(gpu_group).values()
    if not any(Path(config.train.storage_path).is_relative_to(m) for m in mounts):
        problems.append(
            f"train.storage_path {config.train.storage_path} is not on the shared claim"
        )
    return problems


def test_rayjob_entrypoint_is_a_real_command_on_a_config_that_validates():
    job = _rayjob()
    entrypoint = job["spec"]["entrypoint"]
    assert shlex.split(entrypoint)[1:3] == ["run", "configs/alpaca_chat_s3.yaml"], "guard"
    assert entrypoint_problems(entrypoint, job["spec"]["rayClusterSpec"]) == []


def test_the_rayjob_reads_object_storage_with_credentials_from_a_secret():
    """The RayJob's data is on object storage, not in the job's upload, and every pod gets the
    store's credentials from a Kubernetes Secret that cluster/README.md makes (no secret in the
    manifest or in the job's runtime environment)."""
    job = _rayjob()
    words = shlex.split(job["spec"]["entrypoint"])
    args = _parser().parse_args(words[1:])
    with mock.patch("rayjobs.data.files.resolve", _listed):
        config = load_config(ROOT / args.config, args.overrides)
    assert config.datasets and all(
        f.startswith(("s3://", "gs://", "abfs://", "az://"))
        for d in config.datasets
        for f in d.files
    )
    spec = job["spec"]["rayClusterSpec"]
    secrets = set()
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        refs = [
            e["secretRef"]["name"] for e in _container(group).get("envFrom", []) if "secretRef" in e
        ]
        assert refs, group.get("groupName", "head")
        secrets |= set(refs)
    readme = (CLUSTER / "README.md").read_text()
    assert len(secrets) == 1 and f"kubectl create secret generic {secrets.pop()}" in readme
    manifest = RAYJOB.read_text()
    assert "AWS_SECRET_ACCESS_KEY" not in job["spec"]["runtimeEnvYAML"]
    assert not re.search(r"AWS_SECRET_ACCESS_KEY\s*[:=]\s*\S", manifest)


GOOD = (
    "rayjobs run configs/alpaca_chat_gpt2.yaml train.use_gpu=true "
    "'ray.data_label_selector={rayjobs.io/role: data}' train.storage_path=/mnt/rayjobs/runs"
)


@pytest.mark.parametrize(
    "entrypoint, problem",
    [
        pytest.param(*row[1:], id=row[0])
        for row in [
            ("not-rayjobs", "python train.py", "entrypoint does not run the rayjobs command"),
            ("no-such-command", GOOD.replace(" run ", " train "), "rayjobs rejects the arguments"),
            ("no-such-option", GOOD + " --epochs 2", "rayjobs rejects the arguments"),
            ("export", GOOD.replace(" run ", " export ") + " --out x", "rayjobs export is not"),
            ("no-config", GOOD.replace("gpt2", "gpt3"), "config configs/alpaca_chat_gpt3.yaml"),
            ("outside", GOOD.replace("configs/", "../configs/"), "config ../configs/alpaca"),
            ("unknown-key", GOOD + " train.bogus=1", "config does not validate"),
            ("bad-value", GOOD + " packing.seq_len=0", "config does not validate"),
            ("cpu-training", GOOD.replace("gpu=true", "gpu=false"), "train.use_gpu is off"),
            ("too-many-trainers", GOOD + " train.num_workers=3", "3 trainers, 2 GPUs"),
            ("local-checkpoints", GOOD.replace("/mnt/rayjobs/runs", "runs"), "train.storage_path"),
            (
                "data-anywhere",
                GOOD.replace("'ray.data_label_selector={rayjobs.io/role: data}' ", ""),
                "ray.data_label_selector is empty",
            ),
            (
                "data-on-gpus",
                GOOD.replace("role: data", "role: train"),
                "ray.data_label_selector {'rayjobs.io/role': 'train'} matches worker groups "
                "['gpu-workers']",
            ),
            (
                "trainers-on-cpus",
                GOOD + " 'train.label_selector={rayjobs.io/role: data}'",
                "train.label_selector {'rayjobs.io/role': 'data'} matches worker groups "
                "['cpu-workers']",
            ),
        ]
    ],
)
def test_entrypoint_check_catches_a_broken_entrypoint(entrypoint, problem):
    problems = entrypoint_problems(entrypoint, _cluster_spec())
    assert any(p.startswith(problem) for p in problems), problems


def test_rayjob_runtime_env_installs_and_unpacks_the_same_archive():
    env = yaml.safe_load(_rayjob()["spec"]["runtimeEnvYAML"])
    archive = env["working_dir"]
    assert archive.startswith("https://") and archive.endswith(".zip"), archive
    assert env["pip"] == [f"rayjobs @ {archive}"]


# --- Ray cluster launcher ------------------------------------------------------------------------


def launcher_problems(config: dict) -> list[str]:
    """Ray's own check of a launcher config (schema, head_node_type among the node types), then
    the rayjobs layout: a head without work, a CPU type and a GPU type, rayjobs installed."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except Exception as error:  # noqa: BLE001 - jsonschema, ValueError, KeyError: all a "no"
        return [f"Ray rejects it: {type(error).__name__}: {str(error).splitlines()[0]}"]
    problems = []
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    if head["resources"].get("CPU") != 0 or head["resources"].get("GPU"):
        problems.append("head: declares CPUs or GPUs (it runs drivers only)")
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    gpu = [n for n, t in workers.items() if t["resources"].get("GPU", 0) >= 1]
    cpu = [n for n, t in workers.items() if not t["resources"].get("GPU")]
    if gpu != ["gpu-workers"] or cpu != ["cpu-workers"]:
        problems.append(f"GPU types {gpu}, CPU types {cpu}")
    for name, node_type in workers.items():
        image = node_type.get("docker", {}).get("worker_image", config["docker"]["image"])
        expected = IMAGE + ("-gpu" if name in gpu else "")
        if image != expected:
            problems.append(f"{name}: image {image!r}, expected {expected!r}")
    checkout = [remote for remote, local in config.get("file_mounts", {}).items() if local == "."]
    installs = [c for c in config.get("setup_commands", []) if c.startswith("pip install")]
    if not checkout or not any(c.split()[-1] == checkout[0] for c in installs):
        problems.append(f"setup_commands {installs} do not install the mounted checkout {checkout}")
    head_start = " ".join(config["head_start_ray_commands"])
    if "--dashboard-host=127.0.0.1" not in head_start:
        problems.append("head: dashboard not on loopback")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        if "--metrics-export-port=8080" not in " ".join(config[key]):
            problems.append(f"{key}: no --metrics-export-port=8080")
    return problems


def test_cluster_launcher_has_head_cpu_and_gpu_node_types_and_passes_rays_check():
    config = _load(LAUNCHER)
    assert config["head_node_type"] in config["available_node_types"]
    assert launcher_problems(config) == []


def _launcher_head_elsewhere(c):
    c["head_node_type"] = "ray.head.default"


def _launcher_no_gpu(c):
    c["available_node_types"]["gpu-workers"]["resources"].pop("GPU")


def _launcher_gpu_on_cpu(c):
    c["available_node_types"]["cpu-workers"]["resources"]["GPU"] = 1


def _launcher_gpu_image_everywhere(c):
    c["docker"]["image"] = IMAGE + "-gpu"


def _launcher_no_install(c):
    c["setup_commands"] = []


def _launcher_unknown_key(c):
    c["available_node_types"]["cpu-workers"]["node_cfg"] = {}


def _launcher_dashboard_open(c):
    c["head_start_ray_commands"] = [
        s.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
        for s in c["head_start_ray_commands"]
    ]


@pytest.mark.parametrize(
    "mutate, problem",
    _by_name(
        (_launcher_head_elsewhere, "Ray rejects it: ValueError"),
        (_launcher_unknown_key, "Ray rejects it: ValidationError"),
        (_launcher_no_gpu, "GPU types []"),
        (_launcher_gpu_on_cpu, "GPU types ['cpu-workers', 'gpu-workers']"),
        (_launcher_gpu_image_everywhere, "cpu-workers: image"),
        (_launcher_no_install, "setup_commands [] do not install"),
        (_launcher_dashboard_open, "head: dashboard not on loopback"),
    ),
)
def test_launcher_check_catches_a_broken_config(mutate, problem):
    config = copy.deepcopy(_load(LAUNCHER))
    mutate(config)
    problems = launcher_problems(config)
    assert any(p.startswith(problem) for p in problems), problems


# --- Prometheus ----------------------------------------------------------------------------------


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, duration
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60}[match[2]]


def test_prometheus_reads_rays_service_discovery_file_every_few_seconds():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    config = _load(PROMETHEUS)
    (job,) = config["scrape_configs"]
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    # Ray writes the file into its session folder and links it from its temp dir (/tmp/ray).
    assert files == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
    interval = job.get("scrape_interval", config["global"]["scrape_interval"])
    assert _seconds(interval) <= 15, "gauges vanish ~20 s after their last update"
    assert _seconds(job["file_sd_configs"][0].get("refresh_interval", "5m")) <= 15


# --- start-head.sh -------------------------------------------------------------------------------


def test_start_head_is_valid_executable_bash():
    assert START_HEAD.stat().st_mode & stat.S_IXUSR, "cluster/start-head.sh is executable"
    subprocess.run(["bash", "-n", str(START_HEAD)], check=True)


STAND_IN = """#!/usr/bin/env bash
# Stands in for `ray`: records its arguments and the settings it was started with.
printf '%s\\n' "$@" > "$RECORD.args"
for name in RAY_AUTH_MODE RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER RAY_PROMETHEUS_HOST RAY_GRAFANA_HOST \\
            RAY_GRAFANA_IFRAME_HOST; do
  if [[ -v $name ]]; then echo "$name=${!name}"; else echo "$name unset"; fi
done > "$RECORD.env"
exit "${STAND_IN_EXIT:-0}"
"""


def run_start_head(
    tmp_path: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """Runs start-head.sh with a stand-in `ray` first on PATH and a fresh HOME (no token)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(STAND_IN)
    (bin_dir / "ray").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "RAYJOBS_")) and k not in ("HOME", "PATH")
    }
    environment = {
        **clean,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "RECORD": str(tmp_path / "ray"),
        **env,
    }
    done = subprocess.run(
        ["bash", str(START_HEAD), *args], env=environment, capture_output=True, text=True
    )
    recorded = {}
    if (tmp_path / "ray.args").exists():
        recorded["args"] = (tmp_path / "ray.args").read_text().splitlines()
        recorded["env"] = dict(
            line.split("=", 1) if "=" in line else (line.split()[0], None)
            for line in (tmp_path / "ray.env").read_text().splitlines()
        )
    return done, recorded


def test_start_head_starts_a_head_with_dashboard_and_metrics_on_loopback(tmp_path):
    done, ray_call = run_start_head(tmp_path, "--object-store-memory=1000000000")
    assert done.returncode == 0, done.stderr
    args = ray_call["args"]
    assert args[:2] == ["start", "--head"]
    for flag in (
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--node-ip-address=127.0.0.1",
        "--metrics-export-port=8080",
        "--dashboard-port=8265",
        "--port=6379",
    ):
        assert flag in args
    assert args[-1] == "--object-store-memory=1000000000", "extra arguments reach ray start"
    cores = os.sysconf("SC_NPROCESSORS_ONLN")
    assert f"--num-cpus={max(4, 2 * cores)}" in args, "the embedded Ray's logical CPUs"
    # single-machine mode: without it `ray start` swaps 127.0.0.1 for the routable IP
    assert ray_call["env"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert ray_call["env"]["RAY_PROMETHEUS_HOST"] == "http://127.0.0.1:9090"
    assert ray_call["env"]["RAY_GRAFANA_HOST"] == "http://127.0.0.1:3000"
    assert ray_call["env"]["RAY_GRAFANA_IFRAME_HOST"] == "http://127.0.0.1:3000"
    assert "Dashboard       http://127.0.0.1:8265" in done.stdout
    assert "Ray address     127.0.0.1:6379" in done.stdout


def test_start_head_passes_settings_through(tmp_path):
    done, ray_call = run_start_head(
        tmp_path,
        RAYJOBS_NUM_CPUS="7",
        RAYJOBS_METRICS_PORT="9100",
        RAY_GRAFANA_HOST="http://grafana.example:3000",
        RAY_GRAFANA_IFRAME_HOST="https://grafana.example",
    )
    assert done.returncode == 0, done.stderr
    assert "--num-cpus=7" in ray_call["args"]
    assert "--metrics-export-port=9100" in ray_call["args"]
    assert ray_call["env"]["RAY_GRAFANA_HOST"] == "http://grafana.example:3000"
    assert ray_call["env"]["RAY_GRAFANA_IFRAME_HOST"] == "https://grafana.example"


@pytest.mark.parametrize(
    "caller, token_file, seen_by_ray, reported",
    [
        ({}, False, None, "disabled"),  # Ray's choice: no token, no auth (Ray warns)
        ({}, True, None, "token"),  # Ray's choice: a token turns it on
        ({"RAY_AUTH_MODE": "token"}, False, "token", "token"),
        ({"RAY_AUTH_TOKEN": "secret"}, False, None, "token"),
    ],
)
def test_start_head_leaves_the_auth_mode_to_ray(
    tmp_path, caller, token_file, seen_by_ray, reported
):
    if token_file:
        (tmp_path / "home" / ".ray").mkdir(parents=True)
        (tmp_path / "home" / ".ray" / "auth_token").write_text("t" * 32)
    done, ray_call = run_start_head(tmp_path, **caller)
    assert done.returncode == 0, done.stderr
    assert ray_call["env"]["RAY_AUTH_MODE"] == seen_by_ray
    assert re.search(rf"Token auth\s+{reported}\n", done.stdout), done.stdout
    assert ("export RAY_AUTH_MODE=token" in done.stdout) == (reported == "token")


def test_start_head_fails_when_ray_start_fails(tmp_path):
    done, ray_call = run_start_head(tmp_path, STAND_IN_EXIT="1")
    assert ray_call["args"][:2] == ["start", "--head"], "guard: ray was called"
    assert done.returncode != 0
    assert "head is up" not in done.stdout
