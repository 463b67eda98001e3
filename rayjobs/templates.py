"""Templates: one raw row → a list of text segments, each marked trainable or not.

A template only decides *what text* a sample is and *which parts are learned*; tokenization and
label shifting happen once, in ``tokenize.py``, which tokenizes a sample's segments as one text and
trains the tokens that start in a trainable segment (see its module note).

- ``alpaca``: the Stanford Alpaca prompt (with or without ``input``) → untrained; ``output`` →
  trained.
- ``chat``: OpenAI ``messages`` ({role, content}) or ShareGPT ``conversations`` ({from, value}),
  rendered by the tokenizer's chat template (or a ChatML layout when it has none). Each assistant
  turn is found by rendering the conversation prefix by prefix: the text added by the assistant
  message is trained, the rest (system, user, tool turns, generation prompts) is not. This works for
  any prefix-stable template without ``{% generation %}`` markers; an unstable one is an error.
- ``text``: the whole ``text`` field, trained.
- ``preference`` (``task: dpo``): a prompt and two responses → a :class:`Preference` of three
  texts instead of segments. The prompt is text (``{prompt, chosen, rejected}``), or turns: a
  ``prompt`` list of messages, or the row's ``messages`` / ShareGPT ``conversations`` (the
  LLaMA-Factory layout: ``conversations`` + ``chosen`` + ``rejected``), rendered by the chat
  template with its generation prompt. A response is text, a message (``{role: assistant,
  content}`` or ``{from: gpt, value}``) or a list of one; with a chat prompt, a response's text is
  what rendering the conversation with that assistant message adds after the generation prompt
  (its end-of-turn marker included), found the way ``chat`` finds assistant turns.

``column_map`` maps a template field to the dataset's column (``{output: response}``). A bad row
raises ``RowError`` naming the field and a reason of ``formats.SKIP_REASONS``; the caller
(``tokenize.Tokenize``) adds dataset, file and row and applies ``on_bad_row``:

- ``missing_field``: a required field absent or null (alpaca ``instruction``/``output``, text
  ``text``, chat ``messages`` or ``conversations``), or a conversation with no assistant turn;
- ``wrong_type``: the row is not an object, a text field is not a string, turns are not a list of
  ``{role, content}`` with a known role and text content, or a turn carries an OpenAI
  ``tool_calls`` / ``function_call``. Design note: turns reach the chat template as role and
  content only, so such a turn would train as an empty assistant turn with its call lost; it is
  refused rather than trained wrong (ShareGPT's ``function_call`` role, whose call is the text,
  is fine);
- ``empty_field``: a required text field that is empty or only whitespace, or an empty list of
  turns. Design note: such a sample trains on nothing but EOS (an empty output) or teaches an
  answer to no question (an empty instruction); Axolotl and TRL users filter them out, so a
  dataset that has them learns that it has them. Optional fields may be empty as before: alpaca
  ``input`` (no ``### Input:`` block then), chat ``system``, and a turn's ``content``;
- ``template_error``: the chat template is not prefix-stable on the row (``Tokenizer.render_chat``
  reports a chat template that raises the same way).

Templates live in the :data:`TEMPLATES` registry, which ``datasets[].template`` is validated
against: a new template is one function ``(row, column_map, render_chat) -> list[Segment]``
decorated with :func:`register_template`, plus its tests. ``render_chat`` is the run tokenizer's
chat rendering; templates that do not render chat ignore it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}

Message = dict[str, str]
TOOL_CALL_KEYS = ("tool_calls", "function_call")
"""OpenAI turn keys holding a function call: a turn that has one is refused (``wrong_type``), as
rendering it from role and content alone would train an empty assistant turn."""
RenderChat = Callable[[list[Message], bool], str]
"""(messages, add_generation_prompt) → rendered text."""


@dataclass(frozen=True)
class Segment:
    text: str
    trainable: bool


class RowError(ValueError):
    """A row cannot be templated; ``field`` names the template field at fault, ``reason`` the
    class of problem (a key of ``formats.SKIP_REASONS``; see module note)."""

    def __init__(self, field: str, problem: str, reason: str = "wrong_type"):
        super().__init__(f"field {field!r}: {problem}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Preference:
    """A preference row's texts: the prompt (never trained) and the chosen and rejected
    responses (``rayjobs.dpo`` lays the three out in a row)."""

    prompt: str
    chosen: str
    rejected: str


Template = Callable[
    [Mapping[str, Any], Mapping[str, str], RenderChat], "list[Segment] | Preference"
]
"""(row, column_map, render_chat) → segments (or a ``Preference`` for the names in
:data:`PREFERENCE_TEMPLATES`)."""

TEMPLATES: dict[str, Template] = {}
"""Templates by name; ``datasets[].template`` must name one."""

TEMPLATE_FIELDS: dict[str, frozenset[str]] = {}
"""The fields each template reads (where it declares them): the keys ``datasets[].column_map``
may have, so a misspelt optional field (``inputs`` for ``input``) is refused, not ignored."""

PREFERENCE_TEMPLATES = frozenset({"preference"})
"""The templates that return a ``Preference``: the ones ``task: dpo`` takes (and ``sft`` does
not)."""


def register_template(
    name: str, fields: tuple[str, ...] | None = None
) -> Callable[[Template], Template]:
    """Decorator: make ``template(row, column_map, render_chat)`` available as ``name``;
    ``fields`` are the fields it reads (the keys ``column_map`` may have; None: not checked)."""

    def register(template: Template) -> Template:
        if name in TEMPLATES:
            raise ValueError(f"template {name!r} is already registered")
        TEMPLATES[name] = template
        if fields is not None:
            TEMPLATE_FIELDS[name] = frozenset(fields)
        return template

    return register


def _shown(name: str, column_map: Mapping[str, str]) -> str:
    column = column_map.get(name, name)
    return name if column == name else f"{name} (column {column!r})"


def _field(
    row: Mapping[str, Any], name: str, column_map: Mapping[str, str], *, required: bool = True
) -> Any:
    if not isinstance(row, Mapping):
        raise RowError(
            name, f"the row is not an object with fields but {type(row).__name__} {row!r:.80}"
        )
    column = column_map.get(name, name)
    value = row.get(column)
    if value is None and required:
        problem = "null" if column in row else f"missing; the row has columns {sorted(row)}"
        raise RowError(_shown(name, column_map), problem, reason="missing_field")
    return value


def _text_field(
    row: Mapping[str, Any], name: str, column_map: Mapping[str, str], *, required: bool = True
) -> str:
    value = _field(row, name, column_map, required=required)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(_shown(name, column_map), f"expected text, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError(_shown(name, column_map), f"empty ({value!r})", reason="empty_field")
    return value


@register_template("alpaca", fields=("instruction", "input", "output"))
def alpaca(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Alpaca instruction / input / output → [prompt (untrained), output (trained)]."""
    instruction = _text_field(row, "instruction", column_map)
    context = _text_field(row, "input", column_map, required=False)
    output = _text_field(row, "output", column_map)
    template = ALPACA_PROMPT_WITH_INPUT if context.strip() else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=context)
    return [Segment(prompt, False), Segment(output, True)]


@register_template("text", fields=("text",))
def text(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Raw text → one trained segment."""
    return [Segment(_text_field(row, "text", column_map), True)]


def chat_messages(row: Mapping[str, Any], column_map: Mapping[str, str]) -> list[Message]:
    """Normalise OpenAI ``messages`` or ShareGPT ``conversations`` to [{role, content}]."""
    messages = _field(row, "messages", column_map, required=False)
    sharegpt = messages is None
    if sharegpt:
        messages = _field(row, "conversations", column_map, required=False)
    if messages is None:
        raise RowError(
            _shown("messages", column_map),
            f"missing (nor {_shown('conversations', column_map)!r}); the row has columns "
            f"{sorted(row)}",
            reason="missing_field",
        )
    field = "conversations" if sharegpt else "messages"
    if not isinstance(messages, list):
        raise RowError(field, f"expected a non-empty list of turns, got {type(messages).__name__}")
    if not messages:
        raise RowError(field, "empty: expected a non-empty list of turns", reason="empty_field")
    normalised: list[Message] = []
    system = row.get(column_map.get("system", "system"))
    if system is not None and not isinstance(system, str):
        raise RowError(_shown("system", column_map), f"expected text, got {type(system).__name__}")
    if system:
        normalised.append({"role": "system", "content": system})
    for turn_index, turn in enumerate(messages):
        role = turn.get("from" if sharegpt else "role") if isinstance(turn, Mapping) else None
        content = (
            turn.get("value" if sharegpt else "content") if isinstance(turn, Mapping) else None
        )
        role = SHAREGPT_ROLES.get(role) if sharegpt else role
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise RowError(
                f"{field}[{turn_index}]",
                f"expected a turn with a known role and text content, got {turn!r:.120}",
            )
        calls = [key for key in TOOL_CALL_KEYS if turn.get(key)]
        if calls:  # the chat template is given role and content only: the call would be lost
            raise RowError(
                f"{field}[{turn_index}]",
                f"the turn carries {calls[0]!r}, which is not trained (turns are rendered from "
                f"role and content only); put the call in content, or skip such rows",
            )
        normalised.append({"role": role, "content": content})
    return normalised


def chatml(messages: list[Message], add_generation_prompt: bool) -> str:
    """The ChatML layout used when the tokenizer has no chat template."""
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return rendered + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _check_prefix(earlier: str, later: str) -> None:
    if not later.startswith(earlier):
        raise RowError(
            "messages",
            "the chat template is not prefix-stable: rendering a longer "
            "conversation changed earlier text; set tokenizer.chat_template",
            reason="template_error",
        )


@register_template("chat", fields=("messages", "conversations", "system"))
def chat(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """A conversation → segments; only the text each assistant message adds is trainable."""
    render = render_chat or chatml
    messages = chat_messages(row, column_map)
    if not any(m["role"] == "assistant" for m in messages):
        field = (
            "messages" if _field(row, "messages", column_map, required=False) else "conversations"
        )
        raise RowError(
            field, "the conversation has no assistant turn to learn from", reason="missing_field"
        )
    segments: list[Segment] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:index], True)
        full = render(messages[: index + 1], False)
        _check_prefix(done, prompt)
        _check_prefix(prompt, full)
        segments += [Segment(prompt[len(done) :], False), Segment(full[len(prompt) :], True)]
        done = full
    whole = render(messages, False)
    _check_prefix(done, whole)
    if whole[len(done) :]:
        segments.append(Segment(whole[len(done) :], False))
    return [s for s in segments if s.text]


def _response(value: Any, name: str, column_map: Mapping[str, str]) -> str:
    """A preference response's text: a string, an assistant message ({role, content} or
    {from, value}) or a list of exactly one."""
    shown = _shown(name, column_map)
    message = value[0] if isinstance(value, list) and len(value) == 1 else value
    if isinstance(message, Mapping):
        sharegpt = "from" in message
        role = message.get("from") if sharegpt else message.get("role")
        role = SHAREGPT_ROLES.get(role) if sharegpt else role
        if role != "assistant":
            raise RowError(shown, f"expected an assistant message, got role {role!r}")
        message = message.get("value" if sharegpt else "content")
    if not isinstance(message, str):
        raise RowError(shown, f"expected text or one assistant message, got {type(value).__name__}")
    if not message.strip():
        raise RowError(shown, f"empty ({message!r})", reason="empty_field")
    return message


@register_template(
    "preference", fields=("prompt", "chosen", "rejected", "messages", "conversations", "system")
)
def preference(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> Preference:
    """A prompt with a chosen and a rejected response → their texts (see module note)."""
    chosen = _response(_field(row, "chosen", column_map), "chosen", column_map)
    rejected = _response(_field(row, "rejected", column_map), "rejected", column_map)
    prompt = _field(row, "prompt", column_map, required=False)
    if isinstance(prompt, str) or (
        prompt is None
        and _field(row, "messages", column_map, required=False) is None
        and _field(row, "conversations", column_map, required=False) is None
    ):
        return Preference(_text_field(row, "prompt", column_map), chosen, rejected)
    if prompt is not None:  # a list of turns under ``prompt``
        turns = {"messages": prompt, "system": row.get(column_map.get("system", "system"))}
        try:
            messages = chat_messages(turns, {})
        except RowError as error:
            raise RowError(
                _shown("prompt", column_map), str(error).split(": ", 1)[1], error.reason
            ) from None
    else:
        messages = chat_messages(row, column_map)
    if messages[-1]["role"] == "assistant":
        raise RowError(
            "prompt",
            "the prompt's last turn is an assistant turn; the responses answer the prompt",
        )
    render = render_chat or chatml
    prompt_text = render(messages, True)
    texts = []
    for reply in (chosen, rejected):
        full = render([*messages, {"role": "assistant", "content": reply}], False)
        _check_prefix(prompt_text, full)
        texts.append(full[len(prompt_text) :])
    return Preference(prompt_text, *texts)
