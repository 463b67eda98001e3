"""Nothing lost quietly (``rayjobs.data.checks``): which columns a template leaves unread, which
of those are refused, when a dataset's lost samples are worth a warning and what it says, and a
run with nothing to train refused with every dataset's counts. Literal rows, literal messages."""

from __future__ import annotations

import json

import pytest

from conftest import ALPACA, GPT2, HH_CHAT
from rayjobs.config import config_from_dict
from rayjobs.data import checks
from rayjobs.data.templates import alpaca
from rayjobs.errors import DataError

COLUMNS = {
    # name: (template, column_map, ignore_columns, rows, unused columns or the refusal's words)
    "alpaca reads its fields, history included": (
        "alpaca", {}, [],
        [{"instruction": "q", "input": "", "output": "a", "history": []}] * 4, [],
    ),
    "a column in most rows is unused": (
        "alpaca", {}, [],
        [{"instruction": "q", "output": "a", "source": "x"}] * 3
        + [{"instruction": "q", "output": "a"}],
        ["source"],
    ),
    "a column in few rows is not reported": (
        "alpaca", {}, [],
        [{"instruction": "q", "output": "a", "id": 1}] + [{"instruction": "q", "output": "a"}] * 3,
        [],
    ),
    "a mapped column is read": (
        "alpaca", {"output": "response"}, [], [{"instruction": "q", "response": "a"}] * 2, [],
    ),
    "an ignored column is not reported": (
        "chat", {}, ["source"], [{"messages": [], "source": "x"}] * 2, [],
    ),
    "a KTO-style label is refused": (
        "chat", {}, [], [{"messages": [], "label": True}, {"messages": [], "label": False}],
        "column 'label' (true/false: a KTO-style desirability label) is not read by template "
        "'chat': rows labelled false would be trained as targets",
    ),
    "a label that is not a flag is only unused": (
        "chat", {}, [], [{"messages": [], "label": "support"}] * 2, ["label"],
    ),
    "an ignored label is let through": (
        "chat", {}, ["label"], [{"messages": [], "label": False}] * 2, [],
    ),
}  # fmt: skip


def _spec(template, column_map=None, ignore_columns=(), fmt="jsonl", text_split="paragraph"):
    return config_from_dict(
        {
            "datasets": [
                {
                    "name": "d", "source": str(GPT2 / "tokenizer.json"), "format": fmt,
                    "template": template, "column_map": column_map or {},
                    "ignore_columns": list(ignore_columns), "text_split": text_split,
                }
            ],
            "tokenizer": {"path": str(GPT2)},
        }
    )  # fmt: skip


@pytest.mark.parametrize("name", COLUMNS)
def test_columns_a_template_does_not_read_are_reported_or_refused(name):
    template, column_map, ignore, rows, expected = COLUMNS[name]
    [spec] = _spec(template, column_map, ignore).datasets
    records = [json.dumps(row) for row in rows]
    if isinstance(expected, str):
        with pytest.raises(DataError) as caught:
            checks.column_findings(spec, records)
        assert str(caught.value).startswith(f"dataset 'd': {expected}")
        return
    assert checks.column_findings(spec, records) == expected


def _counts(samples, empty, cut, trained=1):
    return {
        "samples": samples,
        "samples_without_trained_tokens": empty,
        "samples_mostly_truncated": cut,
        "trained_tokens": trained,
        "dropped_samples": 0,
        "skipped_rows": 0,
    }


def test_a_dataset_that_loses_samples_is_warned_of_naming_what_to_change():
    config = _spec("text", fmt="text")
    counts = {"d": _counts(100, 0, 2)}
    assert checks.lost_warnings(config, {"d": _counts(100, 1, 1)}) == []  # at 1%: no warning
    assert checks.lost_warnings(config, counts) == [
        "dataset 'd': 0 of 100 samples (0.0%) have no token left to train and 2 (2.0%) lost "
        "most of their tokens to truncation (packing.seq_len 2048, packing.overflow truncate); "
        "set text_split: line (one document a line), or packing.overflow: split, or a longer "
        "packing.seq_len"
    ]


def test_a_run_that_trains_nothing_is_refused_with_each_datasets_counts():
    checks.require_training({"a": _counts(3, 3, 0, trained=0), "b": _counts(1, 0, 0)})  # b trains
    with pytest.raises(DataError) as caught:
        checks.require_training({"a": _counts(3, 3, 0, trained=0)}, "the run")
    assert str(caught.value).startswith(
        "the run has nothing to train: dataset 'a': 3 samples, 0 trained tokens (3 with none "
        "left to train, 0 dropped, 0 rows skipped)."
    )


HISTORY = {
    "instruction": "And in French?",
    "input": "",
    "output": "Bonjour.",
    "history": [["Say hello.", "Hello."], ["In Spanish?", "Hola."]],
}


def test_alpaca_history_turns_come_first_each_response_trained():
    """LLaMA-Factory's alpaca ``history``: earlier turns in the prompt's layout, their responses
    trained like every assistant turn of a chat, never dropped."""
    segments = alpaca(HISTORY, {})
    assert [(s.text, s.trainable) for s in segments] == [
        (
            "Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\nSay hello.\n\n### Response:\n",
            False,
        ),
        ("Hello.", True),
        ("\n\n", False),
        ("### Instruction:\nIn Spanish?\n\n### Response:\n", False),
        ("Hola.", True),
        ("\n\n", False),
        ("### Instruction:\nAnd in French?\n\n### Response:\n", False),
        ("Bonjour.", True),
    ]


def test_alpaca_history_of_the_wrong_shape_is_a_bad_row():
    from rayjobs.data.templates import RowError

    with pytest.raises(RowError, match="field 'history': expected a list of"):
        alpaca({**HISTORY, "history": ["Say hello.", "Hello."]}, {})


# realized shares per epoch of datasets weighted 0.7 / 0.3 → the datasets warned of
SHARE_SCENARIOS = {
    "on the weights": ([{"a": 0.705, "b": 0.295}], []),
    "one epoch short of a share": ([{"a": 0.7, "b": 0.3}, {"a": 0.75, "b": 0.25}], ["a", "b"]),
}


@pytest.mark.parametrize("name", SHARE_SCENARIOS)
def test_a_realized_share_off_its_weight_is_warned_of(name):
    mixes, warned = SHARE_SCENARIOS[name]
    config = config_from_dict(
        {
            "datasets": [
                {"name": "a", "source": str(ALPACA), "template": "alpaca", "weight": 7},
                {"name": "b", "source": str(HH_CHAT), "template": "chat", "weight": 3},
            ],
            "tokenizer": {"path": str(GPT2)},
        }
    )
    said = checks.share_warnings(config, [{k: {"share": v} for k, v in m.items()} for m in mixes])
    assert [line.split("'")[1] for line in said] == warned
    assert all("of epoch 1 (tokens), against a weight of" in line for line in said)
