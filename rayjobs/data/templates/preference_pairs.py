"""The ``preference`` template (``task: dpo``): a prompt (text or turns) and a chosen and a rejected
response → a ``Preference`` of three texts, a chat prompt rendered with its generation prompt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayjobs.data.templates.dialogue import (
    SHAREGPT_ROLES,
    _check_prefix,
    _check_tools_rendered,
    _renderer,
    chat_tools,
    read_conversation,
)
from rayjobs.data.templates.registry import (
    Preference,
    RenderChat,
    RowError,
    _shown,
    field_value,
    register_template,
    text_field,
)


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
    task="dpo",
)
def preference(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> Preference:
    """A prompt with a chosen and a rejected response → their texts (see module note)."""
    chosen = _response(field_value(row, "chosen", column_map), "chosen", column_map)
    rejected = _response(field_value(row, "rejected", column_map), "rejected", column_map)
    prompt = field_value(row, "prompt", column_map, required=False)
    if isinstance(prompt, str) or (
        prompt is None
        and field_value(row, "messages", column_map, required=False) is None
        and field_value(row, "conversations", column_map, required=False) is None
    ):
        return Preference(text_field(row, "prompt", column_map), chosen, rejected)
    if prompt is not None:  # a list of turns under ``prompt``
        field = column_map.get("prompt", "prompt")
        turns = {field: prompt, "system": row.get(column_map.get("system", "system"))}
        messages, field, offset = read_conversation(turns, {"messages": field})
    else:
        messages, field, offset = read_conversation(row, column_map)
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
