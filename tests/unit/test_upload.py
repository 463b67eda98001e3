"""What ``rayjobs submit`` uploads (``job.upload.screen``): no link leads out of the working
directory, and secrets stay out whether a name, a link's target or the content gives them away;
checked against the zip Ray builds from the excludes the plan hands it."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from rayjobs.cli import main
from rayjobs.job import submit

DEMO = ROOT / "configs" / "demo"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk=\n-----END OPENSSH PRIVATE KEY-----\n"
SERVICE_ACCOUNT = json.dumps({"type": "service_account", "project_id": "p", "private_key": "k"})


def _project(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "tok").mkdir()
    lines = (DEMO / "alpaca.jsonl").read_text().splitlines()[:20]
    (root / "data" / "a.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(DEMO / "tokenizer.json", root / "tok" / "tokenizer.json")
    config = {
        "datasets": [{"name": "a", "source": "data/a.jsonl", "template": "alpaca"}],
        "tokenizer": {"path": "tok", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "packing": {"seq_len": 128},
        "train": {"max_steps": 1, "storage_path": "/tmp/rayjobs-runs"},
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(config))
    return root / "cfg.yaml"


@pytest.fixture
def hostile(tmp_path) -> Path:
    """A project beside a folder of keys, holding links out to them and to /etc/passwd, the HF
    token cache, a service-account key by name and one by content only, a link to its .env."""
    config = _project(tmp_path / "proj")
    wd = config.parent
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "deploy").write_text(PEM)
    (tmp_path / "keys" / "notes.txt").write_text("a note")
    files = {
        ".cache/huggingface/token": "hf_abcdefghijklmnopqrstuvwxyz0123",
        "service-account.json": SERVICE_ACCOUNT,
        "conf/gcp.json": SERVICE_ACCOUNT,
        "conf/deploy_copy": PEM,
        ".env": "TOKEN=1",
        "terraform.tfstate": "{}",
        "conf/.s3cfg": "[default]",
    }
    for name, text in files.items():
        (wd / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / name).write_text(text)
    os.symlink("/etc/passwd", wd / "data" / "passwd.txt")
    os.symlink(tmp_path / "keys" / "deploy", wd / "conf" / "deploy")
    os.symlink(tmp_path / "keys", wd / "keys")  # a folder link out
    os.symlink(wd / ".env", wd / "settings.txt")  # inside, to a secret
    return config


def _zipped(wd: Path, excludes: list[str], tmp_path: Path) -> set[str]:
    from ray._private.runtime_env.packaging import _zip_files

    _zip_files(str(wd), excludes, str(tmp_path / "p.zip"), include_gitignore=True)
    with zipfile.ZipFile(tmp_path / "p.zip") as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def test_dry_run_lists_no_link_out_and_no_secret_and_says_why_each_is_left_out(
    hostile, tmp_path, capsys
):
    wd = hostile.parent
    argv = ["submit", str(hostile), "--working-dir", str(wd), "--dry-run", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    listed = json.loads(out.splitlines()[-1])["files"]
    assert sorted(listed) == ["cfg.yaml", "data/a.jsonl", "tok/tokenizer.json"]
    keys = tmp_path / "keys"
    outside = "outside the working directory (--follow-links ships it)"
    for line in [
        f"left out: conf/deploy: a link to {keys / 'deploy'}, {outside}",
        f"left out: data/passwd.txt: a link to /etc/passwd, {outside}",
        f"left out: keys/deploy: a link to {keys / 'deploy'}, {outside}",
        f"left out: keys/notes.txt: a link to {keys / 'notes.txt'}, {outside}",
        "left out: conf/deploy_copy: holds a PEM private key",
        'left out: conf/gcp.json: holds a service-account key ("type": "service_account")',
        f"left out: settings.txt: a link to {wd / '.env'}, a likely secret by its name",
    ]:
        assert f"rayjobs: note: {line}\n" in err
    named = "left out as likely secrets: .cache/huggingface/token, .env, conf/.s3cfg, "
    assert f"{named}service-account.json, terraform.tfstate (" in err
    plan = submit.plan_submission(hostile, working_dir=wd)
    assert _zipped(wd, plan.runtime_env["excludes"], tmp_path) == set(listed)  # what Ray ships


def test_follow_links_ships_a_link_outs_target_but_never_a_secret(hostile, tmp_path):
    wd = hostile.parent
    plan = submit.plan_submission(hostile, working_dir=wd, follow_links=True)
    shipped = {"cfg.yaml", "data/a.jsonl", "tok/tokenizer.json", "data/passwd.txt"}
    assert set(plan.files) == shipped | {"keys/notes.txt"}
    assert _zipped(wd, plan.runtime_env["excludes"], tmp_path) == set(plan.files)
    notes = "\n".join(plan.notes)
    assert "left out: conf/deploy: holds a PEM private key" in notes


def test_a_dataset_behind_a_link_out_is_refused_with_the_way_to_ship_it(tmp_path):
    config = _project(tmp_path / "proj")
    wd = config.parent
    (wd / "data" / "a.jsonl").rename(tmp_path / "a.jsonl")
    os.symlink(tmp_path / "a.jsonl", wd / "data" / "a.jsonl")
    with pytest.raises(submit.SubmitError, match="data/a.jsonl is left out .*--follow-links"):
        submit.plan_submission(config, working_dir=wd)
    assert "data/a.jsonl" in submit.plan_submission(config, working_dir=wd, follow_links=True).files
