"""Templates of one text or one instruction: ``alpaca`` (prompt untrained, output trained) and
``text`` (every token trained)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayjobs.data.templates.registry import (
    RenderChat,
    RowError,
    Segment,
    field_value,
    register_template,
    text_field,
)

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


TURN = "### Instruction:\n{instruction}\n\n### Response:\n"
TURN_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""A turn after the first (``history``): the prompt's turn layout, without its preamble."""


@register_template(
    "alpaca", fields=("instruction", "input", "output", "history", "system"), turns=False
)
def alpaca(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Alpaca instruction / input / output → [prompt (untrained), output (trained)]. Earlier
    turns (``history``: ``[[instruction, response], ...]``, the LLaMA-Factory layout) come first,
    each in the same layout, their responses trained as every assistant turn of a chat is. A
    ``system`` text (LLaMA-Factory's alpaca column), where given, takes the preamble's place."""
    instruction = text_field(row, "instruction", column_map)
    context = text_field(row, "input", column_map, required=False)
    output = text_field(row, "output", column_map)
    turns = _history(field_value(row, "history", column_map, required=False), column_map)
    preamble = (ALPACA_PROMPT_WITH_INPUT if context.strip() else ALPACA_PROMPT).split("###")[0]
    system = text_field(row, "system", column_map, required=False)
    if system.strip():
        preamble = f"{system.strip()}\n\n"
    segments: list[Segment] = []
    for index, (asked, answered) in enumerate(turns):
        head = preamble if index == 0 else ""
        segments += [Segment(head + TURN.format(instruction=asked), False),
                     Segment(answered, True), Segment("\n\n", False)]  # fmt: skip
    head = "" if turns else preamble
    last = TURN_WITH_INPUT if context.strip() else TURN
    return [*segments, Segment(head + last.format(instruction=instruction, input=context), False),
            Segment(output, True)]  # fmt: skip


def _history(value: Any, column_map: Mapping[str, str]) -> list[tuple[str, str]]:
    """Earlier turns as (instruction, response) pairs of text; none for a null or empty list."""
    if value in (None, []):
        return []
    shown = column_map.get("history", "history")
    if not isinstance(value, list) or not all(
        isinstance(turn, list | tuple) and len(turn) == 2 and all(isinstance(x, str) for x in turn)
        for turn in value
    ):
        raise RowError(
            shown, f"expected a list of [instruction, response] pairs, got {value!r:.80}"
        )
    return [(asked, answered) for asked, answered in value]


@register_template("text", fields=("text",), turns=False)
def text(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """Raw text → one trained segment."""
    return [Segment(text_field(row, "text", column_map), True)]
