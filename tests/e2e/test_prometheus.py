"""One job submitted to a real Ray head answers the command line, the model issue and the
metrics: ``rayjobs submit`` runs ``configs/tiny_llama.yaml`` (on a subset of its data) on the
head (README, "Run on a cluster"), its log as the dashboard shows it holds the data side's and
the trainers' progress lines, the Hugging Face Llama it trains saves checkpoints that
``from_pretrained`` loads, and a real Prometheus scraping the head holds the run's series
(README, "Metrics"). One job for all four: each end-to-end run costs the suite about a minute on
2 cores.

Prometheus is Debian's ``prometheus`` package: ``cluster/install-prometheus.sh`` installs it when it
is not on PATH (``.ci/run`` calls it before the tests; the fixture here calls it too, and fails
with its output when it cannot). The head is the session's (``conftest.ray_head``), started the
way ``cluster/start-head.sh`` starts one, with token auth on. Prometheus runs with
``cluster/prometheus.yml`` itself, only its service-discovery path pointed at the head's temp dir
and its intervals at 1 s, so the shipped file-based discovery is what finds the head's metrics
endpoint. ``rayjobs submit`` then ships a project holding ``tiny_llama.yaml`` with the first rows
of its datasets, one torn line skipped, its eval sets and the GPT-2 tokenizer, and follows the
job as a user would. Once it has exited, Prometheus's HTTP API must hold every series of the
README's metrics table, the run summary's counts exactly (efficiency and shares within 1e-6; the
eval sets' under their own run), and data for every Grafana panel's query (not all zeros, rates
aside; the bad-rows panel ending at the summary's counts, the torn line's 1 among them): the run
exported its final values before it exited (``Ledger.flush``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
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
from rayjobs.metrics import METRICS
from support.ray_head import Head, free_ports, rayjobs

INSTALL = ROOT / "cluster" / "install-prometheus.sh"
SHIPPED_CONFIG = ROOT / "cluster" / "prometheus.yml"
DASHBOARD = ROOT / "cluster" / "grafana" / "rayjobs.json"
DISCOVERY = "/tmp/ray/prom_metrics_service_discovery.json"
"""The service-discovery file ``cluster/prometheus.yml`` reads (under the head's temp dir)."""
TINY_LLAMA = ROOT / "configs" / "tiny_llama.yaml"
SUBSET_ROWS = (30, 30)
"""Rows of tiny_llama.yaml's two datasets the job reads (of 300 and 400)."""
SEQ_LEN = 256
EVERY = 4
"""Checkpoints, reports and evaluations every 4 steps."""


def _readme_metrics() -> dict[str, str]:
    """The metrics table of docs/metrics.md: ``{name: "counter" | "gauge"}``."""
    section = (ROOT / "docs" / "metrics.md").read_text()
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


def _expected_eval(summary: dict) -> dict[str, dict[tuple, float]]:
    """What Prometheus must hold for the run's eval sets (their own ledger, run
    ``<run>-eval``), from the summary's ``eval``: tokenization counts and packs."""
    evaluation = summary["eval"]
    expected = {
        f"rayjobs_{key}": {(name,): float(c[key]) for name, c in evaluation["datasets"].items()}
        for key in ("rows", "samples", "tokens", "trained_tokens", "truncated_tokens")
    }
    expected["rayjobs_packs"] = {(): float(evaluation["packed"]["num_packs"])}
    expected["rayjobs_pack_tokens"] = {(): float(evaluation["packed"]["num_tokens"])}
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
        if name.startswith("rayjobs_dpo_"):  # not an SFT run's: test_metrics
            continue
        if _exported(name, kind) not in held:
            problems.append(f"{_exported(name, kind)}: not in Prometheus")
    expected_series = [(run, name, values) for name, values in _expected(summary, seq_len).items()]
    expected_series += [(f"{run}-eval", *item) for item in _expected_eval(summary).items()]
    for tag, name, expected in expected_series:
        found = _values(prometheus, name, table[name], tag)
        if name == "rayjobs_packing_efficiency" or name == "rayjobs_mix_share":
            same = found.keys() == expected.keys() and all(
                math.isclose(found[k], expected[k], rel_tol=0, abs_tol=1e-6) for k in expected
            )
        else:
            same = found == expected
        if not same:
            problems.append(f"{name} (run {tag}): Prometheus {found} != summary {expected}")
    return problems


def _project(folder: Path) -> Path:
    """A project folder holding ``configs/tiny_llama.yaml`` and what it reads: the first
    ``SUBSET_ROWS`` rows of its two datasets (the test stays short) plus one torn JSONL line in
    the chat set, skipped (``rayjobs_skipped_rows`` moves), its eval sets whole and the GPT-2
    tokenizer: what ``rayjobs submit --working-dir`` ships. Trained to the end of its one epoch
    (no ``max_steps``: every pack trained, none cut off), checkpoints and evaluations every
    ``EVERY`` steps, at seq_len ``SEQ_LEN``."""
    config = yaml.safe_load(TINY_LLAMA.read_text())
    alpaca, chat = config["datasets"]
    records = json.loads((ROOT / "configs" / alpaca["source"]).read_text())[: SUBSET_ROWS[0]]
    lines = (ROOT / "configs" / chat["source"]).read_text().splitlines()[: SUBSET_ROWS[1]]
    lines.insert(len(lines) // 2, '{"messages": [{"role": "user", "content": "torn line')
    chat["on_bad_row"] = "skip"
    for spec, text in ((alpaca, json.dumps(records)), (chat, "\n".join(lines) + "\n")):
        (folder / spec["source"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / spec["source"]).write_text(text)
    for spec in config["eval"]["datasets"]:
        (folder / spec["source"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "configs" / spec["source"], folder / spec["source"])
    tokenizer = config["tokenizer"]["path"]
    shutil.copytree(ROOT / "configs" / tokenizer, folder / tokenizer)
    config["eval"]["every_steps"] = EVERY
    config["packing"]["seq_len"] = SEQ_LEN
    del config["train"]["max_steps"]
    config["train"] |= {
        "checkpoint_every": EVERY,
        "report_every": EVERY,
        "storage_path": str(folder.parent / "runs"),
    }
    path = folder / "tiny_llama.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Job:
    record: dict
    """``rayjobs submit --json``'s last line: ``submission_id``, ``status``, ``summary``."""
    stdout: str
    stderr: str
    started: float
    finished: float


@pytest.fixture(scope="module")
def job(ray_head, prometheus, tmp_path_factory) -> Job:
    """One job for the module: ``rayjobs submit`` of the tiny-Llama project (``_project``) to
    the session's head, followed to its end as a user would, while Prometheus scrapes."""
    folder = tmp_path_factory.mktemp("submit") / "proj"
    folder.mkdir()
    config = _project(folder)
    started = time.time()
    argv = ["submit", str(config), "--working-dir", str(folder), "--address", ray_head.url]
    done = rayjobs(ray_head, *argv, "--json", timeout=600)
    finished = time.time()
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    return Job(record, done.stdout, done.stderr, started, finished)


def test_submit_runs_the_job_and_follows_it_to_its_summary(ray_head, job):
    """Acceptance 1 of the cluster issue: ``rayjobs submit`` runs the job on a real head with
    token auth (SUCCEEDED, exit 0), prints where to watch it, follows its log (the human
    summary), and ``logs`` / ``status`` answer for it afterwards."""
    submission = job.record["submission_id"]
    assert job.record["status"] == "SUCCEEDED"
    assert f"submitted job {submission} to {ray_head.url}" in job.stderr
    assert f"{ray_head.url}/#/jobs/{submission}" in job.stderr
    assert "packing efficiency" in job.stdout  # the job's own log, followed
    summary = job.record["summary"]
    # The torn line is skipped and counted once, and named (dataset, file, row).
    chat = summary["datasets"]["hh_chat"]
    assert chat["skipped_by_reason"] == {"invalid_json": 1}
    assert chat["rows"] == SUBSET_ROWS[1] + 1 and chat["samples"] == SUBSET_ROWS[1]
    [example] = chat["skipped_examples"]
    assert "dataset 'hh_chat'" in example and f"row {SUBSET_ROWS[1] // 2 + 1}:" in example
    # On the cluster `rayjobs run --json` printed the summary last, after Ray shut down: no
    # raylet warning or log line follows it.
    logs = rayjobs(ray_head, "logs", submission, "--address", ray_head.url)
    assert logs.returncode == 0, logs.stderr[-2000:]
    last = [line for line in logs.stdout.splitlines() if line.strip()][-1]
    assert json.loads(last) == summary
    status = rayjobs(ray_head, "status", submission, "--address", ray_head.url, "--json")
    assert json.loads(status.stdout.splitlines()[-1])["status"] == "SUCCEEDED"


def _client_logs(head: Head, submission_id: str) -> str:
    """The job's log through the Jobs API's client, with the head's token (what the dashboard's
    job page shows)."""
    code = (
        "import sys\n"
        "from ray.job_submission import JobSubmissionClient\n"
        "sys.stdout.write(JobSubmissionClient(sys.argv[1]).get_job_logs(sys.argv[2]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, head.url, submission_id],
        capture_output=True,
        text=True,
        env=head.env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)


def test_the_jobs_log_holds_the_data_and_training_lines(ray_head, job):
    """Issue 35, acceptance 2: the submitted job's log, as ``JobSubmissionClient.get_job_logs``
    returns it (the dashboard's job page), holds the data side's start-up, token and pack counts
    and rank 0's progress line every ``report_every`` steps and at the last, all before the
    summary line the job's ``rayjobs run --json`` printed."""
    logs = _client_logs(ray_head, job.record["submission_id"])
    steps = job.record["summary"]["steps"]
    # no max_steps: a streamed run's steps are not known ahead, so no "/total" and no ETA
    line = r"rayjobs: step (\d+)  epoch 0/1  loss \d+\.\d+  lr \S+  grad_norm \S+  "
    shown = [int(m[1]) for m in re.finditer(line, logs)]
    assert shown == [*range(EVERY, steps, EVERY), steps], re.findall("rayjobs: step .*", logs)
    counts = r"rayjobs: data: rows \d+  samples \d+  tokens (\d+) \(\d+/s\)  packs (\d+)"
    data = re.findall(counts, logs)
    assert data and int(data[-1][0]) > 0 and int(data[-1][1]) > 0  # tokens and packs
    assert "rayjobs: data: hh_chat: estimating sample lengths from its first rows" in logs
    summary_at = logs.index('{"steps": ')  # the --json line the job's run printed
    assert logs.index(f"rayjobs: step {steps}  ") < summary_at
    assert logs.rindex("rayjobs: data: rows") < summary_at


def test_the_job_trains_a_tiny_llama_whose_checkpoints_load_with_from_pretrained(job):
    """The model issue's acceptance 2 and 4 on the submitted ``rayjobs run
    tiny_llama.yaml`` (real alpaca + hh chat through the GPT-2 tokenizer): a Hugging Face Llama
    trains with 2 workers (equal steps, loss falls, every pack trained), checkpoints every 4
    steps (listed in the summary), and its final checkpoint loads with ``from_pretrained`` and
    gives the trained model's logits (``probe.pt``, computed in the run through the training
    path) on the probe input; the step-4 checkpoint does not (guard). Under DDP; the same save
    path under FSDP2 (sharded parameters gathered, then ``save_model``) is checked on two gloo
    processes by ``test_step.test_fsdp_over_two_processes_takes_the_single_process_step``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import GPT2
    from rayjobs.config import TokenizerConfig
    from rayjobs.data.tokenizer import Tokenizer

    summary = job.record["summary"]
    steps = summary["steps"]
    assert steps >= 2 * EVERY and summary["steps_per_rank"] == [steps, steps]
    assert summary["attempts"] == 1 and not summary["stopped_early"]
    # Every pack trained but an odd one out of the equal split (fewer than 2 workers' worth).
    assert 0 <= summary["untrained_packs"] < 2
    assert (steps - 1) * 2 * 2 < summary["num_packs"] <= steps * 2 * 2
    assert summary["guard_dropped_batches"] == 0
    assert summary["tokens_trained"] > 0 and 0 < summary["packing_efficiency"] <= 1
    assert set(summary["datasets"]) == {"alpaca", "hh_chat"}
    assert summary["datasets"]["alpaca"]["truncated_tokens"] > 0  # seq_len 256 cuts
    assert (summary["parallelism"], summary["model"], summary["attention"]) == ("ddp", "hf", "sdpa")
    assert summary["loss_last"] < summary["loss_first"] - 0.5, summary
    # The first step's (train.checkpoint_every_minutes, on by default), then every EVERY steps.
    assert [c["step"] for c in summary["checkpoints"]] == [1, *range(EVERY, steps + 1, EVERY)]
    for checkpoint in summary["checkpoints"]:
        assert os.path.basename(checkpoint["path"]) == f"checkpoint_step_{checkpoint['step']:06d}"
        assert os.path.isfile(os.path.join(checkpoint["path"], "config.json"))
    final = summary["checkpoint"]
    assert os.path.isfile(os.path.join(final, "summary.json"))
    probe = torch.load(os.path.join(final, "probe.pt"))
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 50257
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        earlier = AutoModelForCausalLM.from_pretrained(summary["checkpoints"][0]["path"]).eval()
        earlier_logits = earlier(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
    assert not torch.allclose(earlier_logits, probe["logits"], atol=1e-3)  # guard: it trained

    tokenizer = AutoTokenizer.from_pretrained(final)
    reference = Tokenizer(TokenizerConfig(path=str(GPT2)))
    text = "Describe a process of making crepes."
    assert tokenizer(text)["input_ids"] == reference.encode_batch([text])[0]
    assert tokenizer.eos_token_id == reference.eos_id == model.config.eos_token_id
    _check_eval(summary, model)


def _check_eval(summary: dict, model) -> None:
    """The held-out loss (eval.datasets) every 4 steps and at the end counts every held-out
    labelled token exactly once over the 2 workers, and the final one equals the loss of the
    loaded checkpoint on each held-out sample run alone (unpacked, no document mask: packing
    changes nothing)."""
    import pyarrow as pa
    import torch

    from conftest import file_tables
    from rayjobs.config import load_config
    from rayjobs.data.tokenize import Tokenize

    evaluation = summary["eval"]
    steps = summary["steps"]
    expected = [*range(EVERY, steps + 1, EVERY), *([steps] if steps % EVERY else [])]
    assert [e["step"] for e in evaluation["history"]] == expected
    held_out = evaluation["datasets"]
    assert set(held_out) == {"alpaca_heldout", "hh_chat_heldout"}
    assert [s["samples"] for s in held_out.values()] == [60, 60]
    trained = sum(s["trained_tokens"] for s in held_out.values())
    for entry in evaluation["history"]:
        assert entry["rows"] == evaluation["packed"]["num_packs"] > 2  # guard: both ranks' shares
        assert entry["tokens"] == trained
    assert evaluation["history"][-1]["loss"] < evaluation["history"][0]["loss"]
    assert evaluation["loss"] == evaluation["history"][-1]["loss"]

    config = load_config(TINY_LLAMA, [f"packing.seq_len={SEQ_LEN}"])
    tokenize = Tokenize(config.eval.datasets, config.tokenizer, SEQ_LEN, "truncate")
    total, count = 0.0, 0
    for spec in config.eval.datasets:
        [path] = spec.files
        data = Path(path).read_bytes()
        tables = file_tables(data, path, format=spec.format, dataset=spec.name)
        samples = tokenize(pa.concat_tables(list(tables)))
        for ids, labels in zip(
            samples.column("input_ids").to_pylist(), samples.column("labels").to_pylist()
        ):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0]
            labels = torch.tensor(labels)
            total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            count += int((labels != -100).sum())
    assert count == trained
    assert abs(evaluation["loss"] - total / count) < 1e-4, (evaluation["loss"], total / count)


def test_prometheus_holds_the_run_summary_and_every_dashboard_series(prometheus, job):
    """Acceptance 3 of the cluster issue: once the job has exited, Prometheus holds every README
    series, the summary's counts (the eval sets' under their own run) and every dashboard
    panel's data for the run."""
    summary = job.record["summary"]
    started, finished = job.started, job.finished
    run = summary["run_name"]
    # The job has exited: what Prometheus holds now is what it exported before exiting. Wait
    # for a few scrapes, never for more exports.
    deadline = time.monotonic() + 15
    while (problems := _mismatches(prometheus, summary, SEQ_LEN, run)) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    assert not problems, "\n".join(problems)
    [loss] = _values(prometheus, "rayjobs_train_loss", "gauge", run).values()
    assert math.isfinite(loss) and loss > 0
    speed = _values(prometheus, "rayjobs_train_tokens_per_s", "gauge", run)
    assert set(speed) == {(str(rank),) for rank in range(len(summary["steps_per_rank"]))}, speed
    assert all(value > 0 for value in speed.values()), speed

    [eval_loss] = _values(prometheus, "rayjobs_eval_loss", "gauge", run).values()
    assert eval_loss == pytest.approx(summary["eval"]["loss"], rel=1e-6)

    # Every query of the Grafana dashboard names series Prometheus holds for this run, and
    # returns data over the run: not all zeros where it is no rate (a rate may miss a burst
    # that a scrape or two saw whole), and the bad-rows panel ends at the summary's counts.
    dashboard = json.loads(DASHBOARD.read_text())
    # (the DPO panels aside: an SFT run exports no such series)
    queries = [
        t["expr"]
        for panel in dashboard["panels"]
        if not panel["title"].startswith("DPO")
        for t in panel.get("targets", [])
    ]
    assert len(queries) >= 15, "guard: every other panel's queries, the eval loss's among them"
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
