"""Where each assistant turn of a rendered conversation starts and ends, in time linear in turns.

An assistant turn at index ``i`` trains what ``render(messages[:i + 1])`` adds to
``render(messages[:i], add_generation_prompt=True)``: the template's own definition of the turn,
prefix by prefix, which works for any prefix-stable template without ``{% generation %}`` markers.
Rendering every prefix costs time and memory quadratic in turns; :func:`turn_bounds` finds the same
boundaries from short windows instead. What message ``k`` adds to a conversation is rendered on a
window that keeps what a template looks at around it: the leading system turn, the two or three
turns before it, and the parity of its index (templates that check that roles alternate). The
window's deltas must tile the whole conversation's one rendering, character for character, and
each generation prompt must be what the whole text holds at its place; where a template does not
allow that (it numbers rounds, looks ahead, or refuses a window), the conversation is rendered
prefix by prefix as before (:func:`prefix_bounds`), so the boundaries are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from rayjobs.data.templates.registry import Message, RowError

Render = Callable[[list[Message], bool], str]
"""(messages, add_generation_prompt) → the conversation's text."""

BEFORE = 2
"""Turns rendered before a message, at least, to find what it adds (one more to keep parity)."""


class Bounds(NamedTuple):
    """A conversation rendered whole, and for each assistant turn its index among the messages,
    where its generation prompt ends (what it trains starts) and where it ends, in ``text``."""

    text: str
    turns: list[tuple[int, int, int]]


class _Untileable(Exception):
    """The windows do not reproduce the whole rendering: render prefix by prefix instead."""


def check_prefix(earlier: str, later: str, field: str) -> None:
    """``later`` (a longer conversation, rendered) starts with ``earlier``; ``field``: the
    column the turns came from.

    Raises:
        RowError: (``template_error``) it does not: the template is not prefix-stable.
    """
    if not later.startswith(earlier):
        raise RowError(
            field,
            "the chat template is not prefix-stable: rendering a longer "
            "conversation changed earlier text; set tokenizer.chat_template",
            reason="template_error",
        )


def turn_bounds(messages: list[Message], render: Render, field: str) -> Bounds:
    """Each assistant turn's boundaries in the conversation rendered whole, as
    :func:`prefix_bounds` finds them, in renders of a few turns each (see module note).

    Raises:
        RowError: as :func:`prefix_bounds` (the template raises, or is not prefix-stable).
    """
    try:
        return _window_bounds(messages, render)
    except (_Untileable, RowError):
        return prefix_bounds(messages, render, field)


def prefix_bounds(messages: list[Message], render: Render, field: str) -> Bounds:
    """The boundaries by definition: every prefix that ends before an assistant turn rendered
    with the generation prompt, and with that turn (quadratic in turns: the fallback)."""
    turns = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:index], True)
        full = render(messages[: index + 1], False)
        check_prefix(done, prompt, field)
        check_prefix(prompt, full, field)
        turns.append((index, len(prompt), len(full)))
        done = full
    whole = render(messages, False)
    check_prefix(done, whole, field)
    return Bounds(whole, turns)


def _delta(shorter: str, longer: str) -> str:
    if not longer.startswith(shorter):
        raise _Untileable
    return longer[len(shorter) :]


def _window(messages: list[Message], index: int) -> list[Message]:
    """The turns rendered before message ``index`` to find what it adds: the leading system
    turn, then at least ``BEFORE`` turns, starting at an index of the same parity as in the
    conversation (the whole prefix where that is no longer)."""
    head = 1 if messages[0]["role"] == "system" else 0
    start = index - BEFORE
    start -= (start - head) % 2
    if start <= head:
        return messages[:index]
    return messages[:head] + messages[start:index]


def _window_bounds(messages: list[Message], render: Render) -> Bounds:
    whole = render(messages, False)
    end = 0  # where the messages so far end in ``whole``
    turns = []
    for index, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if index == 0:
            block = render(messages[:1], False)
            generation = render([], True) if assistant else ""
        else:
            before = _window(messages, index)
            shown = render(before, False)
            block = _delta(shown, render([*before, message], False))
            generation = _delta(shown, render(before, True)) if assistant else ""
        if not whole.startswith(block, end):
            raise _Untileable
        if assistant:
            if not whole.startswith(generation, end) or len(generation) > len(block):
                raise _Untileable
            turns.append((index, end + len(generation), end + len(block)))
        end += len(block)
    if end != len(whole):
        raise _Untileable
    return Bounds(whole, turns)
