"""What every config section shares: strict validation, and names checked against a registry."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def registered(value: str, registry, kind: str) -> str:
    """``value`` if it names an entry of ``registry``; else a message listing the entries."""
    if value not in registry:
        choices = ", ".join(repr(name) for name in sorted(registry))
        raise ValueError(f"unknown {kind} {value!r}; registered: {choices}")
    return value


class Strict(BaseModel):
    """A config section: unknown keys refused, frozen, no coercion of text into numbers."""

    # allow_inf_nan: a weight or lr of .inf passes gt=0 (and NaN fails every check silently);
    # strict: YAML's quoted '3e-4' is text, refused for a number (not coerced: a value the file
    # says is text should not silently become one); an int is still taken for a float
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
