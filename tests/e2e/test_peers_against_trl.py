"""rayjobs bench peers end to end at 1x: every path runs from nothing in its own process (an
export by the local runner, one on its own local Ray; datasets + trl.pack_dataset), they pack the
same tokens, and the figures land in the JSON (acceptance 4 of issue 36 is read off the same run
at 1x and 30x by hand)."""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from rayjobs.cli import main


def test_both_paths_pack_the_same_tokens(tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "runs.json"
    assert (
        main(["bench", "peers", "--scales", "1", "--data-dir", str(DATA), "--json", str(out)]) == 0
    )
    runs = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"rayjobs", "rayjobs-ray", "trl"}
    assert runs["rayjobs"]["tokens"] == runs["rayjobs-ray"]["tokens"] == runs["trl"]["tokens"]
    assert runs["trl"]["tokens"] > 100_000
    for run in runs.values():
        assert 0 < run["first_output_s"] <= run["wall_s"] <= run["exit_s"]
        assert run["peak_pss_mb"] > 100 and 0.9 < run["efficiency"] <= 1
        assert "main process" in run["cpu_by_process"]
    assert "Tokenize" in " ".join(runs["rayjobs-ray"]["cpu_by_process"])  # Ray's tree sampled
    assert list(runs["rayjobs"]["cpu_by_process"]) == ["main process"]  # the local runner: no Ray
    assert "token totals: identical on every path" in capsys.readouterr().out
