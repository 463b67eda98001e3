"""Tests for rayjobs.config and the CLI's config edge: bad configs fail early, naming the key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ALPACA, GPT2, ROOT
from rayjobs.cli import main
from rayjobs.config import ConfigError, config_from_dict, load_config
from rayjobs.data.sources import record_table

# Hermetic: configs point at empty files made in tmp_path (config only checks that files exist).
BASE = {
    "datasets": [{"name": "alpaca", "source": "data/alpaca.json", "template": "alpaca"}],
    "tokenizer": {"path": "tok/tokenizer.json"},
}


def _merge(base: dict, patch: dict) -> dict:
    merged = dict(base)
    for key, value in patch.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and key in base else value
    return merged


ROW = '{"instruction": "a", "output": "b"}\n'  # files need a row: empty datasets are refused


def _write(tmp_path: Path, patch: dict | None = None) -> Path:
    """A config at tmp_path/run.yaml whose data and tokenizer files exist, with `patch` merged
    in."""
    for relative in ("data/alpaca.json", "tok/tokenizer.json"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(ROW)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_merge(BASE, patch or {})))
    return path


def _dataset(**fields) -> dict:
    return {
        "datasets": [
            {"name": "alpaca", "source": "data/alpaca.json", "template": "alpaca", **fields}
        ]
    }


# config patch, overrides, texts the ConfigError message must contain ("{tmp}" = tmp_path).
BAD_CONFIGS = {
    "unknown_top_level_key": ({"sead": 1}, [], ["sead: unknown key"]),
    "unknown_nested_key": ({"packing": {"seq_lenn": 4096}}, [], ["packing.seq_lenn: unknown key"]),
    "unknown_dataset_key": (_dataset(templat="chat"), [], ["datasets.0.templat: unknown key"]),
    "wrong_type": ({"train": {"batch_size": "four"}}, [], ["train.batch_size", "'four'"]),
    "missing_data_file": (
        _dataset(source="data/missing.json"),
        [],
        ["datasets.0.source", "{tmp}/data/missing.json"],
    ),
    "missing_tokenizer_file": (
        {"tokenizer": {"path": "tok/missing.json"}},
        [],
        ["tokenizer.path", "{tmp}/tok/missing.json"],
    ),
    "unknown_template": (
        _dataset(template="alpacca"),
        [],
        [
            "datasets.0.template",
            "unknown template 'alpacca'",
            "registered: 'alpaca', 'chat', 'preference', 'prompt_completion', 'text'",
        ],
    ),
    "column_map_key_naming_no_template_field": (  # a typo once dropped the input block
        _dataset(column_map={"instruction": "question", "inputs": "context"}),
        [],
        [
            "datasets.0",
            "column_map key(s) ['inputs']",
            "['history', 'input', 'instruction', 'output', 'system']",
        ],
    ),
    "files_set_in_the_config": (
        _dataset(files=["data/alpaca.json"]),
        [],
        ["datasets.0.files: filled in from datasets.0.source", "list the files in"],
    ),
    "seq_len_zero": ({"packing": {"seq_len": 0}}, [], ["packing.seq_len", "greater than 1"]),
    "seq_len_one": ({"packing": {"seq_len": 1}}, [], ["packing.seq_len", "greater than 1"]),
    "window_below_a_row": (
        {"packing": {"seq_len": 512, "window_tokens": 100}},
        [],
        ["packing", "window_tokens (100) is below seq_len (512)"],
    ),
    "weight_infinite": (_dataset(weight=float("inf")), [], ["datasets.0.weight", "finite"]),
    "lr_nan": ({"train": {"lr": float("nan")}}, [], ["train.lr", "finite"]),
    "resource_nan": (
        {"train": {"resources_per_worker": {"trainer": float("nan")}}},
        [],
        ["train.resources_per_worker.trainer", "finite"],
    ),
    "num_cpus_zero": ({"ray": {"num_cpus": 0}}, [], ["ray.num_cpus", "greater than 0"]),
    "num_cpus_negative": ({"ray": {"num_cpus": -3}}, [], ["ray.num_cpus", "greater than 0"]),
    "hf_source_list": (
        _dataset(source=["org/a", "org/b"], format="hf"),
        [],
        ["datasets.0.source", "format hf reads one dataset", "got 2"],
    ),
    "empty_source_list": (_dataset(source=[]), [], ["datasets.0.source", "empty list"]),
    "empty_hf_source_list": (_dataset(source=[], format="hf"), [], ["got 0"]),
    "seq_len_negative": ({"packing": {"seq_len": -5}}, [], ["packing.seq_len", "-5"]),
    # numpy's seed sequences refuse it: it failed inside a data task, after Ray started
    "seed_negative": ({}, ["seed=-1"], ["seed", "greater than or equal to 0"]),
    "duplicate_dataset_names": (
        {
            "datasets": [
                {"name": "a", "source": "data/alpaca.json", "template": "alpaca"},
                {"name": "a", "source": "data/alpaca.json", "template": "alpaca"},
            ]
        },
        [],
        ["datasets", "unique", "['a']"],
    ),
    "weight_zero": (_dataset(weight=0), [], ["datasets.0.weight", "greater than 0"]),
    "weight_negative": (_dataset(weight=-1.5), [], ["datasets.0.weight", "-1.5"]),
    "no_datasets": ({"datasets": []}, [], ["datasets", "at least 1"]),
    "format_not_inferable": (
        _dataset(source=["data/alpaca.json", "tok/tokenizer.json", "run.yaml"]),
        [],
        ["datasets.0.format", "jsonl"],
    ),
    "override_without_equals": ({}, ["packing.seq_len"], ["'packing.seq_len'", "dotted.key=value"]),
    "override_without_key": ({}, ["=4096"], ["'=4096'", "dotted.key=value"]),
    "override_bad_value": ({}, ["packing.seq_len=zero"], ["packing.seq_len", "'zero'"]),
    "override_unknown_key": ({}, ["packing.seqlen=1"], ["packing.seqlen: unknown key"]),
    "override_through_a_value": (
        {},
        ["datasets.0.name.first=x"],
        ["datasets.0.name.first", "datasets.0.name is not a section"],
    ),
    "override_list_index_out_of_range": (
        {},
        ["datasets.1.weight=2"],
        ["datasets.1.weight", "datasets.1 is not an index of a list of 1"],
    ),
    "override_list_index_not_a_number": (
        {},
        ["datasets.first.weight=2"],
        ["datasets.first is not an index"],
    ),
    "override_invalid_value_into_list": ({}, ["datasets.0.weight=0"], ["datasets.0.weight"]),
    "decay_schedule_without_max_steps": (
        {"train": {"lr_schedule": "cosine"}},
        [],
        ["train: lr_schedule: cosine decays to max_steps; set train.max_steps"],
    ),
    "warmup_longer_than_the_run": (
        {"train": {"max_steps": 10, "warmup_steps": 20}},
        [],
        ["warmup_steps (20) exceeds max_steps (10)"],
    ),
    "unknown_parallelism": ({"train": {"parallelism": "tp"}}, [], ["train.parallelism", "'tp'"]),
    "unknown_precision": ({"train": {"precision": "fp8"}}, [], ["train.precision", "'fp8'"]),
    "preference_data_without_task_dpo": (
        _dataset(template="preference"),
        [],
        ["datasets ['alpaca'] use a preference template: set task: dpo"],
    ),
    "dpo_on_sft_data": (
        {"task": "dpo"},
        [],
        ["task: dpo trains on preference triples; datasets ['alpaca'] need template: preference"],
    ),
    "eval_dataset_with_weight": (
        {"eval": {"datasets": _dataset(weight=1.0)["datasets"]}},
        [],
        ["eval.datasets: eval datasets ['alpaca'] set weight"],
    ),
    "eval_dataset_names_repeated": (
        {"eval": {"datasets": _dataset()["datasets"] * 2}},
        [],
        ["eval.datasets: dataset names must be unique; repeated: ['alpaca']"],
    ),
    "eval_preference_data_in_sft": (
        {"eval": _dataset(template="preference")},
        [],
        ["eval.datasets ['alpaca'] use a preference template: set task: dpo"],
    ),
    "eval_sft_data_in_dpo": (
        {**_dataset(template="preference"), "task": "dpo", "eval": _dataset()},
        [],
        ["task: dpo trains on preference triples; eval.datasets ['alpaca'] need template"],
    ),
    "eval_missing_file": (
        {"eval": {"datasets": _dataset(source="data/heldout.json")["datasets"]}},
        [],
        ["eval.datasets.0.source (dataset 'alpaca'): no file matches {tmp}/data/heldout.json"],
    ),
    "eval_settings_without_datasets": (
        {"eval": {"every_steps": 10}},
        [],
        ["eval.every_steps is set but eval.datasets is empty"],
    ),
    "eval_files_set": (
        {"eval": {"datasets": _dataset(files=["data/alpaca.json"])["datasets"]}},
        [],
        ["eval.datasets.0.files: filled in from eval.datasets.0.source, not set in a config"],
    ),
    "eval_every_zero_steps": (
        {"eval": {"every_steps": 0, **_dataset()}},
        [],
        ["eval.every_steps", "greater than 0"],
    ),
    "dpo_planned": (
        {**_dataset(template="preference"), "task": "dpo", "packing": {"mode": "planned"}},
        [],
        ["task: dpo packs in stream mode"],
    ),
    "dpo_split": (
        {**_dataset(template="preference"), "task": "dpo", "packing": {"overflow": "split"}},
        [],
        ["split would part a response from its prompt"],
    ),
    "dpo_beta_zero": (
        {**_dataset(template="preference"), "task": "dpo", "dpo": {"beta": 0}},
        [],
        ["dpo.beta"],
    ),
}


@pytest.mark.parametrize(
    "patch, overrides, expected", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS)
)
def test_bad_config_raises_config_error_naming_the_key(tmp_path, patch, overrides, expected):
    path = _write(tmp_path, patch)
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    for text in expected:
        assert text.format(tmp=tmp_path.resolve()) in str(caught.value)


def test_missing_or_non_mapping_config_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("datasets: [\n")
    with pytest.raises(ConfigError, match="broken.yaml is not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_a_key_written_twice_and_a_file_not_utf8_are_refused_naming_the_file(tmp_path):
    """PyYAML keeps the last of two ``train:`` sections: the first's settings vanished."""
    text = _write(tmp_path).read_text()
    path = tmp_path / "twice.yaml"
    path.write_text(text + "train:\n  lr: 0.0001\n  max_steps: 100\ntrain:\n  lr: 0.001\n")
    line = text.count("\n") + 1  # the first train: key
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    for part in ("twice.yaml is not valid YAML", f"key 'train' repeats the key of line {line}"):
        assert part in str(caught.value)
    (tmp_path / "latin1.yaml").write_bytes(text.encode() + b"# caf\xe9\n")
    with pytest.raises(
        ConfigError, match=r"latin1.yaml is not UTF-8 text \(invalid continuation byte"
    ):
        load_config(tmp_path / "latin1.yaml")


def test_an_exponent_without_a_dot_is_a_float_in_free_form_sections(tmp_path):
    """YAML 1.1 reads ``1e-5`` as text; ``train.model.config`` hands values to transformers as
    they are, so ``rms_norm_eps: 1e-5`` failed inside the train workers."""
    text = _write(tmp_path).read_text()
    path = tmp_path / "eps.yaml"
    model = "train:\n  model:\n    kind: hf\n    config: {model_type: llama, rms_norm_eps: 1e-5}\n"
    path.write_text(text + model)
    config = load_config(path, ["train.lr=2e-5", "tokenizer.pad_token='1e-5'"])
    assert config.train.model.config == {"model_type": "llama", "rms_norm_eps": 1e-5}
    assert config.tokenizer.pad_token == "1e-5"  # quoted: text
    assert config.train.lr == 2e-5


@pytest.mark.parametrize(
    "override, key, value",
    [
        (
            "tokenizer.chat_template={% for m in messages %}{{ m.content }}{% endfor %}",
            "chat_template",
            "{% for m in messages %}{{ m.content }}{% endfor %}",
        ),
        ("tokenizer.eos_token=[oops", "eos_token", "[oops"),
    ],
    ids=["jinja_chat_template", "unclosed_bracket"],
)
def test_override_value_that_is_not_yaml_is_taken_as_text(tmp_path, override, key, value):
    config = load_config(_write(tmp_path), [override])
    assert getattr(config.tokenizer, key) == value


@pytest.fixture
def no_ray(monkeypatch):
    """Connecting to (or starting) Ray fails the test: config errors come before it. (Whether
    Ray is initialized says nothing: an earlier module's shared Ray may still be up.)"""
    from rayjobs.job import pipeline

    def refuse(config):
        raise AssertionError("the run connected to Ray before its config error")

    monkeypatch.setattr(pipeline, "init_ray", refuse)


@pytest.mark.parametrize(
    "name", ["unknown_nested_key", "missing_data_file", "override_list_index_out_of_range"]
)
def test_cli_reports_config_error_without_starting_ray(tmp_path, capsys, no_ray, name):
    patch, overrides, expected = BAD_CONFIGS[name]
    code = main(["run", str(_write(tmp_path, patch)), *overrides])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.startswith("rayjobs: ")
    for text in expected:
        assert text.format(tmp=tmp_path.resolve()) in stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.model.config.hiden_size=32", "hiden_size not a setting of LlamaConfig"),
        ("train.model.config.rms_norm_eps='1e-5'", "expected float, got str"),
        ("train.model.config.model_type=lama", "Unrecognized model identifier: lama"),
    ],
    ids=["typo", "wrong_type", "unknown_model_type"],
)
def test_hf_model_config_is_read_before_ray_starts(tmp_path, capsys, no_ray, override, expected):
    """Such configs once failed in every train worker, a minute in, with a traceback."""
    path = _write(tmp_path, {"train": {"model": LLAMA}})
    code = main(["run", str(path), f"tokenizer.path={GPT2}", override])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    for part in ("rayjobs: train.model: cannot build the model from", expected):
        assert part in stderr
    assert len(stderr) < 800  # not transformers' list of every model type


@pytest.mark.parametrize("key", ["eos_token", "pad_token"])
def test_a_special_token_missing_from_the_vocabulary_names_its_key(tmp_path, capsys, no_ray, key):
    """Not ``tokenizer.path``, which loaded fine; exit 2 as for any config error."""
    code = main(["run", str(_write(tmp_path)), f"tokenizer.path={GPT2}", f"tokenizer.{key}=nope"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.startswith(f"rayjobs: tokenizer.{key}: token 'nope' is not in the vocabulary")


def test_cli_subprocess_exits_non_zero_without_traceback(tmp_path):
    path = _write(tmp_path, {"packing": {"seq_lenn": 4096}})
    result = subprocess.run(
        [sys.executable, "-m", "rayjobs.cli", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "packing.seq_lenn" in result.stderr
    assert "Traceback" not in result.stderr


# override, dotted path of the parsed value, expected value (type included).
OVERRIDES = {
    "int": ("packing.seq_len=4096", ("packing", "seq_len"), 4096),
    "bool": ("train.use_gpu=true", ("train", "use_gpu"), True),
    "float": ("train.lr=3e-4", ("train", "lr"), 0.0003),
    "string": ("packing.overflow=split", ("packing", "overflow"), "split"),
    "null": ("train.max_steps=null", ("train", "max_steps"), None),
    "new_nested_section": ("train.model.dim=64", ("train", "model", "dim"), 64),
    "list_index": ("datasets.0.weight=2", ("datasets", 0, "weight"), 2.0),
}


@pytest.mark.parametrize("override, where, expected", list(OVERRIDES.values()), ids=list(OVERRIDES))
def test_override_parses_yaml_scalars(tmp_path, override, where, expected):
    node = load_config(_write(tmp_path), [override])
    for part in where:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    assert node == expected
    assert type(node) is type(expected)


def test_later_override_wins(tmp_path):
    config = load_config(_write(tmp_path), ["packing.seq_len=128", "packing.seq_len=256"])
    assert config.packing.seq_len == 256


def test_relative_paths_resolve_against_the_config_directory(tmp_path, monkeypatch):
    path = _write(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / path.name)
    root = tmp_path.resolve()
    assert config.datasets[0].files == (str(root / "data" / "alpaca.json"),)
    assert config.tokenizer.path == str(root / "tok" / "tokenizer.json")


# train.storage_path (None: the default), overrides, expected ("{tmp}" = the config's folder).
STORAGE_PATHS = {
    "default": (None, [], "{tmp}/runs"),
    "relative": ("ckpt/runs", [], "{tmp}/ckpt/runs"),
    "relative_override": (None, ["train.storage_path=out"], "{tmp}/out"),
    "absolute": ("/abs/runs", [], "/abs/runs"),
    "home": ("~/runs", [], str(Path.home() / "runs")),
    "uri": ("s3://bucket/runs", [], "s3://bucket/runs"),
}


@pytest.mark.parametrize(
    "value, overrides, expected", list(STORAGE_PATHS.values()), ids=list(STORAGE_PATHS)
)
def test_storage_path_resolves_against_the_config_directory(
    tmp_path, monkeypatch, value, overrides, expected
):
    path = _write(tmp_path, {} if value is None else {"train": {"storage_path": value}})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = load_config(Path("..") / path.name, overrides)
    assert config.train.storage_path == expected.format(tmp=tmp_path.resolve())


def test_same_file_reached_twice_is_kept_once_under_its_first_spelling(tmp_path):
    _data_dir(tmp_path, "a.jsonl", "b.jsonl")
    (tmp_path / "alias").symlink_to(tmp_path / "shards")
    sources = ["shards/b.jsonl", "shards/*.jsonl", "alias", str(tmp_path / "shards" / "a.jsonl")]
    config = load_config(_write(tmp_path, _dataset(source=sources)))
    root = tmp_path.resolve() / "shards"
    assert config.datasets[0].files == (str(root / "b.jsonl"), str(root / "a.jsonl"))


# Two datasets over shards/a.jsonl, b.jsonl (alias/ is a symlink to shards/): (first source,
# second source, second's section, allow_duplicate_sources, the ConfigError, or None: loads).
SHARED_FILES = {
    "path_and_symlink": (
        "shards/a.jsonl", "alias/a.jsonl", "datasets", False,
        "datasets.1 (dataset 'second') reads {tmp}/alias/a.jsonl, which datasets.0 (dataset "
        "'first') reads too (as {tmp}/shards/a.jsonl): one file read by two datasets",
    ),
    "path_and_symlink_allowed": ("shards/a.jsonl", "alias/a.jsonl", "datasets", True, None),
    "eval_set_globs_a_training_file": (
        "shards/b.jsonl", "alias/*.jsonl", "eval.datasets", False,
        "eval.datasets.0 (dataset 'second') reads {tmp}/alias/b.jsonl, which datasets.0 (dataset "
        "'first') reads too (as {tmp}/shards/b.jsonl)",
    ),
    "two_files": ("shards/a.jsonl", "alias/b.jsonl", "eval.datasets", False, None),
    "path_and_hard_link": (
        "shards/a.jsonl", "hard/a.jsonl", "datasets", False,
        "datasets.1 (dataset 'second') reads {tmp}/hard/a.jsonl, which datasets.0 (dataset "
        "'first') reads too (as {tmp}/shards/a.jsonl)",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "first, second, section, allow, refusal", SHARED_FILES.values(), ids=SHARED_FILES
)
def test_one_file_read_by_two_datasets_is_refused_unless_allowed(
    tmp_path, first, second, section, allow, refusal
):
    _data_dir(tmp_path, "a.jsonl", "b.jsonl")
    (tmp_path / "alias").symlink_to(tmp_path / "shards")
    (tmp_path / "hard").mkdir()
    os.link(tmp_path / "shards" / "a.jsonl", tmp_path / "hard" / "a.jsonl")
    spec = {"name": "second", "source": second, "template": "alpaca"}
    patch = {**_dataset(source=first), "allow_duplicate_sources": allow}
    patch["datasets"][0]["name"] = "first"
    if section == "datasets":
        patch["datasets"].append(spec)
    else:
        patch["eval"] = {"datasets": [spec]}
    path = _write(tmp_path, patch)
    if refusal is not None:
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert refusal.format(tmp=tmp_path.resolve()) in str(caught.value)
        assert "allow_duplicate_sources: true" in str(caught.value)
        return
    config = load_config(path)
    read = [*config.datasets, *config.eval.datasets]
    assert [len(spec.files) for spec in read] == [1, 1]
    shared = {Path(f).resolve() for f in read[0].files} & {Path(f).resolve() for f in read[1].files}
    assert bool(shared) == allow  # guard: the allowed row did read one file twice


@pytest.mark.parametrize(
    "filename, expected",
    [
        ("rows.json", "json"),
        ("rows.jsonl", "jsonl"),
        ("rows.parquet", "parquet"),
        ("rows.csv", "csv"),
        ("book.txt", "text"),
        ("notes.md", "text"),
    ],
    ids=["json", "jsonl", "parquet", "csv", "txt", "md"],
)
def test_format_is_inferred_from_the_extension(tmp_path, filename, expected):
    (tmp_path / "data" / filename).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / filename).write_text(ROW)
    config = load_config(_write(tmp_path, _dataset(source=f"data/{filename}")))
    assert config.datasets[0].format == expected


def test_explicit_format_is_kept(tmp_path):
    (tmp_path / "data" / "rows.log").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / "rows.log").write_text(ROW)
    config = load_config(_write(tmp_path, _dataset(source="data/rows.log", format="jsonl")))
    assert config.datasets[0].format == "jsonl"


def _data_dir(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / "shards" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "shards" / name).write_text(ROW)
    return tmp_path / "shards"


def test_directory_source_expands_to_its_files_sorted_and_recursive(tmp_path):
    shards = _data_dir(tmp_path, "b.jsonl", "a.jsonl", "more/c.jsonl", "checksums.sha256")
    config = load_config(_write(tmp_path, _dataset(source="shards")))
    root = shards.resolve()
    assert config.datasets[0].files == (
        str(root / "a.jsonl"),
        str(root / "b.jsonl"),
        str(root / "more" / "c.jsonl"),
    )
    assert config.datasets[0].format == "jsonl"


def test_compressed_files_count_as_their_format_in_folders_and_globs(tmp_path):
    """A folder's ``.jsonl.gz`` shard was once left out (the job read half the data), and a glob
    of them could not infer the format."""
    shards = _data_dir(tmp_path, "part-0.jsonl", "part-1.jsonl.gz", "part-2.jsonl.zst", "x.gz")
    root = shards.resolve()
    config = load_config(_write(tmp_path, _dataset(source="shards")))
    assert config.datasets[0].files == tuple(
        str(root / name) for name in ("part-0.jsonl", "part-1.jsonl.gz", "part-2.jsonl.zst")
    )
    assert config.datasets[0].format == "jsonl"
    config = load_config(_write(tmp_path, _dataset(source="shards/*.jsonl.*")))
    assert config.datasets[0].format == "jsonl"
    with pytest.raises(ConfigError, match="cannot infer the format"):  # x.gz names no format
        load_config(_write(tmp_path, _dataset(source="shards/*")))


def test_glob_source_expands_to_matching_files(tmp_path):
    shards = _data_dir(tmp_path, "b.jsonl", "a.jsonl", "a.json")
    config = load_config(_write(tmp_path, _dataset(source="shards/*.jsonl")))
    root = shards.resolve()
    assert config.datasets[0].files == (str(root / "a.jsonl"), str(root / "b.jsonl"))


def test_directory_source_with_explicit_format_keeps_only_that_format(tmp_path):
    shards = _data_dir(tmp_path, "train.jsonl", "README.md")
    config = load_config(_write(tmp_path, _dataset(source="shards", format="jsonl")))
    assert config.datasets[0].files == (str(shards.resolve() / "train.jsonl"),)


# ---------------------------------------------------------------- registries


def test_a_template_registered_outside_config_is_accepted_and_used(tmp_path):
    """A new template is one function plus its tests: config.py reads the registry."""
    from rayjobs.data import templates
    from rayjobs.data.tokenize import Tokenize

    path = _write(tmp_path, _dataset(template="shout"))
    with pytest.raises(ConfigError, match="unknown template 'shout'"):
        load_config(path)

    @templates.register_template("shout")
    def shout(row, column_map, render_chat=None):
        return [templates.Segment(templates.text_field(row, "text", column_map).upper(), True)]

    try:
        config = load_config(path, [f"tokenizer.path={GPT2}"])
        assert config.datasets[0].template == "shout"
        tokenize = Tokenize(config.datasets, config.tokenizer, seq_len=64, overflow="truncate")
        batch = record_table("alpaca", ["x.jsonl"], [1], [json.dumps({"text": "hi"})])
        assert tokenize(batch).column("input_ids").to_pylist() == [[25374, 50256]]  # "HI", EOS
        templates.register_template("shout")(shout)  # its module imported anew: replaced
        with pytest.raises(ValueError, match="already registered"):
            templates.register_template("shout")(lambda row, column_map, render_chat=None: [])
    finally:
        del templates.TEMPLATES["shout"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "packing.strategy=worst_fit",
            "packing.strategy: unknown packing strategy 'worst_fit'; registered: 'bfd'",
        ),
        (
            "datasets.0.format=xml",
            "datasets.0.format: unknown format 'xml'; "
            "registered: 'csv', 'hf', 'json', 'jsonl', 'parquet', 'text'",
        ),
    ],
)
def test_unregistered_strategy_and_format_are_refused(tmp_path, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, {}), [override])
    assert message in str(caught.value)


def test_a_registered_strategy_is_accepted(tmp_path):
    from rayjobs.data import pack

    @pack.register_strategy("worst_fit")
    class WorstFit(pack.Packer):
        def _choose_bin(self, length):
            fits = [i for i, room in enumerate(self.remaining) if room >= length]
            return max(fits, key=lambda i: self.remaining[i]) if fits else None

    try:
        config = load_config(_write(tmp_path, {}), ["packing.strategy=worst_fit"])
        assert config.packing.strategy == "worst_fit"
        lengths = np.array([3, 8, 6, 1])  # worst fit packs these as no built-in strategy does
        packed = {
            name: [b.tolist() for b in pack.pack_lengths(lengths, 10, name)]
            for name in pack.STRATEGIES
        }
        assert packed.pop("worst_fit") == [[0, 2], [1, 3]]
        assert [[0, 2], [1, 3]] not in packed.values()  # guard: the choice shows in the bins
    finally:
        del pack.STRATEGIES["worst_fit"]


# ---------------------------------------------------------------- train.model: demo or hf

LLAMA = {"kind": "hf", "config": {"model_type": "llama", "hidden_size": 64}}

# train.model patch, overrides, texts the ConfigError message must contain ("{tmp}" = tmp_path).
BAD_MODELS = {
    "unknown_kind": ({"kind": "hff"}, [], ["train.model.kind", "'demo' or 'hf'", "'hff'"]),
    "hf_without_a_source": ({"kind": "hf"}, [], ["train.model", "config.model_type"]),
    "hf_with_a_demo_key": ({**LLAMA, "dim": 64}, [], ["train.model.dim: unknown key"]),
    "demo_with_an_hf_key": ({"path": "x"}, [], ["train.model.path: unknown key"]),
    "path_and_config_path": (
        {"kind": "hf", "path": "a", "config_path": "b"},
        [],
        ["train.model", "not both"],
    ),
    "model_type_with_a_path": (
        {"kind": "hf", "path": "a", "config": {"model_type": "llama"}},
        [],
        ["train.model", "remove it"],
    ),
    "unknown_attention": (
        {**LLAMA, "attn_implementation": "flash"},
        [],
        ["train.model.attn_implementation", "'sdpa', 'eager' or 'flex_attention'"],
    ),
    "flex_attention_without_a_gpu": (  # refused before Ray starts, not in every worker
        {**LLAMA, "attn_implementation": "flex_attention"},
        [],
        ["train.model.attn_implementation: flex_attention trains on CUDA only", "use_gpu"],
    ),
    "train_attention_flex_without_a_gpu": (
        {},
        ["train.attention=flex"],
        ["train.attention: flex trains on CUDA only", "train.use_gpu: true"],
    ),
    "demo_heads_of_odd_width": (
        {"dim": 12, "n_heads": 4},
        [],
        ["train.model", "dim (12) must be n_heads (4) heads of even width"],
    ),
    "missing_checkpoint_dir": (
        {"kind": "hf", "path": "./ckpt"},
        [],
        ["train.model.path", "{tmp}/ckpt"],
    ),
    "missing_config_json": (
        {"kind": "hf", "config_path": "llama.json"},
        [],
        ["train.model.config_path", "{tmp}/llama.json"],
    ),
    "not_a_mapping": ({}, ["train.model=llama"], ["train.model", "must be a mapping"]),
    "override_into_hf": (LLAMA, ["train.model.dim=32"], ["train.model.dim: unknown key"]),
}


@pytest.mark.parametrize(
    "patch, overrides, expected", list(BAD_MODELS.values()), ids=list(BAD_MODELS)
)
def test_bad_model_section_names_the_key(tmp_path, patch, overrides, expected):
    path = _write(tmp_path, {"train": {"model": patch}} if patch else {})
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    for text in expected:
        assert text.format(tmp=tmp_path.resolve()) in str(caught.value)


def test_flex_attention_is_taken_with_a_gpu(tmp_path):
    model = {**LLAMA, "attn_implementation": "flex_attention"}
    config = load_config(_write(tmp_path, {"train": {"use_gpu": True, "model": model}}))
    assert config.train.model.attn_implementation == "flex_attention"
    assert load_config(_write(tmp_path), ["train.use_gpu=true", "train.attention=flex"])


def test_model_kind_defaults_to_demo_and_hf_paths_resolve(tmp_path):
    """The demo keys still work without ``kind``; an hf ``config_path`` / ``path`` resolves against
    the config's folder, a Hub name stays as written, and config values pass through."""
    config = load_config(_write(tmp_path, {"train": {"model": {"dim": 64, "n_heads": 2}}}))
    model = config.train.model
    assert (model.kind, model.dim, model.n_layers, model.n_heads) == ("demo", 64, 2, 2)
    assert config.train.loss_chunk_tokens == 1024 and config.train.checkpoint_every is None
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text("{}")
    model = {"kind": "hf", "config_path": "arch", "config": {"num_hidden_layers": 1}}
    config = load_config(_write(tmp_path, {"train": {"model": model}}))
    assert config.train.model.config_path == str(tmp_path.resolve() / "arch")
    assert config.train.model.config == {"num_hidden_layers": 1}
    assert config.train.model.attn_implementation is None and not config.train.model.allow_download
    overrides = ["train.model.kind=hf", "train.model.path=Qwen/Qwen2.5-0.5B"]
    config = load_config(_write(tmp_path), overrides)
    assert config.train.model.path == "Qwen/Qwen2.5-0.5B"
    config = load_config(
        _write(tmp_path, {"train": {"model": LLAMA}}), ["train.model.config.num_hidden_layers=3"]
    )
    assert config.train.model.config == {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 3,
    }
    # the validated config survives the round trip to the train workers (model_dump → validate)
    from rayjobs.config import Config

    assert Config.model_validate(config.model_dump()) == config


# -- guards a mutation run found missing


def _cfg(**extra):
    datasets = extra.pop("datasets", [{"name": "a", "source": str(ALPACA), "template": "alpaca"}])
    return config_from_dict({"datasets": datasets, "tokenizer": {"path": str(GPT2)}, **extra})


def test_window_tokens_may_equal_seq_len_but_not_go_below():
    assert _cfg(packing={"seq_len": 512, "window_tokens": 512}).packing.window_tokens == 512
    with pytest.raises(ConfigError, match=r"window_tokens \(511\) is below seq_len \(512\)"):
        _cfg(packing={"seq_len": 512, "window_tokens": 511})


def test_warmup_may_last_exactly_max_steps():
    assert _cfg(train={"max_steps": 10, "warmup_steps": 10}).train.warmup_steps == 10


def test_weight_on_some_datasets_only_is_refused():
    datasets = [
        {"name": "a", "source": str(ALPACA), "template": "alpaca", "weight": 1.0},
        {"name": "b", "source": str(ALPACA), "template": "alpaca"},
    ]
    with pytest.raises(
        ConfigError, match=r"set weight on every dataset or on none; missing on \['b'\]"
    ):
        _cfg(datasets=datasets)


OBJECT_STORE_CONFIGS = ("alpaca_chat_s3.yaml",)
"""Shipped configs whose data is on object storage: loaded against a local S3 server holding the
bundled files (tests/ray/test_object_storage.py)."""

SHIPPED_CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.yaml") if p.name not in OBJECT_STORE_CONFIGS
)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[p.name for p in SHIPPED_CONFIGS])
def test_every_shipped_config_loads_with_its_data_in_the_repository(path):
    """The configs README points users to validate and name files that exist in a fresh clone
    (the demo and a few others are also run by tests; these are only loaded)."""
    config = load_config(path)
    for dataset in config.datasets:
        assert dataset.files, dataset.name
        for file in dataset.files:
            assert Path(file).is_file() and Path(file).resolve().is_relative_to(ROOT), file
    assert len(SHIPPED_CONFIGS) >= 7, "guard: the configs folder was found"


def test_hf_data_files_resolve_against_the_configs_folder(tmp_path, monkeypatch):
    """``format: hf`` with ``source: json`` and ``data_files``: the files are found beside the
    config, wherever the command runs (they were looked up in the working directory)."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy(ALPACA, project / "data" / "train.json")
    config = project / "run.yaml"
    spec = {"name": "a", "source": "json", "format": "hf", "template": "alpaca"}
    for data_files in ("data/train.json", ["data/*.json"], {"train": "data/train.json"}):
        raw = {"datasets": [{**spec, "data_files": data_files}], "tokenizer": {"path": str(GPT2)}}
        config.write_text(yaml.safe_dump(raw))
        monkeypatch.chdir(tmp_path)  # not the config's folder
        [dataset] = load_config(config).datasets
        assert dataset.files == (str(project / "data" / "train.json"),), data_files
