"""``tokenizer.backend``: the library that encodes the run's text, decided once by the driver.

``fastokens`` encodes a ``tokenizer.json`` as ``tokenizers`` does, several times faster, but some
tokenizers it cannot load (a SentencePiece model's ``Precompiled`` normalizer) and it keeps no
character offsets (``Tokenizer.encode_parts`` works around that). ``auto`` takes it only where it
is installed, loads the run's tokenizer, and gives the same ids and the same samples
(``input_ids`` and ``labels``, or a triple's three parts) as ``tokenizers`` on the head of every
dataset of the run; else ``tokenizers``, with the reason as a warning. The decision reaches the
Tokenize actors in the config (``tokenizer.backend`` set to it): they never decide again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from rayjobs.config import Config, DatasetConfig
from rayjobs.data.tokenize import Tokenize
from rayjobs.data.tokenizer import LONG_CHARS, Tokenizer, load_fast
from rayjobs.errors import ConfigError

logger = logging.getLogger("rayjobs")

HEAD_ROWS = 256
"""Rows of each dataset's head encoded by both libraries to decide ``auto``."""


@dataclass(frozen=True)
class Choice:
    """The run's encoder and why (the summary's, manifest's and report's ``tokenizer``)."""

    backend: str
    reason: str
    rows: int = 0
    """Head rows whose samples were compared (0: none were)."""
    straddles: int = 0
    """Texts of those rows fastokens could not place by parts alone (a token straddling the start
    of a trained part), encoded again by tokenizers for their offsets (``encode_parts``)."""

    warning: str | None = None
    """The fallback's warning (``auto`` only), also the summary's ``warnings``."""

    def summary(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "warning"}


def decided(config: Config, backend: str) -> Config:
    """``config`` with ``tokenizer.backend`` set to ``backend``: what the Tokenize actors get."""
    tokenizer = config.tokenizer.model_copy(update={"backend": backend})
    return config.model_copy(update={"tokenizer": tokenizer})


def refusal(problem: str) -> ConfigError:
    """``tokenizer.backend: fastokens`` set where it cannot be used."""
    return ConfigError(
        f"tokenizer.backend: fastokens {problem}; set tokenizer.backend to auto or tokenizers"
    )


def choose(
    config: Config,
    tokenizer: Tokenizer,
    heads: dict[str, pa.Table | None] | None = None,
) -> tuple[Config, Choice]:
    """The run's encoder, decided on the datasets' ``heads`` (their raw-row tables, by name;
    default: each dataset's first ``HEAD_ROWS`` good rows), and the config the Tokenize actors
    get (``tokenizer.backend`` set to it).

    Raises:
        ConfigError: ``tokenizer.backend: fastokens`` where fastokens is not installed, cannot
            load the tokenizer, or encodes a head otherwise than tokenizers.
    """
    wanted = config.tokenizer.backend
    if wanted == "tokenizers":
        return config, Choice("tokenizers", "tokenizer.backend: tokenizers")
    _, problem = load_fast(tokenizer.backend)
    rows = straddles = 0
    specs = [*config.datasets, *config.eval.datasets]
    if problem is None:
        if heads is None:
            heads = {spec.name: _head(config, spec) for spec in specs}
        problem, rows, straddles = _compare(config, specs, heads)
    if problem is None:
        said = (
            "tokenizer.backend: fastokens, which "
            if wanted == "fastokens"
            else "fastokens is installed, loads the tokenizer and "
        )
        reason = (
            f"{said}gives the same ids and samples as tokenizers on {rows} head rows of "
            f"{len(specs)} dataset(s) ({straddles} text(s) placed by tokenizers' offsets, a "
            "token straddling a trained part's start)"
        )
        return decided(config, "fastokens"), Choice("fastokens", reason, rows, straddles)
    if wanted == "fastokens":
        raise refusal(problem)
    reason = f"fastokens {problem}"
    warning = f"tokenizer.backend auto: using tokenizers ({reason})"
    logger.warning(warning)
    return decided(config, "tokenizers"), Choice("tokenizers", reason, rows, straddles, warning)


def _head(config: Config, spec: DatasetConfig) -> pa.Table | None:
    """Up to ``HEAD_ROWS`` good rows from the head of the dataset's first file (parsed in the
    driver, which opens no other file of the dataset; a Hugging Face dataset's read through Ray,
    on the data nodes, as ``estimate`` reads them)."""
    from rayjobs.data.estimate import _head as head
    from rayjobs.data.placement import on_data_nodes

    first = spec.model_copy(update={"files": spec.files[:1]}) if spec.files else spec
    return head(first, on_data_nodes(config), HEAD_ROWS).table


def _compare(
    config: Config, specs: Sequence[DatasetConfig], heads: dict[str, pa.Table | None]
) -> tuple[str | None, int, int]:
    """Where fastokens and tokenizers part on the heads of ``specs``, in a few words (None:
    nowhere), the head rows compared, and the texts fastokens left to tokenizers' offsets."""
    stages = {
        backend: Tokenize(
            specs,
            config.tokenizer.model_copy(update={"backend": backend}),
            config.packing.seq_len,
            config.packing.overflow,
            min_prompt_tokens=config.dpo.min_prompt_tokens,
        )  # fmt: skip
        for backend in ("tokenizers", "fastokens")
    }
    rows = 0
    for spec in specs:
        head = heads.get(spec.name)
        if head is None or not head.num_rows:
            continue
        rows += head.num_rows
        # a text over LONG_CHARS is encoded by tokenizers a chunk at a time whichever encodes
        texts = [t for t in stages["tokenizers"].texts(head) if len(t) <= LONG_CHARS]
        problem = _ids_differ(stages, texts)
        if problem is None:
            ours, theirs = (stages[b].counted(head)[0] for b in ("tokenizers", "fastokens"))
            if not ours.equals(theirs):
                problem = f"gives other samples than tokenizers on dataset {spec.name!r}'s head"
        if problem is not None:
            return problem, rows, stages["fastokens"].tokenizer.straddles
    return None, rows, stages["fastokens"].tokenizer.straddles


def _ids_differ(stages: dict[str, Tokenize], texts: Sequence[str]) -> str | None:
    ours, theirs = (stages[b].tokenizer.encode_batch(list(texts)) for b in stages)
    for text, a, b in zip(texts, ours, theirs, strict=True):
        if a != b:
            return f"gives other ids than tokenizers for {text[:40]!r}…"
    return None
