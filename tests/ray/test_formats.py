"""The formats of issue #35 end to end: rows made from the bundled public data (configs/data) go
through ``rayjobs export`` on a local Ray, and every document of the exported Parquet trains
exactly the spans it should, read back from its ``labels`` and decoded with the GPT-2 tokenizer.

SFT (one export): TRL's prompt-completion rows as text (from Alpaca) and as conversations (from
the hh-rlhf chats); glaive's ShareGPT rows as they are and with their turns' keys and role names
renamed (``message_keys``, ``roles``: every document comes out twice, identical); Alpaca rows with
a ``history`` turn; a template of the user's own, from a module beside the config that Ray's
workers cannot import. DPO (a second export): hh-rlhf triples as TRL's implicit-prompt rows,
whole texts and whole conversations, the prompt found as what chosen and rejected share.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml
from tokenizers import Tokenizer

from conftest import ALPACA, DATA, GPT2, HH_CHAT, SHAREGPT
from rayjobs.cli import main
from rayjobs.data import templates

EOS = "<|endoftext|>"
END = "<|im_end|>\n"
GPT2_TOKENIZER = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
HH_DPO = DATA / "dpo" / "hh_rlhf_harmless.dpo.jsonl"


def _decode(ids) -> str:
    return GPT2_TOKENIZER.decode([int(i) for i in ids], skip_special_tokens=False)


def _chatml(turns: list[tuple[str, str]], generation_prompt: bool = False) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}{END}" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _fits(*texts: str) -> bool:
    return sum(len(t) for t in texts) < 2500  # well inside seq_len 1024: nothing truncated


# Each builder writes its file and returns (dataset config, {full document text: trained spans}).


def _prompt_completion_text(tmp: Path):
    rows, expected = [], {}
    for row in json.loads(ALPACA.read_text())[:40]:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "") + "\n\n"
        rows.append({"prompt": prompt, "completion": row["output"]})
        expected[prompt + row["output"] + EOS] = [row["output"] + EOS]
    spec = {"name": "pc_text", "source": _write(tmp / "pc_text.jsonl", rows),
            "template": "prompt_completion"}  # fmt: skip
    return spec, expected


def _prompt_completion_chat(tmp: Path):
    rows, expected = [], {}
    for line in HH_CHAT.read_text().splitlines()[:60]:
        turns = json.loads(line)["messages"]
        if turns[-1]["role"] != "assistant" or not _fits(*(t["content"] for t in turns)):
            continue
        rows.append({"prompt": turns[:-1], "completion": turns[-1:]})
        prompt = _chatml([(t["role"], t["content"]) for t in turns[:-1]], True)
        expected[prompt + turns[-1]["content"] + END + EOS] = [turns[-1]["content"] + END + EOS]
    spec = {"name": "pc_chat", "source": _write(tmp / "pc_chat.jsonl", rows),
            "template": "prompt_completion"}  # fmt: skip
    return spec, expected


ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
RENAMED = {"human": "USER", "gpt": "BOT"}


def _glaive_spans(row: dict) -> tuple[str, list[str]]:
    """A glaive row's ChatML text and trained spans (each assistant turn; a call as Hermes'
    ``<tool_call>``), as the chat template lays them out without a chat template."""
    tools = json.loads(row["tools"]) if row.get("tools") else []
    turns, spans = [], []
    for turn in row["conversations"]:
        content = turn["value"]
        if turn["from"] == "function_call":
            call = json.loads(content)
            call = {"name": call["name"], "arguments": call.get("arguments", {})}
            content = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        turns.append((ROLES[turn["from"]], content))
        if ROLES[turn["from"]] == "assistant":
            spans.append(content + END)
    if tools:
        listing = "\n".join(
            json.dumps(t if "function" in t else {"type": "function", "function": t}) for t in tools
        )
        block = (
            "# Tools\n\nYou may call these functions. For each call, write a JSON object with the "
            'function\'s "name" and "arguments" within <tool_call></tool_call> tags.\n'
            f"<tools>\n{listing}\n</tools>"
        )
        turns.insert(0, ("system", block))
    return _chatml(turns) + EOS, [*spans[:-1], spans[-1] + EOS]


def _sharegpt(tmp: Path):
    rows = [r for r in json.loads(SHAREGPT.read_text())[:40]
            if _fits(*(t["value"] for t in r["conversations"]))]  # fmt: skip
    expected = dict(_glaive_spans(row) for row in rows)
    spec = {"name": "glaive", "source": _write(tmp / "glaive.jsonl", rows), "template": "chat"}
    renamed = [
        {"tools": row["tools"], "dialog": [
            {"speaker": RENAMED.get(t["from"], t["from"]), "text": t["value"]}
            for t in row["conversations"]
        ]}
        for row in rows
    ]  # fmt: skip
    mapped = {
        "name": "glaive_mapped", "source": _write(tmp / "glaive_mapped.jsonl", renamed),
        "template": "chat", "column_map": {"conversations": "dialog"},
        "message_keys": {"role": "speaker", "content": "text"},
        "roles": {"USER": "user", "BOT": "assistant"},
    }  # fmt: skip
    return [spec, mapped], expected


def _history(tmp: Path):
    alpaca = json.loads(ALPACA.read_text())
    preamble = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n"
    )
    rows, expected = [], {}
    for before, row in zip(alpaca[100:140], alpaca[101:141]):
        if row["input"] or before["output"] != before["output"].rstrip():
            continue  # whitespace before the untrained "\n\n" would fuse tokens across it
        rows.append({**row, "history": [[before["instruction"], before["output"]]]})
        text = (
            f"{preamble}### Instruction:\n{before['instruction']}\n\n### Response:\n"
            f"{before['output']}\n\n### Instruction:\n{row['instruction']}\n\n### Response:\n"
            f"{row['output']}{EOS}"
        )
        expected[text] = [before["output"], row["output"] + EOS]
    spec = {"name": "history", "source": _write(tmp / "history.jsonl", rows), "template": "alpaca"}
    return spec, expected


TEMPLATE_MODULE = """
from rayjobs.data.templates import Segment, register_template, text_field


@register_template("qa_pair", fields=("question", "answer"))
def qa_pair(row, column_map, render_chat=None):
    question = text_field(row, "question", column_map)
    return [Segment(f"Question: {question}\\nAnswer:", False),
            Segment(" " + text_field(row, "answer", column_map), True)]
"""


def _user_template(tmp: Path):
    (tmp / "formats_e2e_templates.py").write_text(TEMPLATE_MODULE)
    rows, expected = [], {}
    for row in json.loads(ALPACA.read_text())[200:230]:
        rows.append({"q": row["instruction"], "a": row["output"]})
        expected[f"Question: {row['instruction']}\nAnswer: {row['output']}{EOS}"] = [
            f" {row['output']}{EOS}"
        ]
    spec = {"name": "mine", "source": _write(tmp / "qa.jsonl", rows), "template": "qa_pair",
            "column_map": {"question": "q", "answer": "a"}}  # fmt: skip
    return spec, expected


def _export(tmp: Path, raw: dict) -> tuple[list[dict], dict]:
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp / "out"
    assert main(["export", str(config), "--out", str(out)]) == 0
    table = pq.read_table(out / "train")
    rows = [{name: np.asarray(table.column(name)[i].as_py()) for name in table.column_names}
            for i in range(table.num_rows)]  # fmt: skip
    return rows, json.loads((out / "_manifest.json").read_text())


def _documents(row: dict):
    """Each document of a packed row: (its token ids, its labels)."""
    for doc in range(int(row["num_documents"])):
        where = row["document_ids"] == doc
        yield row["input_ids"][where], row["labels"][where]


def _spans(labels: np.ndarray) -> list[str]:
    """The trained tokens (``labels[t]`` is the target at t), decoded run by run."""
    trained = labels != -100
    runs = np.split(
        np.flatnonzero(trained), np.flatnonzero(np.diff(np.flatnonzero(trained)) > 1) + 1
    )
    return [_decode(labels[run]) for run in runs if len(run)]


def test_sft_formats_train_exactly_their_spans(tmp_path, ray_local):
    specs, expected = [], {}
    for build in (_prompt_completion_text, _prompt_completion_chat, _sharegpt, _history,
                  _user_template):  # fmt: skip
        spec, spans = build(tmp_path)
        specs += spec if isinstance(spec, list) else [spec]
        expected.update(spans)
    raw = {
        "template_modules": ["formats_e2e_templates"],
        "datasets": specs,
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": 1024},
        "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
    }
    try:
        rows, manifest = _export(tmp_path, raw)
    finally:  # the user's template leaves the registry with its test
        templates.TEMPLATES.pop("qa_pair", None)
    counts = manifest["datasets"]
    assert {name: c["truncated_tokens"] + c["skipped_rows"] for name, c in counts.items()} == {
        spec["name"]: 0 for spec in specs
    }
    seen = Counter()
    for row in rows:
        for ids, labels in _documents(row):
            text = _decode(ids)
            assert text in expected, text[:300]
            assert _spans(labels) == expected[text], text[:300]
            seen[text] += 1
    samples = {name: c["samples"] for name, c in counts.items()}
    assert sum(seen.values()) == sum(samples.values())
    assert samples["glaive"] == samples["glaive_mapped"] >= 20, samples  # guard: rows of each
    assert min(samples.values()) >= 15, samples
    glaive = {_glaive_spans(r)[0] for r in json.loads(SHAREGPT.read_text())[:40]}
    assert sum(text in seen for text in glaive) == samples["glaive"], "guard: glaive's found"
    assert all(seen[text] == 2 for text in glaive if text in seen)  # original and renamed
    assert any("<tool_call>" in text for text in seen), "guard: calls in the renamed turns"


def _dpo_rows(tmp: Path):
    """hh-rlhf triples whose responses differ from their first letter (so the shared start is the
    prompt itself), as whole texts and as whole conversations (turns split at Human/Assistant)."""
    triples = [json.loads(line) for line in HH_DPO.read_text().splitlines()]
    triples = [
        t for t in triples
        if t["chosen"][:1] == t["rejected"][:1] == " " and t["chosen"][1:2] != t["rejected"][1:2]
        and _fits(t["prompt"], t["chosen"], t["rejected"])
    ][:30]  # fmt: skip
    texts, chats, expected = [], [], {}
    for t in triples:
        texts.append({"chosen": t["prompt"] + t["chosen"], "rejected": t["prompt"] + t["rejected"]})
        expected[t["prompt"]] = (t["chosen"] + EOS, t["rejected"] + EOS)
        parts = re.split(r"\n\n(Human|Assistant):", t["prompt"])[1:]
        turns = [
            {"role": "user" if who == "Human" else "assistant", "content": what.strip()}
            for who, what in zip(parts[::2], parts[1::2])
        ][:-1]  # the last: "Assistant:"
        chats.append({
            name: [*turns, {"role": "assistant", "content": t[name].strip()}]
            for name in ("chosen", "rejected")
        })  # fmt: skip
        prompt = _chatml([(turn["role"], turn["content"]) for turn in turns], True)
        expected[prompt] = tuple(t[n].strip() + END + EOS for n in ("chosen", "rejected"))
    specs = [
        {"name": "implicit_text", "source": _write(tmp / "texts.jsonl", texts),
         "template": "preference"},
        {"name": "implicit_chat", "source": _write(tmp / "chats.jsonl", chats),
         "template": "preference"},
    ]  # fmt: skip
    return specs, expected


def test_implicit_prompt_preference_rows_find_their_prompt(tmp_path, ray_local):
    specs, expected = _dpo_rows(tmp_path)
    raw = {
        "task": "dpo",
        "datasets": specs,
        "tokenizer": {"path": str(GPT2)},
        "packing": {"seq_len": 1024},
        "ray": {"min_actors": 1, "tokenize_concurrency": 1, "pack_concurrency": 1},
    }
    rows, manifest = _export(tmp_path, raw)
    counts = manifest["datasets"]
    assert {n: (c["truncated_tokens"], c["skipped_rows"]) for n, c in counts.items()} == {
        "implicit_text": (0, 0), "implicit_chat": (0, 0)
    }  # fmt: skip
    found = []
    for row in rows:
        roles, documents = row["response_role"], row["document_ids"]
        for triple in range(int(row["num_documents"]) // 3):
            prompt = row["input_ids"][documents == 3 * triple]
            chosen, rejected = (documents == 3 * triple + 1), (documents == 3 * triple + 2)
            assert (roles[chosen] == 1).all() and (roles[rejected] == 2).all()
            text = _decode([*prompt, row["input_ids"][chosen][0]])
            assert text in expected, text[-300:]
            got = ("".join(_spans(row["labels"][chosen])), "".join(_spans(row["labels"][rejected])))
            assert got == expected[text], text[-300:]
            found.append(text)
    assert len(found) == len(set(found)) == sum(c["samples"] for c in counts.values())
    assert min(c["samples"] for c in counts.values()) >= 20, counts  # guard: rows of each
