"""``rayjobs validate``: what can be checked of a config without Ray, in seconds.

The config is validated (every key, sources resolved), each dataset's files listed and sized,
the tokenizer loaded (and a Hugging Face model's config read, without weights), and each
dataset's template tried on its first rows: the driver's head parse (``estimate._parse_head``,
bounded reads of the first file) and the Tokenize stage in this process, so a missing field, a
column that changes what a row means or a head that trains nothing shows here, as the run would
report it once Ray and the data had started; ``tokenizer.backend`` is decided on those rows as a
run decides it (``backends.choose``). No Ray is started or joined: a Hugging Face dataset
that is not a set of files (a ``save_to_disk`` folder, a dataset ``datasets`` builds) is listed,
not read.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pyarrow as pa

from rayjobs.config import Config, DatasetConfig
from rayjobs.data import backends, checks, files
from rayjobs.data.estimate import _parse_head
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
from rayjobs.job.report import tokenizer_line

ROWS = 32
"""Rows of each dataset's first file tried by default (``--rows``)."""


def _size(spec: DatasetConfig) -> str:
    """A dataset's files and their bytes, in words."""
    if not spec.files:
        return f"Hugging Face dataset {spec.source!r} (read through Ray by a run; not tried here)"
    sizes = files.sizes(spec.files, spec.storage)
    total = sum(sizes.values())
    where = files.shown(spec.files[0]) + (
        f" and {len(spec.files) - 1} more" if len(spec.files) > 1 else ""
    )
    return f"{spec.format}, {len(spec.files)} file(s), {total / 2**20:.2f} MiB ({where})"


def _try(
    spec: DatasetConfig, tokenize: Tokenize, rows: int
) -> tuple[dict[str, Any], pa.Table] | None:
    """The template and tokenizer on the first ``rows`` good rows of a dataset's first file:
    its counts (``TokenizeCounts``) and those rows; None for a dataset without files.

    Raises:
        DataError: a bad row under ``on_bad_row: error``, or a column that changes what a row
            means (``checks.REFUSED``).
    """
    if not spec.files:
        return None
    path = spec.files[0]
    numbers, records, _, bad = _parse_head(spec, path, rows)
    numbers, records = numbers[:rows], records[:rows]
    checks.warn_unused(spec, checks.column_findings(spec, records))
    head = record_table(spec.name, [path] * len(records), numbers, records)
    found: dict[str, Any] = {"samples": 0, "tokens": 0}
    if records:  # none: every row read was bad (said below), nothing to template
        _, counts = tokenize.counted(head)
        found = asdict(counts[spec.name]) if spec.name in counts else found
    elif bad:
        reasons = by_reason(bad)
        checks.logger.warning(
            "dataset %r: every row read from the head of %s is bad (%s)", spec.name,
            files.shown(path), reasons,
        )  # fmt: skip
    found["skipped_rows"] = found.get("skipped_rows", 0) + bad.total()
    found["rows"] = len(records) + bad.total()
    found["bad"] = dict(bad)
    return found, head


def validate(config: Config, rows: int = ROWS) -> list[str]:
    """The report's lines for a validated ``config``: datasets, tokenizer, model, each dataset's
    first ``rows`` rows templated and tokenized.

    Raises:
        ConfigError: the tokenizer or the model's config is refused.
        DataError: as ``_try``, or no dataset's first rows train a token.
    """
    from rayjobs.job.pipeline import load_tokenizer

    packing = config.packing
    lines = [
        f"config: task {config.task}, seq_len {packing.seq_len}, {packing.mode} mode, "
        f"{len(config.datasets)} dataset(s), {len(config.eval.datasets)} held out"
    ]
    tokenizer = load_tokenizer(config)
    named = ", ".join(f"{k} {v!r}" for k, v in sorted(tokenizer.special_tokens.items()))
    lines.append(
        f"tokenizer: {config.tokenizer.path}, {tokenizer.vocab_size} tokens ({named}; eos id "
        f"{tokenizer.eos_id}, pad id {tokenizer.pad_id})"
    )
    model = config.train.model
    if model.kind == "hf":
        from rayjobs.train.build import check_model_config  # torch: for kind hf only

        read = check_model_config(config, tokenizer)
        lines.append(f"model: kind hf, {read} (its config read, no weights loaded)")
    else:
        lines.append(f"model: demo decoder, dim {model.dim}, {model.n_layers} layers")
    specs = [*config.datasets, *config.eval.datasets]
    tokenize = Tokenize(
        specs, config.tokenizer, packing.seq_len, packing.overflow,
        min_prompt_tokens=config.dpo.min_prompt_tokens,
    )  # fmt: skip
    heads, tables = {}, {}
    for index, spec in enumerate(specs):
        held_out = index >= len(config.datasets)
        name = f"{spec.name} (held out)" if held_out else spec.name
        lines.append(f"dataset {name}: template {spec.template}, {_size(spec)}")
        tried = _try(spec, tokenize, rows)
        if tried is None:
            continue
        found, tables[spec.name] = tried
        if not held_out:
            heads[spec.name] = found
        lines.append(
            f"  first {found['rows']} rows: {found['samples']} samples, {found['tokens']} tokens, "
            f"{found.get('trained_tokens', 0)} trained, {found['skipped_rows']} skipped"
        )
        if found["bad"]:  # rows the reader refused (the template's own are in skipped)
            lines[-1] += f" ({by_reason(found['bad'])})"
    checks.require_training(heads, "the first rows of every dataset")
    for warning in checks.lost_warnings(config, heads):
        checks.logger.warning("in the first rows: %s", warning)
    # tokenizer.backend on these rows, as a run decides it on its first HEAD_ROWS
    _, choice = backends.choose(config, tokenizer, tables)
    lines.append(tokenizer_line(choice.summary()))
    return lines


def by_reason(counts: dict[str, int]) -> str:
    """Bad rows by reason, in one phrase: ``invalid_json 2, too_deep 1``."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
