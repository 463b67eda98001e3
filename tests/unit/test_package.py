"""The package's shape, checked from its files: sides kept apart (the data side and the job never
import torch), no import cycles, no module too long to read, no test hooks or measured figures in
the product, docs whose links resolve, and nothing that points outside the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "rayjobs"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _torch_after_importing(modules: list[str]) -> list[str]:
    """The torch modules loaded once ``modules`` are imported, in a fresh interpreter."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def test_the_data_side_and_the_job_import_no_torch():
    """Tokenize, pack and read actors run on CPU nodes, and ``export``/``inspect`` drivers need no
    GPU stack: no module under rayjobs/data/ or rayjobs/job/ (found by glob) loads torch."""
    sides = sorted(m for m in MODULES if m.startswith(("rayjobs.data.", "rayjobs.job.")))
    assert len([m for m in sides if m.startswith("rayjobs.data.")]) >= 20, "guard: modules found"
    assert _torch_after_importing(sides) == []


def test_the_train_side_does_load_torch():
    """Guard for the test above: the same check sees torch when a train-side module is imported."""
    assert "torch" in _torch_after_importing(["rayjobs.train.masks"])


def _imports(path: Path, name: str) -> set[str]:
    """The rayjobs modules ``path`` (module ``name``) imports, at any depth in the file (a
    function-level import is an import all the same)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(path, name) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph``, as the modules on it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    assert sum(len(edges) for edges in GRAPH.values()) > 100, "guard: imports found"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check works
    assert _cycle(GRAPH) is None


def test_the_data_side_imports_neither_the_train_side_nor_the_job():
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name.startswith("rayjobs.data")
        for target in targets
        if target.startswith(("rayjobs.train", "rayjobs.job", "rayjobs.bench", "rayjobs.cli"))
    )
    assert upward == []


def test_no_module_is_over_600_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert max(lengths.values()) > 300, "guard: modules measured"
    assert {name: n for name, n in lengths.items() if n > 600} == {}


TEST_ONLY = re.compile(r"\b(_fault|_trace|fail_after|dedupe|injected_faults)\b")


def test_the_package_holds_no_test_only_hooks():
    """Tests hook in through what users have (callbacks, subclasses), never through parameters
    or branches of the product that only tests use."""
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in MODULES.values()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if TEST_ONLY.search(line)
    ]
    assert hits == []


FIGURE = re.compile(r"\b\d+(\.\d+)? ?(s|ms|MB|MiB|GB|GiB|KiB|%)(?!\w)")
DEFAULTS = {
    ("rayjobs/bench/pipeline.py", "0.5 s"),  # SAMPLE_S, the memory sampler's interval
    ("rayjobs/bench/read.py", "0.2 s"),  # the read bench's sampling interval
    ("rayjobs/data/pack.py", "99.9%"),  # the fill under which a bin waits for the next window
    ("rayjobs/data/rows.py", "4 KiB"),  # a memory page
    ("rayjobs/metrics.py", "10 s"),  # Ray's metrics_report_interval_ms default
    ("rayjobs/metrics.py", "1 s"),  # Ray's floor for it
}
"""Figures with units that docstrings may state: documented defaults and constants."""


def test_docstrings_hold_no_measured_figures():
    """Measured figures live in docs/benchmarks.md with their date, commit and machine; a
    docstring says why, not how fast it was once."""
    found = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                for match in FIGURE.finditer(ast.get_docstring(node, clean=False) or ""):
                    found.add((str(path.relative_to(ROOT)), match.group(0)))
    assert found >= DEFAULTS, "guard: the defaults are found where they are documented"
    assert found - DEFAULTS == set()


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_of_the_docs_resolves(doc):
    targets = [t for t in LINK.findall(doc.read_text()) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if not (doc.parent / t.split("#")[0]).exists()]
    assert missing == []


def test_the_readme_is_short_dateless_and_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", readme) == []
    linked = {t.split("#")[0] for t in LINK.findall(readme)}
    assert {f"docs/{d.name}" for d in (ROOT / "docs").glob("*.md")} <= linked


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
        if OUTSIDE.search(line) and not name.endswith("test_package.py")
    ]
    assert hits == []


DOC_REFERENCE = re.compile(r'(docs/[\w-]+\.md)(?:,\s+"([^"]+)")?')


def test_the_packages_references_into_the_docs_resolve():
    """A docstring or comment that sends the reader to ``docs/x.md, "Heading"`` names a file and
    a heading that exist."""
    references = {
        (match.group(1), " ".join((match.group(2) or "").split()))
        for path in [*MODULES.values(), *PACKAGE.rglob("*.md")]
        for match in DOC_REFERENCE.finditer(path.read_text())
    }
    assert len(references) > 10, "guard: references found"
    broken = []
    for doc, heading in sorted(references):
        if not (ROOT / doc).is_file():
            broken.append(doc)
            continue
        headings = [
            line.lstrip("#").strip().strip("`").lower()
            for line in (ROOT / doc).read_text().splitlines()
            if line.startswith("#")
        ]
        if heading and not any(heading.lower().strip("`") in h for h in headings):
            broken.append(f'{doc}, "{heading}"')
    assert broken == []


def test_no_two_test_modules_share_a_name():
    """pytest imports test modules by basename (rootdir-relative, no packages): a second
    ``test_x.py`` in another folder stops the collection of the whole suite."""
    names = Counter(Path(f).name for f in _tracked_files() if re.match(r"tests/.*test_\w+\.py$", f))
    assert len(names) > 50  # the suite's modules were found
    assert [name for name, n in names.items() if n > 1] == []
