"""Exports other trainers read: ``rayjobs export``'s rows in the Hugging Face labels convention
(the default) give a Hugging Face causal LM's own ``labels=`` loss the value rayjobs' step
computes on the packed row; the convention is stated in each Parquet file, converted back by
rayjobs' readers, and DPO rows follow the same rule.

Rows are real: bundled Alpaca and preference rows through the job's Tokenize stage, packed by its
packer and laid out by its task's assembler, written by export's ``to_arrow``."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ALPACA, DATA, GPT2
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data.pack import pack_lengths
from rayjobs.data.rows import (
    IGNORE_INDEX,
    LABELS_METADATA,
    PACKED_COLUMNS,
    export_convention,
    hf_labels,
    shifted_labels,
)
from rayjobs.data.sources import record_table
from rayjobs.data.tasks import TASKS
from rayjobs.data.tokenize import Tokenize
from rayjobs.job.export import to_arrow
from rayjobs.train.hf import build_hf_model
from rayjobs.train.model import PackedLM
from rayjobs.train.objectives import TokenLoss
from support.models import tiny_llama

SEQ_LEN = 256
LLAMA = tiny_llama(SEQ_LEN)
PREFERENCE = DATA / "dpo" / "hh_rlhf_harmless.dpo.jsonl"


def _packed_rows(template: str, records: list[str]) -> tuple[dict[str, np.ndarray], int]:
    """Packed rows (shifted labels, as the job trains on them) of ``records`` and the pad id."""
    spec = DatasetConfig(name="d", source="x", template=template, files=("x",))
    tokenize = Tokenize([spec], TokenizerConfig(path=str(GPT2)), SEQ_LEN, "truncate")
    samples = tokenize(record_table("d", ["x"] * len(records), list(range(len(records))), records))
    task = TASKS[TASKS_OF[template]]
    packs = pack_lengths(samples.column("num_tokens").to_numpy(), SEQ_LEN)
    pad_id = tokenize.tokenizer.pad_id
    return task.assemble(samples, packs, SEQ_LEN, pad_id), pad_id


TASKS_OF = {"alpaca": "sft", "preference": "dpo"}


def _export(rows: dict[str, np.ndarray], tmp_path, labels: str = "hf") -> dict[str, np.ndarray]:
    """``rows`` written as ``rayjobs export`` writes a file, read back with plain pyarrow."""
    pq.write_table(to_arrow(rows, labels=labels), tmp_path / "part-0.parquet")
    table = pq.read_table(tmp_path / "part-0.parquet")
    assert table.schema.metadata[LABELS_METADATA] == labels.encode()
    return {
        name: np.stack(table.column(name).to_numpy(zero_copy_only=False))
        for name in table.column_names
        if name in rows and rows[name].ndim == 2
    }


@pytest.fixture(scope="module")
def alpaca_rows():
    records = [json.dumps(r) for r in json.loads(ALPACA.read_text())[:60]]
    return _packed_rows("alpaca", records)


def test_hf_labels_are_the_tokens_trained_unshifted(alpaca_rows, tmp_path):
    rows, _ = alpaca_rows
    exported = _export(rows, tmp_path)
    ids, labels, documents = exported["input_ids"], exported["labels"], exported["document_ids"]
    first = np.diff(documents, axis=1, prepend=-1) != 0  # each document's first token (and pad's)
    trained = labels != IGNORE_INDEX
    assert (labels[first] == IGNORE_INDEX).all()
    assert (labels[trained] == ids[trained]).all()
    # the same tokens are trained: labels[t] of the shifted rows is labels[t + 1] here
    assert trained.sum() == (rows["labels"] != IGNORE_INDEX).sum() > 1000
    assert (shifted_labels(labels, documents) == rows["labels"]).all()
    assert (exported["input_ids"] == rows["input_ids"]).all()
    shifted = _export(rows, tmp_path, "shifted")
    assert (shifted["labels"] == rows["labels"]).all()


def test_an_hf_models_own_loss_on_exported_rows_is_rayjobs_loss(alpaca_rows, tmp_path):
    """Acceptance 6: each document of an exported row fed to a Hugging Face Llama as
    ``model(input_ids, labels=, position_ids=)`` (the model shifts the labels itself) gives, token
    weighted over the row, the loss rayjobs' step computes on the packed row. The shifted labels
    fed the same way give another loss (the token after next), so the test tells them apart."""
    rows, pad_id = alpaca_rows
    exported = _export(rows, tmp_path)
    torch.manual_seed(0)
    model = build_hf_model(
        vocab_size=50257, seq_len=SEQ_LEN, overrides=LLAMA, token_ids={"pad_token_id": pad_id}
    ).eval()
    picked = [r for r in range(len(rows["input_ids"])) if rows["num_documents"][r] >= 2][-4:]
    assert rows["num_documents"][picked].sum() >= 8, "guard: rows of several documents"
    assert any(rows["num_tokens"][r] < SEQ_LEN for r in picked), "guard: padding present"
    batch = {name: torch.from_numpy(rows[name][picked]).long() for name in PACKED_COLUMNS}
    with torch.no_grad():
        total, _ = TokenLoss().forward(PackedLM(model, loss_chunk_tokens=64), batch)
    rayjobs_loss = float(total) / int((batch["labels"] != IGNORE_INDEX).sum())

    def hf_loss(labels_of_rows: np.ndarray) -> tuple[float, int]:
        summed, count = 0.0, 0
        for r in picked:
            used = int(rows["num_tokens"][r])
            documents = exported["document_ids"][r, :used]
            for d in np.unique(documents):
                span = documents == d
                tensors = [
                    torch.from_numpy(values[r, :used][span]).long()[None]
                    for values in (exported["input_ids"], labels_of_rows, exported["position_ids"])
                ]
                n = int((tensors[1][0, 1:] != IGNORE_INDEX).sum())  # what the model's shift keeps
                if n:
                    with torch.no_grad():
                        out = model(
                            input_ids=tensors[0], labels=tensors[1], position_ids=tensors[2]
                        )
                    summed += float(out.loss) * n
                    count += n
        return summed / count, count

    loss, count = hf_loss(exported["labels"])
    assert count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert abs(loss - rayjobs_loss) <= 1e-5, (loss, rayjobs_loss)
    wrong, _ = hf_loss(rows["labels"])  # rayjobs' own (shifted) labels, shifted again by HF
    assert abs(wrong - rayjobs_loss) > 1e-3, (wrong, rayjobs_loss)


def test_dpo_rows_follow_the_same_rule(tmp_path):
    """A response document starts with its prompt's last token: never trained in the hf
    convention, its first response token trained at position 1 against itself."""
    records = PREFERENCE.read_text().splitlines()[:24]
    rows, _ = _packed_rows("preference", records)
    exported = _export(rows, tmp_path)
    ids, labels, documents = exported["input_ids"], exported["labels"], exported["document_ids"]
    assert {"parent_ids", "response_role"} <= exported.keys()
    responses = rows["response_role"] > 0
    starts = (np.diff(documents, axis=1, prepend=-1) != 0) & responses
    assert starts.sum() >= 2 * 10, "guard: response documents"
    assert (labels[starts] == IGNORE_INDEX).all()
    trained = labels != IGNORE_INDEX
    assert (labels[trained] == ids[trained]).all() and (trained <= responses).all()
    assert (shifted_labels(labels, documents) == rows["labels"]).all()
    assert (hf_labels(rows["labels"], documents) == labels).all()


@pytest.mark.parametrize(
    "manifest, metadata, expected",
    [
        ({"labels": "hf"}, {LABELS_METADATA: b"hf"}, "hf"),
        (None, {LABELS_METADATA: b"shifted"}, "shifted"),
        ({"labels": "shifted"}, None, "shifted"),
        ({"seq_len": 512}, None, "shifted"),  # an export from before the convention was stated
        ({"labels": "hf"}, {LABELS_METADATA: b"shifted"}, "says 'hf'"),
        (None, None, "no _manifest.json"),
        ({"labels": "next"}, None, "none of hf, shifted"),
    ],
    ids=["both", "file", "manifest", "old_manifest", "disagree", "neither", "unknown"],
)
def test_a_reader_takes_the_convention_the_export_states(manifest, metadata, expected):
    if expected in ("hf", "shifted"):
        assert export_convention(manifest, metadata, "f.parquet") == expected
    else:
        with pytest.raises(ValueError, match=expected):
            export_convention(manifest, metadata, "f.parquet")
