"""Templates of one text or one instruction: ``alpaca`` (prompt untrained, output trained) and
``text`` (every token trained)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayjobs.data.templates.registry import RenderChat, Segment, register_template, text_field

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


@register_template("alpaca", fields=("instruction", "input", "output"))
def alpaca(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Alpaca instruction / input / output → [prompt (untrained), output (trained)]."""
    instruction = text_field(row, "instruction", column_map)
    context = text_field(row, "input", column_map, required=False)
    output = text_field(row, "output", column_map)
    template = ALPACA_PROMPT_WITH_INPUT if context.strip() else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=context)
    return [Segment(prompt, False), Segment(output, True)]


@register_template("text", fields=("text",))
def text(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Raw text → one trained segment."""
    return [Segment(text_field(row, "text", column_map), True)]
