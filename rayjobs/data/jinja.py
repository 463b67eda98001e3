"""Chat templates rendered as transformers' ``apply_chat_template`` renders them (its sandbox, its
``tojson``, ``raise_exception``, ``strftime_now``, ``namespace`` and ``{% generation %}`` tag; the
reasoning of a turn under each name templates read), in a sandbox that also bounds what a template
builds: a chat template is code from the Hub, and ``'x' * 10**8`` would allocate its result on
every row. A string or list built by ``*`` or ``+`` is at most :data:`MAX_BUILT` items, a
power's exponent at most :data:`MAX_EXPONENT`, and the rendered text at most :data:`GROWTH` times
the conversation's text plus :data:`SLACK` characters; a template over any raises
:class:`RenderLimitError` (the row is a ``template_error``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import nodes, pass_eval_context
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_BUILT = 1 << 20
"""Characters (or items) of a string (or list) a template may build with ``*`` or ``+``."""

MAX_EXPONENT = 1024
"""The largest exponent of ``**`` (``10 ** 10 ** 8`` would compute for minutes)."""

GROWTH = 4
"""The rendered text is at most this many times the conversation's text, plus :data:`SLACK`."""

SLACK = 1 << 20
"""Characters a template may add beyond ``GROWTH`` times the conversation (its own text: a
default system prompt, a tools preamble)."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RenderLimitError(TemplateError):
    """A chat template built or rendered more than the sandbox allows."""


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with ``*``, ``+`` and ``**`` checked before they run."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                size = _size(seq)
                if size is not None and isinstance(count, int) and size * count > MAX_BUILT:
                    raise RenderLimitError(
                        f"the template repeats {size} items {count} times, over {MAX_BUILT}"
                    )
        elif operator == "+":
            sizes = (_size(left), _size(right))
            if None not in sizes and sum(sizes) > MAX_BUILT:
                raise RenderLimitError(f"the template joins {sum(sizes)} items, over {MAX_BUILT}")
        elif operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise RenderLimitError(f"the template raises to the power {right}, over {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: its body, as rendered (transformers tracks
    where it lies; rayjobs finds turns by rendering, ``templates.spans``)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @pass_eval_context
    def _body(self, context: Any, caller: Any) -> str:
        return caller()


class _Namespace(Namespace):
    """transformers' namespace: no underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store {name!r} on a namespace")


class _Dict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def compiled(chat_template: str) -> Any:
    """``chat_template`` compiled in the bounded sandbox (once per process and template).

    Raises:
        jinja2.TemplateSyntaxError: it is not valid Jinja.
    """
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env.from_string(chat_template)


def _aliased(message: dict) -> dict:
    """A turn with its reasoning under every name templates read (as transformers gives it)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(chat_template: str, messages: list[dict], tools: Any, **context: Any) -> str:
    """The conversation rendered by ``chat_template`` (``context``: ``add_generation_prompt``
    and the special tokens), as ``apply_chat_template`` renders it, within the bounds.

    Raises:
        RenderLimitError: the template builds or renders more than the bounds allow.
        jinja2.TemplateError: what the template raises (``raise_exception``), and other errors.
    """
    chat = [_aliased(m) for m in messages]
    text = sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in chat)
    limit = GROWTH * text + SLACK
    pieces, size = [], 0
    for piece in compiled(chat_template).generate(
        messages=chat, tools=tools, documents=None, **context
    ):
        size += len(piece)
        if size > limit:
            raise RenderLimitError(f"the template rendered over {limit} characters")
        pieces.append(piece)
    return "".join(pieces)
