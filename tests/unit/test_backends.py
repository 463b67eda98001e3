"""tokenizer.backend: fastokens against tokenizers on every bundled set (the same ids, the same
samples), the straddling token left to tokenizers' offsets, and how ``auto`` is decided once and
``fastokens`` refused (rayjobs.data.backends)."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from conftest import ALPACA, DATA, GPT2, ROOT
from rayjobs.cli import main
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.data import backends
from rayjobs.data import tokenizer as tokenizer_module
from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.estimate import _head
from rayjobs.data.samples import Fit, Templated, encode_samples
from rayjobs.data.sources import record_table
from rayjobs.data.templates import Segment
from rayjobs.data.tokenize import Tokenize
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.job.pipeline import load_tokenizer
from rayjobs.job.report import tokenizer_line

SPM_BPE = DATA / "tokenizers" / "sentencepiece" / "botchan_bpe"

SFT_SETS = [
    ("alpaca", "sft/alpaca_en_demo.json", "alpaca", {}),
    ("gpteacher", "sft/gpteacher_roleplay.json", "alpaca", {"column_map": {"output": "response"}}),
    ("hh_chat", "chat/hh_rlhf_harmless_chosen.messages.jsonl", "chat", {}),
    ("glaive", "chat/glaive_toolcall.sharegpt.json", "chat", {}),
    ("alpaca_eval", "eval/alpaca_en_demo.last60.json", "alpaca", {}),
    ("hh_chat_eval", "eval/hh_rlhf_harmless_chosen.last60.messages.jsonl", "chat", {}),
    ("shakespeare", "text/tinyshakespeare.txt", "text", {}),
    ("c4", "text/c4_demo.jsonl", "text", {}),
]
DPO_SETS = [
    ("dpo", "dpo/hh_rlhf_harmless.dpo.jsonl", "preference", {}),
    ("dpo_eval", "eval/hh_rlhf_harmless.last40.dpo.jsonl", "preference", {}),
]
DEMO_SETS = [
    ("stdlib_alpaca", "../demo/alpaca.jsonl", "alpaca", {}),
    ("stdlib_chat", "../demo/chat.jsonl", "chat", {}),
]
BUNDLED = {  # every data file under configs/data, and the demo's, with a tokenizer fastokens loads
    "sft_gpt2": (SFT_SETS, GPT2, {}),
    "dpo_gpt2": (DPO_SETS, GPT2, {"task": "dpo"}),
    "demo": (
        DEMO_SETS,
        ROOT / "configs" / "demo" / "tokenizer.json",
        {"tokenizer": {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}},
    ),
}


def _config(sets, path, backend="auto", tokenizer=None, **extra):
    raw = {
        "datasets": [
            {"name": n, "source": str(DATA / p), "template": t, "on_bad_row": "skip", **kw}
            for n, p, t, kw in sets
        ],
        "packing": {"seq_len": 2048},
        **extra,
    }
    raw["tokenizer"] = {**(tokenizer or {}), "path": str(path), "backend": backend}
    return config_from_dict(raw, base_dir=ROOT)


def _stages(config):
    return {
        backend: Tokenize(
            config.datasets,
            config.tokenizer.model_copy(update={"backend": backend}),
            config.packing.seq_len,
            config.packing.overflow,
        )
        for backend in ("tokenizers", "fastokens")
    }


@pytest.mark.parametrize("name", list(BUNDLED))
def test_both_backends_give_the_same_ids_and_samples_on_every_bundled_set(name):
    sets, path, extra = BUNDLED[name]
    config = _config(sets, path, **extra)
    stages = _stages(config)
    fast = stages["fastokens"].tokenizer
    assert fast.encoder == "fastokens" and fast.fast is not None, "guard: fastokens encodes"
    assert stages["tokenizers"].tokenizer.fast is None, "guard: the reference is tokenizers"
    rows = 0
    for spec in config.datasets:
        head = _head(spec, None, 10**6).table  # the whole file
        texts = stages["tokenizers"].texts(head)
        ours, theirs = (stages[b].tokenizer.encode_batch(texts) for b in stages)
        assert len(texts) >= head.num_rows // 2 and ours == theirs, spec.name
        reference, table = (stages[b].counted(head)[0] for b in stages)
        assert reference.num_rows > 0 and table.equals(reference), spec.name
        if spec.template in ("alpaca", "chat"):  # guard: prompts and responses, placed by parts
            labels = np.concatenate(reference.column("labels").to_numpy(zero_copy_only=False))
            assert 0.1 < (labels == -100).mean() < 0.9, spec.name
        rows += head.num_rows
    # the samples came from fastokens' ids: few texts (none here) fell back to tokenizers
    assert fast.straddles < rows // 100, "guard: most texts placed by parts alone"


class Spec:
    name = "d"
    train_on_input = False


def _straddling_sft(tokenizer):
    """A prompt ending with a space before a number: GPT-2 encodes " 4" as one token, which
    starts in the prompt and ends in the response."""
    segments = [Segment("What is 2+2? ", False), Segment("4", True)]
    counts = {"d": TokenizeCounts()}
    columns, _ = encode_samples(
        tokenizer, [Templated(0, Spec(), "d\x00f\x001", segments)], counts, Fit(64, "truncate")
    )
    return columns["input_ids"].to_pylist(), columns["labels"].to_pylist()


def test_a_token_straddling_a_trained_part_is_placed_by_tokenizers_offsets():
    reference = Tokenizer(_config(SFT_SETS[:1], GPT2, "tokenizers").tokenizer)
    fast = Tokenizer(_config(SFT_SETS[:1], GPT2, "fastokens").tokenizer)
    expected = _straddling_sft(reference)
    assert 604 in expected[0][0], "guard: GPT-2's ' 4' (604), one token across the parts"
    assert _straddling_sft(fast) == expected
    assert (fast.straddles, reference.straddles) == (1, 0)  # kept, where it happened
    # preference data: each response after a prompt ending in a space, the same way
    config = _config(DPO_SETS, GPT2, task="dpo")
    record = '{"prompt": "What is 2+2? ", "chosen": "4", "rejected": "5"}'
    batch = record_table("dpo", ["/f.jsonl"], [1], [record])
    stages = _stages(config)
    (ours, our_counts), (theirs, their_counts) = (stages[b].counted(batch) for b in stages)
    assert theirs.equals(ours) and ours.num_rows == 1
    assert (
        our_counts["dpo"].responses_tokenized_alone
        == 2
        == their_counts["dpo"].responses_tokenized_alone
    )
    assert stages["fastokens"].tokenizer.straddles == 2
    # and the decision reports them: the head's straddles, in the summary's tokenizer
    _, choice = backends.choose(config, stages["tokenizers"].tokenizer, {"dpo": batch})
    assert (choice.backend, choice.rows, choice.straddles) == ("fastokens", 1, 2)
    assert "2 text(s) placed by tokenizers' offsets" in choice.reason


def test_a_batch_of_mixed_texts_places_every_token_in_the_part_it_starts_in():
    """``encode_parts_flat`` over one batch: texts of no part, one part, parts that tokenize
    alike alone and whole, and one whose token straddles its parts (GPT-2's " 4"). fastokens'
    ids are tokenizers' ids, text by text, and each token's offset lies in the part that
    tokenizers' own offset for it lies in; only the straddling text is encoded again."""
    reference = Tokenizer(_config(SFT_SETS[:1], GPT2, "tokenizers").tokenizer)
    fast = Tokenizer(_config(SFT_SETS[:1], GPT2, "fastokens").tokenizer)
    texts = [
        [],
        ["Hello there."],
        ["Q: what is two and two?\n", "A: four."],
        ["What is 2+2? ", "4", " and more"],
        ["", "one", ""],
        ["Name three colours.\n", "Red, green", " and blue."],
    ]
    ids, starts, lengths = fast.encode_parts_flat(texts)
    assert fast.straddles == 1  # guard: the " 4" text went to tokenizers, no other
    assert lengths.tolist() == [len(e[0]) for e in reference.encode_with_starts(
        ["".join(t) for t in texts])]  # fmt: skip
    at = 0
    for parts, (want_ids, want_starts) in zip(
        texts, reference.encode_with_starts(["".join(t) for t in texts]), strict=True
    ):
        got_ids, got_starts = ids[at : at + len(want_ids)], starts[at : at + len(want_ids)]
        at += len(want_ids)
        assert got_ids.tolist() == want_ids
        ends = np.cumsum([len(p) for p in parts])  # each offset's part: where it sorts in them
        assert (
            np.searchsorted(ends, got_starts, side="right").tolist()
            == np.searchsorted(ends, want_starts, side="right").tolist()
        ), parts
    assert at == len(ids) == len(starts)
    assert fast.encode_parts(texts) == [
        (i.tolist(), s.tolist()) for i, s in zip(
            np.split(ids, np.cumsum(lengths)[:-1]), np.split(starts, np.cumsum(lengths)[:-1]),
            strict=True)
    ]  # fmt: skip
    assert fast.encode_parts([]) == [] and len(fast.encode_parts_flat([])[0]) == 0


def _fallback(config, caplog, heads=None):
    with caplog.at_level(logging.WARNING, logger="rayjobs"):
        decided, choice = backends.choose(config, Tokenizer(config.tokenizer), heads)
    assert decided.tokenizer.backend == "tokenizers" == choice.backend
    [record] = [r for r in caplog.records if r.name == "rayjobs"]
    assert record.getMessage() == f"tokenizer.backend auto: using tokenizers ({choice.reason})"
    assert choice.warning == record.getMessage()  # the summary's warnings hold it too
    return choice


def test_auto_falls_back_where_fastokens_cannot_load_a_sentencepiece_model(caplog):
    config = _config(SFT_SETS[:1], SPM_BPE)
    choice = _fallback(config, caplog)
    assert choice.reason.startswith("fastokens cannot load this tokenizer (ValueError: ")
    assert "Precompiled" in choice.reason  # SentencePiece's normalizer, which fastokens lacks
    assert choice.summary() == {
        "backend": "tokenizers",
        "reason": choice.reason,
        "rows": 0,
        "straddles": 0,
    }
    assert tokenizer_line(choice.summary()) == f"tokenizer: encoded by tokenizers ({choice.reason})"
    assert Tokenizer(config.tokenizer).fast is None  # undecided auto encodes with tokenizers


def test_auto_falls_back_where_fastokens_is_not_installed(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastokens", None)  # import fastokens raises ImportError
    choice = _fallback(_config(SFT_SETS[:1], GPT2), caplog)
    assert choice.reason == "fastokens is not installed (pip install fastokens)"


def _other_ids(fast, texts):
    """fastokens' ids with the first token of every text changed: an encoder that disagrees."""
    ids, offsets = _flat(fast, texts)
    ids = ids.copy()
    starts = offsets[:-1][np.diff(offsets) > 0]
    ids[starts] = (ids[starts] + 1) % 50000
    return ids, offsets


_flat = tokenizer_module._flat


def test_auto_falls_back_and_fastokens_is_refused_where_the_samples_differ(caplog, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_flat", _other_ids)
    config = _config(SFT_SETS[:1], GPT2)
    head = {"alpaca": _head(config.datasets[0], None, 8).table}
    choice = _fallback(config, caplog, head)
    assert choice.reason.startswith("fastokens gives other ids than tokenizers for 'Below is")
    assert choice.rows == 8
    explicit = _config(SFT_SETS[:1], GPT2, "fastokens")
    with pytest.raises(ConfigError, match=r"^tokenizer\.backend: fastokens gives other ids"):
        backends.choose(explicit, Tokenizer(explicit.tokenizer), head)


def test_auto_takes_fastokens_and_the_actors_get_the_decision():
    config = _config(SFT_SETS[:1], GPT2)
    head = {"alpaca": _head(config.datasets[0], None, 16).table}
    decided, choice = backends.choose(config, Tokenizer(config.tokenizer), head)
    assert (decided.tokenizer.backend, choice.backend, choice.rows) == (
        "fastokens",
        "fastokens",
        16,
    )
    assert config.tokenizer.backend == "auto"  # the caller's config is left as it was
    assert Tokenize(decided.datasets, decided.tokenizer, 64, "truncate").tokenizer.fast is not None


def test_tokenizers_set_is_taken_without_fastokens(monkeypatch):
    monkeypatch.setattr(backends, "load_fast", pytest.fail)  # never loaded, never compared
    config = _config(SFT_SETS[:1], SPM_BPE, "tokenizers")
    decided, choice = backends.choose(config, Tokenizer(config.tokenizer))
    assert decided is config and choice.backend == "tokenizers"


def test_fastokens_set_where_it_cannot_load_the_tokenizer_is_refused_before_ray(tmp_path, capsys):
    config = _config(SFT_SETS[:1], SPM_BPE, "fastokens")
    with pytest.raises(ConfigError, match=r"^tokenizer\.backend: fastokens cannot load this"):
        load_tokenizer(config)  # what run, export and inspect call before Ray starts
    path = tmp_path / "spm.yaml"
    path.write_text(
        f"datasets: [{{name: alpaca, source: {ALPACA}, template: alpaca}}]\n"
        f"tokenizer: {{path: {SPM_BPE}, backend: fastokens}}\n"
    )
    assert main(["validate", str(path)]) == 2
    assert "tokenizer.backend: fastokens cannot load this tokenizer" in capsys.readouterr().err


def test_validate_says_which_library_would_encode(tmp_path, capsys):
    assert main(["validate", str(ROOT / "configs" / "demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer: encoded by fastokens (fastokens is installed, loads the tokenizer" in out
    path = tmp_path / "spm.yaml"
    path.write_text(
        f"datasets: [{{name: alpaca, source: {ALPACA}, template: alpaca}}]\n"
        f"tokenizer: {{path: {SPM_BPE}}}\n"
    )
    assert main(["validate", str(path)]) == 0
    captured = capsys.readouterr()
    assert "tokenizer: encoded by tokenizers (fastokens cannot load this" in captured.out
    assert "tokenizer.backend auto: using tokenizers (fastokens cannot load" in captured.err
