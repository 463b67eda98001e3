"""``rayjobs submit`` / ``status`` / ``logs`` / ``stop`` (rayjobs/job/submit.py) and the last line
of
``rayjobs run --json``.

Without Ray running: address resolution, the runtime_env and entrypoint built for a config (the
entrypoint goes back through the real argument parser and config loader), the refusals of inputs
the job could not find on the cluster, the file list checked against the zip Ray builds, and the
follow / exit-code logic against a stand-in Jobs client. With Ray: the session's real head
(``conftest.ray_head``: loopback only, token auth on, its own ports and temp dir), a job that fails
inside the cluster; the job that succeeds there (configs/tiny_llama.yaml) is submitted by
test_prometheus.py, which also checks its model and its metrics in Prometheus (one job for all:
a job here costs ~100 s).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import ROOT
from rayjobs.cli import _parser, main
from rayjobs.config import load_config
from rayjobs.job import submit
from support.ray_head import Head

DEMO = ROOT / "configs" / "demo"


# -- address -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, environ, expected",
    [
        ("http://head:8265/", {"RAY_API_SERVER_ADDRESS": "http://other:1"}, "http://head:8265"),
        ("10.0.0.5:8265", {}, "http://10.0.0.5:8265"),
        (None, {"RAY_API_SERVER_ADDRESS": "https://jobs.example", "RAY_ADDRESS": "http://x:1"}, "https://jobs.example"),
        (None, {"RAY_ADDRESS": "http://127.0.0.1:9999"}, "http://127.0.0.1:9999"),
        (None, {"RAY_ADDRESS": "127.0.0.1:6379"}, submit.DEFAULT_ADDRESS),  # a GCS address
        (None, {"RAY_ADDRESS": "auto"}, submit.DEFAULT_ADDRESS),
        (None, {}, "http://127.0.0.1:8265"),
    ],
    ids=["flag", "flag_without_scheme", "api_server_env", "ray_address_url", "ray_address_gcs",
         "ray_address_auto", "default"],
)  # fmt: skip
def test_address_resolution(flag, environ, expected):
    assert submit.resolve_address(flag, environ) == expected


# -- what is shipped -----------------------------------------------------------------------------


def test_demo_ships_the_checkout_and_its_entrypoint_is_a_real_run_command():
    overrides = ["train.max_steps=3", "tokenizer.eos_token=<|endoftext|>", "seed=7"]
    plan = submit.plan_submission(DEMO.parent / "demo.yaml", overrides)
    assert plan.working_dir == ROOT and plan.config == "configs/demo.yaml"
    env = plan.runtime_env
    assert env["working_dir"] == str(ROOT)
    assert "py_modules" not in env  # the checkout's rayjobs/ is the package: shipped once
    for pattern in (".git", "runs/", "__pycache__", "*.egg-info", ".venv"):
        assert pattern in env["excludes"]
    files = submit.shipped_files(ROOT, env["excludes"])
    assert {"configs/demo.yaml", "configs/demo/alpaca.jsonl", "rayjobs/cli.py"} <= set(files)
    assert not [f for f in files if f.startswith(".git/") or "__pycache__" in f or ".egg-info" in f]
    assert plan.upload_bytes == sum(files.values()) < submit.MAX_UPLOAD_MIB * 2**20
    # The cluster runs this command in its copy of the working directory:
    argv = shlex.split(plan.entrypoint)
    assert argv[:3] == ["python", "-m", "rayjobs.cli"]
    args = _parser().parse_args(argv[3:])
    assert (args.command, args.config, args.overrides, args.json) == (
        "run",
        "configs/demo.yaml",
        overrides,  # shell specials (<|...|>) survive the shell
        True,
    )
    config = load_config(plan.working_dir / args.config, args.overrides)
    assert (config.train.max_steps, config.seed) == (3, 7)
    assert any("train.storage_path" in note for note in plan.notes)  # relative: said on stderr


def _project(root: Path, config: dict | None = None) -> Path:
    """A small project outside the checkout: data/a.jsonl, tok/tokenizer.json, cfg.yaml."""
    (root / "data").mkdir(parents=True)
    (root / "tok").mkdir()
    lines = (DEMO / "alpaca.jsonl").read_text().splitlines()[:20]
    (root / "data" / "a.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(DEMO / "tokenizer.json", root / "tok" / "tokenizer.json")
    config = config or {
        "datasets": [{"name": "a", "source": "data/a.jsonl", "template": "alpaca"}],
        "tokenizer": {"path": "tok", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "packing": {"seq_len": 128},
        "train": {"max_steps": 1, "epochs": 1, "storage_path": str(root / "out")},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_project_outside_the_checkout_gets_the_package_as_py_modules(tmp_path):
    config = _project(tmp_path / "proj")
    plan = submit.plan_submission(config, working_dir=tmp_path / "proj")
    assert plan.runtime_env["working_dir"] == str((tmp_path / "proj").resolve())
    assert plan.runtime_env["py_modules"] == [str(ROOT / "rayjobs")]
    assert "/rayjobs/" in plan.runtime_env["excludes"]  # no other rayjobs/ may shadow it
    assert plan.config == "cfg.yaml" and plan.notes == []  # storage_path is absolute
    files = submit.shipped_files(plan.working_dir, plan.runtime_env["excludes"])
    assert set(files) == {"cfg.yaml", "data/a.jsonl", "tok/tokenizer.json"}


def test_default_working_dir_is_the_checkout_holding_the_config(tmp_path):
    (tmp_path / "repo" / "configs").mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    assert (
        submit.repository_root(tmp_path / "repo" / "configs" / "x.yaml")
        == (tmp_path / "repo").resolve()
    )
    assert submit.repository_root(DEMO.parent / "demo.yaml") == ROOT


def _refusal(config: Path, overrides=(), **kwargs) -> str:
    with pytest.raises(submit.SubmitError) as caught:
        submit.plan_submission(config, overrides, **kwargs)
    return str(caught.value)


def test_inputs_outside_the_working_directory_are_refused_naming_key_and_path(tmp_path):
    config = _project(tmp_path / "proj")
    _project(tmp_path / "elsewhere")
    outside = tmp_path / "elsewhere" / "data" / "a.jsonl"
    wd = tmp_path / "proj"
    message = _refusal(config, [f"datasets.0.source={outside}"], working_dir=wd)
    assert message.startswith("cannot submit:")
    assert (
        f"datasets.0.source (dataset 'a'): {outside} is outside the working directory shipped "
        f"to the cluster ({wd.resolve()}); put it under that folder" in message
    )
    assert "--allow-absolute" in message
    # The held-out datasets too (eval.datasets): the job reads them on the cluster as well.
    held_out = f"eval.datasets=[{{name: h, source: {outside}, template: alpaca}}]"
    message = _refusal(config, [held_out], working_dir=wd)
    assert f"eval.datasets.0.source (dataset 'h'): {outside} is outside the working" in message
    # A relative path that climbs out is refused the same way (no flag makes it work there).
    message = _refusal(config, ["tokenizer.path=../elsewhere/tok"], working_dir=wd)
    assert f"tokenizer.path: ../elsewhere/tok ({tmp_path.resolve() / 'elsewhere'}" in message
    assert "is outside the working directory shipped to the cluster" in message
    # An absolute path is the cluster's path: --allow-absolute lets it through.
    plan = submit.plan_submission(
        config, [f"datasets.0.source={outside}"], working_dir=wd, allow_absolute=True
    )
    assert f"datasets.0.source={outside}" in shlex.split(plan.entrypoint)


def test_a_model_to_start_from_must_travel_with_the_job(tmp_path):
    """``train.model.path`` / ``config_path`` (``kind: hf``) are inputs like the data: a
    checkpoint under ``runs/`` (which the upload leaves out) is refused naming the key; without
    the check the cluster took the missing folder for a Hub name."""
    config = _project(tmp_path / "proj")
    (tmp_path / "proj" / "runs" / "prev").mkdir(parents=True)
    (tmp_path / "proj" / "runs" / "prev" / "config.json").write_text('{"model_type": "llama"}')
    for key in ("path", "config_path"):
        message = _refusal(
            config, ["train.model.kind=hf", f"train.model.{key}=runs/prev"],
            working_dir=tmp_path / "proj",
        )  # fmt: skip
        assert f"train.model.{key}: runs/prev" in message, message


def test_runtime_env_excludes_must_be_a_list(tmp_path):
    config = _project(tmp_path / "proj")
    message = _refusal(config, runtime_env={"excludes": "data"}, working_dir=tmp_path / "proj")
    assert "--runtime-env-json: excludes must be a list of patterns, got 'data'" in message
    plan = submit.plan_submission(
        config, runtime_env={"excludes": ["notes/"]}, working_dir=tmp_path / "proj"
    )
    assert "notes/" in plan.runtime_env["excludes"]


def test_an_absolute_path_inside_the_working_directory_is_refused_with_the_relative_one(tmp_path):
    config = _project(tmp_path / "proj")
    data = (tmp_path / "proj" / "data" / "a.jsonl").resolve()
    message = _refusal(config, [f"datasets.0.source={data}"], working_dir=tmp_path / "proj")
    assert f"datasets.0.source (dataset 'a'): {data} is an absolute path" in message
    assert "name it relative to the config (data/a.jsonl)" in message


def test_an_input_the_upload_leaves_out_is_refused(tmp_path):
    config = _project(tmp_path / "proj")
    (tmp_path / "proj" / ".gitignore").write_text("data/\n")
    message = _refusal(config, working_dir=tmp_path / "proj")
    assert "datasets.0.source (dataset 'a'): data/a.jsonl is left out of the upload" in message
    assert "tokenizer.path" not in message


def test_the_config_must_be_inside_the_working_directory(tmp_path):
    config = _project(tmp_path / "proj")
    (tmp_path / "other").mkdir()
    message = _refusal(config, working_dir=tmp_path / "other")
    assert f"the config {config.resolve()} is outside the working directory" in message


def test_an_upload_over_the_limit_is_refused_naming_the_largest_files(tmp_path):
    config = _project(tmp_path / "proj")
    message = _refusal(config, working_dir=tmp_path / "proj", max_upload_mib=0.05)
    assert "over the 0.05 MiB limit (--max-upload-mib); largest: tok/tokenizer.json" in message


SECRETS = {
    ".env": "TOKEN=x",
    ".env.prod": "TOKEN=y",
    "id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----",
    "id_ed25519.pub": "ssh-ed25519 AAAA",
    "creds.json": '{"key": "x"}',
    "gcp-Credentials.json": "{}",
    "tls/server.pem": "cert",
    "tls/server.key": "key",
    "my_secret_notes.txt": "s",
    ".aws/config": "[default]",
    ".ssh/known_hosts": "h",
    "store.p12": "p",
}
"""Files that look like secrets, each one the upload must leave out."""


def test_dry_run_lists_the_upload_without_secrets_and_submits_nothing(
    tmp_path, monkeypatch, capsys
):
    config = _project(tmp_path / "proj")
    for name, text in SECRETS.items():
        (tmp_path / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "proj" / name).write_text(text)
    monkeypatch.setattr(submit, "_client", lambda address: pytest.fail("dry run talked to Ray"))
    code = main(["submit", str(config), "--working-dir", str(tmp_path / "proj"), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0
    listed = {line.split()[-1]: int(line.split()[0].replace(",", "")) for line in out.splitlines()}
    assert listed == {
        "cfg.yaml": (tmp_path / "proj" / "cfg.yaml").stat().st_size,
        "data/a.jsonl": (tmp_path / "proj" / "data" / "a.jsonl").stat().st_size,
        "tok/tokenizer.json": (tmp_path / "proj" / "tok" / "tokenizer.json").stat().st_size,
    }
    assert "rayjobs: dry run: would upload 3 files" in err and "nothing submitted" in err
    # Each secret is named once on stderr as left out (here 8 of them, then a count).
    assert "left out as likely secrets: .aws/config, .env, .env.prod, " in err
    assert f"and {len(SECRETS) - 8} more" in err


def test_a_needed_file_that_looks_like_a_secret_ships_only_when_re_included(tmp_path, capsys):
    config = _project(tmp_path / "proj")
    (tmp_path / "proj" / "data" / "a.jsonl").rename(tmp_path / "proj" / "data" / "secret_a.jsonl")
    wd = tmp_path / "proj"
    override = ["datasets.0.source=data/secret_a.jsonl"]
    message = _refusal(config, override, working_dir=wd)
    assert (
        "datasets.0.source (dataset 'a'): data/secret_a.jsonl is left out of the upload" in message
    )
    assert '"!<path>"' in message  # the way to ship it
    env = {"excludes": ["!data/secret_a.jsonl"]}
    plan = submit.plan_submission(config, override, working_dir=wd, runtime_env=env)
    assert "data/secret_a.jsonl" in plan.files


def test_a_file_over_the_per_file_limit_is_refused_unless_the_limit_is_raised(tmp_path, capsys):
    config = _project(tmp_path / "proj")
    (tmp_path / "proj" / "model.bin").write_bytes(b"0" * (3 << 20))
    argv = ["submit", str(config), "--working-dir", str(tmp_path / "proj"), "--dry-run"]
    assert main([*argv, "--max-file-mib", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 2 and err.startswith("rayjobs: cannot submit:")
    assert "1 file(s) of" in err and "over the 2 MiB limit on one file (--max-file-mib): " in err
    assert "model.bin (3.0 MiB)" in err
    assert main([*argv, "--max-file-mib", "4"]) == 0
    assert f"{3 << 20:,}  model.bin" in capsys.readouterr().out
    # The default (10 MiB, where Ray starts warning) lets it through too.
    assert submit.MAX_FILE_MIB == 10 and main(argv) == 0


def test_shipped_files_are_what_ray_zips(tmp_path):
    from ray._private.runtime_env.packaging import _zip_files

    root = tmp_path / "wd"
    for name, text in {
        "a.txt": "a",
        ".git/HEAD": "ref",
        ".rayignore": "big/\n",
        "big/z.txt": "z",
        "sub/.gitignore": "*.log\n",
        "sub/x.log": "x",
        "sub/y.txt": "y",
        "runs/ckpt/model.pt": "m",
        "pkg/m.py": "m",
        "pkg/__pycache__/m.cpython-311.pyc": "c",
        "pkg.egg-info/PKG-INFO": "p",
        **{f"sub/{name}": text for name, text in SECRETS.items()},
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    excludes = [*submit.EXCLUDES, *submit.SECRET_EXCLUDES]
    _zip_files(str(root), excludes, str(tmp_path / "p.zip"), include_gitignore=True)
    with zipfile.ZipFile(tmp_path / "p.zip") as archive:
        zipped = {name for name in archive.namelist() if not name.endswith("/")}
    assert set(submit.shipped_files(root, excludes)) == zipped
    assert zipped == {"a.txt", ".rayignore", "sub/.gitignore", "sub/y.txt", "pkg/m.py"}


# -- the command line against a stand-in Jobs client --------------------------------------------

SUMMARY = {
    "steps": 2,
    "steps_per_rank": [2, 2],
    "loss_first": 8.0,
    "loss_last": 7.0,
    "num_packs": 16,
    "packing_efficiency": 0.97,
    "tokens_trained": 1000,
    "datasets": {},
    "checkpoint": "/c",
    "run_name": "rayjobs-0123abcd",
}


class FakeClient:
    """Stands in for ``JobSubmissionClient``: a job that ends ``status`` with ``logs``."""

    def __init__(self, status="SUCCEEDED", logs="", message="", interrupt=False):
        self.status, self.logs, self.message, self.interrupt = status, logs, message, interrupt
        self.submitted: dict = {}
        self.stopped: list[str] = []

    def submit_job(self, **kwargs):
        self.submitted = kwargs
        return "raysubmit_test"

    async def tail_job_logs(self, job_id):
        if self.interrupt:
            raise KeyboardInterrupt
        yield self.logs

    def get_job_status(self, job_id):
        return self.status

    def get_job_info(self, job_id):
        return SimpleNamespace(
            status=self.status, message=self.message, entrypoint="e", job_id=None
        )

    def get_job_logs(self, job_id):
        return self.logs

    def stop_job(self, job_id):
        self.stopped.append(job_id)
        return False


def _with_client(monkeypatch, client: FakeClient) -> FakeClient:
    monkeypatch.setattr(submit, "_client", lambda address: client)
    return client


def test_submit_follows_the_logs_and_reports_the_summary(monkeypatch, capsys):
    logs = "starting\nsteps 2 per rank [2, 2]\n" + json.dumps(SUMMARY) + "\n(raylet) late line\n"
    client = _with_client(monkeypatch, FakeClient(logs=logs))
    code = main(["submit", str(DEMO.parent / "demo.yaml"), "--address", "http://h:1", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    assert client.submitted["entrypoint"].startswith("python -m rayjobs.cli run configs/demo.yaml")
    assert client.submitted["runtime_env"]["working_dir"] == str(ROOT)
    record = json.loads(out.splitlines()[-1])
    assert record["status"] == "SUCCEEDED" and record["summary"] == SUMMARY
    assert record["submission_id"] == "raysubmit_test" and record["error"] is None
    assert "steps 2 per rank" in out  # the job's log, followed on stdout
    assert "submitted job raysubmit_test to http://h:1" in err
    assert "http://h:1/#/jobs/raysubmit_test" in err


def test_a_failed_job_exits_1_with_its_error(monkeypatch, capsys):
    logs = "x\nrayjobs: dataset 'a', file /d.jsonl, row 2: field 'output': missing\n"
    message = "Job entrypoint command failed with exit code 1, last available logs: ..."
    _with_client(monkeypatch, FakeClient("FAILED", logs, message))
    code = main(["submit", str(DEMO.parent / "demo.yaml"), "--json"])
    out, err = capsys.readouterr()
    record = json.loads(out.splitlines()[-1])
    assert code == 1 and record["status"] == "FAILED" and record["summary"] is None
    assert record["error"] == "dataset 'a', file /d.jsonl, row 2: field 'output': missing"
    assert record["message"] == message
    assert "job raysubmit_test FAILED: dataset 'a'" in err


def test_ctrl_c_while_following_leaves_the_job_running_and_exits_130(monkeypatch, capsys):
    client = _with_client(monkeypatch, FakeClient("RUNNING", interrupt=True))
    assert main(["submit", str(DEMO.parent / "demo.yaml"), "--address", "http://h:1"]) == 130
    err = capsys.readouterr().err
    assert "job raysubmit_test keeps running" in err
    assert "rayjobs stop raysubmit_test --address http://h:1" in err
    assert client.stopped == []


def test_no_wait_returns_after_submitting(monkeypatch, capsys):
    _with_client(monkeypatch, FakeClient("RUNNING"))
    assert main(["submit", str(DEMO.parent / "demo.yaml"), "--no-wait", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert record == {
        "submission_id": "raysubmit_test",
        "address": submit.resolve_address(None),
        "dashboard_url": f"{submit.resolve_address(None)}/#/jobs/raysubmit_test",
        "status": "PENDING",
    }


def test_a_bad_config_fails_with_exit_2_before_anything_is_submitted(monkeypatch, capsys):
    client = _with_client(monkeypatch, FakeClient())
    assert main(["submit", str(DEMO.parent / "demo.yaml"), "packing.seq_len=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayjobs: invalid config:") and "packing.seq_len" in err
    assert client.submitted == {}


def test_status_logs_and_stop_wrap_the_jobs_api(monkeypatch, capsys):
    _with_client(monkeypatch, FakeClient("STOPPED", "line 1\n", "Job was intentionally stopped."))
    assert main(["status", "raysubmit_test", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "STOPPED"
    assert main(["logs", "raysubmit_test", "--address", "http://h:1"]) == 0
    assert capsys.readouterr().out == "line 1\n"
    assert main(["stop", "raysubmit_test"]) == 0
    assert "had already ended: STOPPED" in capsys.readouterr().err


@pytest.mark.parametrize("after, code", [("STOPPED", 0), ("RUNNING", 1)])
def test_stop_exits_1_when_the_job_is_still_running_after_the_wait(
    monkeypatch, capsys, after, code
):
    client = FakeClient("RUNNING")
    client.stop_job = lambda job_id: True  # the stop request went out
    _with_client(monkeypatch, client)
    monkeypatch.setattr(submit, "_wait", lambda client, job, timeout: after)
    assert main(["stop", "raysubmit_test"]) == code
    err = capsys.readouterr().err
    expected = "is still RUNNING 30 s after the stop request" if code else "raysubmit_test STOPPED"
    assert expected in err


def test_run_json_summary_is_the_last_line_whatever_ray_prints_on_shutdown(monkeypatch, capsys):
    import ray

    import rayjobs.job.pipeline

    state = {"up": False}

    def fake_run(config, resume=None):
        state["up"] = True
        return SUMMARY

    def fake_shutdown():  # what Ray may still print on its way out (raylet warnings, dedup)
        print("(raylet) WARNING: a late raylet warning")
        state["up"] = False

    monkeypatch.setattr(rayjobs.job.pipeline, "run", fake_run)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "shutdown", fake_shutdown)
    assert main(["run", str(DEMO.parent / "demo.yaml"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == SUMMARY and out.count("\n") == 1  # stdout: the JSON alone
    assert not state["up"]
    assert "(raylet) WARNING: a late raylet warning" in err  # Ray's lines: stderr
    assert err.index("a late raylet warning") < err.index("steps 2 per rank")  # then the text


# -- a real head (conftest.ray_head) ---------------------------------------------------------


def _rayjobs(head: Head, *argv: str, env: dict | None = None, timeout: float = 120, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "rayjobs.cli", *argv],
        capture_output=True,
        text=True,
        env=env or head.env,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.mark.e2e
def test_a_job_that_fails_on_the_cluster_exits_1_with_its_error(ray_head, tmp_path):
    head = ray_head
    # Valid here (the tokenizer file exists), broken there: loading it fails inside the job.
    config = _project(tmp_path / "proj")
    (tmp_path / "proj" / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    wd = str(tmp_path / "proj")
    done = _rayjobs(
        head, "submit", str(config), "--working-dir", wd, "--address", head.url, "--json"
    )
    assert done.returncode == 1, done.stderr[-3000:] + done.stdout[-3000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["status"] == "FAILED" and record["summary"] is None
    assert "EOF while parsing" in record["error"]  # the tokenizer's own error, last log line
    assert f"FAILED: {record['error']}" in done.stderr
    assert "exit code 2" in record["message"]  # the job's `rayjobs run`: a config error
    # stop on an ended job says so; a client without the token is turned away.
    stop = _rayjobs(head, "stop", record["submission_id"], "--address", head.url)
    assert stop.returncode == 0 and "had already ended: FAILED" in stop.stderr
    no_token = head.env | {"RAY_AUTH_MODE": "disabled"}
    status = _rayjobs(head, "status", record["submission_id"], "--address", head.url, env=no_token)
    assert status.returncode == 1
    assert "export RAY_AUTH_MODE=token" in status.stderr
