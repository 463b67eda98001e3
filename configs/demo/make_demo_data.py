"""Regenerate the offline demo data and tokenizer in ``configs/demo/``.

The ``rayjobs run configs/demo.yaml`` demo must work on a fresh machine with
no network access and no external data sets or model downloads.  This script
builds everything the demo needs from text that ships with CPython itself:
the docstrings of a fixed list of well-known, stable standard-library
modules.

It writes, next to this file:

``alpaca.jsonl``
    ~600 instruction-tuning rows ``{"instruction", "input", "output"}``.
    Most rows have an empty ``input`` ("Explain what `json.dumps` does." ->
    the docstring); some have a non-empty one ("Summarize this
    documentation.", "Name the function this docstring documents.").
    Outputs range from a handful of tokens to a few hundred.

``chat.jsonl``
    ~300 multi-turn chat rows ``{"messages": [{"role", "content"}, ...]}``
    with 2-3 user/assistant exchanges each (a third of them start with a
    ``system`` message): the user asks about a module, then about one or two
    of its functions/classes, and the assistant answers with the docstrings.

``tokenizer.json``
    A byte-level BPE (``tokenizers`` library) trained on the text of the two
    files above plus the Zen of Python: vocab size 4096, special tokens
    ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2) and
    ``<|pad|>`` (3), ByteLevel pre-tokenizer (``add_prefix_space=False``) and
    ByteLevel decoder, so ``decode(encode(x).ids) == x`` for any string.
    Load it with ``tokenizers.Tokenizer.from_file``.

The outputs are committed to the repository, so users never need to run this
script; it is kept so the files can be audited and rebuilt.  Usage::

    python configs/demo/make_demo_data.py

Generation is deterministic: modules, names and class members are iterated in
sorted order, row templates are chosen from a SHA-1 of the qualified name (not
``hash()``, which is salted per process), there is no randomness, and BPE
training runs single-threaded.  Docstrings differ between Python versions and
platforms (``os.path`` is ``posixpath`` on Linux); the committed files were
generated with CPython 3.11.7 on Linux and ``tokenizers`` 0.23.3, and running
the script twice there gives byte-identical files.  Other versions produce
valid but slightly different files; the script prints a warning then.
"""

from __future__ import annotations

import os

# Single-threaded BPE training so merge ties are always resolved the same way.
# (With tokenizers 0.23.3, multi-threaded training also gave identical bytes in
# our checks; this is belt and braces.)  Set before ``tokenizers`` is imported,
# which sizes its thread pool from these variables.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent
GENERATED_WITH = (3, 11, 7)

# Well-known, pure-Python or long-stable modules.  Order matters only for the
# order of rows in the output files.
MODULES = [
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "heapq",
    "html",
    "itertools",
    "json",
    "keyword",
    "logging",
    "math",
    "operator",
    "os.path",
    "pathlib",
    "pprint",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "struct",
    "tempfile",
    "textwrap",
    "urllib.parse",
    "uuid",
    "zlib",
]

N_ALPACA = 600
N_CHAT = 300
MAX_OUTPUT_CHARS = 1200  # cap on any answer / input text
MAX_CHAT_ANSWER_CHARS = 800
MAX_PER_MODULE = 45  # keep e.g. `operator`/`math` from dominating
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


# --------------------------------------------------------------------------
# Docstring harvesting
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    module: str
    qualname: str  # e.g. "json.dumps", "collections.Counter.most_common"
    kind: str  # "function" | "class" | "method"
    paragraphs: tuple  # whitespace-normalized docstring paragraphs


def stable_hash(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:12], 16)


def paragraphs_of(doc) -> tuple:
    """Split a docstring into paragraphs with whitespace collapsed."""
    if not isinstance(doc, str):
        return ()
    doc = inspect.cleandoc(doc)
    paras = []
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(block.split())
        if text:
            paras.append(text)
    return tuple(paras)


def own_doc(obj):
    """The object's own docstring (never one inherited from a base class)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else None


def public_names(mod) -> list:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in dir(mod) if not n.startswith("_")]
    return sorted(set(names))


def defined_here(obj, mod) -> bool:
    """True unless ``obj`` is clearly a re-export from another public module."""
    owner = getattr(obj, "__module__", None)
    if owner is None or mod.__name__ == owner:
        return True
    if hasattr(mod, "__all__"):  # __all__ states the module's public API
        return True
    # Accept C accelerators (_json, _heapq, ...) and private helpers.
    return owner.lstrip("_").split(".")[0] == mod.__name__.split(".")[0] or owner.startswith("_")


def usable(paras: tuple) -> bool:
    return bool(paras) and len(paras[0]) <= MAX_OUTPUT_CHARS and len(paras[0]) >= 10


def harvest(modname: str) -> tuple:
    """Return (module docstring paragraphs, entries) for one module."""
    mod = importlib.import_module(modname)
    entries = []
    for name in public_names(mod):
        obj = getattr(mod, name, None)
        if obj is None or inspect.ismodule(obj) or not callable(obj):
            continue
        if not defined_here(obj, mod):
            continue
        paras = paragraphs_of(own_doc(obj))
        is_class = inspect.isclass(obj)
        if usable(paras):
            entries.append(
                Entry(modname, f"{modname}.{name}", "class" if is_class else "function", paras)
            )
        if not is_class or issubclass(obj, BaseException):
            continue
        # Public methods defined (and documented) on the class itself.
        for mname in sorted(vars(obj)):
            if mname.startswith("_"):
                continue
            member = vars(obj)[mname]
            if not (inspect.isroutine(member) or isinstance(member, (staticmethod, classmethod))):
                continue
            mparas = paragraphs_of(own_doc(member))
            if usable(mparas):
                entries.append(Entry(modname, f"{modname}.{name}.{mname}", "method", mparas))
    # Balance modules: keep at most MAX_PER_MODULE entries, picked by hash.
    if len(entries) > MAX_PER_MODULE:
        keep = set(sorted(entries, key=lambda e: stable_hash(e.qualname))[:MAX_PER_MODULE])
        entries = [e for e in entries if e in keep]
    return paragraphs_of(mod.__doc__), entries


def clip(paras: tuple, limit: int) -> str:
    """Leading paragraphs joined by blank lines, at most ``limit`` chars
    (the first paragraph is always kept; callers ensure it fits)."""
    out = [paras[0]]
    total = len(paras[0])
    for p in paras[1:]:
        if total + 2 + len(p) > limit:
            break
        out.append(p)
        total += 2 + len(p)
    return "\n\n".join(out)


_SENTENCE = re.compile(r"^(.+?[.!?])(?=\s+[A-Z(`'\"]|\s*$)")


def first_sentence(text: str):
    m = _SENTENCE.match(text)
    return m.group(1) if m else None


# --------------------------------------------------------------------------
# alpaca.jsonl
# --------------------------------------------------------------------------


def alpaca_row(e: Entry) -> dict:
    name = e.qualname.rsplit(".", 1)[-1]
    full = clip(e.paragraphs, MAX_OUTPUT_CHARS)
    sentence = first_sentence(e.paragraphs[0])
    kind = {"function": "function", "class": "class", "method": "method"}[e.kind]
    t = stable_hash("template:" + e.qualname) % 10
    if t in (0, 6) and sentence and len(sentence) < len(full):
        return {"instruction": "Summarize this documentation.", "input": full, "output": sentence}
    if t == 1:
        return {
            "instruction": f"Name the {kind} this docstring documents.",
            "input": full,
            "output": f"`{e.qualname}`",
        }
    if t == 2 and sentence:
        return {
            "instruction": f"Write a one-sentence description of `{e.qualname}`.",
            "input": "",
            "output": sentence,
        }
    if t == 3 and e.kind != "method":
        return {
            "instruction": f"Which standard-library module provides `{name}`?",
            "input": "",
            "output": f"`{name}` is provided by the `{e.module}` module (`import {e.module}`).",
        }
    if t == 4:
        return {"instruction": f"What is `{e.qualname}` used for?", "input": "", "output": full}
    return {"instruction": f"Explain what `{e.qualname}` does.", "input": "", "output": full}


def build_alpaca(harvested: dict) -> list:
    pool = [e for _, entries in harvested.values() for e in entries]
    chosen = set(sorted(pool, key=lambda e: stable_hash(e.qualname))[:N_ALPACA])
    return [alpaca_row(e) for e in pool if e in chosen]  # module order


# --------------------------------------------------------------------------
# chat.jsonl
# --------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a helpful assistant that answers questions about the Python standard library.",
    "You are a concise Python documentation assistant. Answer with the official docstrings.",
    "You explain Python modules and functions to programmers.",
]
MODULE_QUESTIONS = [
    "What is the `{m}` module for?",
    "Can you tell me what Python's `{m}` module does?",
    "I keep seeing `import {m}` in code. What does that module provide?",
    "Give me a short overview of the `{m}` module.",
]
MEMBER_QUESTIONS = [
    "What does `{q}` do?",
    "And `{q}`?",
    "How about `{q}`?",
    "Could you explain `{q}`?",
    "What is `{q}` used for?",
    "Thanks. What about the {kind} `{n}` in that module?",
]


def build_chat(harvested: dict) -> list:
    mods = [
        m
        for m in MODULES
        if harvested[m][0]
        and len(harvested[m][0][0]) <= MAX_CHAT_ANSWER_CHARS
        and len(harvested[m][1]) >= 2
    ]
    pools = {}
    for m in mods:
        pool = [e for e in harvested[m][1] if len(e.paragraphs[0]) <= MAX_CHAT_ANSWER_CHARS]
        pools[m] = sorted(pool, key=lambda e: stable_hash("chat:" + e.qualname))
    rows = []
    for i in range(N_CHAT):
        m = mods[i % len(mods)]
        r = i // len(mods)
        pool = pools[m]
        h = stable_hash(f"chat-row:{i}")
        n_members = 1 + (h % 2)  # 2 or 3 exchanges in total
        messages = []
        if h % 3 == 0:
            messages.append(
                {"role": "system", "content": SYSTEM_PROMPTS[(h // 3) % len(SYSTEM_PROMPTS)]}
            )
        messages.append(
            {
                "role": "user",
                "content": MODULE_QUESTIONS[(h // 7) % len(MODULE_QUESTIONS)].format(m=m),
            }
        )
        messages.append({"role": "assistant", "content": harvested[m][0][0]})
        for k in range(n_members):
            e = pool[(2 * r + k) % len(pool)]
            q = MEMBER_QUESTIONS[(h // 11 + k) % len(MEMBER_QUESTIONS)]
            messages.append(
                {
                    "role": "user",
                    "content": q.format(q=e.qualname, n=e.qualname[len(m) + 1 :], kind=e.kind),
                }
            )
            messages.append(
                {"role": "assistant", "content": clip(e.paragraphs, MAX_CHAT_ANSWER_CHARS)}
            )
        rows.append({"messages": messages})
    return rows


# --------------------------------------------------------------------------
# tokenizer.json
# --------------------------------------------------------------------------


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints
        import this
    return "".join(this.d.get(c, c) for c in this.s)


def training_texts(alpaca: list, chat: list) -> list:
    texts = [zen_of_python()]
    for row in alpaca:
        texts.extend(v for v in (row["instruction"], row["input"], row["output"]) if v)
    for row in chat:
        texts.extend(f"{msg['role']}\n{msg['content']}" for msg in row["messages"])
    return texts


def train_tokenizer(texts: list):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Offsets only; no ids are added and no text is changed.  (The ByteLevel
    # decoder's serialized "add_prefix_space" flag is unused when decoding.)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


# --------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    start = time.perf_counter()
    if sys.version_info[:3] != GENERATED_WITH or platform.system() != "Linux":
        print(
            f"warning: committed files were generated with CPython "
            f"{'.'.join(map(str, GENERATED_WITH))} on Linux; this is "
            f"{platform.python_version()} on {platform.system()}, so docstrings "
            f"(and the output files) may differ.",
            file=sys.stderr,
        )

    harvested = {m: harvest(m) for m in MODULES}
    alpaca = build_alpaca(harvested)
    chat = build_chat(harvested)
    write_jsonl(OUT_DIR / "alpaca.jsonl", alpaca)
    write_jsonl(OUT_DIR / "chat.jsonl", chat)

    tok = train_tokenizer(training_texts(alpaca, chat))
    tok_path = OUT_DIR / "tokenizer.json"
    tok.save(str(tok_path), pretty=False)

    # Sanity checks.
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    probe = "def f(x):\n    return x  # Zen ünïcode ✓"
    assert tok.decode(tok.encode(probe).ids) == probe

    for name in ("alpaca.jsonl", "chat.jsonl", "tokenizer.json"):
        print(f"{name:16s} {(OUT_DIR / name).stat().st_size:>9,d} bytes")
    print(f"alpaca rows: {len(alpaca)} (with input: {sum(1 for r in alpaca if r['input'])})")
    print(
        f"chat rows:   {len(chat)} "
        f"(with system: {sum(1 for r in chat if r['messages'][0]['role'] == 'system')})"
    )
    print(f"vocab size:  {tok.get_vocab_size()}")
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
