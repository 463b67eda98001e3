"""Tests for rayjobs.data.preference and rayjobs.train.dpo: preference triples in packed rows.

Literal scenario tables pin the layout and the overflow policy; the masks are checked against a
reference written from the triple structure (python loops: which part of which triple a token is
in), not from the ``document_ids`` / ``parent_ids`` rule; fidelity checks that a packed row scores
every response exactly as running prompt + response alone does (log-probs, DPO loss, gradients),
on real HH-RLHF triples tokenized with the real GPT-2 tokenizer.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from conftest import DATA, GPT2
from rayjobs.data import preference
from rayjobs.data.pack import pack_lengths
from rayjobs.data.rows import IGNORE_INDEX, STAT_COLUMNS
from rayjobs.train import dpo, masks
from rayjobs.train.hf import build_hf_model
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM, token_logps
from support.models import tiny_llama
from support.tiles import tiles_from_block_mask, tiles_from_dense

HH_DPO = DATA / "dpo" / "hh_rlhf_harmless.dpo.jsonl"
EOS_ID = 50256  # GPT-2's <|endoftext|>, also the pad token here
VOCAB_SIZE = 50257
SEQ_LEN = 512
BETA = 0.5
TINY_LLAMA = tiny_llama(SEQ_LEN)

A = preference.Triple(np.array([11, 12, 13]), np.array([21, 22]), np.array([31]))  # P=3, C=2, R=1
B = preference.Triple(np.array([41]), np.array([51]), np.array([61, 62]))  # P=1, C=1, R=2


def _tensors(rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(value).long() for key, value in rows.items()}


# ---------------------------------------------------------------- the layout, literally

_ = IGNORE_INDEX
LAYOUT_SCENARIOS = {
    "two triples and padding in one row": (
        [A, B],
        [[0, 1]],
        16,
        {
            "input_ids": [[11, 12, 13, 21, 22, 13, 31, 41, 51, 41, 61, 62, 0, 0, 0, 0]],
            "labels": [[_, _, 21, 22, _, 31, _, 51, _, 61, 62, _, _, _, _, _]],
            "position_ids": [[0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2, 3]],
            "document_ids": [[0, 0, 1, 1, 1, 2, 2, 4, 4, 5, 5, 5, 6, 6, 6, 6]],
            "parent_ids": [[0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 6, 6, 6, 6]],
            "response_role": [[0, 0, 1, 1, 1, 2, 2, 1, 1, 2, 2, 2, 0, 0, 0, 0]],
            "num_tokens": [12],
            "num_documents": [6],
        },
    ),
    "one triple a row, the second row exactly full": (
        [A, B],
        [[1], [0]],
        7,
        {
            "input_ids": [[41, 51, 41, 61, 62, 0, 0], [11, 12, 13, 21, 22, 13, 31]],
            "labels": [[51, _, 61, 62, _, _, _], [_, _, 21, 22, _, 31, _]],
            "position_ids": [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 2, 3]],
            "document_ids": [[1, 1, 2, 2, 2, 3, 3], [0, 0, 1, 1, 1, 2, 2]],
            "parent_ids": [[0, 0, 0, 0, 0, 3, 3], [0, 0, 0, 0, 0, 0, 0]],
            "response_role": [[1, 1, 2, 2, 2, 0, 0], [0, 0, 1, 1, 1, 2, 2]],
            "num_tokens": [5, 7],
            "num_documents": [3, 3],
        },
    ),
}


@pytest.mark.parametrize("name", LAYOUT_SCENARIOS)
def test_assembled_rows_are_exactly(name):
    triples, bins, seq_len, expected = LAYOUT_SCENARIOS[name]
    rows = preference.assemble_triples(triples, [np.array(b) for b in bins], seq_len, pad_id=0)
    assert set(rows) == {*preference.DPO_COLUMNS, *STAT_COLUMNS}
    assert all(value.dtype == np.int32 for value in rows.values())
    assert {key: value.tolist() for key, value in rows.items()} == expected
    # guards: the empty prompt document of B (P == 1) keeps its id, unit lengths are P + C + R + 1
    assert [t.unit_length for t in triples] == [7, 5]


def test_assembly_refuses_bad_bins_and_triples():
    with pytest.raises(ValueError, match="triple 2, but there are 2"):
        preference.assemble_triples([A, B], [np.array([0, 2])], 16, pad_id=0)
    with pytest.raises(ValueError, match="Triple 0 appears 2 times"):
        preference.assemble_triples([A, B], [np.array([0]), np.array([0, 1])], 16, pad_id=0)
    with pytest.raises(ValueError, match="12 tokens, more than seq_len=10"):
        preference.assemble_triples([A, B], [np.array([0, 1])], 10, pad_id=0)
    empty = preference.Triple(np.array([1]), np.array([], dtype=np.int32), np.array([2]))
    with pytest.raises(ValueError, match="chosen part of a preference triple is empty"):
        preference.assemble_triples([empty], [np.array([0])], 16, pad_id=0)


# ---------------------------------------------------------------- overflow, literally

OVERFLOW_SCENARIOS = {
    # name: (prompt, chosen, rejected, seq_len, policy, kept triple or None, (P, C, R cut, dropped))
    "fits as it is": (
        [1, 2, 3], [4, 5], [6], 7, "truncate", ([1, 2, 3], [4, 5], [6]), (0, 0, 0, 0)
    ),
    "prompt cut first, its end kept": (
        [1, 2, 3, 4, 5], [6, 7], [8], 7, "truncate", ([3, 4, 5], [6, 7], [8]), (2, 0, 0, 0)
    ),
    "prompt down to one token, then the longer response": (
        [1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11], 8, "truncate",
        ([4], [5, 6, 7, 8], [10, 11]), (3, 1, 0, 0),
    ),
    "the longer response is the rejected one": (
        [1, 2], [3], [4, 5, 6, 7], 5, "truncate", ([2], [3], [4, 5]), (1, 0, 2, 0)
    ),
    "longer response down to the other's length, then both": (
        [1, 2], [3, 4, 5, 6], [7, 8, 9], 6, "truncate", ([2], [3, 4], [7, 8]), (1, 2, 1, 0)
    ),
    "a tie loses the rejected token first": (
        [1], [2, 3, 4], [5, 6, 7], 7, "truncate", ([1], [2, 3, 4], [5, 6]), (0, 0, 1, 0)
    ),
    "the smallest unit, one token a part": (
        [1, 2, 3], [4, 5], [6, 7], 4, "truncate", ([3], [4], [6]), (2, 1, 1, 0)
    ),
    "cannot fit even one token a part": ([1], [2], [3, 4], 3, "truncate", None, (0, 0, 0, 1)),
    "drop drops what does not fit": ([1, 2, 3], [4], [5], 5, "drop", None, (0, 0, 0, 1)),
    "drop keeps what fits": ([1, 2, 3], [4], [5], 6, "drop", ([1, 2, 3], [4], [5]), (0, 0, 0, 0)),
}  # fmt: skip

FLOOR_SCENARIOS = {
    # name: (prompt, chosen, rejected, seq_len, min_prompt_tokens, kept or None, (P, C, R cut,
    # dropped, no room))
    "the prompt kept at its floor, the responses cut instead": (
        [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13], 9, 3,
        ([4, 5, 6], [7, 8, 9], [11, 12]), (3, 1, 1, 0, 0),
    ),
    "a prompt under its floor is not cut at all": (
        [1, 2], [3, 4, 5, 6], [7, 8, 9, 10], 6, 64, ([1, 2], [3, 4], [7]), (0, 2, 3, 0, 0),
    ),
    "no room for the floor and a token a response: dropped": (
        [1, 2, 3, 4], [5], [6], 6, 4, None, (0, 0, 0, 1, 1),
    ),
    "a floor of one cuts the prompt first, as before": (
        [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13], 9, 1,
        ([6], [7, 8, 9, 10], [11, 12, 13]), (5, 0, 0, 0, 0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", FLOOR_SCENARIOS)
def test_a_prompt_keeps_its_floor_and_the_responses_give_way(name):
    """``dpo.min_prompt_tokens``: no triple keeps fewer prompt tokens than the floor (or all it
    had); the responses are cut instead, and a triple that cannot fit so is dropped, its reason
    said (``no_room``)."""
    prompt, chosen, rejected, seq_len, floor, kept, counts = FLOOR_SCENARIOS[name]
    triple, cut = preference.fit_triple(prompt, chosen, rejected, seq_len, "truncate", floor)
    assert (cut.prompt, cut.chosen, cut.rejected, int(cut.dropped), int(cut.no_room)) == counts
    if kept is None:
        assert triple is None
        return
    assert [part.tolist() for part in triple] == [list(part) for part in kept]
    assert len(triple.prompt) >= min(floor, len(prompt)) and triple.unit_length <= seq_len


@pytest.mark.parametrize("name", OVERFLOW_SCENARIOS)
def test_overflow_is_exactly(name):
    prompt, chosen, rejected, seq_len, policy, kept, counts = OVERFLOW_SCENARIOS[name]
    triple, cut = preference.fit_triple(prompt, chosen, rejected, seq_len, policy)
    assert (cut.prompt, cut.chosen, cut.rejected, int(cut.dropped)) == counts
    if kept is None:
        assert triple is None and cut.truncated_tokens == 0
        return
    assert [part.tolist() for part in triple] == [list(part) for part in kept]
    assert triple.unit_length <= seq_len
    # nothing lost silently: kept + cut = given, part by part
    for given, part, removed in zip(
        (prompt, chosen, rejected), triple, (cut.prompt, cut.chosen, cut.rejected)
    ):
        assert len(part) + removed == len(given)


def test_overflow_refuses_split_and_empty_parts():
    with pytest.raises(ValueError, match="'split' does not apply"):
        preference.fit_triple([1], [2], [3], 8, "split")
    with pytest.raises(ValueError, match="prompt part of a preference triple is empty"):
        preference.fit_triple([], [2], [3], 8, "truncate")


# ---------------------------------------------------------------- real triples


def _unit_lengths(triples: list[preference.Triple]) -> np.ndarray:
    """Each triple's unit length (P + C + R + 1): the lengths the packers pack."""
    return np.array([t.unit_length for t in triples], dtype=np.int64)


def _load_triples(
    count: int, seq_len: int
) -> tuple[list[preference.Triple], list[preference.TripleOverflow]]:
    """The first ``count`` HH-RLHF (harmless) preference rows, GPT-2 tokens, EOS after each
    response, fitted to ``seq_len`` with ``truncate``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    records = [json.loads(line) for line in HH_DPO.read_text().splitlines()[:count]]

    def encode(key: str) -> list[list[int]]:
        texts = [record[key] for record in records]
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    triples, cuts = [], []
    for prompt, chosen, rejected in zip(encode("prompt"), encode("chosen"), encode("rejected")):
        triple, cut = preference.fit_triple(
            prompt, chosen + [EOS_ID], rejected + [EOS_ID], seq_len, "truncate"
        )
        cuts.append(cut)
        if triple is not None:
            triples.append(triple)
    return triples, cuts


@pytest.fixture(scope="module")
def packed() -> tuple[list[preference.Triple], list[np.ndarray], dict[str, np.ndarray]]:
    """The first 40 real triples at seq_len 512, packed by best-fit decreasing over unit lengths."""
    triples, _ = _load_triples(40, SEQ_LEN)
    bins = pack_lengths(_unit_lengths(triples), SEQ_LEN)
    return triples, bins, preference.assemble_triples(triples, bins, SEQ_LEN, pad_id=EOS_ID)


def _reference_mask(
    triples: list[preference.Triple], bins: list[np.ndarray] | list[list[int]], seq_len: int
) -> torch.Tensor:
    """Dense [B,S,S] from the triple structure alone: every token sees the tokens before it in its
    own part (prompt[:-1]; prompt[-1] + chosen; prompt[-1] + rejected; the padding), and a response
    token also sees its own triple's prompt part, nothing else."""
    out = torch.zeros(len(bins), seq_len, seq_len, dtype=torch.bool)
    for row, bin_ in enumerate(bins):
        parts = []  # (start, end, the (start, end) of the triple's prompt part for responses)
        start = 0
        for index in bin_:
            prompt_len, chosen_len, rejected_len = (len(part) for part in triples[index])
            prompt = (start, start + prompt_len - 1)
            chosen = (prompt[1], prompt[1] + chosen_len + 1)
            rejected = (chosen[1], chosen[1] + rejected_len + 1)
            parts += [(*prompt, None), (*chosen, prompt), (*rejected, prompt)]
            start = rejected[1]
        parts.append((start, seq_len, None))
        for part_start, part_end, prompt in parts:
            for q in range(part_start, part_end):
                out[row, q, part_start : q + 1] = True
                if prompt is not None:
                    out[row, q, prompt[0] : prompt[1]] = True
    return out


# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("name", LAYOUT_SCENARIOS)
def test_dense_mask_matches_the_triple_structure_on_literal_rows(name):
    triples, bins, seq_len, _ = LAYOUT_SCENARIOS[name]
    rows = _tensors(
        preference.assemble_triples(triples, [np.array(b) for b in bins], seq_len, pad_id=0)
    )
    mask = masks.document_causal_mask(rows["document_ids"], rows["parent_ids"])
    assert torch.equal(mask, _reference_mask(triples, bins, seq_len))
    # guard: a rejected token sees the prompt but not the chosen tokens right before it
    if name == "two triples and padding in one row":
        assert mask[0, 6].tolist()[:7] == [True, True, False, False, False, True, True]


def test_dense_mask_matches_the_triple_structure_on_real_rows(packed):
    triples, bins, rows = packed
    rows = _tensors(rows)
    assert max(len(b) for b in bins) >= 3 and (rows["num_tokens"] < SEQ_LEN).any()  # guards
    mask = masks.document_causal_mask(rows["document_ids"], rows["parent_ids"])
    assert torch.equal(mask, _reference_mask(triples, bins, SEQ_LEN))
    assert mask.any(dim=-1).all()  # every query, padding included, attends somewhere
    # guard: the rule is not the plain document rule (responses would not see their prompt)
    assert not torch.equal(mask, masks.document_causal_mask(rows["document_ids"]))


def test_sft_rule_is_unchanged_when_parents_are_the_documents(packed):
    document_ids = _tensors(packed[2])["document_ids"]
    plain = masks.document_causal_mask(document_ids)
    assert torch.equal(masks.document_causal_mask(document_ids, document_ids), plain)
    with pytest.raises(ValueError, match="parent_ids has shape"):
        masks.document_causal_mask(document_ids, document_ids[:, :-1])


@pytest.mark.parametrize("block_size", [128, 32])
def test_block_mask_tiles_match_the_dense_mask(packed, block_size):
    triples, bins, rows = packed
    rows = _tensors(rows)
    dense = masks.document_causal_mask(rows["document_ids"], rows["parent_ids"])
    full, partial = tiles_from_dense(dense, block_size)
    assert full.any() and partial.any()  # guard
    if block_size == 32:
        # guard: some tile is skipped only because rejected tokens do not see the chosen ones
        # (one causal document per triple would visit it), so block sparsity is tested too
        per_triple = masks.document_causal_mask(rows["document_ids"] // 3)
        triple_full, triple_partial = tiles_from_dense(per_triple, block_size)
        assert ((triple_full | triple_partial) & ~(full | partial)).any()
    block_mask = masks.block_mask(
        rows["document_ids"], block_size=block_size, parent_ids=rows["parent_ids"]
    )
    assert block_mask.shape == (len(bins), 1, SEQ_LEN, SEQ_LEN)
    got_full, got_partial = tiles_from_block_mask(block_mask)
    assert torch.equal(got_full, full)
    assert torch.equal(got_partial, partial)


def test_hf_attention_masks_follow_the_preference_rule():
    rows = _tensors(preference.assemble_triples([A, B], [np.array([0, 1])], 16, pad_id=0))
    document_ids, parent_ids = rows["document_ids"], rows["parent_ids"]
    dense = _reference_mask([A, B], [[0, 1]], 16)[:, None]
    assert torch.equal(masks.hf_attention_mask(document_ids, "sdpa", parent_ids=parent_ids), dense)
    additive = masks.hf_attention_mask(document_ids, "eager", torch.bfloat16, parent_ids)
    assert additive.dtype == torch.bfloat16 and torch.equal(additive == 0, dense)
    assert (additive[~dense] == torch.finfo(torch.bfloat16).min).all()
    block_mask = masks.hf_attention_mask(document_ids, "flex_attention", parent_ids=parent_ids)
    assert isinstance(block_mask, BlockMask) and block_mask.shape == (1, 1, 16, 16)
    index = torch.arange(16)
    allowed = block_mask.mask_mod(
        torch.zeros((), dtype=torch.long),
        torch.zeros((), dtype=torch.long),
        index[:, None],
        index[None, :],
    )
    assert torch.equal(allowed, dense[0, 0])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager, CPU
def test_flex_forward_matches_sdpa_on_real_rows(packed):
    """The demo decoder with the preference BlockMask (eager flex: the mask_mod; the tiles are
    checked above) equals SDPA with the dense mask."""
    rows = _tensors(packed[2])
    batch = {key: value[:2] for key, value in rows.items()}
    assert int(batch["num_documents"].min()) >= 6  # guard: two triples or more a row
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=VOCAB_SIZE, dim=32, n_layers=2, n_heads=4)).eval()
    inputs = batch["input_ids"], batch["position_ids"], batch["document_ids"]
    with torch.no_grad():
        expected = model.hidden_states(*inputs, "sdpa", batch["parent_ids"])
        got = model.hidden_states(*inputs, "flex", batch["parent_ids"])
        plain = model.hidden_states(*inputs, "sdpa")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(plain, expected, atol=1e-3)  # guard: parent_ids reached the mask


# ---------------------------------------------------------------- pack_lengths over real units


def test_packing_real_triples_keeps_every_triple_whole():
    """At seq_len 256 (some real triples truncated), every triple is in exactly one row, whole:
    each is rebuilt from its row through document ids and roles, labels included; tokens are
    conserved."""
    seq_len = 256
    triples, cuts = _load_triples(40, seq_len)
    assert sum(cut.truncated_tokens > 0 for cut in cuts) >= 3  # guard: real truncation happened
    assert len(triples) + sum(cut.dropped for cut in cuts) == 40
    lengths = _unit_lengths(triples)
    bins = pack_lengths(lengths, seq_len)
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(triples)))
    assert max(len(b) for b in bins) >= 2  # guard: triples share rows
    rows = preference.assemble_triples(triples, bins, seq_len, pad_id=EOS_ID)
    assert int(rows["num_tokens"].sum()) == int(lengths.sum())
    assert int((rows["document_ids"] < rows["num_documents"][:, None]).sum()) == lengths.sum()
    for row, bin_ in enumerate(bins):
        ids, labels = rows["input_ids"][row], rows["labels"][row]
        documents, roles = rows["document_ids"][row], rows["response_role"][row]
        for slot, index in enumerate(bin_.tolist()):
            prompt_doc, chosen_doc, rejected_doc = (
                np.flatnonzero(documents == 3 * slot + part) for part in range(3)
            )
            assert (roles[chosen_doc] == preference.ROLE_CHOSEN).all()
            assert (roles[rejected_doc] == preference.ROLE_REJECTED).all()
            assert (rows["parent_ids"][row][np.r_[chosen_doc, rejected_doc]] == 3 * slot).all()
            prompt, chosen, rejected = triples[index]
            assert ids[prompt_doc].tolist() + [ids[chosen_doc[0]]] == prompt.tolist()
            assert ids[rejected_doc[0]] == prompt[-1]
            assert ids[chosen_doc[1:]].tolist() == chosen.tolist()
            assert ids[rejected_doc[1:]].tolist() == rejected.tolist()
            assert labels[chosen_doc].tolist() == [*chosen.tolist(), IGNORE_INDEX]
            assert labels[rejected_doc].tolist() == [*rejected.tolist(), IGNORE_INDEX]
            assert (labels[prompt_doc] == IGNORE_INDEX).all()


# ---------------------------------------------------------------- fidelity: packed = alone


def _demo_model(seed: int) -> PackedLM:
    torch.manual_seed(seed)
    decoder = Decoder(DecoderConfig(vocab_size=VOCAB_SIZE, dim=32, n_layers=2, n_heads=4))
    return PackedLM(decoder, loss_chunk_tokens=256).eval()


def _alone_token_logps(model: PackedLM, prompt: np.ndarray, response: np.ndarray) -> torch.Tensor:
    """log p(response token | prompt, earlier response tokens) from prompt + response run alone:
    the model's own forward (one plain causal sequence, positions 0..), no packing code; logits
    only where they predict a response token."""
    input_ids = torch.from_numpy(np.concatenate([prompt, response])).long()[None]
    if model.is_hf:
        output = model.model(input_ids=input_ids, use_cache=False, logits_to_keep=len(response) + 1)
        logits = output.logits[0, :-1]
    else:
        positions = torch.arange(input_ids.shape[1])[None]
        hidden = model.model.hidden_states(input_ids, positions, torch.zeros_like(input_ids))
        logits = model.model.lm_head(hidden[0, len(prompt) - 1 : -1])
    return logits.log_softmax(-1).gather(-1, input_ids[0, len(prompt) :, None])[:, 0]


def _check_packed_equals_alone(
    policy: PackedLM,
    reference: PackedLM,
    triples: list[preference.Triple],
    bins: list[np.ndarray],
    rows: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Per-token and per-triple log-probs, the DPO loss and the policy's gradients of the packed
    rows against each triple's responses run alone (``_alone_token_logps``)."""
    batch = _tensors(rows)
    order = np.concatenate(bins).tolist()  # pack order: the order of packed_logps' triples

    policy.zero_grad(set_to_none=True)
    hidden = policy.hidden_states(
        batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["parent_ids"]
    )
    logps = token_logps(hidden, policy.head, batch["labels"], chunk_tokens=256)
    assert logps.dtype == dtype
    policy_chosen, policy_rejected = dpo.response_logps(
        logps, batch["document_ids"], batch["response_role"]
    )
    with torch.no_grad():
        ref_chosen, ref_rejected = dpo.packed_logps(reference, batch)
    packed = dpo.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, BETA)
    packed.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    policy.zero_grad(set_to_none=True)
    alone = {"policy": [], "reference": []}  # per triple in pack order: (chosen, rejected) logps
    for index in order:
        prompt, chosen, rejected = triples[index]
        alone["policy"].append([_alone_token_logps(policy, prompt, r) for r in (chosen, rejected)])
        with torch.no_grad():
            alone["reference"].append(
                [_alone_token_logps(reference, prompt, r) for r in (chosen, rejected)]
            )
    # per token: a row's labelled positions are its triples' chosen then rejected tokens
    packed_tokens = logps[batch["labels"] != IGNORE_INDEX].detach()
    alone_tokens = torch.cat([t.detach() for pair in alone["policy"] for t in pair])
    torch.testing.assert_close(packed_tokens, alone_tokens, atol=1e-5, rtol=0)

    # per triple: summed in fp64 on both sides; an fp64 model within 1e-5, an fp32 model within
    # 1e-5 per token (its per-token differences, ~1e-6, add up over hundreds of tokens)
    sizes = torch.tensor([[len(t) for t in pair] for pair in alone["policy"]], dtype=torch.float64)
    tolerance = 1e-5 if dtype == torch.float64 else 1e-5 * sizes
    alone_sums = {
        side: torch.stack([torch.stack([t.double().sum() for t in pair]) for pair in pairs])
        for side, pairs in alone.items()
    }
    for got, want in (
        (torch.stack([policy_chosen, policy_rejected], dim=1), alone_sums["policy"]),
        (torch.stack([ref_chosen, ref_rejected], dim=1), alone_sums["reference"]),
    ):
        assert got.dtype == torch.float64
        assert ((got.detach() - want).abs() <= tolerance).all(), (got - want).abs().max()

    policy_sums, ref_sums = alone_sums["policy"], alone_sums["reference"]
    unpacked = dpo.dpo_loss(*policy_sums.unbind(1), *ref_sums.unbind(1), BETA)
    unpacked.loss.backward()
    alone_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    packed_loss, unpacked_loss = float(packed.loss.detach()), float(unpacked.loss.detach())
    assert abs(packed_loss - unpacked_loss) <= 1e-5, (packed_loss, unpacked_loss)
    assert abs(packed_loss - 0.6931) > 1e-3  # guard: policy and reference differ
    assert packed_grads.keys() == alone_grads.keys() and len(packed_grads) > 5
    worst = max(float((packed_grads[n] - alone_grads[n]).abs().max()) for n in packed_grads)
    assert worst <= 1e-4, worst
    assert max(float(g.abs().max()) for g in packed_grads.values()) > 1e-3  # guard: real grads


@pytest.fixture(scope="module")
def fidelity_rows() -> tuple[list[preference.Triple], list[np.ndarray], dict[str, np.ndarray]]:
    """The first 10 real triples at seq_len 512: 5 rows, 4 of them holding 2 or 3 triples."""
    triples, _ = _load_triples(10, SEQ_LEN)
    bins = pack_lengths(_unit_lengths(triples), SEQ_LEN)
    assert len(bins) >= 2 and max(len(b) for b in bins) >= 2  # guard: triples share a row
    return triples, bins, preference.assemble_triples(triples, bins, SEQ_LEN, pad_id=EOS_ID)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_triples_score_like_each_response_alone(fidelity_rows, dtype):
    """The demo decoder: packed log-probs, DPO loss and gradients equal the unpacked ones."""
    policy, reference = _demo_model(seed=0).to(dtype), _demo_model(seed=1).to(dtype)
    _check_packed_equals_alone(policy, reference, *fidelity_rows, dtype=dtype)


def _tiny_llama(seed: int, attention: str) -> PackedLM:
    torch.manual_seed(seed)
    model = build_hf_model(
        vocab_size=VOCAB_SIZE,
        seq_len=SEQ_LEN,
        overrides=TINY_LLAMA,
        attn_implementation=attention,
        token_ids={"eos_token_id": EOS_ID, "pad_token_id": EOS_ID},
    )
    return PackedLM(model, loss_chunk_tokens=256).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_triples_score_like_each_response_alone_in_a_hf_llama(fidelity_rows, attention):
    """The same on a tiny random Llama (fp32): its reference is the model's own forward with its
    own causal mask and positions; the packed path gets the preference mask in its backend's form
    (``masks.hf_attention_mask`` with ``parent_ids``)."""
    policy, reference = _tiny_llama(0, attention), _tiny_llama(1, attention)
    assert policy.attention == attention
    _check_packed_equals_alone(policy, reference, *fidelity_rows)


def test_fidelity_fails_without_the_preference_mask(fidelity_rows):
    """Guard for the fidelity tests: with the plain document mask (responses blind to their
    prompt) chosen and rejected log-probs change; with one causal document per triple (the
    layout's alternative: rejected tokens see the chosen ones) the rejected ones change while the
    chosen ones do not."""
    triples, bins, rows = fidelity_rows
    batch = _tensors(rows)
    model = _demo_model(seed=0)
    inputs = batch["input_ids"], batch["position_ids"]
    labels, roles = batch["labels"], batch["response_role"]

    def logps(document_ids: torch.Tensor, parent_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            hidden = model.hidden_states(*inputs, document_ids, parent_ids)
            logps = token_logps(hidden, model.head, labels, chunk_tokens=0)
        return dpo.response_logps(logps, batch["document_ids"], roles)

    chosen, rejected = logps(batch["document_ids"], batch["parent_ids"])
    blind_chosen, blind_rejected = logps(batch["document_ids"], batch["document_ids"])
    assert (blind_chosen - chosen).abs().min() > 1e-3
    assert (blind_rejected - rejected).abs().min() > 1e-3
    per_triple = batch["document_ids"] // 3
    leaky_chosen, leaky_rejected = logps(per_triple, per_triple)
    torch.testing.assert_close(leaky_chosen, chosen, atol=1e-4, rtol=0)
    assert (leaky_rejected - rejected).abs().min() > 1e-3


# ---------------------------------------------------------------- the loss


def test_dpo_loss_on_literal_values():
    policy_chosen, policy_rejected = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    out = dpo.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.5)
    # rewards: chosen 0.5 * (1, 0), rejected 0.5 * (-1, 1); margins (1, -0.5)
    assert out.chosen_rewards.tolist() == [0.5, 0.0]
    assert out.rejected_rewards.tolist() == [-0.5, 0.5]
    assert float(out.reward_margin) == 0.25 and float(out.reward_accuracy) == 0.5
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2  # -logsigmoid
    assert abs(float(out.loss) - float(expected)) <= 1e-7 and out.loss.dtype == torch.float32
    total, count = dpo.dpo_loss_sum(policy_chosen, policy_rejected, ref_chosen, ref_rejected, 0.5)
    assert int(count) == 2 and abs(float(total) / 2 - float(out.loss)) <= 1e-7
    empty = torch.zeros(0)
    total, count = dpo.dpo_loss_sum(empty, empty, empty, empty, 0.5)
    assert float(total) == 0.0 and int(count) == 0
    with pytest.raises(ValueError, match="no triples"):
        dpo.dpo_loss(empty, empty, empty, empty, 0.5)
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, 0.0)
    with pytest.raises(
        ValueError, match=r"one length .* shapes \[\(2,\), \(2,\), \(2,\), \(1,\)\]"
    ):
        dpo.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected[:1], 0.5)


def test_chunked_token_logps_equal_full_logits():
    """Chunks that do not divide the labelled positions give the full-logits values and
    gradients; rows that are not preference rows are refused by response_logps."""
    rows = _tensors(
        preference.assemble_triples([A, B, A], [np.array([0, 1]), np.array([2])], 16, 0)
    )
    torch.manual_seed(0)
    model = PackedLM(Decoder(DecoderConfig(vocab_size=100, dim=16, n_layers=1, n_heads=2)))
    hidden = model.hidden_states(
        rows["input_ids"], rows["position_ids"], rows["document_ids"], rows["parent_ids"]
    )
    labelled = int((rows["labels"] != IGNORE_INDEX).sum())
    assert labelled == 3 + 3 + 3 and labelled % 4  # guard: a short last chunk
    results = []
    for chunk in (0, 4):
        model.zero_grad(set_to_none=True)
        values = token_logps(hidden, model.head, rows["labels"], chunk_tokens=chunk)
        values.sum().backward(retain_graph=True)
        results.append((values.detach(), model.model.embedding.weight.grad.clone()))
    (full, full_grad), (chunked, chunked_grad) = results
    assert ((full != 0) == (rows["labels"] != IGNORE_INDEX)).all()
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_grad, full_grad, atol=1e-6, rtol=0)
    chosen, rejected = dpo.response_logps(full, rows["document_ids"], rows["response_role"])
    assert chosen.shape == rejected.shape == (3,)  # pack order: A, B (row 0), A (row 1)
    torch.testing.assert_close(chosen[0], chosen[2])
    with pytest.raises(ValueError, match="no rejected document"):
        dpo.response_logps(full, rows["document_ids"], rows["response_role"].clamp(max=1))


# D8: a zero margin is not a correct preference
def test_reward_accuracy_counts_a_tie_as_wrong():
    t = torch.tensor
    out = dpo.dpo_loss(
        t([-1.0, -2.0, -2.0]),
        t([-3.0, -1.0, -2.0]),
        t([-2.0, -2.0, -2.0]),
        t([-2.0, -2.0, -2.0]),
        beta=0.5,
    )
    assert float(out.reward_accuracy) == pytest.approx(1 / 3)


def test_dpo_doctests():
    import doctest

    results = doctest.testmod(preference)
    assert results.attempted > 0 and results.failed == 0
