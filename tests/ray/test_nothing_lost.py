"""Nothing lost quietly (issue #34): each way a run can train on less than the user gave it ends
refused (exit 1, one ``rayjobs:`` line with per-dataset counts) or warned of (a ``rayjobs:
warning:`` line naming the setting to change), through the real CLI on a local Ray.

The files are made from the bundled public data (``configs/data``): the Alpaca demo, the
hh-rlhf chats (given a KTO-style ``label``), the C4 documents (one to a line), and rows that are
not JSON. Rows 1, 2, 3 and 6 of the issue's table are here; the DPO prompt floor (row 4) is
``test_dpo``'s ``FLOOR_SCENARIOS``, at the Tokenize actor that applies it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ALPACA, DATA, GPT2, HH_CHAT
from rayjobs.cli import main

C4 = DATA / "text" / "c4_demo.jsonl"


def _alpaca(tmp: Path) -> dict:
    return {"name": "alpaca", "source": str(ALPACA), "template": "alpaca"}


def _kto(tmp: Path) -> dict:
    """hh-rlhf chats, every other one labelled undesirable, as KTO sets ship them."""
    path = tmp / "kto.jsonl"
    rows = [json.loads(line) for line in HH_CHAT.read_text().splitlines()[:40]]
    path.write_text(
        "".join(json.dumps({**r, "label": i % 2 == 0}) + "\n" for i, r in enumerate(rows))
    )
    return {"name": "kto", "source": str(path), "template": "chat"}


def _kto_ignored(tmp: Path) -> dict:
    return {**_kto(tmp), "ignore_columns": ["label"]}


def _articles(tmp: Path) -> dict:
    """C4 documents, one to a line, no blank line between them: one paragraph under the
    default ``text_split``."""
    path = tmp / "articles.txt"
    documents = [json.loads(line)["text"] for line in C4.read_text().splitlines()]
    path.write_text("".join(" ".join(d.split()) + "\n" for d in documents))
    return {"name": "articles", "source": str(path), "template": "text"}


def _not_json(tmp: Path) -> dict:
    path = tmp / "broken.jsonl"
    path.write_text('{"instruction": "Say hi.", "output": \n' * 5 + "not json at all\n" * 2)
    return {"name": "broken", "source": str(path), "template": "alpaca", "on_bad_row": "skip"}


@dataclass(frozen=True)
class Case:
    id: str
    dataset: object
    """tmp folder → the dataset's config (its file written there)."""
    seq_len: int
    code: int
    said: tuple[str, ...]
    """What stderr holds: the refusal, or the warning."""


CASES = [
    Case(
        "seq_len below every prompt",
        _alpaca, 8, 1,
        ("rayjobs: ", "dataset 'alpaca': ", "samples, 0 trained tokens", "with none left to train"),
    ),
    Case(
        "KTO-style label refused",
        _kto, 1024, 1,
        ("rayjobs: dataset 'kto': column 'label'", "KTO", "ignore_columns: [label]"),
    ),
    Case("KTO-style label ignored on purpose", _kto_ignored, 1024, 0, ()),
    Case(
        "one article a line under text_split: paragraph",
        _articles, 256, 0,
        ("rayjobs: warning: ", "dataset 'articles'", "lost most of their", "text_split: line"),
    ),
    Case(
        "every row skipped",
        _not_json, 64, 1,
        ("rayjobs: dataset 'broken': every row read was bad", "invalid_json 7"),
    ),
]  # fmt: skip


def _config(tmp: Path, spec: dict, seq_len: int) -> str:
    config = tmp / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "datasets": [spec],
                "tokenizer": {"path": str(GPT2)},
                "packing": {"seq_len": seq_len},
                "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
            }
        )
    )
    return str(config)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_nothing_is_lost_quietly(case, tmp_path, capsys, ray_local):
    config = _config(tmp_path, case.dataset(tmp_path), case.seq_len)
    code = main(["export", config, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == case.code, err
    for said in case.said:
        assert said in err
    assert "Traceback" not in err
    if case.code:
        said = [line for line in err.splitlines() if line.startswith("rayjobs: ")]
        progress = [line for line in said if line.startswith("rayjobs: data: ")]
        assert len(said) - len(progress) == 1, err  # the error alone, besides progress lines
    else:
        assert list((tmp_path / "out").rglob("*.parquet"))
        if not case.said:
            assert "rayjobs: warning" not in err


def test_inspect_counts_what_was_lost_and_the_columns_not_read(tmp_path, capsys, ray_local):
    """``inspect`` shows a dataset's samples that lost their tokens and its unread columns, in
    its table's notes and its JSON."""
    spec = _articles(tmp_path)
    rows = [{"text": line, "url": "https://example.com"} for line in
            Path(spec["source"]).read_text().splitlines()]  # fmt: skip
    source = tmp_path / "articles.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = {"name": "articles", "source": str(source), "template": "text"}
    assert main(["inspect", _config(tmp_path, spec, 256), "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out.splitlines()[-1])["datasets"]["articles"]
    assert stats["samples"] == len(rows) == 60  # guard: one sample a row
    cut = stats["samples_mostly_truncated"]
    assert 0 < cut < len(rows)  # guard: some documents are longer than twice seq_len, not all
    said = f"articles: 0 samples with no token left to train, {cut} that lost most of their"
    assert said in out
    assert "articles: columns its template does not read: ['url']" in out
