"""Nothing lost quietly: what a run would not train on, said before it starts and after it ends.

Before: the driver looks at each dataset's head (the rows it parses for its estimates): a column
the template does not read is reported, one that changes what a row means (a KTO-style
``label``) is refused, and a head that trains nothing fails the run early. After: the exact
counts (``rayjobs.data.counts``) say which datasets lost samples to ``seq_len`` and the overflow
policy (a warning naming the setting to change), and a run or export that trained no token at
all fails (docs/data.md, "What a run loses").
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rayjobs.data import templates
from rayjobs.errors import DataError

logger = logging.getLogger("rayjobs")

MOSTLY = 0.5
"""A column the template does not read is reported when more than this share of rows has it."""

REFUSED = {
    "label": (
        "true/false: a KTO-style desirability label",
        "rows labelled false would be trained as targets; keep only the rows to learn from",
    ),
}
"""Columns that change what a row means, when the template does not read them: (what they are,
what training on such rows would do)."""


def read_columns(spec: Any) -> set[str] | None:
    """The columns ``spec``'s template reads (its fields through ``column_map``), None when the
    template does not declare them."""
    fields = templates.TEMPLATES[spec.template].fields
    if fields is None:
        return None
    return {spec.column_map.get(field, field) for field in fields}


def column_findings(spec: Any, records: Iterable[str]) -> list[str]:
    """The columns present in most of ``records`` (a dataset's head, JSON object strings) that
    its template does not read and the config does not name in ``ignore_columns``.

    Raises:
        DataError: such a column changes what a row means (``REFUSED``); the message says why
            and what to do.
    """
    read = read_columns(spec)
    rows = [json.loads(r) for r in records]
    rows = [r for r in rows if isinstance(r, dict)]
    if read is None or not rows:
        return []
    present = Counter(key for row in rows for key in row)
    unused = sorted(
        key
        for key, count in present.items()
        if count > MOSTLY * len(rows) and key not in read and key not in spec.ignore_columns
    )
    for key in unused:
        if key in REFUSED and all(isinstance(r.get(key), bool) for r in rows if key in r):
            what, harm = REFUSED[key]
            raise DataError(
                f"dataset {spec.name!r}: column {key!r} ({what}) is not read by template "
                f"{spec.template!r}: {harm}, or set ignore_columns: [{key}] if it means "
                "something else"
            )
    return unused


def unused_message(spec: Any, unused: list[str]) -> str:
    """What a dataset's unused columns mean and what to do."""
    return (
        f"dataset {spec.name!r}: column(s) {unused} are in most rows but template "
        f"{spec.template!r} does not read them (it reads {sorted(read_columns(spec) or [])}); "
        "map them with column_map, or name them in ignore_columns"
    )


def warn_unused(spec: Any, unused: list[str]) -> None:
    """Log the warning for a dataset's unused columns, if it has any."""
    if unused:
        logger.warning(unused_message(spec, unused))


def lost_warnings(config: Any, datasets: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A warning per dataset whose samples with nothing left to train, or that lost most of
    their tokens to truncation, are more than ``packing.warn_lost_share`` of its samples:
    each names the setting to change. ``datasets``: per-dataset counts (``TokenizeCounts``)."""
    share = config.packing.warn_lost_share
    specs = {spec.name: spec for spec in config.datasets}
    warnings = []
    for name, counts in datasets.items():
        samples = counts.get("samples", 0)
        empty = counts.get("samples_without_trained_tokens", 0)
        cut = counts.get("samples_mostly_truncated", 0)
        if not samples or max(empty, cut) <= share * samples:
            continue
        warnings.append(
            f"dataset {name!r}: {empty} of {samples} samples ({empty / samples:.1%}) have no "
            f"token left to train and {cut} ({cut / samples:.1%}) lost most of their tokens to "
            f"truncation (packing.seq_len {config.packing.seq_len}, packing.overflow "
            f"{config.packing.overflow}); {_remedy(config, specs.get(name))}"
        )
    return warnings


SHARE_TOLERANCE = 0.01
"""How far a dataset's realized share of an epoch may fall from its weight's before a warning."""


def share_warnings(config: Any, mixes: list[Mapping[str, Mapping[str, float]]]) -> list[str]:
    """A warning per epoch and dataset whose realized share (``mixes``: per epoch, each
    dataset's ``share``) is more than ``SHARE_TOLERANCE`` from its weight's: stream mode sizes
    each dataset from its head, and a dataset much smaller than its head implied cannot fill its
    share."""
    if config.datasets[0].weight is None:
        return []
    total = sum(spec.weight for spec in config.datasets)
    warnings = []
    for epoch, mix in enumerate(mixes):
        for spec in config.datasets:
            want, got = spec.weight / total, mix.get(spec.name, {}).get("share", 0.0)
            if abs(got - want) > SHARE_TOLERANCE:
                warnings.append(
                    f"dataset {spec.name!r}: {got:.1%} of epoch {epoch} ({config.mix.by}), "
                    f"against a weight of {want:.1%}: stream mode sizes a dataset from the head "
                    "of its first file, which did not stand for the rest; packing.mode: planned "
                    "hits weights exactly"
                )
    return warnings


def _remedy(config: Any, spec: Any) -> str:
    """What to change: the settings that keep more of a dataset's tokens."""
    options = ["a longer packing.seq_len"]
    if config.task == "dpo":
        options.append("a lower dpo.min_prompt_tokens")
    elif config.packing.overflow != "split":
        options.insert(0, "packing.overflow: split")
    if spec is not None and spec.format == "text" and spec.text_split != "line":
        options.insert(0, "text_split: line (one document a line)")
    return "set " + ", or ".join(options)


def require_training(datasets: Mapping[str, Mapping[str, Any]], what: str = "the run") -> None:
    """Raise when ``what`` has no token to train in any dataset (``datasets``: per-dataset
    counts), naming each dataset's samples and why.

    Raises:
        DataError: no dataset has a trained token.
    """
    if not datasets or any(c.get("trained_tokens", 0) for c in datasets.values()):
        return
    parts = [
        f"dataset {name!r}: {c.get('samples', 0)} samples, 0 trained tokens "
        f"({c.get('samples_without_trained_tokens', 0)} with none left to train, "
        f"{c.get('dropped_samples', 0)} dropped, {c.get('skipped_rows', 0)} rows skipped)"
        for name, c in datasets.items()
    ]
    raise DataError(
        f"{what} has nothing to train: {'; '.join(parts)}. A prompt as long as packing.seq_len "
        "leaves its response nothing: set a longer packing.seq_len or packing.overflow: split"
    )
