"""Preference (DPO) triples in packed rows: overflow and row assembly (numpy only).

A triple is a prompt (P tokens), a chosen response (C) and a rejected one (R). The loss on these
rows is ``rayjobs.train.dpo``.

Design note
-----------
Layout: "duplicate the last prompt token". One triple is three consecutive documents of a row:

- prompt document = ``prompt[:-1]``, positions 0..P-2, labels all -100 (nothing to train);
- chosen document = ``[prompt[-1]] + chosen``, positions P-1..P-1+C, labels ``chosen`` then -100;
- rejected document = ``[prompt[-1]] + rejected``, positions P-1..P-1+R, labels likewise.

Its *unit length* is P + C + R + 1 tokens; ``pack.pack_lengths`` packs units, and a triple never
splits across rows. Why this layout: the last prompt token is the position whose logits predict a
response's first token, and it must see the prompt and nothing of either response. Copied into each
response document, at its original position P-1, it sees ``prompt[:-1]`` (the parent document, see
below) plus itself, exactly as in the unpacked sequence prompt + response; every response token sees
the prompt and the earlier tokens of its own response, with the positions it would have unpacked.
So each response gets the hidden states of running prompt + response alone, while the prompt is
computed once for both responses. And labels stay shifted *inside* each document, exactly as SFT
rows (``tokenize``'s note): ``labels[t]`` is the target of ``input_ids[t]``, the last position of
every document is -100, and the row machinery (``rows``, ``masks``, ``chunked_loss_sum``) needs no
special case. torchtune's packed DPO layout (prompt, chosen, rejected in one causal run) lets
rejected tokens attend to the chosen ones before them; here they cannot (the masks below).

Document ids: a row's i-th triple takes ids (3i, 3i+1, 3i+2) = (prompt, chosen, rejected), reserved
even when the prompt document is empty (P == 1), so pairing needs no lookup: chosen = prompt id + 1,
rejected = prompt id + 2. Padding is one more document after the last (id 3k for k triples), as in
``rows``; ``num_documents`` counts the ids, 3k, so padding's id is ``num_documents`` there too.

Two more per-token columns (:data:`DPO_COLUMNS`), int32 like the rest:

- ``parent_ids``: the one other document a token may attend to: the prompt's id for chosen and
  rejected tokens, the token's own document id otherwise (prompt and padding). ``masks`` turns it
  into the rule "q attends kv iff q >= kv and (doc[q] == doc[kv] or parent[q] == doc[kv])", which is
  today's document-causal rule when ``parent_ids == document_ids``: one definition for SFT and DPO.
- ``response_role``: 0 prompt or padding, 1 chosen, 2 rejected (:data:`ROLE_PROMPT` ...), so a loss
  can pick responses without knowing the id arithmetic.

Overflow (``fit_triple``) follows the job's policy (``samples.apply_overflow``; ``split`` has no
meaning for a triple and is refused): ``drop`` drops a triple longer than ``seq_len``; ``truncate``
cuts the prompt first, keeping its *end* (the turn the responses answer, as TRL's ``keep_end``
does for prompts) and at least one token (the duplicated one), then the responses, keeping their
*start*, one token at a time from the longer one (the rejected one on a tie, so the preferred one
keeps more), at least one token each; a triple that still cannot fit (``seq_len`` < 4) is dropped.
Every cut token and dropped triple is counted (:class:`TripleOverflow`): nothing is lost silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.rows import DTYPE, IGNORE_INDEX, PACKED_COLUMNS, ranges, row_segments
from rayjobs.data.samples import TOKEN_LIST, Fit, Templated, sample_uid

ROLE_PROMPT, ROLE_CHOSEN, ROLE_REJECTED = 0, 1, 2
"""``response_role`` values: prompt document or padding, chosen response, rejected response."""

PREFERENCE_COLUMNS = ("parent_ids", "response_role")
"""The per-token columns preference rows add to the packed-row contract (``rows``)."""

DPO_COLUMNS = (*PACKED_COLUMNS, *PREFERENCE_COLUMNS)
"""The per-token columns of a preference row, each int32 ``[seq_len]``; the per-row scalars are
``rows.STAT_COLUMNS``."""

OVERFLOW_POLICIES = ("truncate", "drop")
"""The ``packing.overflow`` policies a triple accepts (``split`` would separate a response from its
prompt)."""


class Triple(NamedTuple):
    """One preference sample as token ids (1-D integer arrays, each non-empty)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    @property
    def unit_length(self) -> int:
        """Tokens it takes in a row: P + C + R + 1 (the last prompt token appears twice)."""
        return len(self.prompt) + len(self.chosen) + len(self.rejected) + 1


@dataclass(frozen=True, kw_only=True)
class TripleOverflow:
    """What ``fit_triple`` cut from one triple; all zero when it fit as it was."""

    prompt: int = 0
    """Tokens cut from the prompt's start."""
    chosen: int = 0
    """Tokens cut from the chosen response's end."""
    rejected: int = 0
    """Tokens cut from the rejected response's end."""
    dropped: bool = False
    """The triple was dropped (then the cut counts are 0: it is counted once, as dropped)."""
    no_room: bool = False
    """Dropped because it cannot fit even with its prompt at the floor and one token a response
    (else: ``overflow: drop``)."""

    @property
    def truncated_tokens(self) -> int:
        """Tokens cut from a kept triple, all parts together."""
        return self.prompt + self.chosen + self.rejected


def _as_triple(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int]) -> Triple:
    """The parts as 1-D int32 arrays, or ``ValueError`` naming an empty or malformed part."""
    parts = {}
    for name, tokens in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        array = np.asarray(tokens)
        if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise ValueError(
                f"The {name} part must be a 1-D array of token ids, got shape {array.shape} and "
                f"dtype {array.dtype}."
            )
        if not array.size:
            raise ValueError(
                f"The {name} part of a preference triple is empty; every part needs at least one "
                "token (drop such rows before tokenizing)."
            )
        parts[name] = array.astype(DTYPE, copy=False)
    return Triple(**parts)


def fit_triple(
    prompt: Sequence[int],
    chosen: Sequence[int],
    rejected: Sequence[int],
    seq_len: int,
    policy: str,
    min_prompt_tokens: int = 1,
) -> tuple[Triple | None, TripleOverflow]:
    """Fit one triple into ``seq_len`` tokens of a row (its unit length, P + C + R + 1).

    ``truncate`` cuts the prompt's start down to ``min_prompt_tokens`` (its end is kept: the turn
    the responses answer), then the responses' ends, each token from the longer response (the
    rejected one on a tie), down to one token each. A prompt is never cut below its floor: a
    triple that cannot fit with its prompt at the floor and a token a response is dropped
    (``TripleOverflow.no_room``), as under ``drop`` every triple that does not fit is.

    Returns:
        (the kept triple, or None when dropped; what was cut).

    Raises:
        ValueError: for an unknown policy, a non-positive ``seq_len`` or an empty part.

    >>> triple, cut = fit_triple([1, 2, 3, 4], [5, 6, 7], [8], seq_len=5, policy="truncate")
    >>> [part.tolist() for part in triple], cut.prompt, cut.chosen, cut.rejected
    ([[4], [5, 6], [8]], 3, 1, 0)
    >>> triple, cut = fit_triple([1, 2, 3, 4], [5, 6, 7], [8], 4, "truncate", min_prompt_tokens=2)
    >>> triple, cut.dropped, cut.no_room
    (None, True, True)
    """
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(
            f"Overflow policy {policy!r} does not apply to preference triples; use one of "
            f"{', '.join(OVERFLOW_POLICIES)}."
        )
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    triple = _as_triple(prompt, chosen, rejected)
    excess = triple.unit_length - seq_len
    if excess <= 0:
        return triple, TripleOverflow()
    if policy == "drop":
        return None, TripleOverflow(dropped=True)
    floor = max(1, min(min_prompt_tokens, len(triple.prompt)))
    if seq_len < floor + 3:  # the prompt's floor, a token each response, the duplicated one
        return None, TripleOverflow(dropped=True, no_room=True)
    prompt_cut = min(excess, len(triple.prompt) - floor)
    budget = seq_len - 1 - (len(triple.prompt) - prompt_cut)  # tokens left for the responses
    chosen_len, rejected_len = len(triple.chosen), len(triple.rejected)
    excess = max(0, chosen_len + rejected_len - budget)
    # Water-filling from the top: the longer response loses tokens until both are equal, then
    # they alternate, the rejected one first.
    uneven = min(excess, abs(chosen_len - rejected_len))
    even = excess - uneven
    chosen_cut = (uneven if chosen_len > rejected_len else 0) + even // 2
    rejected_cut = (uneven if rejected_len > chosen_len else 0) + even - even // 2
    return (
        Triple(
            triple.prompt[prompt_cut:],
            triple.chosen[: chosen_len - chosen_cut],
            triple.rejected[: rejected_len - rejected_cut],
        ),
        TripleOverflow(prompt=prompt_cut, chosen=chosen_cut, rejected=rejected_cut),
    )


def assemble_triples(
    triples: Sequence[Triple], bins: Sequence[np.ndarray], seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Preference rows: each bin's triples, in bin order, laid out as the module note says.

    Vectorized like ``rows.assemble``: all parts are concatenated once, each triple's unit stream
    (prompt, chosen, last prompt token, rejected) is gathered with one index array, the units are
    laid into rows with ``rows.row_segments`` (same padding and checks as SFT rows), and every
    per-token column follows from a token's offset in its unit and its triple's P and C. Labels come
    from the laid-out row: ``labels[t] = input_ids[t + 1]`` where t is a response token and t + 1
    is in the same document, else -100.

    Args:
        triples: the triples (each part a non-empty 1-D integer array), e.g. from ``fit_triple``.
        bins: per row, indices into ``triples`` (``pack.pack_lengths`` over ``Triple.unit_length``).
        seq_len: length of every row.
        pad_id: token id that fills the tail of a row.

    Returns:
        :data:`DPO_COLUMNS` as int32 ``[num_rows, seq_len]`` and ``rows.STAT_COLUMNS`` as int32
        ``[num_rows]`` (``num_documents``: 3 per triple).

    Raises:
        ValueError: if a bin names a triple that does not exist or one already placed, a part is
            empty, or a row's units add up to more than ``seq_len``.

    >>> rows = assemble_triples([Triple(np.array([1, 2]), np.array([3]), np.array([4, 5]))],
    ...                         [np.array([0])], seq_len=8, pad_id=0)
    >>> rows["input_ids"].tolist(), rows["labels"].tolist()
    ([[1, 2, 3, 2, 4, 5, 0, 0]], [[-100, 3, -100, 4, 5, -100, -100, -100]])
    >>> rows["document_ids"].tolist(), rows["parent_ids"].tolist()
    ([[0, 1, 1, 2, 2, 2, 3, 3]], [[0, 0, 0, 0, 0, 0, 3, 3]])
    >>> rows["position_ids"].tolist(), rows["response_role"].tolist()
    ([[0, 1, 2, 1, 2, 3, 0, 1]], [[0, 1, 1, 2, 2, 2, 0, 0]])
    """
    per_row = np.array([len(b) for b in bins], dtype=np.int64)
    order = (
        np.concatenate([np.asarray(b, dtype=np.int64) for b in bins])
        if len(bins)
        else np.empty(0, dtype=np.int64)
    )
    outside = (order < 0) | (order >= len(triples))
    if outside.any():
        raise ValueError(
            f"Bins name triple {int(order[outside][0])}, but there are {len(triples)} triples."
        )
    placed, counts = np.unique(order, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"Triple {int(placed[counts > 1][0])} appears {int(counts[counts > 1][0])} times in "
            "the bins; a triple goes in exactly one row."
        )
    packed = [_as_triple(*triples[i]) for i in order.tolist()]
    lengths = np.array([[len(p), len(c), len(r)] for p, c, r in packed], dtype=np.int64)
    lengths = lengths.reshape(-1, 3)
    prompt_len, chosen_len, rejected_len = lengths.T
    units = prompt_len + chosen_len + rejected_len + 1
    # Unit streams: each triple's parts, in pack order, re-read as prompt, chosen, prompt[-1],
    # rejected (four segments per triple, one gather).
    flat = np.concatenate([part for triple in packed for part in triple] or [np.empty(0, DTYPE)])
    base = np.cumsum(lengths.sum(axis=1)) - lengths.sum(axis=1)
    segment_starts = np.stack(
        [base, base + prompt_len, base + prompt_len - 1, base + prompt_len + chosen_len], axis=1
    )
    segment_lengths = np.stack([prompt_len, chosen_len, np.ones_like(base), rejected_len], axis=1)
    unit_stream = np.append(
        flat[ranges(segment_starts.ravel(), segment_lengths.ravel())],
        np.full(seq_len, pad_id, dtype=DTYPE),
    )
    # Rows: each unit is one segment, padding one more, as in rows.assemble.
    row_lengths, row_ids, row_units = row_segments(units, per_row, seq_len)
    unit_starts = np.append(np.cumsum(units) - units, len(unit_stream) - seq_len)
    input_ids = unit_stream[ranges(unit_starts[row_units], row_lengths)]
    offsets = ranges(np.zeros_like(row_lengths), row_lengths, DTYPE)  # in the unit (or padding)
    # Per token: the unit offsets where its triple's chosen (P - 1) and rejected (P + C) documents
    # start; for padding, past any offset, so it stays role 0 with its own id as parent.
    never = np.int64(seq_len + 1)
    prompt_end = np.repeat(np.append(prompt_len - 1, never)[row_units], row_lengths)
    rejected_start = np.repeat(np.append(prompt_len + chosen_len, never)[row_units], row_lengths)
    role = (offsets >= prompt_end).astype(DTYPE) + (offsets >= rejected_start)
    position_ids = offsets - np.where(role == ROLE_REJECTED, rejected_start - prompt_end, 0)
    prompt_ids = 3 * np.repeat(row_ids, row_lengths).astype(DTYPE)
    document_ids = prompt_ids + role
    shape = (len(per_row), seq_len)
    document_ids = document_ids.reshape(shape)
    input_ids = input_ids.astype(DTYPE, copy=False).reshape(shape)
    role = role.reshape(shape)
    labels = np.full(shape, IGNORE_INDEX, dtype=DTYPE)
    trained = (role[:, :-1] != ROLE_PROMPT) & (document_ids[:, 1:] == document_ids[:, :-1])
    labels[:, :-1] = np.where(trained, input_ids[:, 1:], IGNORE_INDEX)
    row_of_unit = np.repeat(np.arange(len(per_row)), per_row)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids.astype(DTYPE, copy=False).reshape(shape),
        "document_ids": document_ids,
        "parent_ids": np.where(role != ROLE_PROMPT, prompt_ids.reshape(shape), document_ids),
        "response_role": role,
        "num_tokens": np.bincount(row_of_unit, weights=units, minlength=len(per_row)).astype(DTYPE),
        "num_documents": (3 * per_row).astype(DTYPE),
    }


# ---------------------------------------------------------------- train side (torch)


TRIPLE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""A tokenized preference triple's columns, list<int32> each."""


def encode_triples(
    tokenizer: Any, rows: Sequence[Templated], counts: dict[str, TokenizeCounts], fit: Fit
) -> tuple[dict[str, pa.Array], list[int]]:
    """Preference rows → one sample per triple: ``prompt_ids``, ``chosen_ids`` and
    ``rejected_ids`` (each response ends with EOS), fitted to ``fit.seq_len`` by :func:`fit_triple`
    (``num_tokens``: the unit length, P + C + R + 1); and, per triple, the index of its row.
    Counted like samples: ``tokens`` are the unit's, ``trained_tokens`` its labelled ones
    (C + R), cuts and drops by the policy."""
    # Each response is tokenized after its prompt, as one text, and keeps the tokens that start
    # past the prompt (on its own a SentencePiece tokenizer would give it a leading space). Where
    # a token of that text straddles the boundary (GPT-2's " 4" after a prompt ending in a space)
    # the prompt's own tokens differ from the text's, and the response is tokenized on its own,
    # as TRL does: keeping only what starts past the prompt lost the straddling token, the
    # answer's first word. EOS is appended unless the text ends with it already.
    texts = [
        t
        for row in rows
        for t in ([row.content.prompt], [row.content.prompt, row.content.chosen],
                  [row.content.prompt, row.content.rejected])
    ]  # fmt: skip
    encoded = iter(tokenizer.encode_parts(texts))
    eos = [tokenizer.eos_id]

    def response(prompt_ids: list[int], at: int, text: str) -> tuple[list[int], int]:
        """The response's tokens, and 1 where it was tokenized on its own (else 0)."""
        ids, starts = next(encoded)
        inside = sum(start < at for start in starts)
        alone = int(ids[:inside] != prompt_ids)
        if alone:  # a token straddles the boundary (rare): the response on its own
            [ids] = tokenizer.encode_batch([text])
            inside = 0
        tokens = ids[inside:]
        return (tokens if tokenizer.ends_with_eos(text) else [*tokens, *eos]), alone

    columns: dict[str, list] = {name: [] for name in TRIPLE_COLUMNS}
    sources, uids, kept = [], [], []
    for row in rows:
        texts_of = row.content
        own, starts = next(encoded)
        at = len(texts_of.prompt)
        tally = counts[row.spec.name]
        chosen, chosen_alone = response(own, at, texts_of.chosen)
        rejected, rejected_alone = response(own, at, texts_of.rejected)
        prompt, _ = tokenizer.with_bos(own, starts)
        if not prompt:  # a prompt that renders to no token (an empty chat template output)
            tally.dropped("empty_prompt")
            continue
        triple, cut = fit_triple(
            prompt, chosen, rejected, fit.seq_len, fit.overflow, fit.min_prompt_tokens
        )
        if triple is None:
            tally.dropped("no_room" if cut.no_room else "overflow_drop")
            continue
        tally.truncated_tokens += cut.truncated_tokens
        for part in ("prompt", "chosen", "rejected"):
            if getattr(cut, part):
                tally.truncated_by_part[part] = tally.truncated_by_part.get(part, 0) + getattr(
                    cut, part
                )
        tally.samples_mostly_truncated += 2 * cut.truncated_tokens > (
            cut.truncated_tokens + triple.unit_length
        )
        for name, part in zip(TRIPLE_COLUMNS, triple, strict=True):
            columns[name].append(part)
        sources.append(row.spec.name)
        uids.append(sample_uid(f"{row.origin}\0{0}"))
        kept.append(row.index)
        tally.samples += 1
        tally.tokens += triple.unit_length
        tally.responses_tokenized_alone += chosen_alone + rejected_alone  # of kept triples
        tally.trained_tokens += len(triple.chosen) + len(triple.rejected)
    out = {name: pa.array(values, type=TOKEN_LIST) for name, values in columns.items()}
    out["source"] = pa.array(sources, type=pa.string())
    out["uid"] = pa.array(uids, type=pa.int64())
    out["num_tokens"] = pa.array(
        [len(p) + len(c) + len(r) + 1 for p, c, r in zip(*columns.values(), strict=True)],
        type=pa.int32(),
    )
    return out, kept


def assemble_triple_rows(
    batch: pa.Table, packs: list[np.ndarray], seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Packed preference rows of a batch of triples (``packs``: each row's triple indices)."""
    parts = [batch.column(name).to_numpy(zero_copy_only=False) for name in TRIPLE_COLUMNS]
    triples = [Triple(*triple) for triple in zip(*parts, strict=True)]
    return assemble_triples(triples, packs, seq_len, pad_id)
