"""The package's shape: the data side imports no torch, and nothing points outside the
repository."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

DATA_SIDE = (
    "formats",
    "sources",
    "templates",
    "tokenize",
    "mix",
    "pack",
    "rows",
    "epochs",
    "seeds",
    "config",
    "metrics",
    "dpo",
    "stream",
    "export",
)


def test_data_side_imports_no_torch():
    """Tokenize, pack and read actors run on CPU nodes: importing them must not load torch."""
    code = (
        "import sys, rayjobs.data.pack, rayjobs.data.tokenize, rayjobs.data.sources, rayjobs.data.mix; "
        "assert 'torch' not in sys.modules\n"
        + "".join(f"import rayjobs.{name}\n" for name in DATA_SIDE)
        + "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_train_side_does_load_torch():
    """Guard for the test above: the same check sees torch when a train-side module is imported."""
    code = "import sys, rayjobs.train.masks; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        f
        for f in listed
        if (ROOT / f).is_file()
        and not f.endswith((".json", ".jsonl", ".txt"))
        or f.endswith("SOURCES.md")
    ]


OUTSIDE = re.compile(r"\.\./shared|shared/data|DESIGN\.md|STYLE\.md|\.\./\.\.")


def test_nothing_refers_to_files_outside_the_repository():
    files = _tracked_files()
    assert any(f.startswith("rayjobs/") for f in files) and "README.md" in files, (
        "guard: files seen"
    )
    hits = [
        f"{name}:{number}: {line.strip()}"
        for name in files
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line) and name != "tests/test_package.py"
    ]
    assert not hits, "\n".join(hits)
