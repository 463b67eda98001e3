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
  Tool use and reasoning (see "Tool calls" below) reach the template as ``apply_chat_template``
  takes them.
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
  ``{role, content}`` with a known role and text content, or a tool call or ``tools`` list is not
  the shape below (arguments that are not a JSON object, a call without a name);
- ``empty_field``: a required text field that is empty or only whitespace, or an empty list of
  turns. Design note: such a sample trains on nothing but EOS (an empty output) or teaches an
  answer to no question (an empty instruction); Axolotl and TRL users filter them out, so a
  dataset that has them learns that it has them. Optional fields may be empty as before: alpaca
  ``input`` (no ``### Input:`` block then), chat ``system``, and a turn's ``content``;
- ``template_error``: the chat template is not prefix-stable on the row, or it drops the row's
  tools or tool calls (``Tokenizer.render_chat`` reports a chat template that raises the same way).

Tool calls. Function-calling data trains the calls themselves, in the layout the model's chat
template gives them (Llama 3.1's JSON, Qwen's and Hermes' ``<tool_call>`` tags), as TRL and
LLaMA-Factory do:

- an OpenAI assistant turn's ``tool_calls`` (``[{type: function, function: {name, arguments}}]``,
  ``id`` kept; a bare ``{name, arguments}`` is accepted) and the legacy ``function_call`` reach the
  template as ``tool_calls`` with ``arguments`` a JSON object, as transformers' tool-use format
  asks (OpenAI writes them as a JSON string: parsed, since templates such as Llama 3.1's apply
  ``tojson`` and would train a doubly encoded string); ``content`` may then be null;
- a ShareGPT ``function_call`` turn's value is the call as JSON (``{"name", "arguments"}`` or a
  list of them, as in glaive / LLaMA-Factory data) and becomes such an assistant turn;
  ``observation`` / ``tool`` / OpenAI's legacy ``function`` role are tool turns (``name`` and
  ``tool_call_id`` kept), never trained;
- the row's ``tools`` column (a list of JSON schemas, or that list as a JSON string, the
  LLaMA-Factory layout; empty: none) is passed to the template as ``tools``; a bare schema
  ``{name, description, parameters}`` is wrapped as ``{type: function, function: schema}``.

An OpenAI assistant turn's reasoning (``reasoning_content``, ``thinking`` or ``reasoning``: the
names transformers aliases) reaches the template as ``reasoning_content`` and is trained with the
turn (Qwen3 and DeepSeek-R1 templates write it in ``<think>`` tags, as the ChatML layout does).

Design note: a template that ignores ``tools``, ``tool_calls`` or reasoning (most templates
written before them) would train an empty assistant turn, calls to functions the prompt never
defined, or answers without their thinking, so each tool's name must appear in the rendering, and
each call's name and the reasoning's text in what their turn trains: otherwise the row is a
``template_error`` (so is a template that keeps reasoning only after the last user turn, as
Qwen3's does, on a multi-turn row: not prefix-stable). Without a chat template the ChatML layout
writes tools in the system turn and each call as
``<tool_call>\n{"name", "arguments"}\n</tool_call>`` (the Hermes convention Qwen also uses).

Templates live in the :data:`TEMPLATES` registry, which ``datasets[].template`` is validated
against: a new template is one function ``(row, column_map, render_chat) -> list[Segment]``
decorated with :func:`register_template`, plus its tests. ``render_chat`` is the run tokenizer's
chat rendering; templates that do not render chat ignore it.
"""

from __future__ import annotations

import json
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

OPENAI_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
"""OpenAI roles (``function``: the legacy role of a function's result) → the roles templates see."""

Message = dict[str, Any]
"""A turn as the chat template sees it: ``role``, ``content`` and, where the data has them,
``tool_calls`` and ``reasoning_content`` (assistant), ``name`` and ``tool_call_id`` (tool)."""
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""An OpenAI assistant turn's reasoning, under the names transformers aliases (the first set is
used); it reaches the template as ``reasoning_content``."""
Tool = dict[str, Any]
RenderChat = Callable[..., str]
"""(messages, add_generation_prompt, tools=None) → rendered text; ``tools`` is the row's list of
tool schemas (templates that render no tools may call it with two arguments)."""


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
        self.problem = problem
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


def _json_value(value: Any, field: str, what: str) -> Any:
    """``value`` parsed where it is JSON text (a call's arguments, a ``tools`` column)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise RowError(field, f"{what} is not valid JSON ({error}): {value!r:.80}") from None


def _function(entry: Any, field: str, what: str) -> tuple[Mapping[str, Any], str]:
    """A call's or a tool schema's function (``{type: function, function: {...}}`` or the bare
    function) and its name, or a ``RowError`` saying ``what`` was expected."""
    function = entry.get("function", entry) if isinstance(entry, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise RowError(field, f"expected {what}, got {entry!r:.120}")
    return function, name


def _tool_call(call: Any, field: str) -> dict[str, Any]:
    """One call as templates take it: ``{type: function, function: {name, arguments: object}}``
    (its ``id`` kept), from the OpenAI shape or a bare ``{name, arguments}``."""
    function, name = _function(call, field, "a call with a function name")
    arguments = function.get("arguments")
    arguments = {} if arguments in (None, "") else _json_value(arguments, field, "arguments")
    if not isinstance(arguments, Mapping):
        raise RowError(
            field, f"the call's arguments are not a JSON object but {type(arguments).__name__}"
        )
    normalised: dict[str, Any] = {
        "type": "function",
        "function": {"name": name, "arguments": dict(arguments)},
    }
    if isinstance(call.get("id"), str):
        normalised["id"] = call["id"]
    return normalised


def _tool_calls(calls: Any, field: str) -> list[dict[str, Any]]:
    calls = calls if isinstance(calls, list) else [calls]
    return [_tool_call(call, f"{field}.tool_calls[{i}]") for i, call in enumerate(calls)]


def chat_tools(row: Mapping[str, Any], column_map: Mapping[str, str]) -> list[Tool] | None:
    """The row's ``tools`` (a list of JSON schemas, or it as JSON text), None where it has none;
    a bare ``{name, description, parameters}`` schema is wrapped as ``{type: function, ...}``."""
    if not isinstance(row, Mapping):
        return None
    shown = _shown("tools", column_map)
    tools = _json_value(row.get(column_map.get("tools", "tools")), shown, "the tools list")
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list):
        raise RowError(shown, f"expected a list of tool schemas, got {type(tools).__name__}")
    wrapped: list[Tool] = []
    for index, tool in enumerate(tools):
        _function(tool, f"{shown}[{index}]", "a schema with a name")
        wrapped.append(dict(tool) if "function" in tool else {"type": "function", "function": tool})
    return wrapped


def _turn(turn: Any, sharegpt: bool, field: str) -> Message:
    """One turn → a message; see the module note's "Tool calls" for what reaches the template."""
    if not isinstance(turn, Mapping):
        raise RowError(
            field, f"expected a turn with a known role and text content, got {turn!r:.120}"
        )
    if sharegpt:
        source_role, content = turn.get("from"), turn.get("value")
        role = SHAREGPT_ROLES.get(source_role)
    else:
        source_role, content = turn.get("role"), turn.get("content")
        role = OPENAI_ROLES.get(source_role)
    calls = None
    if sharegpt and source_role == "function_call" and isinstance(content, str):
        calls, content = _tool_calls(_json_value(content, field, "the call"), field), ""
    elif not sharegpt and role == "assistant":
        found = [key for key in ("tool_calls", "function_call") if turn.get(key)]
        if found:
            calls = _tool_calls(turn[found[0]], field)
            content = "" if content is None else content
    if role is None or not isinstance(content, str):
        raise RowError(
            field, f"expected a turn with a known role and text content, got {turn!r:.120}"
        )
    message: Message = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = calls
    reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
    if role == "assistant" and not sharegpt and reasoning is not None:
        if not isinstance(reasoning, str):
            raise RowError(
                field, f"the turn's reasoning is not text but {type(reasoning).__name__}"
            )
        if reasoning.strip():
            message["reasoning_content"] = reasoning
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if isinstance(turn.get(key), str):
                message[key] = turn[key]
    return message


def chat_messages(row: Mapping[str, Any], column_map: Mapping[str, str]) -> list[Message]:
    """Normalise OpenAI ``messages`` or ShareGPT ``conversations`` to messages (role, content and
    tool calls; see the module note)."""
    return _conversation(row, column_map)[0]


def _conversation(
    row: Mapping[str, Any], column_map: Mapping[str, str]
) -> tuple[list[Message], str, int]:
    """``chat_messages``' messages, the field they came from (``messages`` or ``conversations``)
    and the index of its first turn among them (1 after a ``system`` column's turn)."""
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
    name = "conversations" if sharegpt else "messages"
    field = column_map.get(name, name)  # the dataset's own column, as turn paths name it: dialog[2]
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
    offset = len(normalised)
    for turn_index, turn in enumerate(messages):
        normalised.append(_turn(turn, sharegpt, f"{field}[{turn_index}]"))
    return normalised, field, offset


def _call_json(call: dict[str, Any]) -> str:
    function = call["function"]
    return json.dumps({"name": function["name"], "arguments": function["arguments"]})


def chatml(
    messages: list[Message], add_generation_prompt: bool, tools: list[Tool] | None = None
) -> str:
    """The ChatML layout used when the tokenizer has no chat template; tools go in the system
    turn and calls after the assistant's text, in the Hermes ``<tool_call>`` convention."""
    turns = list(messages)
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        block = (
            "# Tools\n\nYou may call these functions. For each call, write a JSON object with the "
            'function\'s "name" and "arguments" within <tool_call></tool_call> tags.\n'
            f"<tools>\n{listing}\n</tools>"
        )
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{block}"}
        else:
            turns.insert(0, {"role": "system", "content": block})
    rendered = ""
    for message in turns:
        content = message["content"]
        if message.get("reasoning_content"):
            content = f"<think>\n{message['reasoning_content'].strip()}\n</think>\n\n{content}"
        calls = [
            f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in message.get("tool_calls", [])
        ]
        content = "\n".join(([content] if content else []) + calls)
        rendered += f"<|im_start|>{message['role']}\n{content}<|im_end|>\n"
    return rendered + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _renderer(
    render_chat: RenderChat | None, tools: list[Tool] | None, field: str
) -> Callable[..., str]:
    """(messages, add_generation_prompt) → text, with the row's ``tools`` where it has some (a
    row without them calls ``render_chat`` with two arguments, as templates registered before
    tools do). A chat template's error names ``field``, the conversation's column in the
    dataset (``render_chat`` cannot know it: ShareGPT rows were reported as ``messages``)."""
    render = render_chat or chatml
    extra = () if tools is None else (tools,)

    def rendered(messages: list[Message], add_generation_prompt: bool) -> str:
        try:
            return render(messages, add_generation_prompt, *extra)
        except RowError as error:
            if error.field == field:
                raise
            raise RowError(field, error.problem, reason=error.reason) from None

    return rendered


def _check_tools_rendered(rendered: str, tools: list[Tool] | None) -> None:
    for tool in tools or []:
        name = tool["function"]["name"]
        if name not in rendered:
            raise RowError(
                "tools",
                f"the chat template does not render the row's tools (no {name!r} in its text); "
                "set tokenizer.chat_template to one that takes tools",
                reason="template_error",
            )


def _check_turn_rendered(trained: str, message: Message, field: str) -> None:
    """What an assistant turn trains must hold its tool calls and reasoning (by name, by text):
    a template that drops them would train an empty turn, or an answer without its thinking."""
    missing = [
        f"tool call {call['function']['name']!r}"
        for call in message.get("tool_calls", [])
        if call["function"]["name"] not in trained
    ]
    if message.get("reasoning_content", "").strip() not in trained:
        missing.append("reasoning (reasoning_content)")
    if missing:
        raise RowError(
            field,
            f"the chat template does not render the turn's {', '.join(missing)}; set "
            "tokenizer.chat_template to one that does",
            reason="template_error",
        )


def _check_prefix(earlier: str, later: str, field: str) -> None:
    """``later`` (a longer conversation, rendered) starts with ``earlier``; ``field``: the
    column the turns came from."""
    if not later.startswith(earlier):
        raise RowError(
            field,
            "the chat template is not prefix-stable: rendering a longer "
            "conversation changed earlier text; set tokenizer.chat_template",
            reason="template_error",
        )


@register_template("chat", fields=("messages", "conversations", "system", "tools"))
def chat(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """A conversation → segments; only the text each assistant message adds is trainable."""
    messages, field, offset = _conversation(row, column_map)
    tools = chat_tools(row, column_map)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(
            field, "the conversation has no assistant turn to learn from", reason="missing_field"
        )
    render = _renderer(render_chat, tools, field)
    segments: list[Segment] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:index], True)
        full = render(messages[: index + 1], False)
        _check_prefix(done, prompt, field)
        _check_prefix(prompt, full, field)
        _check_turn_rendered(full[len(prompt) :], message, f"{field}[{index - offset}]")
        segments += [Segment(prompt[len(done) :], False), Segment(full[len(prompt) :], True)]
        done = full
    whole = render(messages, False)
    _check_prefix(done, whole, field)
    _check_tools_rendered(whole, tools)
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
    "preference",
    fields=("prompt", "chosen", "rejected", "messages", "conversations", "system", "tools"),
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
        field = column_map.get("prompt", "prompt")
        turns = {field: prompt, "system": row.get(column_map.get("system", "system"))}
        messages, field, offset = _conversation(turns, {"messages": field})
    else:
        messages, field, offset = _conversation(row, column_map)
    if messages[-1]["role"] == "assistant":
        raise RowError(
            f"{field}[{len(messages) - 1 - offset}]",
            "the prompt's last turn is an assistant turn; the responses answer the prompt",
        )
    tools = chat_tools(row, column_map)
    render = _renderer(render_chat, tools, field)
    prompt_text = render(messages, True)
    _check_tools_rendered(prompt_text, tools)
    texts = []
    for reply in (chosen, rejected):
        full = render([*messages, {"role": "assistant", "content": reply}], False)
        _check_prefix(prompt_text, full, field)
        texts.append(full[len(prompt_text) :])
    return Preference(prompt_text, *texts)
