"""Tests for rayjobs.train.model: packing fidelity (a packed row scores like its documents run
alone), flex vs SDPA forward, a training step on CPU, and loss_sum's counting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayjobs.data.rows import layout_rows
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM, loss_sum

VOCAB_SIZE = 50


def _tiny_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=VOCAB_SIZE, dim=32, n_layers=2, n_heads=4)).eval()


def _shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels of one document: the next token, -100 at the last position."""
    return torch.cat([input_ids[1:], torch.tensor([-100])])


def _pack(documents: list[torch.Tensor], seq_len: int) -> dict[str, torch.Tensor]:
    """One packed row [1,seq_len] as the packer emits it; padding token 0 with label -100."""
    num_padding = seq_len - sum(len(document) for document in documents)
    document_ids, position_ids = (
        x[0]
        for x in layout_rows(
            np.array([len(document) for document in documents]), [len(documents)], seq_len
        )
    )
    return {
        "input_ids": torch.cat([*documents, torch.zeros(num_padding, dtype=torch.long)])[None],
        "labels": torch.cat([*map(_shifted_labels, documents), torch.full((num_padding,), -100)])[
            None
        ],
        "document_ids": torch.from_numpy(document_ids).long()[None],
        "position_ids": torch.from_numpy(position_ids).long()[None],
    }


def _loss(model: Decoder, row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return loss_sum(
        model(row["input_ids"], row["position_ids"], row["document_ids"]), row["labels"]
    )


def _documents(lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB_SIZE, (length,), generator=generator) for length in lengths]


def test_packed_loss_equals_token_weighted_mean_of_documents_alone():
    model = _tiny_decoder()
    documents = _documents([7, 12, 5, 9])
    row = _pack(documents, seq_len=40)
    assert int(row["document_ids"].max()) == len(
        documents
    )  # guard: 4 documents, then padding as document 4

    with torch.no_grad():
        packed_sum, packed_count = _loss(model, row)
        alone_sum, alone_count = torch.tensor(0.0), 0
        for document in documents:
            total, count = _loss(model, _pack([document], seq_len=len(document)))
            alone_sum, alone_count = alone_sum + total, alone_count + int(count)

    assert int(packed_count) == alone_count == sum(len(document) - 1 for document in documents)
    assert abs(float(packed_sum / packed_count) - float(alone_sum / alone_count)) <= 1e-5


def test_document_mask_matters():
    """Guard for the fidelity test: with one causal mask over the whole row the later documents'
    logits change, so the fidelity test would catch attention leaking across documents. (Restarting
    position_ids alone is invisible in exact arithmetic: RoPE scores depend only on q - kv.)"""
    model = _tiny_decoder()
    row = _pack(_documents([7, 12, 5]), seq_len=30)
    with torch.no_grad():
        per_document = model(row["input_ids"], row["position_ids"], row["document_ids"])
        one_document = model(
            row["input_ids"], row["position_ids"], torch.zeros_like(row["document_ids"])
        )
    torch.testing.assert_close(per_document[:, :7], one_document[:, :7], atol=1e-5, rtol=0)
    assert not torch.allclose(per_document[:, 7:], one_document[:, 7:], atol=1e-3)


@pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile"
)  # eager on CPU, expected
def test_flex_forward_matches_sdpa():
    model = _tiny_decoder()
    rows = [_pack(_documents(lengths), seq_len=64) for lengths in ([20, 30], [10, 15, 25, 13])]
    batch = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    inputs = batch["input_ids"], batch["position_ids"], batch["document_ids"]
    with torch.no_grad():
        expected = model(*inputs, attention="sdpa")
        got = model(*inputs, attention="flex")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_unknown_attention_is_rejected():
    row = _pack(_documents([3]), seq_len=4)
    with pytest.raises(ValueError, match="'sdpa', 'flex' or 'causal'"):
        _tiny_decoder()(
            row["input_ids"], row["position_ids"], row["document_ids"], attention="flash"
        )


def test_sdpa_training_step_reduces_loss():
    model = _tiny_decoder().train()
    row = _pack(_documents([10, 14, 6]), seq_len=36)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        total, count = _loss(model, row)
        loss = total / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_loss_sum_ignores_minus_100_and_counts():
    # Uniform logits over 4 classes: every counted position costs ln 4.
    logits = torch.zeros(1, 5, 4)
    labels = torch.tensor([[2, -100, 0, 3, -100]])
    total, count = loss_sum(logits, labels)
    assert int(count) == 3
    torch.testing.assert_close(total, 3 * torch.log(torch.tensor(4.0)))

    # The ignored positions' logits do not matter; a confident right answer costs ~0.
    logits[0, 1] = torch.tensor([100.0, 0, 0, 0])
    logits[0, 2, 0] = 100.0
    total, count = loss_sum(logits, labels)
    assert int(count) == 3
    torch.testing.assert_close(total, 2 * torch.log(torch.tensor(4.0)))


def test_packed_lm_is_the_decoder_with_its_loss():
    """``PackedLM`` over the demo decoder: logits are the decoder's, the loss is ``loss_sum`` of
    them (chunked or not), and an unknown attention is refused."""
    model = _tiny_decoder()
    row = _pack(_documents([7, 12, 5]), seq_len=30)
    inputs = row["input_ids"], row["position_ids"], row["document_ids"]
    with torch.no_grad():
        expected = loss_sum(model(*inputs), row["labels"])
        for chunk in (0, 4):
            packed = PackedLM(model, "sdpa", loss_chunk_tokens=chunk)
            torch.testing.assert_close(packed.logits(*inputs), model(*inputs))
            total, count = packed(*inputs, row["labels"])
            assert int(count) == int(expected[1])
            torch.testing.assert_close(total, expected[0], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="'sdpa', 'flex' or 'causal'"):
        PackedLM(model, "flash")
