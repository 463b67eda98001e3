"""What a refused config says: the rayjobs key for a name TRL, Axolotl, torchtune or HF's Trainer
use, the closest key for a typo, one ``key.path: message`` line per error and never the config
itself; quoted numbers refused; keys without effect in the chosen mode warned of."""

from __future__ import annotations

import logging
import re

import pytest
import yaml

from conftest import ALPACA, GPT2, ROOT
from rayjobs.cli import main
from rayjobs.config import advice, load_config
from rayjobs.config.schema import DatasetConfig

DEMO = ROOT / "configs" / "demo.yaml"
BASE = (
    f"datasets:\n  - name: alpaca\n    source: {ALPACA}\n    template: alpaca\n"
    f"tokenizer:\n  path: {GPT2}\n"
)
"""A config on the bundled Alpaca subset and GPT-2 tokenizer; scenarios append YAML to it."""


@pytest.fixture
def no_ray(monkeypatch):
    """Connecting to (or starting) Ray fails the test: config errors come before it."""
    from rayjobs.job import pipeline

    def refuse(config):
        raise AssertionError("the run connected to Ray before its config error")

    monkeypatch.setattr(pipeline, "init_ray", refuse)


# YAML appended to BASE (None: configs/demo.yaml), overrides, fragments stderr must hold.
SCENARIOS = {
    "acceptance_learning_rate_override": (
        None,
        ["train.learning_rate=1e-3"],
        ["train.learning_rate: unknown key; use train.lr"],
    ),
    "axolotl_top_level": (
        "learning_rate: 0.0002\nsample_packing: true\nsequence_len: 4096\nmicro_batch_size: 2\n"
        "gradient_accumulation_steps: 4\nnum_epochs: 3\nwarmup_steps: 10\noutput_dir: ./out\n"
        "lr_scheduler: cosine\nweight_decay: 0.1\n",
        [],
        [
            "  learning_rate: unknown key; use train.lr",
            "  sample_packing: unknown key; rayjobs always packs; remove it",
            "  sequence_len: unknown key; use packing.seq_len",
            "  micro_batch_size: unknown key; use train.batch_size (packed rows",
            "  gradient_accumulation_steps: unknown key; use train.grad_accum_steps",
            "  num_epochs: unknown key; use train.epochs",
            "  warmup_steps: unknown key; use train.warmup_steps",
            "  output_dir: unknown key; use train.storage_path",
            "  lr_scheduler: unknown key; use train.lr_schedule (auto, constant, cosine or linear)",
            "  weight_decay: unknown key; use train.weight_decay",
        ],
    ),
    "trl_names_inside_train": (
        "train:\n  per_device_train_batch_size: 8\n  num_train_epochs: 2\n"
        "  max_seq_length: 1024\n  lr_scheduler_type: linear\n  seed: 3\n",
        [],
        [
            "train.per_device_train_batch_size: unknown key; use train.batch_size",
            "train.num_train_epochs: unknown key; use train.epochs",
            "train.max_seq_length: unknown key; use packing.seq_len",
            "train.lr_scheduler_type: unknown key; use train.lr_schedule",
            "train.seed: unknown key; use seed (at the top level)",
        ],
    ),
    "max_length_override": ("", ["max_length=512"], ["max_length: unknown key; use packing"]),
    "axolotl_dataset_keys": (
        "eval:\n  datasets:\n    - name: held\n      path: x.jsonl\n      type: alpaca\n",
        [],
        [
            "eval.datasets.0.path: unknown key; use eval.datasets.0.source",
            "eval.datasets.0.type: unknown key; use eval.datasets.0.template (alpaca, chat",
            "eval.datasets.0.source: required key is missing",
        ],
    ),
    "dataset_path_override": (
        "",
        ["datasets.0.path=data.jsonl"],
        ["datasets.0.path: unknown key; use datasets.0.source"],
    ),
    "peer_data_and_runtime_keys": (
        "streaming: true\ndeepspeed: ds_config.json\ntrain:\n  compile: true\n",
        ["datasets.0.type=prompt_completion", "datasets.0.message_property_mappings=x"],
        [
            "streaming: unknown key; use packing.mode (stream, the default",
            "deepspeed: unknown key; use train.parallelism (ddp or fsdp; DeepSpeed is not",
            "train.compile: unknown key; torch.compile is not supported",
            "datasets.0.type: unknown key; use datasets.0.template (alpaca, chat, "
            "prompt_completion",
            "datasets.0.message_property_mappings: unknown key; use datasets.0.message_keys",
        ],
    ),
    "typo_did_you_mean": (
        "packing:\n  seq_lenn: 512\n",
        ["datasets.0.templat=chat"],
        [
            "packing.seq_lenn: unknown key; did you mean packing.seq_len?",
            "datasets.0.templat: unknown key; did you mean datasets.0.template?",
        ],
    ),
    "key_of_the_other_model_kind": (
        "train:\n  model: {kind: hf, config: {model_type: llama}, dim: 64}\n",
        [],
        ["train.model.dim: unknown key; a key of train.model.kind: demo"],
    ),
    "quoted_number_in_the_file": (
        "train:\n  lr: '3e-4'\n  batch_size: \"8\"\n",
        [],
        [
            "train.lr: Input should be a valid number (got '3e-4'); a quoted value is text in "
            "YAML: write it without quotes",
            "train.batch_size: Input should be a valid integer (got '8')",
        ],
    ),
    "quoted_number_override": ("", ["train.lr='3e-4'"], ["train.lr:", "(got '3e-4')"]),
    # nothing quoted, and no number either way: no advice about quotes
    "a_word_for_a_number": (
        "",
        ["train.lr=abc"],
        ["train.lr: Input should be a valid number (got 'abc')\n"],
    ),
    "packing_as_a_flag": (
        "packing: true\n",
        [],
        ["packing: must be a mapping of keys (got True); rayjobs always packs"],
    ),
    # section validators receive the whole section: pydantic printed it after "Value error,"
    "section_validator_schedule": (
        "train:\n  lr_schedule: cosine\n  batch_size: 2\n",
        [],
        ["train: lr_schedule: cosine decays to max_steps"],
    ),
    "section_validator_window": (
        "packing:\n  seq_len: 512\n  window_tokens: 100\n",
        [],
        ["packing: window_tokens (100) is below seq_len (512)"],
    ),
    "section_validator_hf_model": (
        "train:\n  model: {kind: hf, config: {hidden_size: 64}}\n",
        [],
        ["train.model: set path (pretrained weights), config_path"],
    ),
    "section_validator_mix": (
        "mix:\n  by: tokens\n  epoch_samples: 10\n",
        [],
        ["mix: epoch_samples does not apply with by: tokens"],
    ),
    "config_level_validator": (
        "task: dpo\n",
        [],
        ["(top level): task: dpo trains on preference triples"],
    ),
    "a_mapping_where_text_goes": (
        "",
        ["datasets.0.name={first: a}"],
        ["datasets.0.name: Input should be a valid string"],
    ),
}


@pytest.mark.parametrize(
    "extra, overrides, expected", list(SCENARIOS.values()), ids=list(SCENARIOS)
)
def test_a_refused_config_names_the_rayjobs_key_and_never_dumps_the_config(
    tmp_path, capsys, no_ray, extra, overrides, expected
):
    if extra is None:
        path = DEMO
    else:
        path = tmp_path / "run.yaml"
        path.write_text(BASE + extra)
    code = main(["run", str(path), *overrides])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.startswith("rayjobs: invalid config:\n"), stderr
    for fragment in expected:
        assert fragment in stderr, stderr
    # no dict of the input: pydantic's "Value error, ..." line went on with the whole section
    for dump in ("Value error", "input_value", "{'", "': "):
        assert dump not in stderr, stderr
    assert all(line.startswith("  ") and ": " in line for line in stderr.splitlines()[1:])


def test_a_section_validator_once_printed_the_section(tmp_path):
    """Guard for the scenarios: pydantic's own message of a section validator holds the input
    dict, so the check above would see it."""
    from pydantic import ValidationError

    from rayjobs.config.schema import Config

    raw = yaml.safe_load(BASE + "train:\n  lr_schedule: cosine\n")
    with pytest.raises(ValidationError) as caught:
        Config.model_validate(raw)
    assert "{'lr_schedule': 'cosine'}" in str(caught.value)
    assert "{'" not in advice.describe(caught.value, raw)


def test_numbers_from_the_file_and_from_overrides_are_taken(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "train:\n  lr: 3e-4\n  batch_size: 8\n  max_grad_norm: 1\n")
    config = load_config(path, ["train.weight_decay=0.1", "datasets.0.weight=2"])
    assert (config.train.lr, config.train.batch_size, config.train.weight_decay) == (3e-4, 8, 0.1)
    assert type(config.train.max_grad_norm) is float and config.datasets[0].weight == 2.0


def test_every_peer_name_points_at_a_rayjobs_key():
    """The alias table names keys that exist, and no peer name is itself a key where it is
    looked up (a dataset's peer names are none of a dataset's keys)."""
    keys = set(advice.KEYS)
    assert {"train.lr", "packing.seq_len", "datasets[].source", "eval.datasets[].template"} <= keys
    for name, peer in advice.PEERS.items():
        assert peer.key is None or peer.key in keys, name
        assert peer.key is not None or peer.note, name
    for name, peer in advice.DATASET_PEERS.items():
        assert peer.key in DatasetConfig.model_fields and name not in DatasetConfig.model_fields


def _key_map() -> list[tuple[list[str], str]]:
    """docs/config.md's "Coming from" table: (the peers' names, the rayjobs key) per row."""
    text = (ROOT / "docs" / "config.md").read_text()
    table = text[text.index("## Coming from TRL, Axolotl or torchtune") :]
    rows = []
    for line in table.splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def test_the_docs_key_map_says_what_the_loader_says():
    rows = _key_map()
    assert len(rows) >= 15, "guard: the table was found"
    for names, rayjobs in rows:
        for name in names:
            peer = advice.DATASET_PEERS.get(name) or advice.PEERS[name]
            where = "datasets[]." if name in advice.DATASET_PEERS else ""
            assert peer.key is None or f"`{where}{peer.key}`" in rayjobs, (name, rayjobs)


# YAML appended to BASE, the keys warned of (no warning: []).
IDLE = {
    "window_in_stream_mode": ("packing:\n  window: 1024\n", ["packing.window"]),
    "stream_keys_in_planned_mode": (
        "packing:\n  mode: planned\n  window_tokens: 65536\n  warmup_tokens: 0\n"
        "ray:\n  pack_concurrency: 2\n",
        ["packing.window_tokens", "packing.warmup_tokens", "ray.pack_concurrency"],
    ),
    "planned_window": ("packing:\n  mode: planned\n  window: 64\n", []),
    "dpo_settings_in_sft": ("dpo:\n  beta: 0.2\n", ["dpo.beta"]),
    "floor_of_a_constant_rate": ("train:\n  min_lr_ratio: 0.1\n", ["train.min_lr_ratio"]),
    "floor_of_a_decay": ("train:\n  min_lr_ratio: 0.1\n  max_steps: 10\n", []),
    "keep_without_periodic_checkpoints": (
        "train:\n  keep_checkpoints: 2\n",
        ["train.keep_checkpoints"],
    ),
    "mix_unit_without_weights": ("mix:\n  by: samples\n", ["mix.by"]),
    "split_of_a_file_dataset": (
        "datasets:\n  - {name: a, source: " + str(ALPACA) + ", template: alpaca, split: test, "
        "text_split: line, binary: utf8, storage: {anonymous: true}}\n",
        ["datasets.0.split", "datasets.0.text_split", "datasets.0.binary", "datasets.0.storage"],
    ),
}


@pytest.mark.parametrize("extra, keys", list(IDLE.values()), ids=list(IDLE))
def test_keys_without_effect_are_warned_of(tmp_path, caplog, extra, keys):
    path = tmp_path / "run.yaml"
    own_datasets = extra.startswith("datasets:")
    path.write_text(extra + f"tokenizer:\n  path: {GPT2}\n" if own_datasets else BASE + extra)
    with caplog.at_level(logging.WARNING, logger="rayjobs"):
        load_config(path)
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("rayjobs")]
    assert [m.split(":")[0] for m in warned] == keys
    assert all(": has no effect " in m for m in warned)


def test_the_cli_prints_the_warning(tmp_path, capsys, no_ray):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "packing:\n  window: 1024\n")
    assert main(["validate", str(path), "--rows", "4"]) == 0
    stderr = capsys.readouterr().err
    assert "rayjobs: warning: packing.window: has no effect in stream mode" in stderr
    assert main(["validate", str(path), "packing.seq_len=0"]) == 2
    assert "packing.window" not in capsys.readouterr().err  # refused: the error alone


SHIPPED = sorted(p for p in (ROOT / "configs").glob("*.yaml") if "s3" not in p.name)


def test_no_shipped_config_sets_a_key_without_effect(caplog):
    """configs/demo.yaml set packing.window (planned mode only) in stream mode."""
    assert len(SHIPPED) >= 7, "guard: configs found"
    with caplog.at_level(logging.WARNING, logger="rayjobs"):
        for path in SHIPPED:
            load_config(path)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("rayjobs")] == []


def test_the_readme_annotates_the_demo_config_as_it_is():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("This is `configs/demo.yaml`") :]
    start = block.index("```yaml\n") + len("```yaml\n")
    block = block[start : block.index("```", start)]
    annotated = [line.split("#")[0].rstrip() for line in block.splitlines()]
    assert yaml.safe_load("\n".join(annotated)) == yaml.safe_load(DEMO.read_text())
