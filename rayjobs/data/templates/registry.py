"""The template registry: a template turns one raw row into text segments, each trained or not.

A template decides *what text* a sample is and *which parts are learned*; tokenization and label
shifting happen once, in ``rayjobs.data.tokenize``. A bad row raises :class:`RowError` naming the
field and a reason of ``formats.SKIP_REASONS``; the Tokenize actor adds dataset, file and row and
applies ``on_bad_row``. Which templates exist, and what each reads, is in docs/data.md; a user's
own templates register with the same decorator from a module the config names
(``template_modules``, docs/data.md "Your own templates").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
"""A turn as the chat template sees it: ``role``, ``content`` and, where the data has them,
``tool_calls`` and ``reasoning_content`` (assistant), ``name`` and ``tool_call_id`` (tool)."""
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
    responses (``rayjobs.data.preference`` lays the three out in a row)."""

    prompt: str
    chosen: str
    rejected: str


TemplateFn = Callable[
    [Mapping[str, Any], Mapping[str, str], RenderChat], "list[Segment] | Preference"
]
"""(row, column_map, render_chat) → segments (``task: sft``) or a ``Preference`` (``task: dpo``)."""


@dataclass(frozen=True)
class Template:
    """A registered template: everything the job knows of it, in one record."""

    name: str
    render: TemplateFn
    fields: frozenset[str] | None
    """The fields it reads: the keys ``datasets[].column_map`` may have, so a misspelt optional
    field (``inputs`` for ``input``) is refused, not ignored; None: not checked."""
    task: str
    """The task its rows train (``rayjobs.data.tasks.TASKS``): ``sft`` (segments) or ``dpo``
    (preference triples)."""
    turns: bool | None = None
    """Whether it reads conversation turns (then ``datasets[].message_keys`` and ``roles``
    apply); None: not said, not checked."""


TEMPLATES: dict[str, Template] = {}
"""Templates by name; ``datasets[].template`` must name one."""


def register_template(
    name: str, fields: tuple[str, ...] | None = None, task: str = "sft", turns: bool | None = None
) -> Callable[[TemplateFn], TemplateFn]:
    """Decorator: make ``render(row, column_map, render_chat)`` available as template ``name``,
    reading ``fields`` (None: not checked), for ``task``; ``turns``: it reads conversation turns
    (through ``read_conversation`` or ``read_turns``, which honour the dataset's
    ``message_keys`` and ``roles``).

    A name is registered once; the same function registered again (its module imported anew)
    replaces itself.
    """

    def register(render: TemplateFn) -> TemplateFn:
        known = TEMPLATES.get(name)
        if known is not None and _origin(known.render) != _origin(render):
            raise ValueError(
                f"template {name!r} is already registered (by {_origin(known.render)})"
            )
        TEMPLATES[name] = Template(
            name, render, None if fields is None else frozenset(fields), task, turns
        )
        return render

    return register


def _origin(render: Callable) -> str:
    return f"{render.__module__}.{render.__qualname__}"


class Columns(dict):
    """A dataset's ``column_map`` (template field → column) as templates receive it, carrying how
    its conversation turns are read: ``message_keys`` (``{role: from, content: value}``) and
    ``roles`` (the data's role names → ``system``, ``user``, ``assistant``, ``tool``), which
    assistant turns train (``train_on``: ``all_assistant`` or ``last_assistant``) and how many
    turns a conversation may have (``max_turns``; None: ``dialogue.MAX_TURNS``). A plain dict
    works wherever a ``Columns`` does: turns are then read with the built-in keys."""

    def __init__(
        self,
        column_map: Mapping[str, str] = (),
        message_keys: Mapping[str, str] | None = None,
        roles: Mapping[str, str] | None = None,
        train_on: str = "all_assistant",
        max_turns: int | None = None,
    ):
        super().__init__(column_map)
        self.message_keys = dict(message_keys or {})
        self.roles = dict(roles or {})
        self.train_on = train_on
        self.max_turns = max_turns


def _shown(name: str, column_map: Mapping[str, str]) -> str:
    column = column_map.get(name, name)
    return name if column == name else f"{name} (column {column!r})"


def field_value(
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


def text_field(
    row: Mapping[str, Any], name: str, column_map: Mapping[str, str], *, required: bool = True
) -> str:
    value = field_value(row, name, column_map, required=required)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(_shown(name, column_map), f"expected text, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError(_shown(name, column_map), f"empty ({value!r})", reason="empty_field")
    return value
