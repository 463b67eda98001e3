"""Hostile rows: a long text encoded a chunk at a time (the same ids as whole, the same samples and
counts through the Tokenize actor, in memory bounded by the chunk), and rows over the limits
(``max_row_bytes``, ``max_depth``, ``max_turns``) as counted bad rows in the parsers."""

from __future__ import annotations

import io
import json

import pytest

from conftest import DATA
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data import flat
from rayjobs.data import tokenizer as tokenizer_module
from rayjobs.data.formats import read_rows
from rayjobs.data.sources import record_table
from rayjobs.data.templates import RowError, chat
from rayjobs.data.tokenize import Tokenize
from rayjobs.data.tokenizer import Tokenizer

TOKENIZERS = [
    "tokenizers/gpt2",
    "tokenizers/sentencepiece/botchan_unigram.model",
    "tokenizers/sentencepiece/botchan_bpe",
]


def _real_texts() -> list[str]:
    alpaca = json.loads((DATA / "sft/alpaca_en_demo.json").read_text())
    c4 = (DATA / "text/c4_demo.jsonl").read_text().splitlines()
    return [
        (DATA / "text/tinyshakespeare.txt").read_text(),
        "\n".join(json.loads(line)["text"] for line in c4),
        "\n\n".join(f"{r['instruction']} {r['output']}" for r in alpaca),
    ]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2,000 characters: a bundled text is many of them."""
    monkeypatch.setattr(tokenizer_module, "CHUNK_CHARS", 2000)


@pytest.mark.parametrize("path", TOKENIZERS)
def test_a_long_text_encodes_by_chunks_to_the_ids_of_the_whole(path, small_chunks, monkeypatch):
    tokenizer = Tokenizer(TokenizerConfig(path=str(DATA / path)))
    texts = _real_texts()
    expected = [tokenizer.encode_with_starts([text])[0] for text in texts]

    def whole(texts):
        raise AssertionError("encoded whole")

    monkeypatch.setattr(tokenizer, "encode_with_starts", whole)  # the chunks must line up
    for text, (ids, starts) in zip(texts, expected, strict=True):
        got, got_starts, total = tokenizer.encode_long(text)
        assert (got.tolist(), got_starts.tolist(), total) == (ids, starts, len(ids))
        kept, kept_starts, total = tokenizer.encode_long(text, keep=700)
        assert (kept.tolist(), kept_starts.tolist(), total) == (ids[:700], starts[:700], len(ids))
        assert len(ids) > 30_000


def test_a_text_without_a_cut_is_encoded_whole(small_chunks):
    tokenizer = Tokenizer(TokenizerConfig(path=str(DATA / "tokenizers/gpt2")))
    text = "x" * 9000 + " y"  # no space between two words before the end
    ids, starts = tokenizer.encode_with_starts([text])[0]
    got, got_starts, total = tokenizer.encode_long(text, keep=3)
    assert (got.tolist(), got_starts.tolist(), total) == (ids[:3], starts[:3], len(ids))


def _samples(overflow: str, records: list[dict], template: str) -> tuple[list[dict], dict]:
    spec = DatasetConfig(name="d", source="unused", template=template)
    config = TokenizerConfig(path=str(DATA / "tokenizers/gpt2"))
    batch = record_table(
        "d", ["/x.jsonl"] * len(records), list(range(1, len(records) + 1)),
        [json.dumps(r) for r in records],
    )  # fmt: skip
    table, counts = Tokenize([spec], config, 512, overflow).counted(batch)
    return table.to_pylist(), vars(counts["d"])


def _counted(monkeypatch, owner, name) -> list[int]:
    """``owner.name`` counting its calls (in the returned list)."""
    taken: list[int] = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: taken.append(1) or original(*a))
    return taken


@pytest.mark.parametrize("overflow", ["truncate", "split", "drop"])
def test_long_rows_give_the_samples_and_counts_of_whole_encoding(
    overflow, small_chunks, monkeypatch
):
    """A batch of short and long rows (alpaca, text) through the Tokenize actor: the samples and
    every count as when each text is encoded whole."""
    shakespeare = (DATA / "text/tinyshakespeare.txt").read_text()
    for template, records in [
        ("alpaca", [{"instruction": "Say hi.", "output": "Hi!"},
                    {"instruction": "Recite.", "output": shakespeare[:60_000]},
                    {"instruction": shakespeare[:30_000], "output": shakespeare[-20_000:]}]),
        ("text", [{"text": "Short."}, {"text": shakespeare}]),
        ("text", [{"text": shakespeare}]),  # long rows alone
    ]:  # fmt: skip
        monkeypatch.setattr(flat, "LONG_CHARS", 10**9)
        expected = _samples(overflow, records, template)
        monkeypatch.setattr(flat, "LONG_CHARS", 10_000)
        with monkeypatch.context() as patched:
            taken = _counted(patched, Tokenizer, "encode_long")
            got = _samples(overflow, records, template)
        for table in (expected, got):
            table[1].pop("seconds"), table[1].pop("cpu_seconds")
        assert got == expected and taken, template
        assert expected[1]["truncated_tokens" if overflow == "truncate" else "rows"] > 0


def _parsed(data: bytes, fmt: str, **options) -> tuple[list[int], list[tuple[int, str, str]]]:
    rows, bad = [], []
    parts = read_rows(io.BytesIO(data), "/x", format=fmt, dataset="d", on_bad_row="skip",
                      chunk_bytes=64, **options)  # fmt: skip
    for part in parts:
        rows += part.rows
        bad += [(b.row, b.reason, b.detail) for b in part.bad]
    return rows, bad


DEEP = b'{"text": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
LINE = b'{"text": "' + b"w " * 200 + b'"}'

# data, format, options, good rows, bad rows (row, reason, problem)
LIMITS = {
    "jsonl_deeper_than_python_parses": (
        b'{"text": "a"}\n' + DEEP + b'\n{"text": "b"}\n', "jsonl", {},
        [1, 3], [(2, "too_deep", "line 2 is nested 50001 levels, over max_depth (100)")],
    ),
    "jsonl_over_max_depth": (
        b'{"text": "a", "x": [[[[1]]]]}\n{"text": "[[[[["}\n', "jsonl", {"max_depth": 3},
        [2], [(1, "too_deep", "line 1 is nested 5 levels, over max_depth (3)")],
    ),
    "jsonl_over_max_row_bytes": (
        b'{"text": "a"}\n' + LINE + b'\n{"text": "b"}', "jsonl", {"max_row_bytes": 300},
        [1, 3], [(2, "too_large", "line 2 is 412 bytes, over max_row_bytes (300)")],
    ),
    "text_file_without_newline": (
        b"word " * 100, "text", {"max_row_bytes": 300},
        [], [(1, "too_large", "the document from line 1 is over max_row_bytes (300)")],
    ),
    "text_paragraph_of_many_lines": (
        b"a\n\n" + b"word word\n" * 40 + b"\nb\n", "text", {"max_row_bytes": 300},
        [1, 44], [(3, "too_large", "the document from line 3 is over max_row_bytes (300)")],
    ),
    "text_lines": (
        b"a\n" + b"w" * 400 + b"\nb\n", "text", {"max_row_bytes": 300, "text_split": "line"},
        [1, 3], [(2, "too_large", "the document from line 2 is over max_row_bytes (300)")],
    ),
    "text_whole_file": (
        b"w" * 400, "text", {"max_row_bytes": 300, "text_split": "file"},
        [], [(1, "too_large", "the file is 400 bytes, over max_row_bytes (300)")],
    ),
    "under_the_limits": (
        b"a\n" + b"w" * 300 + b"\n", "text", {"max_row_bytes": 300, "text_split": "line"},
        [1, 2], [],
    ),
}  # fmt: skip


@pytest.mark.parametrize("data, fmt, options, good, bad", LIMITS.values(), ids=LIMITS)
def test_rows_over_the_limits_are_counted_bad_rows(data, fmt, options, good, bad):
    assert _parsed(data, fmt, **options) == (good, bad)


def test_a_conversation_over_max_turns_is_a_bad_row():
    turns = [{"role": ["user", "assistant"][i % 2], "content": "hi"} for i in range(12)]
    columns = DatasetConfig(name="d", source="x", template="chat", max_turns=10).columns
    with pytest.raises(RowError, match=r"12 turns, over max_turns \(10\)") as caught:
        chat({"messages": turns}, columns)
    assert caught.value.reason == "too_many_turns"
    assert len(chat({"messages": turns[:10]}, columns)) == 10
