"""Hostile rows, bounded before they are parsed: a row's bytes (``max_row_bytes``) and how deep its
JSON nests (``max_depth``); a row over either is a bad row (``too_large``, ``too_deep``), never a
``MemoryError`` or a ``RecursionError`` (docs/data.md, "Bad rows")."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_ROW_BYTES = 128 << 20
"""A row's bytes at most, by default (``datasets[].max_row_bytes``): a JSONL line, a text
document, a record of a JSON list."""

MAX_DEPTH = 100
"""How deep a row's JSON may nest, by default (``datasets[].max_depth``); Python's parser stops
near a thousand levels with a ``RecursionError``."""


class TooLarge(int):
    """A line's size in bytes where it is over ``max_row_bytes``: its bytes were not kept."""


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def nesting(text: str) -> int:
    """How deep ``text`` (JSON) nests its arrays and objects, strings aside.

    >>> nesting('{"a": [1, {"b": "[[["}]}')
    3
    """
    codes = np.frombuffer(_STRING.sub("", text).encode(), dtype=np.uint8)
    steps = np.isin(codes, (91, 123)).astype(np.int32) - np.isin(codes, (93, 125))
    return int(np.cumsum(steps).max(initial=0))


def too_deep(text: str, max_depth: int) -> str | None:
    """Why ``text`` (a JSON row) nests too deep, or None: counted only where it holds more
    brackets than ``max_depth`` (two counts in C: a row of any size but few brackets passes)."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    depth = nesting(text)
    return f"nested {depth} levels, over max_depth ({max_depth})" if depth > max_depth else None


def load_row(text: str, max_depth: int) -> tuple[Any, str | None, str]:
    """A JSON row's value, or None, the bad-row reason and the problem (``too_deep``; text that
    is not JSON raises ``json.JSONDecodeError`` as ``json.loads`` does)."""
    problem = too_deep(text, max_depth)
    if problem is None:
        try:
            return json.loads(text), None, ""
        except RecursionError:
            problem = f"nested deeper than Python's JSON parser goes, over max_depth ({max_depth})"
    return None, "too_deep", problem


def size_problem(size: int, max_row_bytes: int) -> str:
    return f"{size} bytes, over max_row_bytes ({max_row_bytes})"
