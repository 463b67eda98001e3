"""The ``chat`` template: OpenAI ``messages`` or ShareGPT ``conversations``, rendered by the
tokenizer's chat template (ChatML when it has none); only what each assistant turn adds is trained.

Each assistant turn trains what it adds to the conversation rendered up to it, with the generation
prompt, which works for any prefix-stable template without ``{% generation %}`` markers (found in
time linear in turns: ``spans``); an unstable one is a bad row. A turn's ``train`` or ``weight``
and the dataset's ``train_on`` say which assistant turns train. Tool
calls, tool schemas and reasoning reach the template as ``apply_chat_template`` takes them, and a
template that drops them makes the row a ``template_error`` (docs/data.md, "Templates").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rayjobs.data.templates.registry import (
    Message,
    RenderChat,
    RowError,
    Segment,
    Tool,
    _shown,
    field_value,
    register_template,
)
from rayjobs.data.templates.spans import turn_bounds

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
"""ShareGPT roles (``from``) → the roles templates see; a dataset's ``roles`` adds its own."""


OPENAI_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
"""OpenAI roles (``function``: the legacy role of a function's result) → the roles templates see."""


TURN_ROLES = ("system", "user", "assistant", "tool")
"""The roles a dataset's ``roles`` may map its own role names to."""


def check_turn_setting(name: str, value: Any) -> None:
    """A dataset's ``message_keys`` or ``roles`` as written (see ``turn_style``).

    Raises:
        ValueError: a key other than ``role`` and ``content``, an empty key, a role mapped to
            none of :data:`TURN_ROLES`, or Axolotl's ``{user: [human]}`` form of ``roles``.
    """
    if not isinstance(value, dict):
        return  # the field's type says what is expected
    if name == "message_keys":
        unknown = sorted(set(value) - {"role", "content"})
        if unknown or not all(isinstance(v, str) and v for v in value.values()):
            raise ValueError(
                f"message_keys names the keys of a turn's role and content in the data, e.g. "
                f"{{role: from, content: value}}; got {value!r:.80}"
            )
    elif any(isinstance(v, list) for v in value.values()):
        raise ValueError(
            "roles maps each of the data's role names to one of rayjobs' roles, "
            "{human: user, gpt: assistant}; Axolotl's {user: [human]} is written {human: user}"
        )
    elif wrong := sorted(k for k, v in value.items() if v not in TURN_ROLES):
        raise ValueError(
            f"{wrong}: a role maps to one of {', '.join(TURN_ROLES)}, got "
            f"{[value[k] for k in wrong]}"
        )


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""An OpenAI assistant turn's reasoning, under the names transformers aliases (the first set is
used); it reaches the template as ``reasoning_content``."""


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
    value = row.get(column_map.get("tools", "tools"))
    if isinstance(value, str) and not value.strip():  # LLaMA-Factory's "" for no tools
        return None
    tools = _json_value(value, shown, "the tools list")
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list):
        raise RowError(shown, f"expected a list of tool schemas, got {type(tools).__name__}")
    wrapped: list[Tool] = []
    for index, tool in enumerate(tools):
        _function(tool, f"{shown}[{index}]", "a schema with a name")
        wrapped.append(dict(tool) if "function" in tool else {"type": "function", "function": tool})
    return wrapped


MAX_TURNS = 100_000
"""Turns of a conversation at most, by default (``datasets[].max_turns``)."""


@dataclass(frozen=True)
class TurnStyle:
    """How a conversation's turns are read: the keys of a turn's role and text, the role names
    known (the data's → the template's) and whether ShareGPT's ``function_call`` turns hold a
    call (ShareGPT) or an assistant turn's ``tool_calls`` and reasoning are read (OpenAI)."""

    role: str
    content: str
    roles: Mapping[str, str]
    sharegpt: bool
    max_turns: int = MAX_TURNS


def turn_style(column_map: Mapping[str, str], sharegpt: bool) -> TurnStyle:
    """The style of a ShareGPT (``conversations``) or OpenAI (any other) list of turns, with the
    dataset's ``message_keys`` and ``roles`` (``registry.Columns``) over the built-in ones."""
    keys = getattr(column_map, "message_keys", {})
    extra = getattr(column_map, "roles", {})
    role, content = ("from", "value") if sharegpt else ("role", "content")
    table = SHAREGPT_ROLES if sharegpt else OPENAI_ROLES
    most = getattr(column_map, "max_turns", None) or MAX_TURNS
    return TurnStyle(
        keys.get("role", role), keys.get("content", content), {**table, **extra}, sharegpt, most
    )


def _unknown_turn(turn: Any, style: TurnStyle, field: str) -> RowError:
    source_role = turn.get(style.role) if isinstance(turn, Mapping) else None
    if isinstance(source_role, str) and source_role not in style.roles:
        known = ", ".join(repr(name) for name in sorted(style.roles))
        return RowError(
            field,
            f"unknown role {source_role!r} (known: {known}; name others in the dataset's roles)",
        )
    return RowError(
        field,
        f"expected a turn with a known role and text content (keys {style.role!r}, "
        f"{style.content!r}; the dataset's message_keys name others), got {turn!r:.120}",
    )


def _turn(turn: Any, style: TurnStyle, field: str) -> Message:
    """One turn → a message; see the module note's "Tool calls" for what reaches the template."""
    if not isinstance(turn, Mapping):
        raise _unknown_turn(turn, style, field)
    source_role, content = turn.get(style.role), turn.get(style.content)
    role = style.roles.get(source_role) if isinstance(source_role, str) else None
    sharegpt = style.sharegpt
    calls = None
    if sharegpt and source_role == "function_call" and isinstance(content, str):
        calls, content = _tool_calls(_json_value(content, field, "the call"), field), ""
    elif not sharegpt and role == "assistant":
        found = [key for key in ("tool_calls", "function_call") if turn.get(key)]
        if found:
            calls = _tool_calls(turn[found[0]], field)
            content = "" if content is None else content
    if role is None or not isinstance(content, str):
        raise _unknown_turn(turn, style, field)
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


def read_turns(value: Any, field: str, style: TurnStyle) -> list[Message]:
    """A non-empty list of turns (``field``: the dataset's column, as turn paths name it:
    ``dialog[2]``) as messages."""
    if not isinstance(value, list):
        raise RowError(field, f"expected a non-empty list of turns, got {type(value).__name__}")
    if not value:
        raise RowError(field, "empty: expected a non-empty list of turns", reason="empty_field")
    if len(value) > style.max_turns:
        raise RowError(
            field,
            f"{len(value)} turns, over max_turns ({style.max_turns})",
            reason="too_many_turns",
        )
    return [_turn(turn, style, f"{field}[{index}]") for index, turn in enumerate(value)]


def system_turns(row: Mapping[str, Any], column_map: Mapping[str, str]) -> list[Message]:
    """The row's ``system`` column as a first turn (none where it is absent or empty)."""
    system = row.get(column_map.get("system", "system"))
    if system is not None and not isinstance(system, str):
        raise RowError(_shown("system", column_map), f"expected text, got {type(system).__name__}")
    return [{"role": "system", "content": system}] if system else []


def read_conversation(
    row: Mapping[str, Any], column_map: Mapping[str, str]
) -> tuple[list[Message], str, int]:
    """The row's conversation as messages (OpenAI ``messages`` or ShareGPT ``conversations``,
    normalised: roles, content, tool calls, reasoning), the column they came from and the index of
    its first turn among them (1 after a ``system`` column's turn)."""
    messages = field_value(row, "messages", column_map, required=False)
    sharegpt = messages is None
    if sharegpt:
        messages = field_value(row, "conversations", column_map, required=False)
    if messages is None:
        raise RowError(
            _shown("messages", column_map),
            f"missing (nor {_shown('conversations', column_map)!r}); the row has columns "
            f"{sorted(row)}",
            reason="missing_field",
        )
    name = "conversations" if sharegpt else "messages"
    field = column_map.get(name, name)  # the dataset's own column, as turn paths name it: dialog[2]
    system = system_turns(row, column_map)
    turns = read_turns(messages, field, turn_style(column_map, sharegpt))
    return [*system, *turns], field, len(system)


def _call_json(call: dict[str, Any]) -> str:
    function = call["function"]
    return json.dumps({"name": function["name"], "arguments": function["arguments"]})


def chatml(
    messages: list[Message], add_generation_prompt: bool, tools: list[Tool] | None = None
) -> str:
    """The ChatML layout used when the tokenizer has no chat template; tools go in the system
    turn and calls after the assistant's text, in the Hermes ``<tool_call>`` convention."""
    rendered = "".join(_chatml_blocks(messages, tools))
    return rendered + (CHATML_GENERATION if add_generation_prompt else "")


CHATML_GENERATION = "<|im_start|>assistant\n"


def _chatml_blocks(messages: list[Message], tools: list[Tool] | None) -> list[str]:
    """``chatml``'s text turn by turn (a tools block first where there is no system turn)."""
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
    blocks = []
    for message in turns:
        content = message["content"]
        if message.get("reasoning_content"):
            content = f"<think>\n{message['reasoning_content'].strip()}\n</think>\n\n{content}"
        calls = [
            f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in message.get("tool_calls", [])
        ]
        content = "\n".join(([content] if content else []) + calls)
        blocks.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
    return blocks


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


TRAIN_ON = ("all_assistant", "last_assistant")
"""A dataset's ``train_on``: every assistant turn, or the last one only (LLaMA-Factory's
``mask_history``); a turn's own ``train`` or ``weight`` wins over it."""

UNHONOURED_TURN_KEYS = ("training", "train_detail", "loss", "loss_weight", "mask", "masked")
"""Turn keys that decide what trains elsewhere (Axolotl's ``training`` and ``train_detail``,
other tools' masks) and that rayjobs does not read: a turn holding one is a bad row
(``unknown_turn_key``), rather than be trained against what it says."""


def _turn_flag(turn: Any, field: str) -> bool | None:
    """A turn's ``train`` (bool) or ``weight`` (0 or 1, Axolotl's): whether it trains, None
    where it says nothing."""
    if not isinstance(turn, Mapping):
        return None
    unhonoured = [key for key in UNHONOURED_TURN_KEYS if key in turn]
    if unhonoured:
        raise RowError(
            field,
            f"turn key {unhonoured[0]!r} is not read by rayjobs (a turn says whether it trains "
            'with "train": true/false or "weight": 0/1)',
            reason="unknown_turn_key",
        )
    said = []
    if "train" in turn:
        if not isinstance(turn["train"], bool):
            raise RowError(field, f"train is true or false, got {turn['train']!r:.40}")
        said.append(turn["train"])
    if "weight" in turn:
        weight = turn["weight"]
        if isinstance(weight, bool) or weight not in (0, 1):
            raise RowError(field, f"a turn's weight is 0 or 1, got {weight!r:.40}")
        said.append(weight == 1)
    if len(set(said)) > 1:
        raise RowError(field, "the turn's train and weight disagree")
    return said[0] if said else None


def trained_turns(
    row: Mapping[str, Any], messages: list[Message], field: str, offset: int, train_on: str
) -> dict[int, bool]:
    """Whether each assistant turn (by its index among ``messages``) trains: its own ``train``
    or ``weight``, else the dataset's ``train_on``. A flag that trains any other turn is a bad
    row (``train_on_input`` trains those)."""
    turns = row.get(field)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    trained = {}
    for index, message in enumerate(messages):
        turn = turns[index - offset] if index >= offset else None
        flag = _turn_flag(turn, f"{field}[{index - offset}]")
        if message["role"] == "assistant":
            trained[index] = (
                (train_on == "all_assistant" or index == last) if flag is None else flag
            )
        elif flag:
            raise RowError(
                f"{field}[{index - offset}]",
                f"only assistant turns train, not a {message['role']} turn (train_on_input: "
                "true trains every turn)",
            )
    return trained


@register_template("chat", fields=("messages", "conversations", "system", "tools"), turns=True)
def chat(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """A conversation → segments; only the text each assistant message adds is trainable."""
    messages, field, offset = read_conversation(row, column_map)
    tools = chat_tools(row, column_map)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(
            field, "the conversation has no assistant turn to learn from", reason="missing_field"
        )
    trained = trained_turns(
        row, messages, field, offset, getattr(column_map, "train_on", TRAIN_ON[0])
    )
    whole, turns = turn_bounds(messages, _renderer(render_chat, tools, field), field)
    segments: list[Segment] = []
    done = 0
    for index, start, end in turns:
        _check_turn_rendered(whole[start:end], messages[index], f"{field}[{index - offset}]")
        segments += [Segment(whole[done:start], False), Segment(whole[start:end], trained[index])]
        done = end
    _check_tools_rendered(whole, tools)
    segments.append(Segment(whole[done:], False))
    return [s for s in segments if s.text]
