"""The ``prompt_completion`` template: TRL's ``{prompt, completion}`` rows, the standard SFT type.

Both text: the prompt is not trained, the completion (and the EOS after it) is. Both lists of
turns (conversational): the prompt is rendered by the chat template with its generation prompt,
and what the completion's turns add to it is trained, end-of-turn markers included, as TRL's
``completion_only_loss`` trains it (docs/data.md, "Templates").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayjobs.data.templates.dialogue import (
    _check_tools_rendered,
    _check_turn_rendered,
    _renderer,
    chat_tools,
    read_turns,
    system_turns,
    turn_style,
)
from rayjobs.data.templates.registry import (
    RenderChat,
    RowError,
    Segment,
    _shown,
    field_value,
    register_template,
    text_field,
)
from rayjobs.data.templates.spans import check_prefix


@register_template(
    "prompt_completion", fields=("prompt", "completion", "system", "tools"), turns=True
)
def prompt_completion(
    row: Mapping[str, Any], column_map: Mapping[str, str], render_chat: RenderChat | None = None
) -> list[Segment]:
    """A prompt and its completion, both text or both turns → [prompt (untrained), completion
    (trained)]."""
    prompt = field_value(row, "prompt", column_map)
    completion = field_value(row, "completion", column_map)
    if isinstance(prompt, str) and isinstance(completion, str):
        return [
            Segment(text_field(row, "prompt", column_map), False),
            Segment(text_field(row, "completion", column_map), True),
        ]
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise RowError(
            _shown("completion", column_map),
            "prompt and completion are both text or both lists of turns, got "
            f"{type(prompt).__name__} and {type(completion).__name__}",
        )
    style = turn_style(column_map, sharegpt=False)
    prompt_field = column_map.get("prompt", "prompt")
    completion_field = column_map.get("completion", "completion")
    system = system_turns(row, column_map)
    messages = [*system, *read_turns(prompt, prompt_field, style)]
    answer = read_turns(completion, completion_field, style)
    if messages[-1]["role"] == "assistant":
        raise RowError(
            f"{prompt_field}[{len(messages) - 1 - len(system)}]",
            "the prompt's last turn is an assistant turn; the completion answers the prompt",
        )
    if not any(turn["role"] == "assistant" for turn in answer):
        raise RowError(
            completion_field,
            "the completion has no assistant turn to learn from",
            reason="missing_field",
        )
    tools = chat_tools(row, column_map)
    render = _renderer(render_chat, tools, prompt_field)
    head = render(messages, True)
    whole = render([*messages, *answer], False)
    check_prefix(head, whole, prompt_field)
    _check_tools_rendered(whole, tools)
    trained = whole[len(head) :]
    for index, turn in enumerate(answer):
        if turn["role"] == "assistant":
            _check_turn_rendered(trained, turn, f"{completion_field}[{index}]")
    return [Segment(head, False), Segment(trained, True)]
