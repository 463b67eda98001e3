"""Templates: one raw row → text segments, trained or not. Importing this package registers the
built-ins (``alpaca``, ``text``, ``chat``, ``prompt_completion``, ``preference``) in
:data:`TEMPLATES`."""

from rayjobs.data.templates.completion import prompt_completion
from rayjobs.data.templates.dialogue import (
    MAX_TURNS,
    chat,
    chat_tools,
    chatml,
    check_turn_setting,
    read_conversation,
    read_turns,
    system_turns,
    turn_style,
)
from rayjobs.data.templates.instruction import alpaca, text
from rayjobs.data.templates.preference_pairs import preference
from rayjobs.data.templates.registry import (
    TEMPLATES,
    Columns,
    Message,
    Preference,
    RenderChat,
    RowError,
    Segment,
    Template,
    Tool,
    field_value,
    register_template,
    text_field,
)

__all__ = [
    "MAX_TURNS",
    "TEMPLATES",
    "Columns",
    "Message",
    "Preference",
    "RenderChat",
    "RowError",
    "Segment",
    "Template",
    "Tool",
    "alpaca",
    "chat",
    "chat_tools",
    "chatml",
    "check_turn_setting",
    "field_value",
    "preference",
    "prompt_completion",
    "read_conversation",
    "read_turns",
    "register_template",
    "system_turns",
    "text",
    "text_field",
    "turn_style",
]
