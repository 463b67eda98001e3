"""rayjobs bench sft end to end at a tiny scale: `rayjobs run` and TRL's SFTTrainer each train the
bench's saved tiny Llama for a few steps in a fresh process tree, and the figures the table is
made of land in the JSON (acceptance 4 of issue 46 is read off a whole run at 1x and 30x,
docs/benchmarks.md). The data is the head of the bundled sets, so each side is mostly start-up."""

from __future__ import annotations

import json
import math

import pytest

from conftest import DATA
from rayjobs.cli import main


def _head_of_the_bundled_sets(folder, rows: int):
    """configs/data's layout, its alpaca and hh chat sets cut to their first ``rows`` rows."""
    (folder / "sft").mkdir(parents=True)
    (folder / "chat").mkdir()
    (folder / "tokenizers").mkdir()
    alpaca = json.loads((DATA / "sft" / "alpaca_en_demo.json").read_text())[:rows]
    (folder / "sft" / "alpaca_en_demo.json").write_text(json.dumps(alpaca))
    chat = DATA / "chat" / "hh_rlhf_harmless_chosen.messages.jsonl"
    lines = chat.read_text().splitlines(keepends=True)[:rows]
    (folder / "chat" / chat.name).write_text("".join(lines))
    (folder / "tokenizers" / "gpt2").symlink_to(DATA / "tokenizers" / "gpt2")
    return folder


def test_both_sides_train_the_same_steps_timed_from_their_start(tmp_path, capsys):
    pytest.importorskip("trl")
    data = _head_of_the_bundled_sets(tmp_path / "data", rows=24)
    out = tmp_path / "runs.json"
    argv = ["--scales", "1", "--steps", "3", "--data-dir", str(data), "--json", str(out)]
    assert main(["bench", "sft", *argv]) == 0
    runs = {r["side"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"rayjobs", "trl"}
    for run in runs.values():
        assert run["steps"] == 3
        assert 0 < run["first_step_s"] < run["last_step_s"] <= run["tree"]["exit_s"]
        assert run["tokens_per_s"] > 0 and run["tree"]["peak_pss_mb"] > 100
        assert "main process" in run["tree"]["cpu_by_process"]
    # the same initial weights and samples: the first steps' losses are those of one model on
    # the same kind of rows (ln of GPT-2's vocabulary, 10.8, at a random init)
    assert math.isclose(runs["rayjobs"]["loss_first"], runs["trl"]["loss_first"], abs_tol=0.2)
    text = capsys.readouterr().out
    assert "1x rayjobs / trl: first step" in text and "machine: " in text
