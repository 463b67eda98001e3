"""``rayjobs init``: a pip-installed user gets the example configs and the data they read. The
repository's configs/ is packaged as ``rayjobs.examples`` (pyproject.toml); ``init`` writes it to a
folder where every example config validates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from setuptools import find_packages

from conftest import ROOT
from rayjobs.cli import main
from rayjobs.config import load_config
from rayjobs.job.examples import PATTERNS, example_files, init

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _tracked(folder: str) -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {str(os.path.relpath(ROOT / name, ROOT / folder)) for name in listed}


def test_the_package_lists_every_package_and_the_examples():
    """pyproject.toml lists the packages (configs/ is mapped in as rayjobs.examples, which
    discovery would not find): a package folder left off the list would be left out of a wheel."""
    found = find_packages(str(ROOT), include=["rayjobs*"])
    assert len(found) >= 8, "guard: packages found"
    assert sorted(PYPROJECT["packages"]) == sorted([*found, "rayjobs.examples"])
    assert PYPROJECT["package-dir"]["rayjobs.examples"] == "configs"
    assert tuple(PYPROJECT["package-data"]["rayjobs.examples"]) == PATTERNS


def test_every_file_of_configs_is_an_example_file():
    """Nothing the example configs read is left out of the package (and so out of init)."""
    tracked = _tracked("configs")
    assert {"demo.yaml", "demo/tokenizer.json", "data/tokenizers/gpt2/tokenizer.json"} <= tracked
    assert {str(p) for p in example_files()} == tracked


def test_init_writes_examples_that_validate(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    folder = tmp_path / "examples"
    assert main(["init", str(folder)]) == 0
    assert f"next: rayjobs validate {folder}/demo.yaml" in capsys.readouterr().out
    assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == {
        str(p) for p in example_files()
    }
    assert main(["validate", str(folder / "demo.yaml")]) == 0, capsys.readouterr().err
    for config in sorted(folder.glob("*.yaml")):
        if "s3" in config.name:
            continue
        for dataset in load_config(config).datasets:  # the data read lies in the folder
            assert all(f.startswith(str(folder.resolve())) for f in dataset.files), config


def test_init_never_writes_into_a_folder_in_use(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["init", str(tmp_path)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert len(init(tmp_path / "new")) == len(example_files())


@pytest.mark.e2e
def test_a_built_wheel_carries_the_examples(tmp_path):
    """What pip installs: the wheel built from this checkout's files (copied: a build writes
    build/ and *.egg-info where it runs), unpacked alone on the path, inits a folder whose demo
    config validates."""
    source = tmp_path / "source"
    for name in _tracked("."):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheel"), "-q"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "wheel").glob("rayjobs-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    assert {f"rayjobs/examples/{p}" for p in example_files()} <= names
    code = (
        "import sys, rayjobs; assert rayjobs.__file__.startswith(sys.argv[1]), rayjobs.__file__\n"
        "from rayjobs.cli import main\n"
        "folder = sys.argv[1] + '/../examples'\n"
        "assert main(['init', folder]) == 0\n"
        "sys.exit(main(['validate', folder + '/demo.yaml']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "valid: " in done.stdout
