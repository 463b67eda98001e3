"""A real Prometheus scrapes a real Ray head while the demo runs (README, "Metrics"), and
``rayjobs submit`` runs that demo on the head (README, "Run on a cluster"): one job for both.

Prometheus is Debian's ``prometheus`` package: ``cluster/install-prometheus.sh`` installs it when it
is not on PATH (``.ci/run`` calls it before the tests; the fixture here calls it too, and fails
with its output when it cannot). The head is the session's (``conftest.ray_head``), started the
way ``cluster/start-head.sh`` starts one, with token auth on. Prometheus runs with
``cluster/prometheus.yml`` itself, only its service-discovery path pointed at the head's temp dir
and its intervals at 1 s, so the shipped file-based discovery is what finds the head's metrics
endpoint. ``rayjobs submit`` then ships a project holding ``configs/demo.yaml`` (one epoch) with
the demo's first rows, one torn line skipped, and follows the job as a user would. Once it has
exited, Prometheus's HTTP API must hold every series of the README's metrics table, the run
summary's counts exactly (efficiency and shares within 1e-6), and data for every Grafana panel's
query (not all zeros, rates aside; the bad-rows panel ending at the summary's counts, the torn
line's 1 among them): the run exported its final values before it exited (``Ledger.flush``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from ray_head import Head, free_ports
from rayjobs.metrics import METRICS

INSTALL = ROOT / "cluster" / "install-prometheus.sh"
SHIPPED_CONFIG = ROOT / "cluster" / "prometheus.yml"
DASHBOARD = ROOT / "cluster" / "grafana" / "rayjobs.json"
DISCOVERY = "/tmp/ray/prom_metrics_service_discovery.json"
"""The service-discovery file ``cluster/prometheus.yml`` reads (under the head's temp dir)."""
SUBSET_ROWS = (150, 75)
"""Rows of the demo's two datasets the job reads (all 600 + 300: 28 steps instead of ~7)."""


def _readme_metrics() -> dict[str, str]:
    """The README's metrics table: ``{name: "counter" | "gauge"}``."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Metrics") : readme.index("## Benchmarks")]
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`rayjobs_"):
            for name in re.findall(r"`(rayjobs_[a-z_]+)`", cells[0]):
                table[name] = cells[1]
    return table


def _exported(name: str, kind: str) -> str:
    """The Prometheus name of a ``ray.util.metrics`` series: Ray's ``ray_`` prefix, counters
    with ``_total``, a histogram's count of observations ``_count`` (``_sum`` and ``_bucket``
    beside it)."""
    suffix = {"counter": "_total", "histogram": "_count"}.get(kind, "")
    return f"ray_{name}{suffix}"


def _get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def test_the_final_export_wait_is_one_report_interval_after_the_last_record():
    import ray

    from rayjobs.metrics import export_interval, wait_for_export

    assert export_interval() == max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    assert wait_for_export(None) == 0  # nothing recorded: no wait
    assert wait_for_export(time.monotonic() - export_interval() - 60) == 0  # exported long ago
    started = time.monotonic()
    # recorded "now" minus all but 0.2 s of the interval and margin: about 0.2 s left
    left = wait_for_export(started - export_interval() - max(1.0, 0.2 * export_interval()) + 0.2)
    assert 0 < left <= 0.2 and time.monotonic() - started >= left


# -- Prometheus ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """``prometheus`` from PATH, installed by ``cluster/install-prometheus.sh`` when absent. Not
    a skip: a machine that cannot get it fails here with the script's output."""
    found = shutil.which("prometheus")
    if found:
        return found
    try:
        done = subprocess.run(
            ["bash", str(INSTALL)], capture_output=True, text=True, timeout=900, check=False
        )
        output = f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    except subprocess.TimeoutExpired as error:
        output = f"timed out after {error.timeout} s"
    found = shutil.which("prometheus")
    if not found:
        pytest.fail(f"cluster/install-prometheus.sh could not install Prometheus: {output}")
    return found


def test_install_script_is_idempotent(prometheus_binary):
    """With ``prometheus`` on PATH the script changes nothing and says so."""
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"already installed: {prometheus_binary}" in done.stderr


def test_promtool_accepts_the_shipped_config(prometheus_binary):
    """Prometheus's own checker (``promtool``, shipped with it) on ``cluster/prometheus.yml``."""
    promtool = Path(prometheus_binary).with_name("promtool")
    promtool = str(promtool) if promtool.exists() else shutil.which("promtool")
    assert promtool, f"no promtool next to {prometheus_binary} or on PATH"
    done = subprocess.run(
        [promtool, "check", "config", str(SHIPPED_CONFIG)], capture_output=True, text=True
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def _test_config(temp: Path) -> dict:
    """``cluster/prometheus.yml`` with its discovery file under ``temp`` and 1 s intervals."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    [job] = config["scrape_configs"]
    [discovery] = job["file_sd_configs"]
    assert discovery["files"] == [DISCOVERY], "cluster/prometheus.yml changed: update this test"
    discovery["files"] = [str(temp / Path(DISCOVERY).name)]
    discovery["refresh_interval"] = "1s"
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    return config


@dataclass
class Prometheus:
    url: str
    log: Path


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, ray_head):
    """Prometheus on loopback, scraping the head through ``cluster/prometheus.yml``'s file-based
    discovery; its storage in a temp dir; stopped by its process id."""
    temp = Path(tempfile.mkdtemp(prefix="rjprom"))
    config = temp / "prometheus.yml"
    config.write_text(yaml.safe_dump(_test_config(ray_head.temp)))
    [port] = free_ports(1)
    log = temp / "prometheus.log"
    command = [
        prometheus_binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={temp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        target = f"127.0.0.1:{ray_head.metrics_port}"
        while True:  # ready once the head's metrics endpoint was scraped successfully
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                active = _get(f"{url}/api/v1/targets")["data"]["activeTargets"]
                if any(t["labels"]["instance"] == target and t["health"] == "up" for t in active):
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus never scraped {target}:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield Prometheus(url, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(temp, ignore_errors=True)


# -- the run ---------------------------------------------------------------------------------------


def _query(prometheus: Prometheus, promql: str) -> list[dict]:
    query = urllib.parse.urlencode({"query": promql})
    answer = _get(f"{prometheus.url}/api/v1/query?{query}")
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _values(prometheus: Prometheus, name: str, kind: str, run: str) -> dict[tuple, float]:
    """``{(label values other than run, in METRICS order): value}`` of one series at its last
    scrape (a gauge's series ends when the run does: Ray drops it ~2 report intervals later and
    Prometheus marks it stale, hence ``last_over_time``), summed over Ray's own labels
    (``WorkerId``: counters are per process, e.g. per train worker)."""
    keys = [key for key in METRICS[name][1] if key != "run"]
    by = ", ".join(keys)
    agg = "max" if kind == "gauge" else "sum"
    promql = f'{agg} by ({by}) (last_over_time({_exported(name, kind)}{{run="{run}"}}[15m]))'
    return {
        tuple(row["metric"].get(key, "") for key in keys): float(row["value"][1])
        for row in _query(prometheus, promql)
    }


def _expected(summary: dict, seq_len: int) -> dict[str, dict[tuple, float]]:
    """What Prometheus must hold for the run, from its summary (the ledger's exact counts)."""
    packed = summary["packed"]
    expected = {
        "rayjobs_packs": {(): float(packed["num_packs"])},
        "rayjobs_pack_tokens": {(): float(packed["num_tokens"])},
        "rayjobs_pack_slots": {(): float(packed["num_packs"] * seq_len)},
        "rayjobs_packing_efficiency": {(): packed["efficiency"]},
        "rayjobs_train_steps": {(): float(summary["steps"])},
        "rayjobs_train_tokens": {(): float(summary["tokens_trained"])},
    }
    for key in ("rows", "samples", "tokens", "trained_tokens", "truncated_tokens",
                "dropped_samples", "split_samples", "skipped_rows"):  # fmt: skip
        expected[f"rayjobs_{key}"] = {
            (name,): float(counts[key]) for name, counts in summary["datasets"].items()
        }
    # Histograms: the count of the length histogram is each dataset's samples, the count of
    # samples per pack every pack (their buckets: ``_bucket_bounds``).
    expected["rayjobs_sample_tokens"] = {
        (name,): float(counts["samples"]) for name, counts in summary["datasets"].items()
    }
    expected["rayjobs_samples_per_pack"] = {(): float(packed["num_packs"])}
    for key in ("share", "samples", "tokens"):
        expected[f"rayjobs_mix_{key}"] = {
            (name, str(epoch["epoch"])): float(stats[key])
            for epoch in summary["mix"]
            for name, stats in epoch["datasets"].items()
        }
    return expected


def _bucket_problems(
    prometheus: Prometheus, name: str, run: str, totals: dict[tuple, float], seq_len: int
) -> list[str]:
    """A histogram's buckets against what the summary knows of its observations: cumulative
    and ending (``le="+Inf"``) at the count, and ``totals`` (the exact sum of the values
    observed, per label set) between the sums of the buckets' lower and upper bounds. Ray
    re-records observations at their buckets' midpoints before export, so ``_sum`` is an
    estimate; the buckets are exact."""
    keys = [key for key in METRICS[name][1] if key != "run"]
    promql = (
        f"sum by ({', '.join([*keys, 'le'])}) "
        f'(last_over_time(ray_{name}_bucket{{run="{run}"}}[15m]))'
    )
    cumulative: dict[tuple, dict[float, float]] = {}
    for row in _query(prometheus, promql):
        labels = tuple(row["metric"].get(key, "") for key in keys)
        cumulative.setdefault(labels, {})[float(row["metric"]["le"])] = float(row["value"][1])
    problems = []
    if cumulative.keys() != totals.keys():
        return [f"{name}_bucket: label sets {sorted(cumulative)} != {sorted(totals)}"]
    for labels, by_le in cumulative.items():
        bounds = sorted(by_le)
        counts = [by_le[b] for b in bounds]
        per_bucket = [b - a for a, b in zip([0.0, *counts], counts)]
        low = sum(n * lo for n, lo in zip(per_bucket, [0.0, *bounds]))
        high = sum(n * min(hi, seq_len) for n, hi in zip(per_bucket, bounds))
        if bounds[-1] != math.inf or min(per_bucket) < 0 or not low <= totals[labels] <= high:
            problems.append(f"{name}_bucket {labels}: {by_le} cannot hold {totals[labels]}")
        if max(per_bucket) == counts[-1]:  # guard: the observations span several buckets
            problems.append(f"{name}_bucket {labels}: every observation in one bucket")
    return problems


def _mismatches(prometheus: Prometheus, summary: dict, seq_len: int, run: str) -> list[str]:
    problems = []
    tokens = {(name,): float(c["tokens"]) for name, c in summary["datasets"].items()}
    problems += _bucket_problems(prometheus, "rayjobs_sample_tokens", run, tokens, seq_len)
    packed = sum(s["samples"] for epoch in summary["mix"] for s in epoch["datasets"].values())
    problems += _bucket_problems(
        prometheus, "rayjobs_samples_per_pack", run, {(): float(packed)}, seq_len
    )
    table = _readme_metrics()
    held = set(_get(f"{prometheus.url}/api/v1/label/__name__/values")["data"])
    for name, kind in sorted(table.items()):
        if name.startswith(("rayjobs_dpo_", "rayjobs_eval_")):  # not this run's: test_metrics
            continue
        if _exported(name, kind) not in held:
            problems.append(f"{_exported(name, kind)}: not in Prometheus")
    for name, expected in _expected(summary, seq_len).items():
        found = _values(prometheus, name, table[name], run)
        if name == "rayjobs_packing_efficiency" or name == "rayjobs_mix_share":
            same = found.keys() == expected.keys() and all(
                math.isclose(found[k], expected[k], rel_tol=0, abs_tol=1e-6) for k in expected
            )
        else:
            same = found == expected
        if not same:
            problems.append(f"{name}: Prometheus {found} != summary {expected}")
    return problems


def _demo_project(folder: Path) -> Path:
    """A project folder holding ``configs/demo.yaml`` and the first rows of its two datasets (the
    test stays short) plus one torn JSONL line in the first, skipped (``rayjobs_skipped_rows``
    moves), and the demo tokenizer: what ``rayjobs submit --working-dir`` ships."""
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    for index, spec in enumerate(demo["datasets"]):
        lines = (ROOT / "configs" / spec["source"]).read_text().splitlines()[: SUBSET_ROWS[index]]
        if index == 0:
            lines.insert(len(lines) // 2, '{"instruction": "torn line')
            spec["on_bad_row"] = "skip"
        path = folder / spec["source"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    shutil.copy(ROOT / "configs" / demo["tokenizer"]["path"], folder / demo["tokenizer"]["path"])
    demo["train"] |= {"epochs": 1, "storage_path": str(folder.parent / "runs")}
    config = folder / "demo.yaml"
    config.write_text(yaml.safe_dump(demo, sort_keys=False))
    return config


def _rayjobs(head: Head, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayjobs.cli", *argv],
        capture_output=True,
        text=True,
        env=head.env,
        cwd=ROOT,
        timeout=timeout,
    )


def test_submit_and_prometheus_hold_the_run_summary_and_every_dashboard_series(
    ray_head, prometheus, tmp_path
):
    """Acceptance 1 and 3 of the cluster issue, on one job: ``rayjobs submit`` runs the demo on a
    real head with token auth (SUCCEEDED, exit 0, the summary in the job's log), and once the job
    has exited Prometheus holds every README series, the summary's counts and every dashboard
    panel's data for the run."""
    seq_len = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["packing"]["seq_len"]
    config = _demo_project(tmp_path / "proj")
    started = time.time()
    done = _rayjobs(
        ray_head,
        "submit",
        str(config),
        "--working-dir",
        str(config.parent),
        "--address",
        ray_head.url,
        "--json",
        timeout=600,
    )
    finished = time.time()
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    job = record["submission_id"]
    assert record["status"] == "SUCCEEDED"
    assert f"submitted job {job} to {ray_head.url}" in done.stderr
    assert f"{ray_head.url}/#/jobs/{job}" in done.stderr
    assert "packing efficiency" in done.stdout  # the job's own log, followed
    summary = record["summary"]
    assert summary["steps"] > 0 and len(set(summary["steps_per_rank"])) == 1, summary
    assert not summary["stopped_early"]
    # The torn line is skipped and counted once per read of it. The demo's weights read alpaca
    # 1.08 times (a whole pass and a 7.7% subsample), and the subsample, decided by (seed, file
    # under the dataset's folder, row), leaves row 76 out wherever the project lies: once.
    assert summary["datasets"]["stdlib_alpaca"]["skipped_by_reason"] == {"invalid_json": 1}
    # On the cluster `rayjobs run --json` printed the summary last, after Ray shut down.
    logs = _rayjobs(ray_head, "logs", job, "--address", ray_head.url)
    assert logs.returncode == 0, logs.stderr[-2000:]
    last = [line for line in logs.stdout.splitlines() if line.strip()][-1]
    assert json.loads(last)["steps"] == summary["steps"]
    status = _rayjobs(ray_head, "status", job, "--address", ray_head.url, "--json")
    assert json.loads(status.stdout.splitlines()[-1])["status"] == "SUCCEEDED"

    run = summary["run_name"]
    assert not summary["stopped_early"] and summary["steps"] > 0

    # The job has exited: what Prometheus holds now is what it exported before exiting. Wait
    # for a few scrapes, never for more exports.
    deadline = time.monotonic() + 15
    while (problems := _mismatches(prometheus, summary, seq_len, run)) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    assert not problems, "\n".join(problems)
    [loss] = _values(prometheus, "rayjobs_train_loss", "gauge", run).values()
    assert math.isfinite(loss) and loss > 0
    speed = _values(prometheus, "rayjobs_train_tokens_per_s", "gauge", run)
    assert set(speed) == {(str(rank),) for rank in range(len(summary["steps_per_rank"]))}, speed
    assert all(value > 0 for value in speed.values()), speed

    # Every query of the Grafana dashboard names series Prometheus holds for this run, and
    # returns data over the run: not all zeros where it is no rate (a rate may miss a burst
    # that a scrape or two saw whole), and the bad-rows panel ends at the summary's counts.
    dashboard = json.loads(DASHBOARD.read_text())
    # (the DPO and eval panels aside: an SFT run without eval.datasets exports no such series)
    queries = [
        t["expr"]
        for panel in dashboard["panels"]
        if not panel["title"].startswith(("DPO", "Eval"))
        for t in panel.get("targets", [])
    ]
    assert len(queries) >= 14, "guard: every other panel's queries"
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    [bad_rows] = [panel for panel in dashboard["panels"] if panel["title"].startswith("Bad rows")]
    for expr in queries:
        names = set(re.findall(r"\bray_rayjobs_[a-z_]+", expr))
        assert names, expr
        for name in names:
            match = urllib.parse.urlencode(
                {"match[]": f'{name}{{run="{run}"}}', "start": started - 60, "end": time.time()}
            )
            assert _get(f"{prometheus.url}/api/v1/series?{match}")["data"], (name, expr)
        if expr.startswith("label_values("):
            continue
        window = urllib.parse.urlencode(
            {
                "query": expr.replace("$run", run),
                "start": started,
                "end": max(finished + 5, time.time()),  # the values checked above are in
                "step": "1",
            }
        )
        answer = _get(f"{prometheus.url}/api/v1/query_range?{window}")
        assert answer["status"] == "success" and answer["data"]["result"], expr
        series = answer["data"]["result"]
        if expr in [target["expr"] for target in bad_rows["targets"]]:
            [key] = re.findall(r"ray_rayjobs_([a-z_]+)_total", expr)
            last = {row["metric"]["dataset"]: float(row["values"][-1][1]) for row in series}
            counts = {name: float(c[key]) for name, c in summary["datasets"].items()}
            assert last == counts, (expr, last, counts)  # skipped rows: 1 for the torn line
        elif "rate(" not in expr:
            assert any(float(v) > 0 for row in series for _, v in row["values"]), expr
