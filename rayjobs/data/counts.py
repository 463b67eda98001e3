"""Counts: what each data batch did, and the end-of-run check that the books balance.

A Tokenize or packer call counts its batch (``TokenizeCounts``, ``PackCounts``) and reports it to
the run's ledger (``report``) with the batch's identity (``batch_key``), synchronously, before its
rows move on: ``rayjobs.job.ledger`` adds a batch once however often Ray runs it.
``check_accounting`` is the check every run ends with (docs/design.md, "Exact counts, exactly
once").
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import ray

from rayjobs.data.formats import bad_row_order


class StageTimer:
    """Wall and CPU seconds of a block, the stage timers of the bench and the summary.

    CPU time is the process's (all threads: the Rust tokenizer's too); wall time also counts
    waiting for a core.

    >>> with StageTimer() as timer:
    ...     _ = sum(range(1000))
    >>> timer.seconds >= 0 and timer.cpu_seconds >= 0
    True
    """

    seconds = cpu_seconds = 0.0

    def __enter__(self) -> StageTimer:
        self._started, self._cpu_started = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds += time.perf_counter() - self._started
        self.cpu_seconds += time.process_time() - self._cpu_started


def report_actor(ledger: Any, kind: str) -> None:
    """Tell the run's ledger that an actor of ``kind`` started on this node (where the work ran)."""
    if ledger is not None and ray.is_initialized():
        report(ledger, "add_actor", kind, ray.get_runtime_context().get_node_id())


def report(ledger: Any, method: str, *args: Any) -> Any:
    """Call ``ledger.<method>(*args)`` and return its answer once it is in (so counts are in
    before rows move on): on the run's ``Ledger`` actor, or in this process on a ``Tally`` (the
    local runner); no-op without a ledger (in-process use, unit tests)."""
    if ledger is None:
        return None
    call = getattr(ledger, method)
    return ray.get(call.remote(*args)) if hasattr(call, "remote") else call(*args)


@dataclass
class TokenizeCounts:
    """What one batch did, per dataset: the run summary's accounting."""

    rows: int = 0
    """Raw rows received (bad ones included): samples − split_samples + dropped_samples +
    skipped_rows (``check_accounting``)."""
    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated_tokens: int = 0
    dropped_samples: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    """The same samples by reason: ``overflow_drop`` (``packing.overflow: drop``), ``no_room``
    (a triple that cannot fit even at its floors), ``empty_prompt``; sums to ``dropped_samples``."""
    split_samples: int = 0
    samples_without_trained_tokens: int = 0
    """Samples with no token left to train: a prompt that fills ``seq_len``, a response cut away,
    a template that marks nothing trainable."""
    samples_mostly_truncated: int = 0
    """Samples that lost more than half their tokens to truncation."""
    truncated_by_part: dict[str, int] = field(default_factory=dict)
    """Preference triples: the truncated tokens by part (``prompt``, ``chosen``, ``rejected``)."""
    responses_tokenized_alone: int = 0
    """Preference data: responses tokenized on their own, not after their prompt, because a
    token of prompt + response straddled the prompt's end (TRL's fallback)."""
    skipped_rows: int = 0
    """Bad rows skipped under ``on_bad_row: skip``, all reasons."""
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    """The same rows by reason (``formats.SKIP_REASONS``); sums to ``skipped_rows``."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' places and problems: the 5 first in the data (by file, then
    row) of those seen, whatever order their batches arrived in, so two runs over the same data
    list the same rows. A row re-read in a later epoch is counted in ``skipped_rows`` again, but
    listed once."""
    seconds: float = 0.0
    """Wall time spent in Tokenize calls (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the actor process during those calls (all threads: the Rust tokenizer's too)."""

    def dropped(self, reason: str) -> None:
        """One sample dropped, for ``reason`` (a key of ``dropped_by_reason``)."""
        self.dropped_samples += 1
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + 1


@dataclass
class PackCounts:
    """What one packing call emitted."""

    num_packs: int = 0
    num_tokens: int = 0
    """Non-pad tokens in the packs."""
    num_slots: int = 0
    """num_packs × seq_len."""
    num_documents: int = 0
    documents_by_source: dict[str, int] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    trimmed_by_source: dict[str, int] = field(default_factory=dict)
    """Samples tokenized but left out because their dataset had reached its share of the epoch
    (weighted stream mode reads a margin more than its share; ``Ledger.admit``)."""
    trimmed_tokens_by_source: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    """Packing calls that emitted these packs (stream mode: each leaves at most one row's worth of
    padding more than global best-fit would)."""
    seconds: float = 0.0
    """Wall time spent assembling these packs (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the assembling process during those calls."""


def batch_key(stage: str, *columns: Any) -> str:
    """A batch's identity for the ledger: a digest of the stage and the batch's identifying
    columns (e.g. dataset, file, row, epoch and pass of every row), the same when Ray runs the
    same batch again after a failure, different for any other batch."""
    import hashlib

    digest = hashlib.blake2b(stage.encode(), digest_size=16)
    for column in columns:
        values = column.to_numpy(zero_copy_only=False) if hasattr(column, "to_numpy") else column
        values = np.asarray(values)
        if values.dtype.kind in "OUS":
            digest.update("\0".join(map(str, values.tolist())).encode())
        else:
            digest.update(np.ascontiguousarray(values).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def check_accounting(snapshot: dict[str, Any], streamed: bool, complete: bool = True) -> list[str]:
    """The end-of-run check (every run): per dataset, rows read = samples − split pieces + dropped
    + skipped; and, when streamed (every tokenized sample packed once, every epoch tokenized
    anew), samples and tokens tokenized = documents and tokens in the packs + those trimmed to the
    dataset's share, over all epochs.
    (In planned mode the plan repeats or subsamples the tokenized samples per epoch, so only the
    first holds.) ``complete``: False when training stopped before the stream ended
    (``train.max_steps``): samples tokenized but still on their way to a packer when the pipeline
    was shut down are then allowed, so the packs may hold fewer, never more
    (``unpacked``). Returns the problems, empty when the books balance."""
    problems = []
    packed = packed_by_source(snapshot)
    for name, c in snapshot["tokenize"].items():
        rows = c["samples"] - c["split_samples"] + c["dropped_samples"] + c["skipped_rows"]
        if rows != c["rows"]:
            problems.append(
                f"dataset {name!r}: {c['rows']} rows read but samples − split pieces + dropped + "
                f"skipped = {rows}"
            )
        documents, tokens = packed.get(name, (0, 0))
        if complete:
            balanced = (documents, tokens) == (c["samples"], c["tokens"])
        else:
            balanced = documents <= c["samples"] and tokens <= c["tokens"]
        if streamed and not balanced:
            problems.append(
                f"dataset {name!r}: tokenized {c['samples']} samples / {c['tokens']} tokens but "
                f"the packs hold (or trimmed) {documents} / {tokens}"
                + ("" if complete else " (more than was tokenized)")
            )
    if streamed:
        for name in set(packed) - set(snapshot["tokenize"]):
            problems.append(f"dataset {name!r}: packed but never tokenized")
    return problems


def packed_by_source(snapshot: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per dataset, (documents, tokens) that reached a packer over all epochs: packed, or trimmed
    to the dataset's share."""
    documents: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    for counts in snapshot["pack"].values():
        for key, total in (
            ("documents_by_source", documents),
            ("trimmed_by_source", documents),
            ("tokens_by_source", tokens),
            ("trimmed_tokens_by_source", tokens),
        ):
            for name, value in counts.get(key, {}).items():
                total[name] += value
    return {name: (documents[name], tokens[name]) for name in documents.keys() | tokens.keys()}


def unpacked(snapshot: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per dataset, samples and tokens tokenized but never packed nor trimmed: 0 in a complete
    streamed run; after an early stop, what was in flight when the pipeline was shut down."""
    packed = packed_by_source(snapshot)
    return {
        name: {
            "samples": c["samples"] - packed.get(name, (0, 0))[0],
            "tokens": c["tokens"] - packed.get(name, (0, 0))[1],
        }
        for name, c in snapshot["tokenize"].items()
    }


def packing_efficiency(num_tokens: int, num_slots: int) -> float:
    """Share of pack slots holding real tokens (1.0 = no padding)."""
    return num_tokens / num_slots if num_slots else 0.0


def _merge(total: Any, part: Any) -> None:
    for name, value in asdict(part).items():
        current = getattr(total, name)
        if isinstance(value, dict):
            for key, amount in value.items():
                current[key] = current.get(key, 0) + amount
        elif isinstance(value, list):  # skipped_examples: the first 5 distinct (stream mode
            # re-reads a bad row every epoch, and the same row 5 times said nothing more)
            current.extend(v for v in dict.fromkeys(value) if v not in current)
            current.sort(key=bad_row_order)  # by place in the data, not arrival
            del current[5:]
        else:
            setattr(total, name, current + value)
