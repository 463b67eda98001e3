"""Templates: one raw row → text segments, trained or not. Importing this package registers the
built-ins (``alpaca``, ``text``, ``chat``, ``preference``) in :data:`TEMPLATES`."""

from rayjobs.data.templates.dialogue import chat, chat_tools, chatml, read_conversation
from rayjobs.data.templates.instruction import alpaca, text
from rayjobs.data.templates.preference_pairs import preference
from rayjobs.data.templates.registry import (
    TEMPLATES,
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
    "TEMPLATES",
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
    "field_value",
    "preference",
    "read_conversation",
    "register_template",
    "text",
    "text_field",
]
