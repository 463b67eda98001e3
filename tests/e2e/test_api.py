"""The library API for users' own training loops (docs/own-loop.md): the
example is extracted and run as written, on the module's local Ray."""

from __future__ import annotations

import re
import runpy
import sys

from conftest import ROOT

HEADING = "## Bring your own training loop"


def readme_example() -> str:
    """The first ```python block under docs/own-loop.md's "Bring your own training loop"
    heading."""
    text = (ROOT / "docs" / "own-loop.md").read_text()
    assert HEADING in text, "docs/own-loop.md lost its 'Bring your own training loop' section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no python block in docs/own-loop.md.s 'Bring your own training loop' section"
    return blocks[0]


def test_readme_example_trains_a_users_own_loop(ray_local, tmp_path, monkeypatch, capsys):
    """Acceptance 3 of the models issue: the README's code, as written, trains a tiny Llama with
    a user-written loop over ``rayjobs.train_batches``: 2 workers, the same steps on each, the loss
    falls, and the job's accounting balances."""
    from transformers import AutoModelForCausalLM

    script = tmp_path / "example.py"
    script.write_text(readme_example())
    overrides = ["packing.seq_len=256", "train.max_steps=8", f"train.storage_path={tmp_path}"]
    monkeypatch.chdir(ROOT)  # the example names configs/tiny_llama.yaml from the repository root
    monkeypatch.setattr(sys, "argv", [str(script), *overrides])
    namespace = runpy.run_path(str(script), run_name="__main__")

    result = namespace["result"]
    metrics = result.metrics
    assert metrics["steps_per_rank"] == [8, 8], metrics
    assert metrics["loss_last"] < metrics["loss_first"] - 0.5, metrics
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint.path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 50257
    packed = namespace["job"].accounting(complete=False)["packed"]
    assert packed["num_packs"] >= 2 * 8 * 2 and 0.5 < packed["efficiency"] <= 1.0, packed
    printed = capsys.readouterr().out
    assert "steps_per_rank" in printed and "efficiency" in printed
