"""Tests for rayjobs.tokenize with the real GPT-2 tokenizer: literal rows, label shifting, overflow,
the Tokenize batch class (errors, skips, ledger counts) and invariants on ../shared/data."""

from __future__ import annotations

import dataclasses
import doctest
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import ray

from rayjobs import tokenize
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.sources import record_table
from rayjobs.tokenize import (DataError, Tokenize, TokenizeCounts, Tokenizer, apply_overflow,
                              sample_uid, shift_labels)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
EOS = 50256  # GPT-2 "<|endoftext|>"
X = -100     # IGNORE_INDEX, short so the label rows below line up


def _shared(relative: str) -> Path:
    path = SHARED / relative
    if not path.exists():
        pytest.fail(f"shared data missing: {path} (expected ../shared/data next to the repo root)")
    return path


@pytest.fixture(scope="module")
def gpt2_path() -> str:
    return str(_shared("tokenizers/gpt2"))


@pytest.fixture(scope="module")
def gpt2(gpt2_path) -> Tokenizer:
    return Tokenizer(TokenizerConfig(path=gpt2_path))


def _spec(template: str, name: str = "d", **fields) -> DatasetConfig:
    return DatasetConfig(name=name, source="unused", template=template, **fields)


def _batch(dataset: str, records: list, path: str = "/data/rows.jsonl") -> pa.Table:
    return record_table(dataset, [path] * len(records), list(range(1, len(records) + 1)),
                        [r if isinstance(r, str) else json.dumps(r) for r in records])


@pytest.fixture
def gpt2_config(monkeypatch, gpt2, gpt2_path) -> TokenizerConfig:
    """The GPT-2 config; Tokenize reuses the module's loaded tokenizer instead of reloading it."""
    monkeypatch.setattr(tokenize, "Tokenizer", lambda config: gpt2)
    return TokenizerConfig(path=gpt2_path)


def _one(gpt2_config, template: str, record: dict, **fields) -> dict:
    tokenizer = Tokenize(datasets=[_spec(template, **fields)], tokenizer=gpt2_config, seq_len=4096,
                         overflow="truncate")
    [row] = tokenizer(_batch("d", [record])).to_pylist()
    assert row.pop("num_tokens") == len(row["input_ids"])
    assert row.pop("uid") == sample_uid("d\0/data/rows.jsonl\0" "1\0" "0")  # row 1, piece 0
    return row


def test_gpt2_tokenizer_ids(gpt2):
    assert (gpt2.eos_id, gpt2.pad_id, gpt2.vocab_size) == (EOS, EOS, 50257)
    # "Hello", " world", "!"
    assert gpt2.encode_batch(["Hello world!", "5"]) == [[15496, 995, 0], [20]]


def test_raw_text_row(gpt2_config):
    assert _one(gpt2_config, "text", {"text": "Hello world!"}) == {
        "input_ids": [15496, 995, 0, EOS],
        "labels": [995, 0, EOS, X],
        "source": "d",
    }


# record, number of prompt tokens, expected output+EOS ids. Ids read by eye: 21017 "###",
# 18261 " Response", 25 ":", 198 "\n", 17250 "Hi", 0 "!", 20 "5".
ALPACA = {
    "without_input": ({"instruction": "Say hi.", "input": "", "output": "Hi!"}, 33, [17250, 0, EOS]),
    "with_input": ({"instruction": "Add.", "input": "2 and 3", "output": "5"}, 50, [20, EOS]),
}


@pytest.mark.parametrize("record, num_prompt, answer", list(ALPACA.values()), ids=list(ALPACA))
def test_alpaca_row_trains_only_the_output_and_eos(gpt2_config, record, num_prompt, answer):
    row = _one(gpt2_config, "alpaca", record)
    assert len(row["input_ids"]) == num_prompt + len(answer)
    assert row["input_ids"][num_prompt - 4:] == [21017, 18261, 25, 198, *answer]
    # The last prompt token ("\n") predicts the first output token; the EOS position predicts nothing.
    assert row["labels"] == [X] * (num_prompt - 1) + answer + [X]


def test_train_on_input_trains_everything_but_the_last_position(gpt2_config):
    record = ALPACA["without_input"][0]
    row = _one(gpt2_config, "alpaca", record, train_on_input=True)
    assert len(row["input_ids"]) == 36
    assert row["labels"] == row["input_ids"][1:] + [X]
    assert row["input_ids"] == _one(gpt2_config, "alpaca", record)["input_ids"]


IM_START = [27, 91, 320, 62, 9688, 91, 29]   # "<|im_start|>": not special for GPT-2, 7 tokens
IM_END_NL = [27, 91, 320, 62, 437, 91, 29, 198]  # "<|im_end|>\n"


def test_multi_turn_chat_trains_only_assistant_turns(gpt2_config):
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ]}
    row = _one(gpt2_config, "chat", record)
    prompt_1 = [*IM_START, 10057, 198, 3856, 4506, 29847, 91, 320, 62, 437, 91, 29, 198,  # system
                *IM_START, 7220, 198, 17250, *IM_END_NL,  # user\nHi<|im_end|>\n
                *IM_START, 562, 10167, 198]  # <|im_start|>assistant\n
    answer_1 = [15496, *IM_END_NL]  # Hello<|im_end|>\n
    prompt_2 = [*IM_START, 7220, 198, 3886, 68, *IM_END_NL, *IM_START, 562, 10167, 198]
    answer_2 = [34, 13481, *IM_END_NL]  # Ciao<|im_end|>\n
    assert (len(prompt_1), len(answer_1), len(prompt_2), len(answer_2)) == (47, 9, 29, 10)
    assert row["input_ids"] == prompt_1 + answer_1 + prompt_2 + answer_2 + [EOS]
    assert row["labels"] == (
        [X] * 46 + [15496, 27, 91, 320, 62, 437, 91, 29, 198]
        + [X] * 29 + [34, 13481, 27, 91, 320, 62, 437, 91, 29, 198, EOS, X]
    )


# input_ids, trained mask → labels (labels[t] = input_ids[t+1] where token t+1 is trained).
SHIFT = {
    "docstring_example": ([5, 6, 7, 8], [False, False, True, True], [X, 7, 8, X]),
    "all_trained": ([5, 6, 7, 8], [True, True, True, True], [6, 7, 8, X]),
    "none_trained": ([5, 6, 7], [False, False, False], [X, X, X]),
    "untrained_gap": ([5, 6, 7, 8], [True, True, False, True], [6, X, 8, X]),
    "first_token_trained_is_never_a_target": ([5, 6], [True, False], [X, X]),
    "single_token": ([9], [True], [X]),
}


@pytest.mark.parametrize("input_ids, trained, expected", list(SHIFT.values()), ids=list(SHIFT))
def test_shift_labels(input_ids, trained, expected):
    labels = shift_labels(np.array(input_ids), np.array(trained))
    assert labels.dtype == np.int32
    assert labels.tolist() == expected


def test_tokenize_doctests():
    assert doctest.testmod(tokenize).failed == 0


IDS = [10, 11, 12, 13, 14]
LABELS = [11, 12, 13, 14, X]
# seq_len, policy → (pieces as (input_ids, labels), truncated token count). A cut position's label
# pointed into the next piece, so it becomes -100.
OVERFLOW = {
    "fits_truncate": (5, "truncate", [(IDS, LABELS)], 0),
    "fits_split": (5, "split", [(IDS, LABELS)], 0),
    "fits_drop": (5, "drop", [(IDS, LABELS)], 0),
    "truncate": (2, "truncate", [([10, 11], [11, X])], 3),
    "truncate_by_one": (4, "truncate", [([10, 11, 12, 13], [11, 12, 13, X])], 1),
    "split_even_then_rest": (2, "split", [([10, 11], [11, X]), ([12, 13], [13, X]), ([14], [X])], 0),
    "split_long_then_one": (4, "split", [([10, 11, 12, 13], [11, 12, 13, X]), ([14], [X])], 0),
    "drop": (4, "drop", [], 0),
}


@pytest.mark.parametrize("seq_len, policy, pieces, truncated", list(OVERFLOW.values()), ids=list(OVERFLOW))
def test_apply_overflow(seq_len, policy, pieces, truncated):
    labels = np.array(LABELS, dtype=np.int32)
    got, got_truncated = apply_overflow(np.array(IDS, dtype=np.int32), labels, seq_len, policy)
    assert [(ids.tolist(), lab.tolist()) for ids, lab in got] == pieces
    assert got_truncated == truncated
    assert labels.tolist() == LABELS  # the caller's labels are not modified


class _FakeRemote:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return args


class FakeLedger:
    """Stands in for the ledger actor: ``add_tokenize.remote(...)`` records its arguments."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.add_tokenize = _FakeRemote(self.calls)


@pytest.fixture
def ledger(monkeypatch) -> FakeLedger:
    monkeypatch.setattr(ray, "get", lambda values: values)
    return FakeLedger()


SAY_HI, ADD = ALPACA["without_input"][0], ALPACA["with_input"][0]
NO_OUTPUT = {"instruction": "Say hi.", "answer": "Hi!"}


def test_bad_row_under_error_raises_data_error_naming_dataset_file_row_field(gpt2_config):
    tokenizer = Tokenize(datasets=[_spec("alpaca", name="alpaca")], tokenizer=gpt2_config,
                         seq_len=4096, overflow="truncate")
    with pytest.raises(DataError) as caught:
        tokenizer(_batch("alpaca", [SAY_HI, NO_OUTPUT, ADD], path="/data/alpaca.json"))
    message = str(caught.value)
    for part in ("dataset 'alpaca'", "file /data/alpaca.json", "row 2", "field 'output'",
                 "on_bad_row: skip"):
        assert part in message


def test_bad_row_under_skip_is_skipped_and_counted(gpt2_config, ledger):
    tokenizer = Tokenize(datasets=[_spec("alpaca", name="alpaca", on_bad_row="skip")],
                         tokenizer=gpt2_config, seq_len=4096, overflow="truncate", ledger=ledger)
    table = tokenizer(_batch("alpaca", [SAY_HI, NO_OUTPUT, ADD], path="/data/alpaca.json"))
    assert table.column_names == ["input_ids", "labels", "source", "uid", "num_tokens"]
    assert len(set(table.column("uid").to_pylist())) == 2
    assert [len(ids) for ids in table.column("input_ids").to_pylist()] == [36, 52]
    assert table.column("source").to_pylist() == ["alpaca", "alpaca"]
    [(name, counts)] = ledger.calls
    assert name == "alpaca"
    assert (counts.samples, counts.tokens, counts.trained_tokens, counts.skipped_rows) == (2, 88, 5, 1)
    [example] = counts.skipped_examples
    assert example.startswith("dataset 'alpaca', file /data/alpaca.json, row 2: field 'output'")


# overflow policy at seq_len 3 for "Hello world!" (4 tokens) → (rows, counts sent to the ledger).
OVERFLOW_COUNTS = {
    "truncate": ("truncate", [([15496, 995, 0], [995, 0, X])],
                 TokenizeCounts(samples=1, tokens=3, trained_tokens=2, truncated_tokens=1)),
    "split": ("split", [([15496, 995, 0], [995, 0, X]), ([EOS], [X])],
              TokenizeCounts(samples=2, tokens=4, trained_tokens=2, split_samples=1)),
    "drop": ("drop", [], TokenizeCounts(dropped_samples=1)),
}


@pytest.mark.parametrize("overflow, rows, counts", list(OVERFLOW_COUNTS.values()), ids=list(OVERFLOW_COUNTS))
def test_overflow_rows_and_counts(gpt2_config, ledger, overflow, rows, counts):
    tokenizer = Tokenize(datasets=[_spec("text")], tokenizer=gpt2_config, seq_len=3,
                         overflow=overflow, ledger=ledger)
    table = tokenizer(_batch("d", [{"text": "Hello world!"}]))
    assert list(zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist())) == rows
    [(name, got)] = ledger.calls
    assert got.seconds > 0  # the stage timer ran; the counts are exact
    assert (name, dataclasses.replace(got, seconds=0.0, cpu_seconds=0.0)) == ("d", counts)


def test_one_batch_serves_several_datasets(gpt2_config, ledger):
    tokenizer = Tokenize(datasets=[_spec("text", name="web"), _spec("alpaca", name="sft")],
                         tokenizer=gpt2_config, seq_len=4096, overflow="truncate", ledger=ledger)
    batch = pa.table({
        "_dataset": ["web", "sft", "web"],
        "_path": ["/w.jsonl", "/s.json", "/w.jsonl"],
        "_row": pa.array([1, 0, 2], type=pa.int64()),
        "_record": [json.dumps({"text": "Hello world!"}), json.dumps(ADD), json.dumps({"text": "5"})],
    })
    table = tokenizer(batch)
    assert table.column("source").to_pylist() == ["web", "sft", "web"]
    assert [ids[-1] for ids in table.column("input_ids").to_pylist()] == [EOS, EOS, EOS]
    assert {name: (c.samples, c.tokens) for name, c in ledger.calls} == {"web": (2, 6), "sft": (1, 52)}


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_record_that_is_not_an_object_is_a_bad_row(gpt2_config, on_bad_row):
    tokenizer = Tokenize(datasets=[_spec("text", on_bad_row=on_bad_row)], tokenizer=gpt2_config,
                         seq_len=4096, overflow="truncate")
    batch = _batch("d", [{"text": "Hello world!"}, "[1, 2]"])
    if on_bad_row == "error":
        with pytest.raises(DataError, match="row 2"):
            tokenizer(batch)
    else:
        assert tokenizer(batch).column("input_ids").to_pylist() == [[15496, 995, 0, EOS]]


def _head_records(relative: str, count: int) -> list[str]:
    path = _shared(relative)
    if path.suffix == ".jsonl":
        with path.open() as lines:
            return [next(lines).strip() for _ in range(count)]
    return [json.dumps(record) for record in json.loads(path.read_text())[:count]]


@pytest.mark.parametrize("relative, template", [
    ("sft/alpaca_en_demo.json", "alpaca"),
    ("chat/hh_rlhf_harmless_chosen.messages.jsonl", "chat"),
], ids=["alpaca_en_demo", "hh_rlhf_chat"])
def test_label_invariants_on_shared_data(gpt2_config, relative, template):
    records = _head_records(relative, 200)
    tokenizer = Tokenize(datasets=[_spec(template)], tokenizer=gpt2_config, seq_len=4096,
                         overflow="truncate")
    table = tokenizer(record_table("d", [relative] * 200, list(range(200)), records))
    assert table.num_rows == 200
    num_trained = num_ignored = 0
    for ids, labels in zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist()):
        assert len(ids) == len(labels) <= 4096
        assert ids[-1] == EOS
        assert labels[-1] == X
        for t, label in enumerate(labels):
            if label != X:
                assert label == ids[t + 1]
        num_trained += sum(label != X for label in labels)
        num_ignored += sum(label == X for label in labels)
    assert num_trained > 0 and num_ignored > 200  # guard: prompts masked and responses trained
