"""Tests for rayjobs.data.tokenize with the real GPT-2 tokenizer: literal rows, label shifting,
overflow, the Tokenize batch class (errors, skips, ledger counts) and invariants on the bundled real
data."""

from __future__ import annotations

import dataclasses
import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import DATA
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data import tokenize
from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.samples import apply_overflow, sample_uid, shift_labels
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.errors import DataError

EOS = 50256  # GPT-2 "<|endoftext|>"
X = -100  # IGNORE_INDEX, short so the label rows below line up


def _data(relative: str) -> Path:
    return DATA / relative


@pytest.fixture(scope="module")
def gpt2_path() -> str:
    return str(_data("tokenizers/gpt2"))


@pytest.fixture(scope="module")
def gpt2(gpt2_path) -> Tokenizer:
    return Tokenizer(TokenizerConfig(path=gpt2_path))


def _spec(template: str, name: str = "d", **fields) -> DatasetConfig:
    return DatasetConfig(name=name, source="unused", template=template, **fields)


def _batch(dataset: str, records: list, path: str = "/data/rows.jsonl") -> pa.Table:
    return record_table(
        dataset,
        [path] * len(records),
        list(range(1, len(records) + 1)),
        [r if isinstance(r, str) else json.dumps(r) for r in records],
    )


@pytest.fixture
def gpt2_config(monkeypatch, gpt2, gpt2_path) -> TokenizerConfig:
    """The GPT-2 config; Tokenize reuses the module's loaded tokenizer instead of reloading it."""
    monkeypatch.setattr(tokenize, "Tokenizer", lambda config: gpt2)
    return TokenizerConfig(path=gpt2_path)


def _one(gpt2_config, template: str, record: dict, **fields) -> dict:
    tokenizer = Tokenize(
        datasets=[_spec(template, **fields)],
        tokenizer=gpt2_config,
        seq_len=4096,
        overflow="truncate",
    )
    [row] = tokenizer(_batch("d", [record])).to_pylist()
    assert row.pop("num_tokens") == len(row["input_ids"])
    assert row.pop("uid") == sample_uid("d\x00/data/rows.jsonl\x001\x000")  # row 1, piece 0
    return row


def test_gpt2_tokenizer_ids(gpt2):
    assert (gpt2.eos_id, gpt2.pad_id, gpt2.vocab_size) == (EOS, EOS, 50257)
    # "Hello", " world", "!"
    assert gpt2.encode_batch(["Hello world!", "5"]) == [[15496, 995, 0], [20]]


# A template in the style of Llama/Mistral ones: special tokens, a system turn, a generation prompt.
JINJA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}[SYS]{{ m.content }}[/SYS]"
    "{% elif m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]{% else %} {{ m.content }}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %} {% endif %}"
)


def test_tokenizer_matches_transformers_on_real_text_and_chat(gpt2_path):
    """The torch-free loader agrees with transformers' AutoTokenizer: ids, special tokens, vocab
    size, and chat rendering with a Jinja template on real conversations."""
    from transformers import AutoTokenizer

    ours = Tokenizer(TokenizerConfig(path=gpt2_path, chat_template=JINJA_TEMPLATE))
    theirs = AutoTokenizer.from_pretrained(gpt2_path)
    theirs.chat_template = JINJA_TEMPLATE
    assert (ours.eos_id, ours.vocab_size) == (theirs.eos_token_id, len(theirs))
    lines = _data("chat/hh_rlhf_harmless_chosen.messages.jsonl").read_text().splitlines()[:20]
    conversations = [json.loads(line)["messages"] for line in lines]
    texts = [m["content"] for c in conversations for m in c]
    assert ours.encode_batch(texts) == [
        theirs(x, add_special_tokens=False).input_ids for x in texts
    ]
    rendered = 0
    for messages in conversations:
        for end in range(1, len(messages) + 1):
            for prompt in (True, False):
                expected = theirs.apply_chat_template(
                    messages[:end], tokenize=False, add_generation_prompt=prompt
                )
                assert ours.render_chat(messages[:end], prompt) == expected
                rendered += 1
    assert rendered > 100 and "<|endoftext|>" in expected, "guard: special tokens rendered"


@pytest.mark.parametrize("key", ["eos_token", "pad_token"])
def test_a_configured_special_token_missing_from_the_vocabulary_is_refused(gpt2_path, key):
    """A token the config names must exist: a misspelt ``pad_token`` was replaced by EOS without
    a word. Unset, the pad token falls back to EOS (GPT-2 has none)."""
    with pytest.raises(ValueError, match=f"tokenizer.{key}: token '<pda>' is not in the vocab"):
        Tokenizer(TokenizerConfig(path=gpt2_path, **{key: "<pda>"}))
    assert Tokenizer(TokenizerConfig(path=gpt2_path)).pad_id == EOS


def test_tokenizer_reads_a_folder_chat_template_and_added_tokens(tmp_path, gpt2_path):
    """A saved folder's own chat template (tokenizer_config or chat_template.jinja) and special
    tokens written as AddedToken dicts are read as transformers reads them."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((Path(gpt2_path) / "tokenizer.json").read_bytes())
    settings = {
        "eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"},
        "chat_template": [
            {"name": "default", "template": JINJA_TEMPLATE},
            {"name": "tool_use", "template": "{{ 1 }}"},
        ],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    loaded = Tokenizer(TokenizerConfig(path=str(folder)))
    assert (loaded.eos_id, loaded.chat_template) == (EOS, JINJA_TEMPLATE)
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert (
        Tokenizer(TokenizerConfig(path=str(folder))).render_chat(
            [{"role": "user", "content": "hi"}], False
        )
        == "hi!"
    )


def test_tokenize_actor_never_imports_torch(gpt2_path):
    """A Tokenize actor on a CPU node loads the tokenizer and renders chat without torch."""
    code = f"""
import json, sys
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
spec = DatasetConfig(name="d", source="unused", template="chat")
tokenize = Tokenize([spec], TokenizerConfig(path={gpt2_path!r}, chat_template={JINJA_TEMPLATE!r}),
                    seq_len=64, overflow="truncate")
turns = [{{"role": "user", "content": "Hi"}}, {{"role": "assistant", "content": "Yo"}}]
record = {{"messages": turns}}
table = tokenize(record_table("d", ["x"], [1], [json.dumps(record)]))
assert table.num_rows == 1, table
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to see a wider pool")
def test_a_tokenize_stage_caps_the_tokenizers_threads(gpt2_path):
    """A Tokenize actor asks Ray for one CPU; its tokenizer's thread pool (rayon, as wide as the
    machine by default) is capped at that (``threads``). Measured as the threads the process gains
    over its first batch, in a fresh process each (the pool is built once per process)."""
    code = f"""
import json, sys
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
def threads():
    status = open("/proc/self/status").read().splitlines()
    return int(next(line.split()[1] for line in status if line.startswith("Threads:")))
cap = int(sys.argv[1]) or None
spec = DatasetConfig(name="d", source="unused", template="text")
tokenize = Tokenize([spec], TokenizerConfig(path={gpt2_path!r}), 64, "truncate", threads=cap)
before = threads()
records = [json.dumps({{"text": "word " * 50}})] * 512
tokenize(record_table("d", ["x"] * 512, list(range(512)), records))
print(threads() - before)
"""
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    grown = {
        cap: int(subprocess.run([sys.executable, "-c", code, str(cap)], check=True, env=env,
                                capture_output=True, text=True).stdout)
        for cap in (0, 1)
    }  # fmt: skip
    assert grown[0] >= 2, grown  # guard: uncapped, the pool spans the machine's cores
    assert grown[1] <= 1, grown


def test_raw_text_row(gpt2_config):
    assert _one(gpt2_config, "text", {"text": "Hello world!"}) == {
        "input_ids": [15496, 995, 0, EOS],
        "labels": [995, 0, EOS, X],
        "source": "d",
    }


# record, number of prompt tokens, expected output+EOS ids. Ids read by eye: 21017 "###",
# 18261 " Response", 25 ":", 198 "\n", 17250 "Hi", 0 "!", 20 "5".
ALPACA = {
    "without_input": (
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        33,
        [17250, 0, EOS],
    ),
    "with_input": ({"instruction": "Add.", "input": "2 and 3", "output": "5"}, 50, [20, EOS]),
}


@pytest.mark.parametrize("record, num_prompt, answer", list(ALPACA.values()), ids=list(ALPACA))
def test_alpaca_row_trains_only_the_output_and_eos(gpt2_config, record, num_prompt, answer):
    row = _one(gpt2_config, "alpaca", record)
    assert len(row["input_ids"]) == num_prompt + len(answer)
    assert row["input_ids"][num_prompt - 4 :] == [21017, 18261, 25, 198, *answer]
    # The last prompt token ("\n") predicts the first output token; the EOS position predicts
    # nothing.
    assert row["labels"] == [X] * (num_prompt - 1) + answer + [X]


def test_train_on_input_trains_everything_but_the_last_position(gpt2_config):
    record = ALPACA["without_input"][0]
    row = _one(gpt2_config, "alpaca", record, train_on_input=True)
    assert len(row["input_ids"]) == 36
    assert row["labels"] == row["input_ids"][1:] + [X]
    assert row["input_ids"] == _one(gpt2_config, "alpaca", record)["input_ids"]


IM_START = [27, 91, 320, 62, 9688, 91, 29]  # "<|im_start|>": not special for GPT-2, 7 tokens
IM_END_NL = [27, 91, 320, 62, 437, 91, 29, 198]  # "<|im_end|>\n"


def test_multi_turn_chat_trains_only_assistant_turns(gpt2_config):
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Ciao"},
        ]
    }
    row = _one(gpt2_config, "chat", record)
    prompt_1 = [
        *IM_START,
        10057,
        198,
        3856,
        4506,
        29847,
        91,
        320,
        62,
        437,
        91,
        29,
        198,  # system
        *IM_START,
        7220,
        198,
        17250,
        *IM_END_NL,  # user\nHi<|im_end|>\n
        *IM_START,
        562,
        10167,
        198,
    ]  # <|im_start|>assistant\n
    answer_1 = [15496, *IM_END_NL]  # Hello<|im_end|>\n
    prompt_2 = [*IM_START, 7220, 198, 3886, 68, *IM_END_NL, *IM_START, 562, 10167, 198]
    answer_2 = [34, 13481, *IM_END_NL]  # Ciao<|im_end|>\n
    assert (len(prompt_1), len(answer_1), len(prompt_2), len(answer_2)) == (47, 9, 29, 10)
    assert row["input_ids"] == prompt_1 + answer_1 + prompt_2 + answer_2 + [EOS]
    assert row["labels"] == (
        [X] * 46
        + [15496, 27, 91, 320, 62, 437, 91, 29, 198]
        + [X] * 29
        + [34, 13481, 27, 91, 320, 62, 437, 91, 29, 198, EOS, X]
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


def test_samples_doctests():
    from rayjobs.data import samples

    results = doctest.testmod(samples)
    assert results.attempted >= 1 and results.failed == 0  # guard: the examples ran


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
    "split_even_then_rest": (
        2,
        "split",
        [([10, 11], [11, X]), ([12, 13], [13, X]), ([14], [X])],
        0,
    ),
    "split_long_then_one": (4, "split", [([10, 11, 12, 13], [11, 12, 13, X]), ([14], [X])], 0),
    "drop": (4, "drop", [], 0),
}


@pytest.mark.parametrize(
    "seq_len, policy, pieces, truncated", list(OVERFLOW.values()), ids=list(OVERFLOW)
)
def test_apply_overflow(seq_len, policy, pieces, truncated):
    labels = np.array(LABELS, dtype=np.int32)
    got, got_truncated = apply_overflow(np.array(IDS, dtype=np.int32), labels, seq_len, policy)
    assert [(ids.tolist(), lab.tolist()) for ids, lab in got] == pieces
    assert got_truncated == truncated
    assert labels.tolist() == LABELS  # the caller's labels are not modified


SAY_HI, ADD = ALPACA["without_input"][0], ALPACA["with_input"][0]
NO_OUTPUT = {"instruction": "Say hi.", "answer": "Hi!"}


def test_bad_row_under_error_raises_data_error_naming_dataset_file_row_field(gpt2_config):
    tokenizer = Tokenize(
        datasets=[_spec("alpaca", name="alpaca")],
        tokenizer=gpt2_config,
        seq_len=4096,
        overflow="truncate",
    )
    with pytest.raises(DataError) as caught:
        tokenizer(_batch("alpaca", [SAY_HI, NO_OUTPUT, ADD], path="/data/alpaca.json"))
    message = str(caught.value)
    for part in (
        "dataset 'alpaca'",
        "file /data/alpaca.json",
        "row 2",
        "field 'output'",
        "[missing_field]",
        "on_bad_row: skip",
    ):
        assert part in message


def test_bad_row_under_skip_is_skipped_and_counted(gpt2_config, fake_ledger):
    tokenizer = Tokenize(
        datasets=[_spec("alpaca", name="alpaca", on_bad_row="skip")],
        tokenizer=gpt2_config,
        seq_len=4096,
        overflow="truncate",
        ledger=fake_ledger,
    )
    table = tokenizer(_batch("alpaca", [SAY_HI, NO_OUTPUT, ADD], path="/data/alpaca.json"))
    assert table.column_names == ["input_ids", "labels", "source", "uid", "num_tokens"]
    assert len(set(table.column("uid").to_pylist())) == 2
    assert [len(ids) for ids in table.column("input_ids").to_pylist()] == [36, 52]
    assert table.column("source").to_pylist() == ["alpaca", "alpaca"]
    [(by_dataset, _key, lengths)] = fake_ledger.calls  # one report per batch
    [(name, counts)] = by_dataset.items()
    assert name == "alpaca"
    assert lengths == {"alpaca": [36, 52]}  # the sample-length histogram's values
    assert (counts.samples, counts.tokens, counts.trained_tokens, counts.skipped_rows) == (
        2,
        88,
        5,
        1,
    )
    assert counts.skipped_by_reason == {"missing_field": 1}
    [example] = counts.skipped_examples
    assert example.startswith("dataset 'alpaca', file /data/alpaca.json, row 2: field 'output'")
    assert example.endswith("[missing_field]")


# overflow policy at seq_len 3 for "Hello world!" (4 tokens) → (rows, counts sent to the ledger).
OVERFLOW_COUNTS = {
    "truncate": (
        "truncate",
        [([15496, 995, 0], [995, 0, X])],
        TokenizeCounts(rows=1, samples=1, tokens=3, trained_tokens=2, truncated_tokens=1),
    ),
    "split": (
        "split",
        [([15496, 995, 0], [995, 0, X]), ([EOS], [X])],
        # the second piece, EOS alone, has nothing to train
        TokenizeCounts(
            rows=1,
            samples=2,
            tokens=4,
            trained_tokens=2,
            split_samples=1,
            samples_without_trained_tokens=1,
        ),
    ),
    "drop": (
        "drop",
        [],
        TokenizeCounts(rows=1, dropped_samples=1, dropped_by_reason={"overflow_drop": 1}),
    ),
}


@pytest.mark.parametrize(
    "overflow, rows, counts", list(OVERFLOW_COUNTS.values()), ids=list(OVERFLOW_COUNTS)
)
def test_overflow_rows_and_counts(gpt2_config, fake_ledger, overflow, rows, counts):
    tokenizer = Tokenize(
        datasets=[_spec("text")],
        tokenizer=gpt2_config,
        seq_len=3,
        overflow=overflow,
        ledger=fake_ledger,
    )
    table = tokenizer(_batch("d", [{"text": "Hello world!"}]))
    assert (
        list(zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist())) == rows
    )
    [(by_dataset, _key, _lengths)] = fake_ledger.calls
    [(name, got)] = by_dataset.items()
    assert got.seconds > 0  # the stage timer ran; the counts are exact
    assert (name, dataclasses.replace(got, seconds=0.0, cpu_seconds=0.0)) == ("d", counts)


def test_one_batch_serves_several_datasets(gpt2_config, fake_ledger):
    tokenizer = Tokenize(
        datasets=[_spec("text", name="web"), _spec("alpaca", name="sft")],
        tokenizer=gpt2_config,
        seq_len=4096,
        overflow="truncate",
        ledger=fake_ledger,
    )
    batch = pa.table(
        {
            "_dataset": ["web", "sft", "web"],
            "_path": ["/w.jsonl", "/s.json", "/w.jsonl"],
            "_row": pa.array([1, 0, 2], type=pa.int64()),
            "_record": [
                json.dumps({"text": "Hello world!"}),
                json.dumps(ADD),
                json.dumps({"text": "5"}),
            ],
        }
    )
    table = tokenizer(batch)
    assert table.column("source").to_pylist() == ["web", "sft", "web"]
    assert [ids[-1] for ids in table.column("input_ids").to_pylist()] == [EOS, EOS, EOS]
    [(by_dataset, _key, lengths)] = fake_ledger.calls  # one report for the whole batch
    assert {name: (c.samples, c.tokens) for name, c in by_dataset.items()} == {
        "web": (2, 6),
        "sft": (1, 52),
    }
    assert {name: (len(v), sum(v)) for name, v in lengths.items()} == {
        "web": (2, 6),
        "sft": (1, 52),
    }


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_record_that_is_not_an_object_is_a_bad_row(gpt2_config, on_bad_row):
    tokenizer = Tokenize(
        datasets=[_spec("text", on_bad_row=on_bad_row)],
        tokenizer=gpt2_config,
        seq_len=4096,
        overflow="truncate",
    )
    batch = _batch("d", [{"text": "Hello world!"}, "[1, 2]"])
    if on_bad_row == "error":
        with pytest.raises(DataError, match="row 2"):
            tokenizer(batch)
    else:
        assert tokenizer(batch).column("input_ids").to_pylist() == [[15496, 995, 0, EOS]]


def _head_records(relative: str, count: int) -> list[str]:
    path = _data(relative)
    if path.suffix == ".jsonl":
        with path.open() as lines:
            return [next(lines).strip() for _ in range(count)]
    return [json.dumps(record) for record in json.loads(path.read_text())[:count]]


@pytest.mark.parametrize(
    "relative, template",
    [
        ("sft/alpaca_en_demo.json", "alpaca"),
        ("chat/hh_rlhf_harmless_chosen.messages.jsonl", "chat"),
    ],
    ids=["alpaca_en_demo", "hh_rlhf_chat"],
)
def test_label_invariants_on_real_data(gpt2_config, relative, template):
    records = _head_records(relative, 200)
    tokenizer = Tokenize(
        datasets=[_spec(template)], tokenizer=gpt2_config, seq_len=4096, overflow="truncate"
    )
    table = tokenizer(record_table("d", [relative] * 200, list(range(200)), records))
    assert table.num_rows == 200
    num_trained = num_ignored = 0
    for ids, labels in zip(
        table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    ):
        assert len(ids) == len(labels) <= 4096
        assert ids[-1] == EOS
        assert labels[-1] == X
        for t, label in enumerate(labels):
            if label != X:
                assert label == ids[t + 1]
        num_trained += sum(label != X for label in labels)
        num_ignored += sum(label == X for label in labels)
    assert num_trained > 0 and num_ignored > 200  # guard: prompts masked and responses trained


def test_uids_do_not_depend_on_where_the_files_are(gpt2_config):
    """The same data at two absolute paths (a fresh clone, another machine) gets the same uids,
    so the planned path's shuffles and packs repeat there."""
    record = [{"text": "Hello world!"}]
    uids = []
    for root in ("/a/clone", "/b/elsewhere"):
        files = (f"{root}/data/x.jsonl", f"{root}/data/y.jsonl")
        spec = _spec("text").model_copy(update={"files": files})
        tokenize = Tokenize([spec], gpt2_config, seq_len=64, overflow="truncate")
        uids.append(tokenize(_batch("d", record, path=f"{root}/data/y.jsonl"))["uid"].to_pylist())
    assert uids[0] == uids[1] == [sample_uid("d\x001\x001\x000")]  # file 1 of the dataset, row 1


def test_a_corrupt_tokenizer_file_is_a_config_error(tmp_path):
    """tokenizers raises a bare Exception on a torn tokenizer.json; the user sees the key."""
    from rayjobs.config import ConfigError, config_from_dict
    from rayjobs.job.pipeline import load_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    config = config_from_dict(
        {
            "datasets": [
                {
                    "name": "a",
                    "source": str(DATA / "sft" / "alpaca_en_demo.json"),
                    "template": "alpaca",
                }
            ],
            "tokenizer": {"path": str(tmp_path)},
        }
    )
    with pytest.raises(ConfigError, match=r"tokenizer\.path: cannot load a tokenizer from .*EOF"):
        load_tokenizer(config)


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_preference_rows_tokenize_to_fitted_triples_counted_once(
    gpt2_config, gpt2, overflow, monkeypatch
):
    """Real hh-rlhf triples (task: dpo): each row becomes one sample of three token lists, the
    prompt's tokens those of its text (its start cut first under truncate), each response its text
    then EOS; counts add up: rows = samples + dropped, tokens = the units' lengths, trained = the
    responses' tokens."""
    records = _head_records("dpo/hh_rlhf_harmless.dpo.jsonl", 40)
    seq_len = 256
    tokenizer = Tokenize([_spec("preference")], gpt2_config, seq_len=seq_len, overflow=overflow)
    captured = {}
    tokenizer.ledger = object()  # any ledger: capture the counts report() would send it
    monkeypatch.setattr(tokenize, "report", lambda _, __, counts, *___: captured.update(counts))
    table = tokenizer(record_table("d", ["dpo.jsonl"] * 40, list(range(40)), records))
    counts = captured["d"]
    assert set(table.column_names) >= {"prompt_ids", "chosen_ids", "rejected_ids", "num_tokens"}
    assert counts.rows == 40 and counts.samples == table.num_rows
    assert counts.samples + counts.dropped_samples == 40
    lengths = table.column("num_tokens").to_pylist()
    assert counts.tokens == sum(lengths) and max(lengths) <= seq_len
    whole, cut = 0, 0
    for row, record in zip(table.to_pylist(), (json.loads(r) for r in records if r), strict=False):
        prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
        assert row["num_tokens"] == len(prompt) + len(chosen) + len(rejected) + 1
        if overflow == "drop":
            break  # rows were dropped: which record a row came from is checked under truncate
        full = gpt2.encode_batch([record["prompt"], record["chosen"], record["rejected"]])
        assert prompt == full[0][len(full[0]) - len(prompt) :]  # the prompt's end is kept
        assert chosen == (full[1] + [EOS])[: len(chosen)]
        assert rejected == (full[2] + [EOS])[: len(rejected)]
        whole += chosen[-1] == EOS and rejected[-1] == EOS
        cut += len(prompt) < len(full[0])
    trained = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in table.to_pylist())
    assert counts.trained_tokens == trained
    if overflow == "truncate":
        assert table.num_rows == 40 and cut > 0 and whole > 0  # guard: both cases occurred
        assert counts.truncated_tokens > 0
    else:
        assert counts.dropped_samples > 0 and counts.truncated_tokens == 0


# -- tokenizers that are not GPT-2's byte-level BPE, and chat templates that write BOS / EOS


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory) -> Path:
    """A SentencePiece-layout tokenizer: Metaspace with ``prepend_scheme="first"``, as the
    tokenizer.json of Llama, Mistral and Gemma split text (a ``▁`` before the first word of every
    encode call), trained on the bundled Alpaca text; bos ``<s>``, eos ``</s>``."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    records = json.loads(_data("sft/alpaca_en_demo.json").read_text())
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    backend.train_from_iterator(
        [f"{r['instruction']}\n{r['output']}" for r in records],
        trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    folder = tmp_path_factory.mktemp("spm")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return folder


def _tokenized(folder, spec: DatasetConfig, records: list, **tokenizer) -> list[dict]:
    stage = Tokenize([spec], TokenizerConfig(path=str(folder), **tokenizer), 4096, "truncate")
    return stage(_batch(spec.name, records)).to_pylist()


def test_a_sentencepiece_response_gets_no_space_the_data_lacks(spm_folder):
    """Segments are tokenized as one text: on its own, ``Hello there`` became ``▁He llo ...``,
    a space before every response that neither the data nor inference has."""
    backend = Tokenizer(TokenizerConfig(path=str(spm_folder))).backend
    record = {"instruction": "Say hi.", "output": "Hello there"}
    [row] = _tokenized(spm_folder, _spec("alpaca"), [record])
    text = "".join(s.text for s in tokenize.templates.alpaca(record, {}))
    assert row["input_ids"][:-1] == backend.encode(text, add_special_tokens=False).ids
    trained = [t for t, label in zip(row["input_ids"][1:], row["labels"]) if label != X]
    assert backend.id_to_token(trained[-1]) == "</s>"
    assert backend.decode(trained[:-1]) == "Hello there"
    assert not backend.id_to_token(trained[0]).startswith("▁")
    assert backend.encode("Hello", add_special_tokens=False).tokens[0].startswith("▁"), "guard"


def test_a_sentencepiece_preference_response_follows_its_prompt(spm_folder):
    backend = Tokenizer(TokenizerConfig(path=str(spm_folder))).backend
    record = {"prompt": "Say hi.\n", "chosen": "Hello there", "rejected": "Go away"}
    [row] = _tokenized(spm_folder, _spec("preference"), [record])
    for name in ("chosen", "rejected"):
        whole = backend.encode(record["prompt"] + record[name], add_special_tokens=False).ids
        assert row[f"{name}_ids"] == whole[len(row["prompt_ids"]) :] + [backend.token_to_id("</s>")]
        assert not backend.id_to_token(row[f"{name}_ids"][0]).startswith("▁")


MISTRAL_LIKE = (  # closes each assistant turn with EOS itself
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("path", ["folder", "tokenizer.json"])
def test_a_template_that_ends_turns_with_eos_gets_no_second_one(spm_folder, path):
    """Also where the tokenizer is a bare tokenizer.json (no folder settings): the template's
    ``eos_token`` is the configured one (it was undefined, and every row failed)."""
    chat = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye now"},
        ]
    }
    source = spm_folder if path == "folder" else spm_folder / "tokenizer.json"
    settings = {"chat_template": MISTRAL_LIKE, "eos_token": "</s>"}
    [row] = _tokenized(source, _spec("chat"), [chat], **settings)
    eos = Tokenizer(TokenizerConfig(path=str(spm_folder))).eos_id
    assert row["input_ids"].count(eos) == 2  # one per assistant turn, none appended after
    assert row["input_ids"][-1] == eos and row["labels"][-2] == eos  # the last one trained


def test_an_opening_assistant_turn_does_not_train_the_template_preamble(gpt2_path):
    """The template's text before the first turn (a default system prompt) was trained with a
    conversation that opens with the assistant."""
    template = (
        "PREAMBLE\n{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = {
        "conversations": [{"from": "gpt", "value": "Welcome!"}, {"from": "human", "value": "Hi"}]
    }
    [row] = _tokenized(gpt2_path, _spec("chat"), [chat], chat_template=template)
    gpt2 = Tokenizer(TokenizerConfig(path=gpt2_path)).backend
    trained = [t for t, label in zip(row["input_ids"][1:], row["labels"]) if label != X]
    assert gpt2.decode(trained) == "Welcome!</assistant>\n"
    assert gpt2.decode(row["input_ids"]).startswith("PREAMBLE\n<assistant>Welcome!")


# -- counts the mutation review found unguarded


# T10: a skipped row counted once in `rows`
def test_skipped_row_counts_once_in_rows(gpt2_config, fake_ledger):
    tokenizer = Tokenize(
        [_spec("alpaca", name="alpaca", on_bad_row="skip")],
        gpt2_config,
        seq_len=4096,
        overflow="truncate",
        ledger=fake_ledger,
    )
    tokenizer(_batch("alpaca", [SAY_HI, NO_OUTPUT, ADD]))
    [(by_dataset, _key, _lengths)] = fake_ledger.calls
    counts = by_dataset["alpaca"]
    assert (counts.rows, counts.samples, counts.skipped_rows) == (3, 2, 1)
    assert (
        counts.rows
        == counts.samples - counts.split_samples + counts.dropped_samples + counts.skipped_rows
    )


# T12: DPO truncated_tokens equals every cut token (prompt and responses)
def test_preference_truncated_tokens_count_every_cut_token(gpt2_config, gpt2, monkeypatch):
    records = _head_records("dpo/hh_rlhf_harmless.dpo.jsonl", 40)
    tokenizer = Tokenize([_spec("preference")], gpt2_config, seq_len=256, overflow="truncate")
    captured = {}
    tokenizer.ledger = object()
    monkeypatch.setattr(tokenize, "report", lambda _, __, counts, *___: captured.update(counts))
    table = tokenizer(record_table("d", ["dpo.jsonl"] * 40, list(range(40)), records))
    expected, response_cut = 0, 0
    for row, record in zip(table.to_pylist(), (json.loads(r) for r in records if r), strict=False):
        full = gpt2.encode_batch([record["prompt"], record["chosen"], record["rejected"]])
        cut_c = len(full[1]) + 1 - len(row["chosen_ids"])
        cut_r = len(full[2]) + 1 - len(row["rejected_ids"])
        expected += len(full[0]) - len(row["prompt_ids"]) + cut_c + cut_r
        response_cut += cut_c + cut_r
    assert response_cut > 0, "guard: some responses were cut"
    assert captured["d"].truncated_tokens == expected


@pytest.fixture(scope="module")
def spm_bos_folder(spm_folder, tmp_path_factory) -> Path:
    """``spm_folder``'s tokenizer with Llama's post-processor: ``tokenizer(text)`` puts ``<s>``
    first."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_file(str(spm_folder / "tokenizer.json"))
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    folder = tmp_path_factory.mktemp("spm_bos")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        (spm_folder / "tokenizer_config.json").read_text()
    )
    return folder


def test_bos_starts_each_sample_as_the_tokenizer_would_put_it(spm_bos_folder, spm_folder):
    """Llama-style tokenizers put BOS first (``tokenizer(text)``); the samples did not have it.
    Once, also where the chat template writes it; never where the tokenizer adds none."""
    tokenizer = Tokenizer(TokenizerConfig(path=str(spm_bos_folder)))
    bos = tokenizer.backend.token_to_id("<s>")
    assert tokenizer.bos_id == bos
    record = {"instruction": "Say hi.", "output": "Hello there"}
    text = "".join(s.text for s in tokenize.templates.alpaca(record, {}))
    [row] = _tokenized(spm_bos_folder, _spec("alpaca"), [record])
    assert row["input_ids"][:-1] == tokenizer.backend.encode(text).ids  # <s> first, as at inference
    assert row["input_ids"][0] == bos and row["labels"][0] == X  # the prompt's first token
    [plain] = _tokenized(spm_bos_folder, _spec("alpaca"), [record], add_bos=False)
    assert plain["input_ids"] == row["input_ids"][1:]
    [own] = _tokenized(spm_folder, _spec("alpaca"), [record])  # no post-processor: no BOS
    assert own["input_ids"] == plain["input_ids"]
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    [row] = _tokenized(spm_bos_folder, _spec("chat"), [chat], chat_template=MISTRAL_LIKE)
    assert row["input_ids"][0] == bos and row["input_ids"].count(bos) == 1
    triple = {"prompt": "Say hi.\n", "chosen": "Hello there", "rejected": "Go away"}
    [row] = _tokenized(spm_bos_folder, _spec("preference"), [triple])
    assert row["prompt_ids"][0] == bos and bos not in row["chosen_ids"] + row["rejected_ids"]


def test_add_bos_needs_a_bos_token(spm_folder):
    bare = spm_folder / "tokenizer.json"  # no settings beside it: no bos_token
    with pytest.raises(ValueError, match="tokenizer.add_bos: the tokenizer names no BOS token"):
        Tokenizer(TokenizerConfig(path=str(bare), eos_token="</s>", add_bos=True))
    named = Tokenizer(TokenizerConfig(path=str(spm_folder), add_bos=True))  # bos_token: <s>
    assert named.bos_id == named.backend.token_to_id("<s>")


# A tool-use template in the style of Qwen2.5's / Hermes': tools listed in a system turn, each call
# as <tool_call> JSON with ``arguments | tojson`` (an object, as transformers' tool format has it),
# tool results in a user turn; an assistant's reasoning_content in <think> tags (Qwen3's way).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OPENAI_TOOL_ROW = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 5}'},
        {"role": "assistant", "content": "It is 5 degrees."},
    ],
}


def _trained_and_untrained(tokenizer: Tokenizer, row: dict) -> tuple[str, str]:
    """The sample's trained text and its untrained text (runs of tokens decoded together)."""
    ids, labels = row["input_ids"], row["labels"]
    runs: dict[bool, list[list[int]]] = {True: [], False: []}
    previous = None
    for t, token in enumerate(ids):
        trained = t > 0 and labels[t - 1] != X
        if trained != previous:
            runs[trained].append([])
        runs[trained][-1].append(token)
        previous = trained
    decode = lambda run: tokenizer.backend.decode(run, skip_special_tokens=False)  # noqa: E731
    return "".join(map(decode, runs[True])), "".join(map(decode, runs[False]))


def test_tool_calls_and_tools_render_as_transformers_renders_them(gpt2_path):
    """An OpenAI tool-use row renders as ``apply_chat_template(messages, tools=...)`` does with
    the calls' arguments as objects: the call is trained once-encoded (a JSON string argument
    under ``tojson`` trained ``"{\\"city\\"...``), the tools and the tool result are not."""
    from transformers import AutoTokenizer

    ours = Tokenizer(TokenizerConfig(path=gpt2_path, chat_template=TOOL_TEMPLATE))
    theirs = AutoTokenizer.from_pretrained(gpt2_path)
    theirs.chat_template = TOOL_TEMPLATE
    messages = tokenize.templates.read_conversation(OPENAI_TOOL_ROW, {})[0]
    expected = theirs.apply_chat_template(
        [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": {"city": "Oslo"}}}
                    for c in m["tool_calls"]
                ],
            }
            if "tool_calls" in m
            else m
            for m in OPENAI_TOOL_ROW["messages"]
        ],
        tools=OPENAI_TOOL_ROW["tools"],
        tokenize=False,
    )
    rendered = ours.render_chat(messages, False, tokenize.templates.chat_tools(OPENAI_TOOL_ROW, {}))
    assert rendered == expected
    assert '"arguments": {"city": "Oslo"}' in rendered, "guard: arguments once encoded"
    [row] = _tokenized(gpt2_path, _spec("chat"), [OPENAI_TOOL_ROW], chat_template=TOOL_TEMPLATE)
    trained, untrained = _trained_and_untrained(ours, row)
    assert trained == (  # its leading "\n" is GPT-2's "\n\n" token, begun by the prompt
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>\nIt is 5 degrees.<|im_end|>\n<|endoftext|>"
    )
    assert "<tools>" in untrained and "<tool_response>" in untrained


@pytest.mark.parametrize(
    "row, field, problem",
    [
        (
            {
                "tools": OPENAI_TOOL_ROW["tools"],
                "messages": OPENAI_TOOL_ROW["messages"][:1]
                + [{"role": "assistant", "content": "I cannot look that up."}],
            },
            "tools",
            "does not render the row's tools (no 'get_weather'",
        ),
        (
            {"messages": OPENAI_TOOL_ROW["messages"]},
            "messages[1]",
            "does not render the turn's tool call 'get_weather'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "reasoning": "Two and two.", "content": "4"},
                ]
            },
            "messages[1]",
            "does not render the turn's reasoning (reasoning_content)",
        ),
    ],
    ids=["tools", "tool_calls", "reasoning"],
)
def test_a_template_blind_to_tools_is_a_template_error(gpt2_path, fake_ledger, row, field, problem):
    """JINJA_TEMPLATE writes role and content only: the call would train as an empty assistant
    turn, and tools would vanish from the prompt; such rows are template errors, skippable."""
    config = TokenizerConfig(path=gpt2_path, chat_template=JINJA_TEMPLATE)
    with pytest.raises(DataError, match=re.escape(f"field {field!r}: the chat template {problem}")):
        Tokenize([_spec("chat")], config, 4096, "truncate")(_batch("d", [row]))
    spec = _spec("chat", on_bad_row="skip")
    stage = Tokenize([spec], config, 4096, "truncate", ledger=fake_ledger)
    assert stage(_batch("d", [row])).num_rows == 0
    [(by_dataset, _key, _lengths)] = fake_ledger.calls
    assert by_dataset["d"].skipped_by_reason == {"template_error": 1}


def test_bundled_glaive_tool_calls_train_calls_and_keep_tools_in_the_prompt(gpt2_config, gpt2):
    """The bundled glaive rows (ShareGPT + ``tools`` as JSON text): every row tokenizes, each
    function_call turn trains its call as a <tool_call> with the arguments of the data, each
    row's tools are in its untrained prompt, and no observation is trained."""
    records = json.loads(_data("chat/glaive_toolcall.sharegpt.json").read_text())
    stage = Tokenize([_spec("chat")], gpt2_config, 4096, "truncate")
    rows = stage(_batch("d", records)).to_pylist()
    assert len(rows) == len(records) == 100
    calls = tools = tooled_rows = 0
    for record, row in zip(records, rows):
        trained, untrained = _trained_and_untrained(gpt2, row)
        for tool in json.loads(record["tools"] or "[]"):
            assert f'"name": "{tool["name"]}"' in untrained.split("</tools>")[0]
            tools += 1
        tooled_rows += "<tools>" in untrained
        for turn in record["conversations"]:
            if turn["from"] == "function_call":
                call = json.loads(turn["value"])
                text = json.dumps({"name": call["name"], "arguments": call["arguments"]})
                assert f"<tool_call>\n{text}\n</tool_call><|im_end|>" in trained
                calls += 1
            if turn["from"] == "observation":
                assert turn["value"] not in trained and turn["value"] in untrained
    assert (calls, tools, tooled_rows) == (73, 71, 59), "guard: the subset's calls and tools"


def test_reasoning_trains_with_its_answer_as_transformers_renders_it(gpt2_path):
    """An assistant turn's ``reasoning`` (or ``thinking`` / ``reasoning_content``, the names
    transformers aliases) reaches the template as ``reasoning_content`` and is trained with the
    answer; it was dropped without a word."""
    from transformers import AutoTokenizer

    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "thinking": "Two and two make four.", "content": "4"},
        ]
    }
    theirs = AutoTokenizer.from_pretrained(gpt2_path)
    theirs.chat_template = TOOL_TEMPLATE
    ours = Tokenizer(TokenizerConfig(path=gpt2_path, chat_template=TOOL_TEMPLATE))
    messages = tokenize.templates.read_conversation(row, {})[0]
    assert ours.render_chat(messages, False) == theirs.apply_chat_template(
        row["messages"], tokenize=False
    )
    [sample] = _tokenized(gpt2_path, _spec("chat"), [row], chat_template=TOOL_TEMPLATE)
    trained, _ = _trained_and_untrained(ours, sample)
    assert trained == "<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>\n<|endoftext|>"


def test_a_preference_response_keeps_a_token_that_straddles_its_prompt(
    gpt2_config, gpt2, fake_ledger
):
    """A prompt ending in a space: GPT-2 encodes prompt + "4" as ... ":" " 4", a token that
    starts inside the prompt. Keeping the tokens past the prompt left both responses [EOS] (the
    pair taught nothing); such a response is now tokenized on its own, as TRL does, and counted
    (``responses_tokenized_alone``)."""
    record = {"prompt": "Question: What is 2+2?\nAnswer: ", "chosen": "4", "rejected": "5"}
    joint = gpt2.backend.encode(record["prompt"] + "4", add_special_tokens=False).tokens
    assert joint[-2:] == [":", "Ġ4"], "guard: the answer's token straddles the prompt's end"
    # The usual case (hh-rlhf: responses start with their space) keeps the joint tokenization.
    usual = {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}
    rows = Tokenize([_spec("preference")], gpt2_config, 256, "truncate", ledger=fake_ledger)(
        _batch("d", [record, usual])
    ).to_pylist()
    assert rows[0]["prompt_ids"] == gpt2.encode_batch([record["prompt"]])[0]
    assert (rows[0]["chosen_ids"], rows[0]["rejected_ids"]) == ([19, EOS], [20, EOS])  # "4", "5"
    assert (rows[1]["chosen_ids"], rows[1]["rejected_ids"]) == ([604, EOS], [642, EOS])  # " 4"
    [(by_dataset, _key, _lengths)] = fake_ledger.calls
    assert by_dataset["d"].responses_tokenized_alone == 2  # both of the first row's, once each


def test_a_dropped_triple_counts_no_response_tokenized_alone(gpt2_config, fake_ledger):
    """``responses_tokenized_alone`` counts the responses of the triples kept: a triple dropped
    for its length (``overflow: drop``) is counted in ``dropped_samples`` only."""
    long = {"prompt": "Question: " + "why " * 20 + "2+2?\nAnswer: ", "chosen": "4", "rejected": "5"}
    short = {"prompt": "Answer: ", "chosen": "4", "rejected": "5"}
    rows = Tokenize([_spec("preference")], gpt2_config, 16, "drop", ledger=fake_ledger)(
        _batch("d", [long, short])
    ).to_pylist()
    assert len(rows) == 1  # guard: the long one was dropped, the short one kept
    [(by_dataset, _key, _lengths)] = fake_ledger.calls
    assert by_dataset["d"].dropped_samples == 1
    assert by_dataset["d"].responses_tokenized_alone == 2  # the short triple's two, alone


# Issue #34 row 4: the DPO prompt floor on the 300 bundled hh-rlhf triples (one has an empty
# response: skipped). (seq_len, dpo.min_prompt_tokens) → (samples, dropped by reason, prompts
# cut to exactly the floor).
FLOOR_ON_REAL_TRIPLES = {
    "the floor keeps 64 prompt tokens; responses give way": (128, 64, (299, {}, 125)),
    "a floor with no room for it drops the triple, counted": (66, 64, (110, {"no_room": 189}, 0)),
}


@pytest.mark.parametrize("name", FLOOR_ON_REAL_TRIPLES)
def test_no_real_triple_keeps_fewer_prompt_tokens_than_the_floor(name, gpt2_config, gpt2):
    """Every kept triple has at least min(floor, its prompt's length) prompt tokens; triples
    that cannot keep it are dropped and counted by reason; tokens cut are counted by part."""
    seq_len, floor, expected = FLOOR_ON_REAL_TRIPLES[name]
    records = _head_records("dpo/hh_rlhf_harmless.dpo.jsonl", 300)
    batch = record_table("d", ["dpo.jsonl"] * 300, list(range(300)), records)
    spec = _spec("preference", on_bad_row="skip")
    stage = Tokenize([spec], gpt2_config, seq_len, "truncate", min_prompt_tokens=floor)
    table, counts = stage.counted(batch)
    prompts = gpt2.encode_batch([json.loads(r)["prompt"] for r in records])
    prompt_tokens = {  # each row's uid → its whole prompt's token count
        sample_uid(f"d\x00dpo.jsonl\x00{row}\x000"): len(ids) for row, ids in enumerate(prompts)
    }
    at_floor = 0
    for row in table.to_pylist():
        kept, whole = len(row["prompt_ids"]), prompt_tokens[row["uid"]]
        assert kept >= min(floor, whole)
        at_floor += kept == floor < whole
    tally = counts["d"]
    assert (tally.samples, tally.dropped_by_reason, at_floor) == expected
    assert tally.skipped_by_reason == {"empty_field": 1}
    assert sum(tally.truncated_by_part.values()) == tally.truncated_tokens
    if at_floor:  # guard: without the floor, the same prompts are cut further
        _, loose = Tokenize([spec], gpt2_config, seq_len, "truncate", min_prompt_tokens=1).counted(
            batch
        )
        assert loose["d"].truncated_by_part["prompt"] > tally.truncated_by_part["prompt"]
