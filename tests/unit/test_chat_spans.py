"""The chat template's turn boundaries found from short windows (``templates.spans``) against
rendering every prefix (the definition, ``spans.prefix_bounds``): the same segments on every
bundled and tested conversation under every tested chat template, in renders linear in turns;
and per-turn training control (``train``, ``weight``, ``train_on``, ``train_on_eos``)."""

from __future__ import annotations

import json
import re

import pytest
from test_tokenize import JINJA_TEMPLATE, MISTRAL_LIKE, TOOL_TEMPLATE

from conftest import DATA
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data import templates
from rayjobs.data.samples import encode_segments
from rayjobs.data.sources import record_table
from rayjobs.data.templates import RowError, Segment, dialogue, spans
from rayjobs.data.tokenize import Tokenize
from rayjobs.data.tokenizer import Tokenizer

ROUNDS = (  # numbers its rounds: a window renders other numbers, so prefixes are rendered
    "{% for m in messages %}[Round {{ loop.index }}] {{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[Round {{ messages | length + 1 }}] assistant: {% endif %}"
)
ALTERNATING = (  # Llama 2's check: roles alternate from a user turn, after a system turn or not
    "{% if messages and messages[0].role == 'system' %}{% set rest = messages[1:] %}<<SYS>>"
    "{{ messages[0].content }}<</SYS>>{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}{% if m.role == 'user' %}"
    "[INST] {{ m.content }} [/INST]{% else %} {{ m.content }} </s>{% endif %}{% endfor %}"
)


def chat_rows() -> list[dict]:
    """Every bundled conversation, and a few of tools beside a system turn or none."""
    rows = [json.loads(line) for line in (DATA / "chat/hh_rlhf_harmless_chosen.messages.jsonl")
            .read_text().splitlines()]  # fmt: skip
    rows += json.loads((DATA / "chat/glaive_toolcall.sharegpt.json").read_text())
    rows += [json.loads(line) for line in (DATA / "eval/hh_rlhf_harmless_chosen.last60.messages"
             ".jsonl").read_text().splitlines()]  # fmt: skip
    tool = {"name": "get_time", "description": "The time", "parameters": {}}
    turns = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Noon."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    rows += [
        {"messages": turns, "tools": [tool]},
        {"messages": [{"role": "system", "content": "Be brief."}, *turns], "tools": [tool]},
        {"messages": [{"role": "assistant", "content": "Hi."}, *turns], "tools": [tool]},
        {"messages": [{"role": "assistant", "content": "Hi."}, *turns]},
        {"messages": turns, "system": "Be brief.", "tools": json.dumps([tool])},
        {"messages": [*turns, {"role": "user", "content": "Bye."}]},
    ]
    return rows


def _counting(render):
    """``render`` and the number of messages each call rendered."""
    sizes: list[int] = []

    def counted(messages, add_generation_prompt, *tools):
        sizes.append(len(messages))
        return render(messages, add_generation_prompt, *tools)

    return counted, sizes


@pytest.fixture(scope="module")
def renderers() -> dict[str, object]:
    """ChatML, and the gpt2 tokenizer rendering each tested chat template."""
    gpt2_path = str(DATA / "tokenizers/gpt2")
    found = {"chatml": templates.chatml}
    for name, template in [("jinja", JINJA_TEMPLATE), ("mistral", MISTRAL_LIKE),
                           ("tools", TOOL_TEMPLATE), ("rounds", ROUNDS),
                           ("alternating", ALTERNATING)]:  # fmt: skip
        found[name] = Tokenizer(TokenizerConfig(path=gpt2_path, chat_template=template)).render_chat
    return found


@pytest.mark.parametrize("name", ["chatml", "jinja", "mistral", "tools", "rounds", "alternating"])
def test_windows_find_the_prefix_boundaries_on_every_tested_chat(name, renderers, monkeypatch):
    """The same segments (or the same bad row) as rendering every prefix, on every bundled
    conversation; templates that allow windows never render a conversation of more than a few
    turns but once, and the ones that do not (round numbers, a window refused) fall back."""
    render = renderers[name]
    fast, slow, long_renders, compared = [], [], 0, 0
    for row in chat_rows():
        counted, sizes = _counting(render)
        try:
            fast = templates.chat(row, {}, counted)
        except RowError as error:
            fast = error
        with monkeypatch.context() as patched:
            patched.setattr(dialogue, "turn_bounds", spans.prefix_bounds)
            try:
                slow = templates.chat(row, {}, render)
            except RowError as error:
                slow = error
        if isinstance(slow, RowError):
            assert isinstance(fast, RowError) and (fast.reason, fast.field) == (
                slow.reason,
                slow.field,
            )
            continue
        assert fast == slow
        compared += 1
        long_renders += sum(size > 2 * spans.BEFORE + 2 for size in sizes) > 1
    assert compared > 150
    if name == "rounds":
        assert long_renders > 100  # the fallback: every prefix rendered
    else:
        assert long_renders == 0


def _turns(n: int) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": f"turn {i} " + "w " * (i % 7)} for i in range(n)]


@pytest.mark.parametrize("name", ["chatml", "jinja"])
def test_a_long_chat_renders_in_work_linear_in_turns(name, renderers):
    """Twice the turns, twice the messages rendered (prefix by prefix it was four times)."""
    work = []
    for n in (400, 800):
        counted, sizes = _counting(renderers[name])
        segments = templates.chat({"messages": _turns(n)}, {}, counted)
        assert sum(s.trainable for s in segments) == n // 2
        work.append(sum(sizes))
    assert work[1] <= 2.05 * work[0]
    assert work[1] < 20 * 800


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now"},
]


def _with(index: int, **flags) -> list[dict]:
    turns = [dict(turn) for turn in CHAT]
    turns[index].update(flags)
    return turns


def _trained(segments: list[Segment]) -> list[str]:
    return [s.text for s in segments if s.trainable]


# turns, train_on, the texts trained (ChatML: each assistant turn with its end-of-turn marker).
PER_TURN = {
    "all": (CHAT, "all_assistant", ["Hello<|im_end|>\n", "Bye now<|im_end|>\n"]),
    "last_only": (CHAT, "last_assistant", ["Bye now<|im_end|>\n"]),
    "weight_0": (_with(2, weight=0), "all_assistant", ["Bye now<|im_end|>\n"]),
    "weight_0_last": (_with(4, weight=0), "all_assistant", ["Hello<|im_end|>\n"]),
    "train_false": (_with(2, train=False), "all_assistant", ["Bye now<|im_end|>\n"]),
    "train_true_beats_last_only": (
        _with(2, train=True),
        "last_assistant",
        ["Hello<|im_end|>\n", "Bye now<|im_end|>\n"],
    ),
    "weight_1_beats_last_only": (
        _with(2, weight=1.0),
        "last_assistant",
        ["Hello<|im_end|>\n", "Bye now<|im_end|>\n"],
    ),
    "untrained_user_flag_is_no_op": (
        _with(1, train=False),
        "all_assistant",
        ["Hello<|im_end|>\n", "Bye now<|im_end|>\n"],
    ),  # fmt: skip
}


@pytest.mark.parametrize("turns, train_on, expected", PER_TURN.values(), ids=PER_TURN)
def test_per_turn_control(turns, train_on, expected):
    columns = templates.Columns(train_on=train_on)
    segments = templates.chat({"messages": turns}, columns, templates.chatml)
    assert _trained(segments) == expected
    assert "".join(s.text for s in segments) == templates.chatml(
        [{k: v for k, v in t.items() if k in ("role", "content")} for t in turns], False
    )


# turns, the field at fault, reason, what the problem says.
BAD_FLAGS = {
    "weight_half": (_with(2, weight=0.5), "messages[2]", "wrong_type", "0 or 1"),
    "weight_bool": (_with(2, weight=True), "messages[2]", "wrong_type", "0 or 1"),
    "train_text": (_with(2, train="no"), "messages[2]", "wrong_type", "true or false"),
    "disagree": (_with(2, train=True, weight=0), "messages[2]", "wrong_type", "disagree"),
    "user_trained": (_with(1, train=True), "messages[1]", "wrong_type", "only assistant"),
    "axolotl_training": (_with(2, training=False), "messages[2]", "unknown_turn_key", "'training'"),
    "train_detail": (_with(4, train_detail=[]), "messages[4]", "unknown_turn_key", "train_detail"),
}


@pytest.mark.parametrize("turns, field, reason, problem", BAD_FLAGS.values(), ids=BAD_FLAGS)
def test_a_bad_turn_flag_is_a_bad_row(turns, field, reason, problem):
    with pytest.raises(RowError, match=re.escape(problem)) as caught:
        templates.chat({"messages": turns}, {}, templates.chatml)
    assert (caught.value.field, caught.value.reason) == (field, reason)


def _eos_trained(chat_template: str | None, train_on_eos: str) -> tuple[int, int]:
    """A two-answer chat through a Tokenize stage: (EOS tokens, EOS tokens trained)."""
    config = TokenizerConfig(path=str(DATA / "tokenizers/gpt2"), chat_template=chat_template)
    spec = DatasetConfig(name="d", source="unused", template="chat", train_on_eos=train_on_eos)
    batch = record_table("d", ["/x.jsonl"], [1], [json.dumps({"messages": CHAT[1:]})])
    [row] = Tokenize([spec], config, 4096, "truncate")(batch).to_pylist()
    eos = Tokenizer(config).eos_id
    trained = [t for t, label in zip(row["input_ids"][1:], row["labels"][:-1]) if label != -100]
    return row["input_ids"].count(eos), trained.count(eos)


# chat template, train_on_eos, (EOS tokens, EOS tokens trained): Mistral's closes each answer
# with EOS (and opens with BOS, GPT-2's EOS too); ChatML's is the one appended after the last.
EOS_CASES = {
    "mistral_turn": (MISTRAL_LIKE, "turn", (3, 2)),
    "mistral_last": (MISTRAL_LIKE, "last", (3, 1)),
    "mistral_none": (MISTRAL_LIKE, "none", (3, 0)),
    "chatml_turn": (None, "turn", (1, 1)),
    "chatml_last": (None, "last", (1, 1)),
    "chatml_none": (None, "none", (1, 0)),
}


@pytest.mark.parametrize("chat_template, train_on_eos, expected", EOS_CASES.values(),
                         ids=EOS_CASES)  # fmt: skip
def test_train_on_eos(chat_template, train_on_eos, expected):
    assert _eos_trained(chat_template, train_on_eos) == expected


def test_train_on_eos_row_by_row_as_in_the_batch():
    """``samples.encode_segments`` (the reference) untrains the same EOS tokens."""
    segments = [Segment("Q", False), Segment("A<|endoftext|>", True), Segment("B", True)]
    ids, starts = [48, 32, 50256, 33], [0, 1, 2, 15]
    for mode, trained in [("turn", 2), ("last", 1), ("none", 0)]:
        input_ids, labels = encode_segments(segments, ids, starts, 50256, False, False, mode)
        assert int((labels == 50256).sum()) == trained


def test_train_on_needs_a_template_of_turns():
    with pytest.raises(ValueError, match="train_on apply to templates that read conversation"):
        DatasetConfig(name="d", source="x", template="alpaca", train_on="last_assistant")
    assert DatasetConfig(name="d", source="x", template="chat").columns.train_on == "all_assistant"


# A chat template's bombs: what each builds, and what the bounded sandbox says of it.
BOMBS = {
    "repeat": ("{{ 'x' * 10**8 }}", "repeats 1 items 100000000 times"),
    "repeat_list": ("{{ ([1] * 10**7) | length }}", "repeats 1 items 10000000 times"),
    "power": ("{{ 10 ** (10 ** 8) }}", "to the power 100000000"),
    "joined": (
        "{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "joins 2097152 items",
    ),  # fmt: skip
    "output": ("{% for i in range(3000) %}{{ 'y' * 1000 }}{% endfor %}", "rendered over"),
}


@pytest.mark.parametrize("template, problem", BOMBS.values(), ids=BOMBS)
def test_a_chat_template_cannot_build_without_bound(template, problem):
    render = Tokenizer(TokenizerConfig(path=str(DATA / "tokenizers/gpt2"), chat_template=template))
    with pytest.raises(RowError, match="RenderLimitError.*" + re.escape(problem)) as caught:
        render.render_chat(CHAT, False)
    assert caught.value.reason == "template_error"
