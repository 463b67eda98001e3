"""Tokenize: templated segments → ``input_ids`` and per-sample shifted ``labels``.

Design note. Labels are shifted here, once, inside each sample: ``labels[t]`` is the target for
``input_ids[t]`` (= ``input_ids[t + 1]`` when that token is trained, else -100) and the last
position is always -100. A packed row is a plain concatenation of samples, so no position can ever
be trained to predict the first token of the next document, and the model never shifts again. An EOS
token ends every sample (trained when the sample's last segment is), appended unless the text
already ends with it (a chat template that closes turns with EOS), so never twice. BOS starts a
sample where the tokenizer's post-processor puts one (``tokenizer.add_bos``; what
``tokenizer(text)`` gives at inference), unless the text starts with it already.

A sample's segments are tokenized as one text, and a token is trained when it starts in a
trainable segment: tokenizing each segment on its own gave a SentencePiece-style tokenizer
(Llama 2, Mistral, Gemma: a ``▁`` prepended to every encode call) a space before every response
that the data does not have, and the model never sees at inference. A token that spans a
boundary (BPE merging the end of one segment with the start of the next; templates put special
tokens or newlines there, and on the bundled data with GPT-2 no sample has one) counts with the
segment it starts in. Over-length samples follow
``packing.overflow``: ``truncate`` keeps the first ``seq_len`` tokens, ``split`` cuts them into
``seq_len`` chunks that become separate documents, ``drop`` discards them; every case is counted.

``Tokenize`` is the Ray Data ``map_batches`` class: the tokenizer is loaded once per actor in
``__init__`` and every batch is encoded with one call into the Rust tokenizer.

Bad rows are counted here, and only here: the rows the parser found bad under ``on_bad_row: skip``
arrive with their ``_skip`` reason (see ``sources``), and the rows the template refuses are found
here (``RowError``'s reason; a template function raising ValueError, TypeError or LookupError, or
a chat template raising, is ``template_error``). Under ``skip`` each is counted in
``TokenizeCounts.skipped_rows`` and ``skipped_by_reason`` and its place kept in
``skipped_examples``; under ``error`` it raises ``DataError`` naming dataset, file, row and field
or reason. Other exceptions are bugs, not bad rows, and stop the run under either policy.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayjobs.config import ConfigError, DatasetConfig, TokenizerConfig
from rayjobs.data import templates
from rayjobs.data.counts import StageTimer, TokenizeCounts, batch_key, report, report_actor
from rayjobs.data.formats import HF, HF_PLACE, bad_row_error, bad_row_place, hf_label
from rayjobs.data.preference import fit_triple
from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.data.templates import Message, RowError, Segment

TOKEN_LIST = pa.list_(pa.int32())


class DataError(ValueError):
    """A bad row under ``on_bad_row: error``: names dataset, file, row and field."""


class _BadRow(Exception):
    """A row that cannot become a sample: its reason (``formats.SKIP_REASONS``) and problem."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail.replace("\n", "\\n")


class Tokenizer:
    """The run's tokenizer: the Rust ``tokenizers`` backend, the special-token ids rayjobs needs and
    chat rendering.

    A ``tokenizer.json`` (given as the file, or inside a folder with its ``tokenizer_config.json``)
    loads with ``tokenizers`` alone, and chat templates render with transformers' own Jinja renderer
    (``render_jinja_template``, which does not import torch): Tokenize actors on CPU nodes never
    load torch. Only a Hub name, or a folder without ``tokenizer.json`` (slow-tokenizer files that
    need converting), goes through ``AutoTokenizer``, which imports torch where it is installed.
    """

    def __init__(self, config: TokenizerConfig):
        path = Path(config.path)
        file = path if path.is_file() else path / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer as Backend

            self.backend = Backend.from_file(str(file))
            settings = _folder_settings(path) if path.is_dir() else {}
            special = {key: _token_text(settings.get(key)) for key in SPECIAL_TOKENS}
            chat_template = _chat_template(path, settings) if path.is_dir() else None
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(config.path, local_files_only=path.exists())
            self.backend = hf.backend_tokenizer
            special = {key: getattr(hf, key, None) for key in SPECIAL_TOKENS}
            chat_template = hf.chat_template
        self.chat_template = config.chat_template or chat_template
        self.special_tokens = {key: value for key, value in special.items() if value}
        self.eos_id = self._token_id(
            config.eos_token, special["eos_token"], "eos_token", fallback="<|endoftext|>"
        )
        self.pad_id = self._token_id(
            config.pad_token, special["pad_token"], "pad_token", fallback=None, default=self.eos_id
        )
        # A chat template's eos_token / pad_token are the ones the run uses: a tokenizer.json
        # given as a file has no folder settings, and a template writing {{ eos_token }} failed
        # on every row (undefined) even with tokenizer.eos_token set.
        for key, configured in (("eos_token", config.eos_token), ("pad_token", config.pad_token)):
            if configured:
                self.special_tokens[key] = configured
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._bos_id(config.add_bos)
        self._eos_text = self.backend.id_to_token(self.eos_id)

    def _token_id(
        self,
        configured: str | None,
        own: str | None,
        key: str,
        *,
        fallback: str | None,
        default: int | None = None,
    ) -> int:
        token = configured or own or fallback
        token_id = self.backend.token_to_id(token) if token else None
        if token_id is None:
            if default is not None and configured is None:  # one the config names must exist
                return default
            raise ConfigError(
                f"tokenizer.{key}: token {token!r} is not in the vocabulary; "
                f"set tokenizer.{key} to one of its special tokens"
            )
        return int(token_id)

    def _bos_id(self, add_bos: bool | None) -> int | None:
        """The BOS id every sample starts with, or None (``tokenizer.add_bos``): by default the
        one the tokenizer's post-processor puts first (what ``tokenizer(text)`` gives)."""
        if add_bos is False:
            return None
        plain = self.backend.encode("a", add_special_tokens=False).ids
        framed = self.backend.encode("a", add_special_tokens=True).ids
        own = framed[0] if len(framed) > len(plain) and framed[1:][: len(plain)] == plain else None
        if add_bos is None:
            return own
        named = self.special_tokens.get("bos_token")
        bos = self.backend.token_to_id(named) if named else own
        if bos is None:
            raise ConfigError(
                "tokenizer.add_bos: the tokenizer names no BOS token (no bos_token in its "
                "settings, none added by its post-processor)"
            )
        return int(bos)

    def with_bos(self, ids: list[int], starts: list[int]) -> tuple[list[int], list[int]]:
        """``ids`` (and their ``starts``) with BOS first where the run adds one and the text did
        not start with it already."""
        if self.bos_id is None or (ids and ids[0] == self.bos_id):
            return ids, starts
        return [self.bos_id, *ids], [0, *starts]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [ids for ids, _ in self.encode_with_starts(texts)]

    def encode_with_starts(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        """Each text's token ids and where each token starts (a character offset in the text)."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, [start for start, _ in e.offsets]) for e in encodings]

    def ends_with_eos(self, text: str) -> bool:
        """Whether ``text`` already ends with the EOS token, whitespace aside (a chat template
        that closes each turn with it: Mistral's ``</s>``, Zephyr's ``</s>\n``, Qwen's
        ``<|im_end|>\n`` where that is the EOS): then none is appended."""
        return bool(self._eos_text) and text.rstrip().endswith(self._eos_text)

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        tools: list[templates.Tool] | None = None,
    ) -> str:
        """The conversation as the chat template renders it (as ``apply_chat_template`` would,
        with ``tools``, special tokens visible to the template); ChatML when there is no
        template.

        Raises:
            RowError: (``template_error``) the template raised on this conversation, as templates
                do through ``raise_exception`` ("roles must alternate", ...).
            jinja2.TemplateSyntaxError: the template itself is not valid Jinja (every row would
                fail: the run stops under either policy).
        """
        if self.chat_template is None:
            return templates.chatml(messages, add_generation_prompt, tools)
        # No shortcut for no messages: what a template writes before the first turn (BOS, a
        # default system prompt) comes before a conversation's opening assistant turn too, and
        # an empty prompt made it part of that turn's trained text.
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateSyntaxError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a template raises on a row
            before = " on the turns before the opening assistant turn" if not messages else ""
            raise RowError(
                "messages",
                f"the chat template raised {type(error).__name__}{before}: {error}",
                reason="template_error",
            ) from None
        return rendered[0]


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The special tokens a tokenizer folder may name (and a chat template may use)."""


def _folder_settings(folder: Path) -> dict[str, Any]:
    """``special_tokens_map.json`` overlaid with ``tokenizer_config.json`` (where either exists)."""
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            settings.update(json.loads((folder / name).read_text()))
    return settings


def _token_text(value: Any) -> str | None:
    """A special token as saved by transformers: a string, or an AddedToken dict with content."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: Path, settings: dict[str, Any]) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else tokenizer_config's
    ``chat_template`` (a string, or named templates of which ``default`` is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def shift_labels(input_ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Labels shifted within one sample: ``labels[t] = input_ids[t+1]`` if token t+1 is trained.

    >>> shift_labels(np.array([5, 6, 7, 8]), np.array([False, False, True, True]))
    array([-100,    7,    8, -100], dtype=int32)
    """
    labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(trained[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def encode_segments(
    segments: Sequence[Segment],
    ids: Sequence[int],
    starts: Sequence[int],
    eos_id: int,
    train_on_input: bool,
    has_eos: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """A sample's ``input_ids`` and shifted labels from its segments' texts tokenized as one
    text (``ids``, and each token's character offset in the joined text, ``starts``): a token is
    trained when it starts in a trainable segment; EOS is appended (trained when the last segment
    is) unless the text ``has_eos`` already (see module note).

    >>> segments = [Segment("Q: hi ", False), Segment("A: yo", True)]
    >>> encode_segments(segments, [1, 2, 3, 4], [0, 3, 6, 9], 0, False)[1].tolist()
    [-100, 3, 4, 0, -100]
    """
    ends = np.cumsum([len(segment.text) for segment in segments])
    trainable = np.array([train_on_input or s.trainable for s in segments] or [True], dtype=bool)
    which = np.minimum(np.searchsorted(ends, np.asarray(starts, dtype=np.int64), side="right"),
                       len(trainable) - 1)  # fmt: skip
    trained = trainable[which] if len(ids) else np.zeros(0, dtype=bool)
    if not has_eos:
        ids = [*ids, eos_id]
        trained = np.append(trained, trainable[-1])
    input_ids = np.asarray(ids, dtype=np.int32)
    return input_ids, shift_labels(input_ids, trained)


def apply_overflow(
    input_ids: np.ndarray, labels: np.ndarray, seq_len: int, policy: str
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
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
        piece_labels = labels[start : start + seq_len].copy()
        piece_labels[-1] = IGNORE_INDEX
        pieces.append((input_ids[start : start + seq_len], piece_labels))
    return pieces, 0


def sample_uid(origin: str) -> int:
    """A stable 63-bit id of a sample from where it came from (dataset, file, row, piece)."""
    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(), "big") >> 1


THREADS_ENV = "RAYON_NUM_THREADS"
"""The Rust tokenizer's ``encode_batch`` runs on a rayon thread pool as wide as the machine. A
Tokenize actor on Ray caps it at the CPUs it asked Ray for (``threads``), so a node's tokenizers
use the cores they were scheduled on and no more, and the pipeline bench's "CPUs given to
tokenization" is what they really used; a value already in the environment wins."""


class Tokenize:
    """Ray Data ``map_batches`` class: raw rows (see ``sources``) → tokenized samples.

    One actor pool serves every dataset of the run; each row names its dataset in ``_dataset``.
    Output columns: ``input_ids`` and ``labels`` (list<int32>), ``source`` (dataset name), ``uid``
    (``sample_uid``: identifies the sample across runs, for mixing plans) and ``num_tokens``; for
    preference data (``task: dpo``) :data:`TRIPLE_COLUMNS` instead of ``input_ids`` and ``labels``.
    """

    def __init__(
        self,
        datasets: Sequence[DatasetConfig],
        tokenizer: TokenizerConfig,
        seq_len: int,
        overflow: str,
        ledger: Any = None,
        threads: int | None = None,
    ):
        if threads:  # before the tokenizer's first batch builds its thread pool
            os.environ.setdefault(THREADS_ENV, str(threads))
        self.datasets = {spec.name: spec for spec in datasets}
        self.file_index = {  # a file's place in its dataset (sample uids); HF_PLACE for HF's
            s.name: {hf_label(s.source, s.split): HF_PLACE}
            if s.format == HF
            else {f: str(i) for i, f in enumerate(s.files)}
            for s in datasets
        }
        self.tokenizer = Tokenizer(tokenizer)
        report_actor(ledger, "Tokenize")
        self.seq_len = seq_len
        self.overflow = overflow
        self.ledger = ledger

    def _segments(self, spec: DatasetConfig, record: dict[str, Any]) -> list[Segment]:
        template = templates.TEMPLATES[spec.template]
        return template.render(record, spec.column_map, self.tokenizer.render_chat)

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)
        with StageTimer() as timer:
            table = self._tokenize(batch, counts)
        for tally in counts.values():  # the batch's time, shared by the datasets in it
            tally.seconds = timer.seconds / len(counts)
            tally.cpu_seconds = timer.cpu_seconds / len(counts)
        report(self.ledger, "add_tokenize", dict(counts), input_key(batch), sample_lengths(table))
        return table

    def _bad_row(
        self,
        counts: dict[str, TokenizeCounts],
        spec: DatasetConfig,
        where: tuple[str, int],
        reason: str,
        detail: str,
    ) -> None:
        """Count a bad row under ``skip``; raise ``DataError`` under ``error``."""
        place = bad_row_place(spec.name, *where, detail)
        if spec.on_bad_row == "error":
            fix = {
                "missing_field": "Fix the data, map the column with column_map",
                "template_error": "Fix the data or the template",
            }.get(reason, "Fix the data")
            raise DataError(bad_row_error(place, reason, fix))
        tally = counts[spec.name]
        tally.skipped_rows += 1
        tally.skipped_by_reason[reason] = tally.skipped_by_reason.get(reason, 0) + 1
        if len(tally.skipped_examples) < 5:
            tally.skipped_examples.append(f"{place} [{reason}]")

    def _template(self, spec: DatasetConfig, record: str) -> list[Segment]:
        """The row's segments.

        Raises:
            _BadRow: the row's reason and problem (a template function raising ValueError,
                TypeError or LookupError is ``template_error``).
        """
        try:
            row = json.loads(record)
        except json.JSONDecodeError as error:  # parsers emit valid JSON; a hand-made row may not
            raise _BadRow("invalid_json", f"the record is not valid JSON: {error.msg}") from None
        try:
            return self._segments(spec, row)
        except RowError as error:
            raise _BadRow(error.reason, str(error)) from None
        except (ValueError, TypeError, LookupError) as error:
            problem = f"template {spec.template!r} raised {type(error).__name__}: {error}"
            raise _BadRow("template_error", problem) from None

    def _tokenize(self, batch: pa.Table, counts: dict[str, TokenizeCounts]) -> pa.Table:
        rows: list[tuple[int, DatasetConfig, str, list[Segment]]] = []
        columns = [
            batch.column(name).to_pylist() for name in ("_dataset", "_path", "_row", "_record")
        ]
        skips = (
            batch.column("_skip").to_pylist()
            if "_skip" in batch.column_names
            else [None] * batch.num_rows
        )
        for index, (name, path, row, record, skip) in enumerate(zip(*columns, skips, strict=True)):
            spec = self.datasets[name]
            counts[name].rows += 1
            if skip is not None:  # found bad by the parser; the record says what is wrong
                self._bad_row(counts, spec, (path, row), skip, record)
                continue
            try:
                segments = self._template(spec, record)
            except _BadRow as bad:
                self._bad_row(counts, spec, (path, row), bad.reason, bad.detail)
                continue
            # The file's place in the dataset's sorted file list, not its absolute path:
            # the same data elsewhere (another machine, a fresh clone) gets the same uids.
            origin = f"{name}\0{self.file_index[name].get(path, path)}\0{row}"
            rows.append((index, spec, origin, segments))
        if self._preference(batch):
            return self._triples(batch, rows, counts)
        texts = ["".join(s.text for s in segments) for *_, segments in rows]
        encoded = self.tokenizer.encode_with_starts(texts)
        input_ids, labels, sources, uids, kept = [], [], [], [], []
        for (index, spec, origin, segments), text, (ids, starts) in zip(
            rows, texts, encoded, strict=True
        ):
            has_eos = self.tokenizer.ends_with_eos(text)
            ids, starts = self.tokenizer.with_bos(ids, starts)
            ids, sample_labels = encode_segments(
                segments, ids, starts, self.tokenizer.eos_id, spec.train_on_input, has_eos
            )
            pieces, truncated = apply_overflow(ids, sample_labels, self.seq_len, self.overflow)
            tally = counts[spec.name]
            tally.truncated_tokens += truncated
            tally.dropped_samples += not pieces
            tally.split_samples += max(0, len(pieces) - 1)
            for piece, (piece_ids, piece_labels) in enumerate(pieces):
                uids.append(sample_uid(f"{origin}\0{piece}"))
                kept.append(index)
                input_ids.append(piece_ids)
                labels.append(piece_labels)
                sources.append(spec.name)
                tally.samples += 1
                tally.tokens += len(piece_ids)
                tally.trained_tokens += int((piece_labels != IGNORE_INDEX).sum())
        out = {
            "input_ids": pa.array(input_ids, type=TOKEN_LIST),
            "labels": pa.array(labels, type=TOKEN_LIST),
            "source": pa.array(sources, type=pa.string()),
            "uid": pa.array(uids, type=pa.int64()),
            "num_tokens": pa.array([len(ids) for ids in input_ids], type=pa.int32()),
        }
        for tag in STREAM_TAGS:  # the streaming path's epoch and pass follow the sample
            if tag in batch.column_names:
                out[tag] = batch.column(tag).take(pa.array(kept, type=pa.int64()))
        return pa.table(out)

    def _preference(self, batch: pa.Table) -> bool:
        """Whether the batch holds preference data (a run's datasets are all preference data or
        none, as the config checks; a batch whose rows were all bad still gets the triple
        columns, so every block of a run has one schema)."""
        names = pc.unique(batch.column("_dataset")).to_pylist()
        return any(
            templates.TEMPLATES[self.datasets[name].template].task == "dpo" for name in names
        )

    def _triples(
        self,
        batch: pa.Table,
        rows: list[tuple[int, DatasetConfig, str, templates.Preference]],
        counts: dict[str, TokenizeCounts],
    ) -> pa.Table:
        """Preference rows → one sample per triple: ``prompt_ids``, ``chosen_ids`` and
        ``rejected_ids`` (each response ends with EOS), fitted to ``seq_len`` by ``preference.fit_triple``
        (``num_tokens``: the unit length, P + C + R + 1). Counted like samples: ``tokens`` are the
        unit's, ``trained_tokens`` its labelled ones (C + R), cuts and drops by the policy."""
        # Each response is tokenized after its prompt, as one text, and keeps the tokens that
        # start past the prompt (on its own a SentencePiece tokenizer would give it a leading
        # space). Where a token of that text straddles the boundary (GPT-2's " 4" after a
        # prompt ending in a space) the prompt's own tokens differ from the text's, and the
        # response is tokenized on its own, as TRL does: keeping only what starts past the
        # prompt lost the straddling token, the answer's first word. EOS is appended unless the
        # text ends with it already.
        texts = [
            t for *_, p in rows for t in (p.prompt, p.prompt + p.chosen, p.prompt + p.rejected)
        ]
        encoded = iter(self.tokenizer.encode_with_starts(texts))
        eos = [self.tokenizer.eos_id]

        def response(prompt_ids: list[int], at: int, text: str) -> tuple[list[int], int]:
            """The response's tokens, and 1 where it was tokenized on its own (else 0)."""
            ids, starts = next(encoded)
            inside = sum(start < at for start in starts)
            alone = int(ids[:inside] != prompt_ids)
            if alone:  # a token straddles the boundary (rare): the response on its own
                [(ids, _)] = self.tokenizer.encode_with_starts([text])
                inside = 0
            tokens = ids[inside:]
            return (tokens if self.tokenizer.ends_with_eos(text) else [*tokens, *eos]), alone

        columns: dict[str, list] = {name: [] for name in TRIPLE_COLUMNS}
        sources, uids, kept = [], [], []
        for index, spec, origin, preference in rows:
            own, starts = next(encoded)
            at = len(preference.prompt)
            tally = counts[spec.name]
            chosen, chosen_alone = response(own, at, preference.chosen)
            rejected, rejected_alone = response(own, at, preference.rejected)
            prompt, _ = self.tokenizer.with_bos(own, starts)
            if not prompt:  # a prompt that renders to no token (an empty chat template output)
                tally.dropped_samples += 1
                continue
            triple, cut = fit_triple(prompt, chosen, rejected, self.seq_len, self.overflow)
            tally.truncated_tokens += cut.truncated_tokens
            if triple is None:
                tally.dropped_samples += 1
                continue
            for name, part in zip(TRIPLE_COLUMNS, triple, strict=True):
                columns[name].append(part)
            sources.append(spec.name)
            uids.append(sample_uid(f"{origin}\0{0}"))
            kept.append(index)
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
        for tag in STREAM_TAGS:
            if tag in batch.column_names:
                out[tag] = batch.column(tag).take(pa.array(kept, type=pa.int64()))
        return pa.table(out)


def sample_lengths(table: pa.Table) -> dict[str, list[int]]:
    """Each tokenized sample's tokens, by dataset (the ledger's length histogram)."""
    sources = table.column("source").to_numpy(zero_copy_only=False)
    lengths = table.column("num_tokens").to_numpy()
    return {str(name): lengths[sources == name].tolist() for name in np.unique(sources)}


TRIPLE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""A tokenized preference triple's columns (``task: dpo``), list<int32> each."""

STREAM_TAGS = ("_epoch", "_pass")
"""Columns the streaming path tags raw rows with (``stream._tag_epoch``)."""


def input_key(batch: pa.Table) -> str:
    """A Tokenize batch's identity for the ledger (``metrics.batch_key``): the place of every row
    it holds (bad rows included), with their epoch and pass when streamed."""
    columns = ["_dataset", "_path", "_row", *(t for t in STREAM_TAGS if t in batch.column_names)]
    return batch_key("tokenize", *(batch.column(name) for name in columns))
