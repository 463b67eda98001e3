"""Tokenize: templated segments → ``input_ids`` and per-sample shifted ``labels``.

Design note. Labels are shifted here, once, inside each sample: ``labels[t]`` is the target for
``input_ids[t]`` (= ``input_ids[t + 1]`` when that token is trained, else -100) and the last position
is always -100. A packed row is a plain concatenation of samples, so no position can ever be trained
to predict the first token of the next document, and the model never shifts again. An EOS token ends
every sample (trained when the sample's last segment is). Over-length samples follow
``packing.overflow``: ``truncate`` keeps the first ``seq_len`` tokens, ``split`` cuts them into
``seq_len`` chunks that become separate documents, ``drop`` discards them; every case is counted.

``Tokenize`` is the Ray Data ``map_batches`` class: the tokenizer is loaded once per actor in
``__init__`` and every batch is encoded with one call into the Rust tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rayjobs import templates
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.pack import IGNORE_INDEX
from rayjobs.templates import Message, RowError, Segment

TOKEN_LIST = pa.list_(pa.int32())


class DataError(ValueError):
    """A bad row under ``on_bad_row: error``: names dataset, file, row and field."""


class Tokenizer:
    """The HF tokenizer plus the ids and chat rendering rayjobs needs."""

    def __init__(self, config: TokenizerConfig):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        path = Path(config.path)
        if path.is_file():
            self.hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            self.hf = AutoTokenizer.from_pretrained(config.path, local_files_only=path.exists())
        if config.chat_template:
            self.hf.chat_template = config.chat_template
        self.eos_id = self._token_id(config.eos_token, self.hf.eos_token, "eos_token",
                                     fallback="<|endoftext|>")
        self.pad_id = self._token_id(config.pad_token, self.hf.pad_token, "pad_token",
                                     fallback=None, default=self.eos_id)
        self.vocab_size = len(self.hf)

    def _token_id(self, configured: str | None, own: str | None, key: str, *, fallback: str | None,
                  default: int | None = None) -> int:
        token = configured or own or fallback
        token_id = self.hf.convert_tokens_to_ids(token) if token else None
        if token_id is None or (token_id == self.hf.unk_token_id and token != self.hf.unk_token):
            if default is not None:
                return default
            raise ValueError(f"tokenizer.{key}: token {token!r} is not in the vocabulary; "
                             f"set tokenizer.{key} to one of its special tokens")
        return int(token_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self.hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def render_chat(self, messages: list[Message], add_generation_prompt: bool) -> str:
        if self.hf.chat_template is None:
            return templates.chatml(messages, add_generation_prompt)
        if not messages:
            return ""
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)


def shift_labels(input_ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Labels shifted within one sample: ``labels[t] = input_ids[t+1]`` if token t+1 is trained.

    >>> shift_labels(np.array([5, 6, 7, 8]), np.array([False, False, True, True]))
    array([-100,    7,    8, -100], dtype=int32)
    """
    labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(trained[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def encode_segments(segments: Sequence[Segment], segment_ids: Sequence[list[int]], eos_id: int,
                    train_on_input: bool) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate tokenized segments, append EOS and shift labels (see module note)."""
    ids = [token for tokens in segment_ids for token in tokens] + [eos_id]
    trained = [train_on_input or s.trainable for s, tokens in zip(segments, segment_ids)
               for _ in tokens]
    trained.append(train_on_input or (segments[-1].trainable if segments else True))
    input_ids = np.asarray(ids, dtype=np.int32)
    return input_ids, shift_labels(input_ids, np.asarray(trained, dtype=bool))


def apply_overflow(input_ids: np.ndarray, labels: np.ndarray, seq_len: int,
                   policy: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Fit one sample into ``seq_len``: returns (pieces, truncated token count).

    A cut position's label pointed at a token now in another piece, so it becomes -100.
    """
    if len(input_ids) <= seq_len:
        return [(input_ids, labels)], 0
    if policy == "drop":
        return [], 0
    if policy == "truncate":
        kept = labels[:seq_len].copy()
        kept[-1] = IGNORE_INDEX
        return [(input_ids[:seq_len], kept)], len(input_ids) - seq_len
    pieces = []
    for start in range(0, len(input_ids), seq_len):
        piece_labels = labels[start:start + seq_len].copy()
        piece_labels[-1] = IGNORE_INDEX
        pieces.append((input_ids[start:start + seq_len], piece_labels))
    return pieces, 0


@dataclass
class TokenizeCounts:
    """What one batch did, per dataset: the run summary's accounting."""

    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated_tokens: int = 0
    dropped_samples: int = 0
    split_samples: int = 0
    skipped_rows: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent in Tokenize calls (a stage timer for the bench)."""
    cpu_seconds: float = 0.0
    """CPU time of the actor process during those calls (all threads: the Rust tokenizer's too)."""


def sample_uid(origin: str) -> int:
    """A stable 63-bit id of a sample from where it came from (dataset, file, row, piece)."""
    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(), "big") >> 1


class Tokenize:
    """Ray Data ``map_batches`` class: raw rows (see ``sources``) → tokenized samples.

    One actor pool serves every dataset of the run; each row names its dataset in ``_dataset``.
    Output columns: ``input_ids`` and ``labels`` (list<int32>), ``source`` (dataset name), ``uid``
    (``sample_uid``: identifies the sample across runs, for mixing plans) and ``num_tokens``.
    """

    def __init__(self, datasets: Sequence[DatasetConfig], tokenizer: TokenizerConfig, seq_len: int,
                 overflow: str, ledger: Any = None):
        self.datasets = {spec.name: spec for spec in datasets}
        self.tokenizer = Tokenizer(tokenizer)
        self.seq_len = seq_len
        self.overflow = overflow
        self.ledger = ledger

    def _segments(self, spec: DatasetConfig, record: dict[str, Any]) -> list[Segment]:
        if spec.template == "chat":
            return templates.chat(record, spec.column_map, self.tokenizer.render_chat)
        return getattr(templates, spec.template)(record, spec.column_map)

    def __call__(self, batch: pa.Table) -> pa.Table:
        started, cpu_started = time.perf_counter(), time.process_time()
        counts: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)
        rows: list[tuple[DatasetConfig, str, list[Segment]]] = []
        columns = [batch.column(name).to_pylist() for name in ("_dataset", "_path", "_row", "_record")]
        for name, path, row, record in zip(*columns):
            spec = self.datasets[name]
            try:
                rows.append((spec, f"{name}\0{path}\0{row}", self._segments(spec, json.loads(record))))
            except RowError as error:
                where = f"dataset {name!r}, file {path}, row {row}: {error}"
                if spec.on_bad_row == "error":
                    raise DataError(f"{where}. Fix the data, map the column with column_map, or "
                                    f"set on_bad_row: skip to count and skip such rows.") from None
                counts[name].skipped_rows += 1
                if len(counts[name].skipped_examples) < 5:
                    counts[name].skipped_examples.append(where)
        encoded = iter(self.tokenizer.encode_batch([s.text for *_, segments in rows for s in segments]))
        input_ids, labels, sources, uids = [], [], [], []
        for spec, origin, segments in rows:
            segment_ids = [next(encoded) for _ in segments]
            ids, sample_labels = encode_segments(segments, segment_ids, self.tokenizer.eos_id,
                                                 spec.train_on_input)
            pieces, truncated = apply_overflow(ids, sample_labels, self.seq_len, self.overflow)
            tally = counts[spec.name]
            tally.truncated_tokens += truncated
            tally.dropped_samples += not pieces
            tally.split_samples += max(0, len(pieces) - 1)
            for piece, (piece_ids, piece_labels) in enumerate(pieces):
                uids.append(sample_uid(f"{origin}\0{piece}"))
                input_ids.append(piece_ids)
                labels.append(piece_labels)
                sources.append(spec.name)
                tally.samples += 1
                tally.tokens += len(piece_ids)
                tally.trained_tokens += int((piece_labels != IGNORE_INDEX).sum())
        if self.ledger is not None:
            import ray

            seconds = (time.perf_counter() - started) / max(1, len(counts))
            cpu_seconds = (time.process_time() - cpu_started) / max(1, len(counts))
            for tally in counts.values():
                tally.seconds, tally.cpu_seconds = seconds, cpu_seconds
            ray.get([self.ledger.add_tokenize.remote(name, tally)
                     for name, tally in counts.items()])
        return pa.table({
            "input_ids": pa.array(input_ids, type=TOKEN_LIST),
            "labels": pa.array(labels, type=TOKEN_LIST),
            "source": pa.array(sources, type=pa.string()),
            "uid": pa.array(uids, type=pa.int64()),
            "num_tokens": pa.array([len(ids) for ids in input_ids], type=pa.int32()),
        })
