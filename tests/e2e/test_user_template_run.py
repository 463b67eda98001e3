"""docs/data.md's "Your own templates" example, as written, trains through ``rayjobs run`` with two
train workers: the workers take the driver's validated config and never import the user's module
(a worker that validated the config again refused the template as unknown)."""

from __future__ import annotations

import json
import re

import yaml

from conftest import ALPACA, DEMO_TOKENIZER, ROOT
from rayjobs.data import templates

HEADING = "## Your own templates"


def _example() -> tuple[str, dict]:
    """The section's python module and YAML config."""
    text = (ROOT / "docs" / "data.md").read_text()
    assert HEADING in text, "docs/data.md lost its 'Your own templates' section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    [module] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    [config] = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    return module, yaml.safe_load(config)


def test_the_docs_user_template_trains_with_two_workers(ray_local, tmp_path, capsys):
    from rayjobs.cli import main

    module, config = _example()
    (tmp_path / "my_templates.py").write_text(module)
    [spec] = config["datasets"]
    rows = [{"q": r["instruction"], "a": r["output"]} for r in json.loads(ALPACA.read_text())[:40]]
    (tmp_path / spec["source"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config |= {
        "tokenizer": DEMO_TOKENIZER,
        "packing": {"seq_len": 128, "window": 128},
        "train": {
            "num_workers": 2,
            "batch_size": 1,
            "max_steps": 2,
            "storage_path": str(tmp_path / "runs"),
            "model": {"dim": 32, "n_layers": 1, "n_heads": 2},
        },
        "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
    }
    path = tmp_path / "qa.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        code = main(["run", str(path), "--json"])
    finally:  # the user's template leaves the registry with its test
        templates.TEMPLATES.pop("qa_pair", None)
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    summary = json.loads(out.splitlines()[-1])
    assert summary["steps_per_rank"] == [2, 2], summary
    assert summary["datasets"]["qa"]["samples"] == len(rows), summary["datasets"]
