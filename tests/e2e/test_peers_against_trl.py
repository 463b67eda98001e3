"""rayjobs bench peers end to end at 1x: the default export (its local runner) and the TRL path
(datasets + trl.pack_dataset), each from nothing in its own process tree, pack the same tokens,
and the figures land in the JSON (acceptance 4 of issue 36 is read off a whole run at 1x and 30x,
docs/benchmarks.md). The Ray path's export is left out here (``--paths``): the other tiers run
it many times."""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from rayjobs.cli import main


def test_both_paths_pack_the_same_tokens(tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "runs.json"
    argv = ["--scales", "1", "--paths", "rayjobs", "trl", "--data-dir", str(DATA)]
    assert main(["bench", "peers", *argv, "--json", str(out)]) == 0
    runs = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"rayjobs", "trl"}
    assert runs["rayjobs"]["tokens"] == runs["trl"]["tokens"] > 100_000
    for run in runs.values():
        assert 0 < run["first_output_s"] <= run["wall_s"] <= run["exit_s"]
        assert run["peak_pss_mb"] > 100 and 0.9 < run["efficiency"] <= 1
        assert "main process" in run["cpu_by_process"]
    assert "forked worker" in runs["trl"]["cpu_by_process"]  # the whole tree was sampled
    assert list(runs["rayjobs"]["cpu_by_process"]) == ["main process"]  # the local runner: no Ray
    assert "token totals: identical on every path" in capsys.readouterr().out
