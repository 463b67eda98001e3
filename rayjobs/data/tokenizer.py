"""The run's tokenizer: the Rust ``tokenizers`` backend, the special-token ids rayjobs needs, and
chat rendering, loaded without torch (Tokenize actors on CPU nodes never import it); where
``tokenizer.backend`` says so, text is encoded by ``fastokens`` instead (``encode_parts``)."""

from __future__ import annotations

import functools
import json
import re
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateSyntaxError

from rayjobs.config import TokenizerConfig
from rayjobs.data import jinja, spm, templates
from rayjobs.data.rows import ranges
from rayjobs.data.templates import Message, RowError
from rayjobs.errors import ConfigError


class Tokenizer:
    """The run's tokenizer: the Rust ``tokenizers`` backend, the special-token ids rayjobs needs and
    chat rendering.

    A ``tokenizer.json`` (given as the file, or inside a folder with its ``tokenizer_config.json``)
    loads with ``tokenizers`` alone, a SentencePiece model (``tokenizer.model``, as the file or in
    a folder without ``tokenizer.json``) is converted to one (``spm``), and chat templates render
    as transformers renders them, in a bounded sandbox (``jinja``, which does not import torch):
    Tokenize actors on CPU nodes never load torch. Only a Hub name, or a folder of other
    slow-tokenizer files (``vocab.json`` and ``merges.txt``), goes through ``AutoTokenizer``, which
    imports torch where it is installed.
    """

    def __init__(self, config: TokenizerConfig):
        # ``auto`` is the driver's to decide (``backends.choose``) and reaches the Tokenize actors
        # decided; left undecided, it encodes with tokenizers, the reference.
        self.encoder = "fastokens" if config.backend == "fastokens" else "tokenizers"
        self._fast: Any = None
        self.straddles = 0
        """Texts ``encode_parts`` encoded again by tokenizers (a token straddling two parts)."""
        path = Path(config.path)
        settings = _folder_settings(path) if path.is_dir() else {}
        kind, file, proto = _source(path)
        if kind == "json":
            from tokenizers import Tokenizer as Backend

            self.backend = Backend.from_file(str(file))
            special = {key: _token_text(settings.get(key)) for key in SPECIAL_TOKENS}
            chat_template = _chat_template(path, settings) if path.is_dir() else None
        elif kind == "sentencepiece":
            self.backend, own = spm.load(file, proto, settings)
            named = {key: _token_text(settings.get(key)) for key in SPECIAL_TOKENS}
            special = {key: named[key] or own[key] for key in SPECIAL_TOKENS}
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
            if configured:
                problem = f"token {token!r} is not in the vocabulary"
            elif own:
                problem = f"the tokenizer's own {key} {own!r} is not in its vocabulary"
            else:
                problem = (
                    f"the tokenizer names no {key}, and the default {fallback!r} is not in its "
                    "vocabulary"
                )
            raise ConfigError(
                f"tokenizer.{key}: {problem}; set tokenizer.{key} to one of its special tokens: "
                f"{self._special_listing()}"
            )
        return int(token_id)

    def _special_listing(self) -> str:
        """The tokenizer's special tokens (its named ones, and its added tokens marked
        special), for an error message."""
        added = self.backend.get_added_tokens_decoder()
        found = [t.content for _, t in sorted(added.items()) if t.special]
        found += [t for t in self.special_tokens.values() if t not in found]
        if not found:
            return "it has none; name a token of its vocabulary"
        shown = ", ".join(repr(t) for t in found[:20])
        return shown + (f" (and {len(found) - 20} more)" if len(found) > 20 else "")

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

    @property
    def fast(self) -> Any:
        """The fastokens encoder where the run encodes with it (loaded on first use: a train
        worker that never encodes never loads it), else None.

        Raises:
            ConfigError: fastokens is not installed or cannot load this tokenizer.
        """
        if self._fast is None and self.encoder == "fastokens":
            self._fast, problem = load_fast(self.backend)
            if problem:
                raise ConfigError(
                    f"tokenizer.backend: fastokens {problem}; set tokenizer.backend to auto or "
                    "tokenizers"
                )
        return self._fast

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, by the run's encoder."""
        if self.fast is not None:
            ids, offsets = _flat(self.fast, texts)
            return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def encode_with_starts(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        """Each text's token ids and where each token starts (a character offset in the text),
        by ``tokenizers`` (fastokens has no offsets)."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, [start for start, _ in e.offsets]) for e in encodings]

    def encode_long(self, text: str, keep: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """``encode_with_starts`` of one long text (int64 arrays) a chunk at a time, in memory
        bounded by the chunk, not the text: the first ``keep`` tokens (all: None) and the count
        of all of them, exact.

        The text is cut before a space between two words about every :data:`CHUNK_CHARS`
        characters (where pre-tokenizers split). Each chunk is encoded with
        :data:`CONTEXT_CHARS` of the text on either side, and keeps the tokens that start in
        it; a token must start exactly at each cut, as in the whole text. Where one does not
        (a tokenizer that does not split at spaces, a token across the cut), the text is
        encoded whole.
        """
        cuts = [0]
        while (at := cuts[-1] + CHUNK_CHARS) < len(text) and (found := _CUT.search(text, at)):
            cuts.append(found.start())
        cuts.append(len(text))
        ids: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        held = total = 0
        chunks = list(zip(cuts[:-1], cuts[1:], strict=True))
        for first in range(0, len(chunks), CHUNKS_AT_ONCE):
            if keep is not None and held >= keep:  # the rest is only counted
                rest = self._count_chunks(text, chunks[first:])
                if rest is None:
                    break
                n = min(held, keep)
                return np.concatenate(ids)[:n], np.concatenate(starts)[:n], total + rest
            batch = chunks[first : first + CHUNKS_AT_ONCE]
            spans = [
                (max(0, a - CONTEXT_CHARS), min(len(text), b + CONTEXT_CHARS)) for a, b in batch
            ]
            encoded = self.backend.encode_batch(
                [text[a:b] for a, b in spans], add_special_tokens=False
            )
            for (a, b), (begin, _), encoding in zip(batch, spans, encoded, strict=True):
                offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + begin
                lo, hi = np.searchsorted(offsets[:, 0], (a, b))
                if not (
                    _starts_at(offsets, lo, a, len(text)) and _starts_at(offsets, hi, b, len(text))
                ):
                    return self._whole(text, keep)
                total += hi - lo
                if keep is None or held < keep:
                    ids.append(np.asarray(encoding.ids[lo:hi], dtype=np.int64))
                    starts.append(offsets[lo:hi, 0])
                    held += hi - lo
        else:
            n = held if keep is None else min(held, keep)
            empty = np.zeros(0, dtype=np.int64)
            return np.concatenate([empty, *ids])[:n], np.concatenate([empty, *starts])[:n], total
        return self._whole(text, keep)

    def _whole(self, text: str, keep: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """``encode_long`` of a text that cannot be cut: encoded whole."""
        whole, whole_starts = self.encode_with_starts([text])[0]
        n = len(whole) if keep is None else keep
        return (np.asarray(whole[:n], dtype=np.int64),
                np.asarray(whole_starts[:n], dtype=np.int64), len(whole))  # fmt: skip

    def _count_chunks(self, text: str, chunks: list[tuple[int, int]]) -> int | None:
        """The tokens of ``chunks`` of ``text`` (the first starting where a token starts), by
        the run's encoder, without offsets: each chunk encoded after :data:`CONTEXT_CHARS` of
        the text before it, and that context alone, whose ids must start the chunk's (no token
        across the cut); None where they do not."""
        count = 0
        for first in range(0, len(chunks), CHUNKS_AT_ONCE):
            batch = chunks[first : first + CHUNKS_AT_ONCE]
            pairs = []
            for a, b in batch:
                begin = max(0, a - CONTEXT_CHARS)
                pairs += [text[begin:a], text[begin:b]]
            encoded = self.encode_batch(pairs)
            for before, both in zip(encoded[::2], encoded[1::2], strict=True):
                if both[: len(before)] != before:
                    return None
                count += len(both) - len(before)
        return count

    def encode_parts(self, texts: list[list[str]]) -> list[tuple[list[int], list[int]]]:
        """``encode_parts_flat``, one ``(ids, starts)`` pair of lists per text."""
        if not texts:
            return []
        ids, starts, lengths = self.encode_parts_flat(texts)
        bounds = np.cumsum(lengths)[:-1]
        return [
            (i.tolist(), s.tolist())
            for i, s in zip(np.split(ids, bounds), np.split(starts, bounds), strict=True)
        ]

    def encode_parts_flat(self, texts: list[list[str]]) -> tuple[np.ndarray, ...]:
        """Each text, given as its parts, as one text's token ids, and for each token a
        character offset in the text that lies in the part the token starts in: where the token
        starts (``encode_with_starts``), or, encoded by fastokens, where its part starts. As
        arrays: every text's ids one after another, each token's offset, and each text's count
        of tokens (int64).

        fastokens tracks no offsets. It encodes each text whole and each of its parts alone;
        where the parts' ids, one after another, are the whole text's, every token lies inside
        one part, and the part's start stands for the token's. Where they are not (a token
        straddles two parts: GPT-2's " 4" after a part ending in a space; a SentencePiece
        tokenizer's space before a part), the text is encoded again by ``tokenizers``, with its
        offsets. Either way each token is placed in the part it starts in. The comparison and
        the offsets are array operations over the whole batch.
        """
        whole = ["".join(parts) for parts in texts]
        if self.fast is None or not texts:
            return _arrays(self.encode_with_starts(whole))
        n = len(texts)
        split = [p for parts in texts if len(parts) > 1 for p in parts]
        ids, offsets = _flat(self.fast, whole + split)
        ids = ids.astype(np.int64)
        lengths = np.diff(offsets[: n + 1])
        starts = np.zeros(int(offsets[n]), dtype=np.int64)
        if not split:
            return ids[: offsets[n]], starts, lengths
        # The texts of several parts, and where their parts' ids lie (one run per text).
        counts = np.fromiter((len(parts) for parts in texts), dtype=np.int64, count=n)
        multi = np.flatnonzero(counts > 1)
        k = counts[multi]
        first = np.cumsum(k) - k  # each text's first part among the split parts
        part_begin = offsets[n + first]
        size = lengths[multi]
        same = (offsets[n + first + k] - part_begin) == size
        # Token by token, each text against as many ids of its parts' run (those of the same
        # length only: another's run may end sooner).
        text_of = np.repeat(np.arange(len(multi)), size)
        whole_at, parts_at = ranges(offsets[multi], size), ranges(part_begin, size)
        check = same[text_of]
        differ = ids[whole_at[check]] != ids[parts_at[check]]
        ok = same & (np.bincount(text_of[check], weights=differ, minlength=len(multi)) == 0)
        # Each part's first character in its text, repeated over the part's tokens.
        chars = np.fromiter((len(p) for p in split), dtype=np.int64, count=len(split))
        before = np.cumsum(chars) - chars
        part_start = before - np.repeat(before[first], k)
        region = np.repeat(part_start, np.diff(offsets[n:]))  # the split parts' tokens
        placed = ok[text_of]
        starts[whole_at[placed]] = region[parts_at[placed] - offsets[n]]
        straddled = multi[~ok].tolist()
        if not straddled:
            return ids[: offsets[n]], starts, lengths
        self.straddles += len(straddled)
        pieces = [(ids[offsets[i] : offsets[i + 1]], starts[offsets[i] : offsets[i + 1]])
                  for i in range(n)]  # fmt: skip
        again = self.encode_with_starts([whole[i] for i in straddled])
        for index, (again_ids, again_starts) in zip(straddled, again, strict=True):
            pieces[index] = (np.asarray(again_ids, dtype=np.int64),
                             np.asarray(again_starts, dtype=np.int64))  # fmt: skip
        return (
            np.concatenate([i for i, _ in pieces]),
            np.concatenate([s for _, s in pieces]),
            np.fromiter((len(i) for i, _ in pieces), dtype=np.int64, count=n),
        )

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
        try:
            return jinja.render(
                self.chat_template,
                messages,
                tools,
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


LONG_CHARS = 1 << 20
"""A sample's text longer than this is encoded a chunk at a time (``Tokenizer.encode_long``)."""

CHUNK_CHARS = 1 << 18
"""About how many characters of a long text one chunk holds."""

CONTEXT_CHARS = 256
"""Characters of the text encoded on either side of a chunk, so that its first and last tokens
are those of the whole text."""

CHUNKS_AT_ONCE = 8
"""Chunks encoded in one call (the tokenizer's threads share them)."""

_CUT = re.compile(r"(?<=\S) (?=\S)")
"""Where a long text is cut: before a space between two words."""


def _starts_at(offsets: np.ndarray, index: int, cut: int, length: int) -> bool:
    """A token starts exactly at ``cut`` (``index``: the first token starting at or after it)
    and none before it reaches past it; the text's own start and end need none."""
    if cut in (0, length):
        return True
    found = index < len(offsets) and offsets[index, 0] == cut
    return bool(found and (index == 0 or offsets[index - 1, 1] <= cut))


def load_fast(backend: Any) -> tuple[Any, str | None]:
    """``backend`` (a ``tokenizers.Tokenizer``) as a fastokens tokenizer, or None and why not, in a
    few words (what a fallback or a refusal says). Loaded once per process and tokenizer: the
    driver checks that it loads, then encodes the heads with it (``backends.choose``)."""
    try:
        import fastokens
    except ImportError:
        return None, "is not installed (pip install fastokens)"
    return _from_json(fastokens.Tokenizer, backend.to_str())


@functools.lru_cache(maxsize=2)
def _from_json(kind: Any, definition: str) -> tuple[Any, str | None]:
    try:
        return kind.from_json_str(definition), None
    except Exception as error:  # noqa: BLE001 - whatever it raises on a tokenizer it cannot read
        said = (str(error).strip().splitlines() or [""])[0][:200]
        return None, f"cannot load this tokenizer ({type(error).__name__}: {said})"


def _arrays(encoded: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, ...]:
    """Per-text ``(ids, starts)`` lists as ``encode_parts_flat``'s three arrays."""
    lengths = np.fromiter((len(ids) for ids, _ in encoded), dtype=np.int64, count=len(encoded))
    total = int(lengths.sum())
    ids = np.fromiter(chain.from_iterable(e[0] for e in encoded), dtype=np.int64, count=total)
    starts = np.fromiter(chain.from_iterable(e[1] for e in encoded), dtype=np.int64, count=total)
    return ids, starts, lengths


def _flat(fast: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``texts`` encoded by fastokens in one call: every token id, one text after another, and
    where each text's ids start in them (and, last, their count)."""
    ids, offsets = fast.encode_batch_flat(texts, add_special_tokens=False)
    return np.frombuffer(ids, np.uint32), np.frombuffer(offsets, np.uint64).astype(np.int64)


def _source(path: Path) -> tuple[str, Path | None, Any]:
    """How ``path`` loads: ("json", its tokenizer.json, None), ("sentencepiece", its model file,
    the model), or ("auto", None, None) for ``AutoTokenizer`` (a Hub name, a folder of other
    files).

    Raises:
        ConfigError: a file that is neither JSON nor a SentencePiece model (a tiktoken file).
    """
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return "json", path / "tokenizer.json", None
        model = next((path / n for n in spm.MODEL_FILES if (path / n).is_file()), None)
        if model is None:
            return "auto", None, None
        path = model
    elif not path.is_file():
        return "auto", None, None
    with path.open("rb") as handle:
        if handle.read(64).lstrip()[:1] == b"{":
            return "json", path, None
    proto = spm.read_model(path)
    if proto is None:
        raise spm.unsupported(path)
    return "sentencepiece", path, proto


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
