"""The Tokenize actor's batch encoder (``flat.encode_flat``) against the row-by-row reference
(``samples.encode_samples``): the same samples, counts and row indices on every bundled SFT set,
under every overflow policy, with BOS added or not, and the fast path taken."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest

from conftest import DATA
from rayjobs.bench.packing import pipeline_config
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data import flat
from rayjobs.data.samples import encode_samples
from rayjobs.data.sources import open_row_file, read_tables
from rayjobs.data.tasks import TASKS
from rayjobs.data.tokenize import Tokenize

BATCH_ROWS = 256


def _batches(spec: DatasetConfig) -> list[pa.Table]:
    """A bundled set's raw rows as the read tasks emit them, in Tokenize batches."""
    tables = []
    for path in spec.files:
        with open_row_file(path, spec.format) as file:
            tables += read_tables(
                file, path, format=spec.format, dataset=spec.name, text_split=spec.text_split
            )
    table = pa.concat_tables(tables)
    return [table.slice(i, BATCH_ROWS) for i in range(0, table.num_rows, BATCH_ROWS)]


@pytest.fixture(scope="module")
def bundled() -> list[tuple[DatasetConfig, list[pa.Table]]]:
    """Every bundled set the SFT path reads (``bench packing``'s: alpaca, gpteacher, hh chat,
    glaive's tool calls, Shakespeare, C4), and the eval subsets."""
    from rayjobs.config import config_from_dict

    evals = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca_eval", "source": str(DATA / "eval/alpaca_en_demo.last60.json"),
                 "template": "alpaca"},
                {"name": "hh_eval", "template": "chat",
                 "source": str(DATA / "eval/hh_rlhf_harmless_chosen.last60.messages.jsonl")},
            ],
            "tokenizer": {"path": str(DATA / "tokenizers/gpt2")},
        }
    )  # fmt: skip
    specs = [*pipeline_config(DATA).datasets, *evals.datasets]
    return [(spec, _batches(spec)) for spec in specs]


def _both(stage: Tokenize, batch: pa.Table, monkeypatch) -> tuple:
    """(flat's table and counts, the reference's), the flat path checked to be the actor's."""
    encoders = {task.encode for task in stage.tasks.values()}
    assert encoders == {flat.encode_flat}, "the Tokenize actor does not take the flat path"
    fast = stage.counted(batch)
    with monkeypatch.context() as patched:
        reference = dataclasses.replace(TASKS["sft"], encode=encode_samples)
        patched.setattr(stage, "tasks", dict.fromkeys(stage.tasks, reference))
        slow = stage.counted(batch)
    return fast, slow


def _same(fast: tuple, slow: tuple) -> None:
    (table, counts), (expected, expected_counts) = fast, slow
    assert table.schema == expected.schema
    assert table.to_pydict() == expected.to_pydict()
    for name, tally in expected_counts.items():
        mine = dataclasses.replace(counts[name], seconds=0.0, cpu_seconds=0.0)
        assert mine == dataclasses.replace(tally, seconds=0.0, cpu_seconds=0.0), name


@pytest.mark.parametrize(
    ("seq_len", "overflow", "tokenizer"),
    [
        (2048, "truncate", {}),
        (256, "truncate", {}),
        (256, "split", {"add_bos": True}),
        (256, "drop", {}),
        (64, "split", {}),
    ],
)
def test_the_flat_encoder_gives_the_reference_samples_on_every_bundled_set(
    bundled, seq_len, overflow, tokenizer, monkeypatch
):
    config = TokenizerConfig(path=str(DATA / "tokenizers/gpt2"), **tokenizer)
    specs = [spec for spec, _ in bundled]
    stage = Tokenize(specs, config, seq_len, overflow)
    for _, batches in bundled:
        for batch in batches:
            _same(*_both(stage, batch, monkeypatch))


def _record_batch(name: str, records: list[dict]) -> pa.Table:
    from rayjobs.data.sources import record_table

    rows = list(range(1, len(records) + 1))
    return record_table(name, ["/x.jsonl"] * len(rows), rows, [json.dumps(r) for r in records])


def test_train_on_input_and_texts_that_end_with_eos(monkeypatch):
    """Every token trained (``train_on_input``), texts that already end with EOS (none added),
    in one batch of two datasets."""
    records = [
        {"instruction": "Say hi.", "output": "Hello<|endoftext|>"},
        {"instruction": "Count.", "input": "1 2", "output": "3 4 5"},
        {"instruction": "Say hi.", "output": "Hello <|endoftext|>\n"},
    ]
    specs = [
        DatasetConfig(name="a", source="unused", template="alpaca", train_on_input=True),
        DatasetConfig(name="b", source="unused", template="alpaca"),
    ]
    batch = pa.concat_tables([_record_batch(spec.name, records) for spec in specs])
    config = TokenizerConfig(path=str(DATA / "tokenizers/gpt2"))
    for seq_len in (8, 4096):
        _same(*_both(Tokenize(specs, config, seq_len, "split"), batch, monkeypatch))
