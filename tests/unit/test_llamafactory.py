"""LLaMA-Factory's layouts as its users have them: a ``data/`` folder with ``dataset_info.json``
and its files, named by a config (``datasets[].dataset_info``), exports without edits: alpaca
rows with a ``system`` column (the system text in place of the preamble), sharegpt rows with
tools and with ``"tools": ""`` (no tools), the registry's column and tag names honoured."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ALPACA, GPT2, SHAREGPT
from rayjobs.config import ConfigError, load_config
from rayjobs.job.export import export

SYSTEM = "You answer in one short sentence."

DATASET_INFO = {
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "glaive_toolcall_en_demo": {
        "file_name": "glaive_toolcall_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
    "identity_sys": {
        "file_name": "identity_sys.json",
        "columns": {"prompt": "question", "response": "answer", "system": "system_prompt"},
    },
    "chat_openai_tags": {
        "file_name": "chat_openai.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },  # fmt: skip
}
"""Entries as LLaMA-Factory's data/dataset_info.json writes them (its demo sets' names)."""


@pytest.fixture
def project(tmp_path):
    """A project: LLaMA-Factory's ``data/`` folder and a config beside it naming its entries."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2))
    (data / "alpaca_en_demo.json").write_text(ALPACA.read_text())
    glaive = json.loads(SHAREGPT.read_text())[:40]
    for row in glaive[::2]:
        row["tools"] = ""  # how LLaMA-Factory writes "no tools"
    (data / "glaive_toolcall_en_demo.json").write_text(json.dumps(glaive))
    alpaca = json.loads(ALPACA.read_text())[:30]
    identity = [
        {"question": r["instruction"], "answer": r["output"], "system_prompt": SYSTEM}
        for r in alpaca
    ]
    (data / "identity_sys.json").write_text(json.dumps(identity))
    chats = [
        {"messages": [{"role": "user", "content": r["instruction"]},
                      {"role": "assistant", "content": r["output"]}]}
        for r in alpaca
    ]  # fmt: skip
    (data / "chat_openai.json").write_text(json.dumps(chats))
    config = {
        "datasets": [
            {"name": "alpaca_en_demo", "dataset_info": "data/dataset_info.json"},
            {"name": "glaive", "dataset_info": "data/dataset_info.json#glaive_toolcall_en_demo"},
            {"name": "identity_sys", "dataset_info": "data/dataset_info.json"},
            {"name": "chat_openai_tags", "dataset_info": "data/dataset_info.json"},
        ],
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": 1024, "overflow": "truncate"},
    }
    path = tmp_path / "llamafactory.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_the_registry_sets_each_datasets_keys(project):
    config = load_config(project)
    got = {
        d.name: (d.template, d.column_map, d.message_keys, d.roles, len(d.files))
        for d in config.datasets
    }
    assert got == {
        "alpaca_en_demo": ("alpaca", {}, {}, {}, 1),
        "glaive": ("chat", {}, {}, {}, 1),
        "identity_sys": (
            "alpaca",
            {"instruction": "question", "output": "answer", "system": "system_prompt"},
            {}, {}, 1,
        ),
        "chat_openai_tags": (
            "chat", {}, {"role": "role", "content": "content"},
            {"user": "user", "assistant": "assistant"}, 1,
        ),
    }  # fmt: skip
    assert config.datasets[0].files[0].endswith("data/alpaca_en_demo.json")


def test_llamafactory_data_exports_without_edits(project, tmp_path):
    from transformers import AutoTokenizer

    manifest = export(load_config(project), tmp_path / "out", runner="local")
    counts = manifest["datasets"]
    assert {name: (c["samples"], c["skipped_rows"]) for name, c in counts.items()} == {
        "alpaca_en_demo": (300, 0),
        "glaive": (40, 0),
        "identity_sys": (30, 0),
        "chat_openai_tags": (30, 0),
    }
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "_tokenizer")
    table = pq.read_table(tmp_path / "out" / "train")
    text = "".join(tokenizer.decode(ids) for ids in table.column("input_ids").to_pylist())
    assert text.count(f"{SYSTEM}\n\n### Instruction:") == 30  # the system text, not the preamble
    assert "<tool_call>" in text or "search_recipes" in text, "guard: the tools rendered"


def test_a_bad_entry_is_refused_naming_the_dataset_and_the_file(project):
    raw = yaml.safe_load(project.read_text())
    info = project.parent / "data" / "dataset_info.json"
    registry = json.loads(info.read_text())
    for spec, change, message in (
        ({"dataset_info": "data/dataset_info.json#nope"}, {}, "no entry 'nope'"),
        ({}, {"ranking": True}, "['ranking'] not supported"),
        ({}, {"formatting": "openai"}, "formatting 'openai': alpaca or sharegpt"),
    ):
        info.write_text(
            json.dumps(registry | {"alpaca_en_demo": {**registry["alpaca_en_demo"], **change}})
        )
        raw["datasets"][0] |= spec
        project.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match="datasets.0.dataset_info") as caught:
            load_config(project)
        assert message in str(caught.value)
        raw["datasets"][0]["dataset_info"] = "data/dataset_info.json"


def test_an_alpaca_system_column_maps_as_the_warning_suggests(tmp_path):
    """The unused-column warning's remedy (column_map) is accepted for ``system``."""
    rows = [{"instruction": "Hi", "output": "Hello", "sys": SYSTEM}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    raw = {
        "datasets": [{"name": "a", "source": "a.json", "template": "alpaca",
                      "column_map": {"system": "sys"}}],
        "tokenizer": {"path": str(GPT2)},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    [spec] = load_config(tmp_path / "c.yaml").datasets
    assert spec.column_map == {"system": "sys"}
