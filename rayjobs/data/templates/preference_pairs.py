"""The ``preference`` template (``task: dpo``): a prompt (text or turns) and a chosen and a rejected
response → a ``Preference`` of three texts, a chat prompt rendered with its generation prompt.

Without a prompt (TRL's implicit prompt), ``chosen`` and ``rejected`` are whole texts or whole
conversations and the prompt is what they share at the start, as TRL's ``extract_prompt``
finds it: the longest common leading turns, or for texts the longest common leading characters,
a space just before the first difference going to the responses (docs/data.md, "Templates").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rayjobs.data.templates.dialogue import (
    _check_tools_rendered,
    _check_turn_rendered,
    _renderer,
    _turn,
    chat_tools,
    read_conversation,
    read_turns,
    system_turns,
    turn_style,
)
from rayjobs.data.templates.registry import (
    Message,
    Preference,
    RenderChat,
    RowError,
    _shown,
    field_value,
    register_template,
    text_field,
)
from rayjobs.data.templates.spans import check_prefix


def _response(value: Any, name: str, column_map: Mapping[str, str]) -> Message:
    """A preference response as an assistant message: from a string, an assistant message
    ({role, content}, {from, value}, or the dataset's ``message_keys``) or a list of one."""
    shown = _shown(name, column_map)
    message = value[0] if isinstance(value, list) and len(value) == 1 else value
    if isinstance(message, str):
        message = {"role": "assistant", "content": message}
    elif isinstance(message, Mapping):
        sharegpt = not getattr(column_map, "message_keys", {}) and "from" in message
        message = _turn(message, turn_style(column_map, sharegpt), shown)
        if message["role"] != "assistant":
            raise RowError(shown, f"expected an assistant message, got role {message['role']!r}")
    else:
        raise RowError(shown, f"expected text or one assistant message, got {type(value).__name__}")
    _check_not_blank(message, shown)
    return message


def _check_not_blank(message: Message, shown: str) -> None:
    if not message["content"].strip() and not message.get("tool_calls"):
        raise RowError(shown, f"empty ({message['content']!r})", reason="empty_field")


def _text(message: Message, shown: str) -> str:
    """A response to a text prompt: its text (a tool call needs a conversation to render in)."""
    if message.get("tool_calls"):
        raise RowError(shown, "a tool call answers a conversation prompt, not a text prompt")
    return message["content"]


@register_template(
    "preference",
    fields=("prompt", "chosen", "rejected", "messages", "conversations", "system", "tools"),
    task="dpo",
    turns=True,
)
def preference(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> Preference:
    """A prompt with a chosen and a rejected response → their texts (see module note)."""
    prompt = field_value(row, "prompt", column_map, required=False)
    conversation = any(
        field_value(row, name, column_map, required=False) is not None
        for name in ("messages", "conversations")
    )
    if prompt is None and not conversation:
        return _implicit(row, column_map, render_chat)
    chosen = _response(field_value(row, "chosen", column_map), "chosen", column_map)
    rejected = _response(field_value(row, "rejected", column_map), "rejected", column_map)
    if isinstance(prompt, str):
        return Preference(
            text_field(row, "prompt", column_map),
            _text(chosen, _shown("chosen", column_map)),
            _text(rejected, _shown("rejected", column_map)),
        )
    if prompt is not None:  # a list of turns under ``prompt``
        field = column_map.get("prompt", "prompt")
        system = system_turns(row, column_map)
        turns = read_turns(prompt, field, turn_style(column_map, sharegpt=False))
        messages, offset = [*system, *turns], len(system)
    else:
        messages, field, offset = read_conversation(row, column_map)
    return _rendered(row, column_map, render_chat, (messages, field, offset), (chosen, rejected))


def _rendered(
    row: Mapping[str, Any],
    column_map: Mapping[str, str],
    render_chat: RenderChat | None,
    prompt: tuple[list[Message], str, int],
    responses: tuple[Message, Message],
) -> Preference:
    """A chat prompt (its turns, their column, the index of their first) rendered with its
    generation prompt, and what each response's turn adds to it."""
    messages, field, offset = prompt
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
    for name, reply in zip(("chosen", "rejected"), responses, strict=True):
        full = render([*messages, reply], False)
        check_prefix(prompt_text, full, field)
        _check_turn_rendered(full[len(prompt_text) :], reply, _shown(name, column_map))
        texts.append(full[len(prompt_text) :])
    return Preference(prompt_text, *texts)


def _implicit(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None
) -> Preference:
    """TRL's implicit prompt: ``chosen`` and ``rejected`` whole, the prompt what they share."""
    chosen = field_value(row, "chosen", column_map)
    rejected = field_value(row, "rejected", column_map)
    shown = _shown("chosen", column_map)
    if isinstance(chosen, str) and isinstance(rejected, str):
        start = _shared_text(chosen, rejected, shown)
        return Preference(chosen[:start], chosen[start:], rejected[start:])
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise RowError(
            shown,
            "without a prompt, chosen and rejected are both whole texts or both whole "
            f"conversations (implicit prompt), got {type(chosen).__name__} and "
            f"{type(rejected).__name__}; or map the prompt's column with column_map",
        )
    style = turn_style(column_map, sharegpt=False)
    fields = [column_map.get(name, name) for name in ("chosen", "rejected")]
    chosen_turns = read_turns(chosen, fields[0], style)
    rejected_turns = read_turns(rejected, fields[1], style)
    shared = 0
    for ours, theirs in zip(chosen_turns, rejected_turns, strict=False):
        if ours != theirs:
            break
        shared += 1
    if not shared:
        raise RowError(
            shown,
            "chosen and rejected share no leading turn, so there is no prompt (implicit prompt: "
            "the turns both start with); or map the prompt's column with column_map",
            reason="missing_field",
        )
    replies = []
    for field, turns in zip(fields, (chosen_turns, rejected_turns), strict=True):
        rest = turns[shared:]
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            raise RowError(
                f"{field}[{shared}]" if rest else field,
                f"after the {shared} turn(s) chosen and rejected share (the implicit prompt), "
                f"expected one assistant turn, got {[turn['role'] for turn in rest]}",
                reason="empty_field" if not rest else "wrong_type",
            )
        _check_not_blank(rest[0], f"{field}[{shared}]")
        replies.append(rest[0])
    system = system_turns(row, column_map)
    prompt = ([*system, *chosen_turns[:shared]], fields[0], len(system))
    return _rendered(row, column_map, render_chat, prompt, (replies[0], replies[1]))


def _shared_text(chosen: str, rejected: str, shown: str) -> int:
    """Where the responses start in two whole texts: after their longest common prefix, less a
    space just before the first difference (TRL's ``extract_prompt``: ``" blue."`` and
    ``" green."`` after ``"The sky is"``).

    Raises:
        RowError: no common prefix (no prompt), or one text is the other's start (a response
            would be empty).
    """
    end = len(os.path.commonprefix([chosen, rejected]))
    if end == min(len(chosen), len(rejected)):
        raise RowError(
            shown,
            "chosen and rejected are the same text, or one is the start of the other: after "
            "their shared start (the implicit prompt) a response would be empty",
            reason="empty_field",
        )
    if end and chosen[end - 1] == " ":
        end -= 1
    if not chosen[:end].strip():
        raise RowError(
            shown,
            "chosen and rejected share no leading text, so there is no prompt (implicit prompt: "
            "the text both start with); or map the prompt's column with column_map",
            reason="missing_field",
        )
    return end
