"""Faults: an actor that dies right after reporting a batch (fault injection through the ledger,
not timing luck) changes nothing in what is trained or counted: Ray runs the batch again and the
ledger, keyed by batch identity, adds it once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import ALPACA, GPT2, HH_CHAT
from rayjobs.config import config_from_dict
from rayjobs.data.counts import AccountingError
from rayjobs.job.pipeline import start_job

TIMERS = ("seconds", "cpu_seconds")


def _config():
    return config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"},
                {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat"},
            ],
            "tokenizer": {"path": str(GPT2)},
            # Several windows and Tokenize batches, so the second of each exists.
            "packing": {"seq_len": 512, "window_tokens": 30_000, "warmup_tokens": 0},
            "train": {"epochs": 1},
            "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
        }
    )


def _documents(rows: list[dict]) -> Counter:
    """Every packed document as (token ids, labels): the multiset the trainers see."""
    documents = Counter()
    for row in rows:
        n = int(row["num_tokens"])
        doc = np.asarray(row["document_ids"][:n])
        for d in np.unique(doc):
            where = doc == d
            documents[
                (
                    tuple(np.asarray(row["input_ids"][:n])[where]),
                    tuple(np.asarray(row["labels"][:n])[where]),
                )
            ] += 1
    return documents


def _run(config, fail_after=None):
    job = start_job(config, prefix="faults", fail_after=fail_after)
    rows = job.rows.take_all()
    return _documents(rows), job.snapshot()


def _counts(snapshot: dict) -> dict:
    """The summary's counts without timers or pack layout (which windows meet depends on arrival
    order, so the number of packs may differ between runs; what is in them may not)."""
    tokenize = {
        name: {k: v for k, v in counts.items() if k not in TIMERS}
        for name, counts in snapshot["tokenize"].items()
    }
    pack = {
        epoch: {
            k: counts[k]
            for k in ("num_documents", "num_tokens", "documents_by_source", "tokens_by_source")
        }
        for epoch, counts in snapshot["pack"].items()
    }
    return {"tokenize": tokenize, "pack": pack}


@pytest.fixture(scope="module")
def clean(ray_local):
    return _run(_config())


@pytest.mark.parametrize("stage", ["add_tokenize", "add_pack"])
def test_an_actor_killed_after_reporting_changes_no_count_and_no_row(clean, stage):
    documents, snapshot = _run(_config(), fail_after={stage: 2})
    assert snapshot["injected_faults"] == 1  # guard: the actor did die after its 2nd report
    assert _counts(snapshot) == _counts(clean[1])
    assert documents == clean[0]
    assert sum(documents.values()) == snapshot["pack"][0]["num_documents"]
    assert snapshot["repeated_reports"] >= 1  # guard: Ray did run that batch again


def test_the_end_of_run_check_fails_a_run_whose_counts_do_not_add_up(ray_local):
    """The ledger as it was before batch identities (a repeat added twice): the check that runs
    at the end of every run refuses the summary."""
    job = start_job(_config(), prefix="faults", fail_after={"add_tokenize": 2}, dedupe=False)
    job.rows.materialize()
    assert job.snapshot()["injected_faults"] == 1  # guard: a batch was run twice
    with pytest.raises(AccountingError, match=r"dataset '\w+': tokenized \d+ samples"):
        job.accounting()
