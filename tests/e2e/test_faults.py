"""Faults: an actor that dies right after reporting a batch (a stage subclass that exits after its
n-th call, not timing luck) changes nothing in what is trained or counted: Ray runs the batch
again and the ledger, keyed by batch identity, adds it once."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import ray

from conftest import ALPACA, GPT2, HH_CHAT
from rayjobs.config import config_from_dict
from rayjobs.data import stream
from rayjobs.errors import AccountingError
from rayjobs.job import ledger
from rayjobs.job.ledger import Ledger
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


def _dies_after(stage: type, calls: int, marker: str) -> type:
    """``stage`` (a map_batches class), but its actor process exits right after its ``calls``-th
    call has returned, its report to the ledger in, once (``marker``): a crash Ray recovers from
    by running that batch again on a new actor. Defined here, so Ray ships it by value."""

    class DiesAfter(stage):
        made = 0

        def __call__(self, batch):
            out = super().__call__(batch)
            self.made += 1
            if self.made == calls and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write("died")
                os._exit(1)
            return out

    return DiesAfter


def _run(config):
    job = start_job(config, prefix="faults")
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


@pytest.mark.parametrize("stage", ["Tokenize", "PackStream"])
def test_an_actor_killed_after_reporting_changes_no_count_and_no_row(
    clean, stage, monkeypatch, tmp_path
):
    marker = tmp_path / "died"
    monkeypatch.setattr(stream, stage, _dies_after(getattr(stream, stage), 2, str(marker)))
    documents, snapshot = _run(_config())
    assert marker.exists()  # guard: the actor did die after its 2nd report
    assert _counts(snapshot) == _counts(clean[1])
    assert documents == clean[0]
    assert sum(documents.values()) == snapshot["pack"][0]["num_documents"]
    assert snapshot["repeated_reports"] >= 1  # guard: Ray did run that batch again


class _AddsEveryReport(Ledger.__ray_actor_class__):
    """The ledger as it was before batch identities: a batch Ray runs again is added again."""

    def _first(self, key):
        return True


def test_the_end_of_run_check_fails_a_run_whose_counts_do_not_add_up(
    ray_local, monkeypatch, tmp_path
):
    """With a batch counted twice, the check that runs at the end of every run refuses the
    summary."""
    marker = tmp_path / "died"
    monkeypatch.setattr(ledger, "Ledger", ray.remote(num_cpus=0)(_AddsEveryReport))
    monkeypatch.setattr(stream, "Tokenize", _dies_after(stream.Tokenize, 2, str(marker)))
    job = start_job(_config(), prefix="faults")
    job.rows.materialize()
    assert marker.exists()  # guard: a batch was run twice
    with pytest.raises(AccountingError, match=r"dataset '\w+': tokenized \d+ samples"):
        job.accounting()
