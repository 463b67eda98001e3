"""Tokenize: the Ray Data ``map_batches`` class that turns raw rows into samples.

The tokenizer loads once per actor and every batch is encoded with one call into the Rust
tokenizer; what a sample is (SFT segments, a DPO triple) is the task's (``rayjobs.data.tasks``).
Bad rows are counted here, and only here: the rows the parser found bad under ``on_bad_row: skip``
arrive with their ``_skip`` reason (``sources``), and the rows the template refuses are found here
(``RowError``'s reason; a template raising ValueError, TypeError or LookupError, or a chat template
raising, is ``template_error``). Under ``skip`` each is counted by reason, under ``error`` it raises
``DataError`` naming dataset, file, row and field. Other exceptions are bugs and stop the run.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data import templates
from rayjobs.data.counts import StageTimer, TokenizeCounts, batch_key, report, report_actor
from rayjobs.data.formats import HF, HF_PLACE, bad_row_error, bad_row_place, hf_label
from rayjobs.data.samples import Fit, Templated
from rayjobs.data.tasks import TASKS, Task
from rayjobs.data.templates import Preference, RowError, Segment
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.errors import DataError


class _BadRow(Exception):
    """A row that cannot become a sample: its reason (``formats.SKIP_REASONS``) and problem."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail.replace("\n", "\\n")


THREADS_ENV = "RAYON_NUM_THREADS"
"""The Rust tokenizer's ``encode_batch`` runs on a rayon thread pool as wide as the machine. A
Tokenize actor on Ray caps it at the CPUs it asked Ray for (``threads``), so a node's tokenizers
use the cores they were scheduled on and no more, and the pipeline bench's "CPUs given to
tokenization" is what they really used; a value already in the environment wins."""


class Tokenize:
    """Ray Data ``map_batches`` class: raw rows (see ``sources``) → tokenized samples.

    One actor pool serves every dataset of the run; each row names its dataset in ``_dataset``.
    Output columns: the task's ``sample_columns`` (SFT: ``input_ids`` and ``labels``), ``source``
    (dataset name), ``uid`` (``sample_uid``: identifies the sample across runs, for mixing plans),
    ``num_tokens``, and the streaming path's tags.
    """

    def __init__(
        self,
        datasets: Sequence[DatasetConfig],
        tokenizer: TokenizerConfig,
        seq_len: int,
        overflow: str,
        ledger: Any = None,
        threads: int | None = None,
        min_prompt_tokens: int = 64,
        registry: Mapping[str, templates.Template] | None = None,
    ):
        """``seq_len``, ``overflow`` and (preference triples) ``min_prompt_tokens``: how a sample
        is fitted into a row (``samples.Fit``). ``registry``: the datasets' templates by name,
        as the driver registered them (its user templates travel with them: ``shipped``);
        default: this process's registry."""
        if threads:  # before the tokenizer's first batch builds its thread pool
            os.environ.setdefault(THREADS_ENV, str(threads))
        self.datasets = {spec.name: spec for spec in datasets}
        self.file_index = {  # a file's place in its dataset (sample uids); HF_PLACE for HF's
            s.name: {hf_label(s.source, s.split): HF_PLACE}
            if s.format == HF
            else {f: str(i) for i, f in enumerate(s.files)}
            for s in datasets
        }
        known = templates.TEMPLATES if registry is None else registry
        self.templates = {s.name: known[s.template] for s in datasets}
        self.columns = {s.name: s.columns for s in datasets}
        self.tasks = {s.name: TASKS[self.templates[s.name].task] for s in datasets}
        self.tokenizer = Tokenizer(tokenizer)
        report_actor(ledger, "Tokenize")
        self.fit = Fit(seq_len, overflow, min_prompt_tokens)
        self.ledger = ledger

    def _segments(self, spec: DatasetConfig, record: dict[str, Any]) -> list[Segment]:
        render = self.templates[spec.name].render
        # Without a chat template the tokenizer renders ChatML: handed over as such, rendering
        # skips the tokenizer's method.
        plain = self.tokenizer.chat_template is None
        chat = templates.chatml if plain else self.tokenizer.render_chat
        return render(record, self.columns[spec.name], chat)

    def __call__(self, batch: pa.Table) -> pa.Table:
        table, counts = self.counted(batch)
        report(self.ledger, "add_tokenize", counts, input_key(batch), sample_lengths(table))
        return table

    def counted(self, batch: pa.Table) -> tuple[pa.Table, dict[str, TokenizeCounts]]:
        """The batch's samples and what tokenizing it did, per dataset (reported to no one:
        ``__call__`` reports them to the run's ledger)."""
        counts: dict[str, TokenizeCounts] = defaultdict(TokenizeCounts)
        with StageTimer() as timer:
            table = self._tokenize(batch, counts)
        for tally in counts.values():  # the batch's time, shared by the datasets in it
            tally.seconds = timer.seconds / len(counts)
            tally.cpu_seconds = timer.cpu_seconds / len(counts)
        return table, dict(counts)

    def texts(self, batch: pa.Table) -> list[str]:
        """The texts the batch's good rows are encoded as, whole (a sample's joined segments; a
        triple's prompt, and its prompt followed by each response): what ``backends`` compares
        the two libraries' ids on. Bad rows are left out, uncounted."""
        texts = []
        skips = (
            batch.column("_skip").to_pylist()
            if "_skip" in batch.column_names
            else [None] * batch.num_rows
        )
        names, records = (batch.column(c).to_pylist() for c in ("_dataset", "_record"))
        for name, record, skip in zip(names, records, skips, strict=True):
            if skip is not None:
                continue
            try:
                content = self._template(self.datasets[name], record)
            except _BadRow:
                continue
            if isinstance(content, Preference):
                prompt = content.prompt
                texts += [prompt, prompt + content.chosen, prompt + content.rejected]
            else:
                texts.append("".join(segment.text for segment in content))
        return texts

    def _task(self, batch: pa.Table) -> Task:
        """The task of the batch's datasets (a job's datasets share one, as the config checks; a
        batch whose rows were all bad still gets its task's columns, so every block of a run has
        one schema)."""
        tasks = {self.tasks[name] for name in pc.unique(batch.column("_dataset")).to_pylist()}
        if len(tasks) != 1:
            raise ValueError(f"a Tokenize batch holds samples of {len(tasks)} tasks")
        return tasks.pop()

    def _bad_row(
        self,
        counts: dict[str, TokenizeCounts],
        spec: DatasetConfig,
        where: tuple[str, int],
        reason: str,
        detail: str,
    ) -> None:
        """Count a bad row under ``skip``; raise ``DataError`` under ``error``."""
        place = bad_row_place(spec.name, *where, detail)
        if spec.on_bad_row == "error":
            fix = {
                "missing_field": "Fix the data, map the column with column_map",
                "template_error": "Fix the data or the template",
            }.get(reason, "Fix the data")
            raise DataError(bad_row_error(place, reason, fix))
        tally = counts[spec.name]
        tally.skipped_rows += 1
        tally.skipped_by_reason[reason] = tally.skipped_by_reason.get(reason, 0) + 1
        if len(tally.skipped_examples) < 5:
            tally.skipped_examples.append(f"{place} [{reason}]")

    def _template(self, spec: DatasetConfig, record: str) -> list[Segment]:
        """The row's segments.

        Raises:
            _BadRow: the row's reason and problem (a template function raising ValueError,
                TypeError or LookupError is ``template_error``).
        """
        try:
            row = json.loads(record)
        except json.JSONDecodeError as error:  # parsers emit valid JSON; a hand-made row may not
            raise _BadRow("invalid_json", f"the record is not valid JSON: {error.msg}") from None
        try:
            return self._segments(spec, row)
        except RowError as error:
            raise _BadRow(error.reason, str(error)) from None
        except (ValueError, TypeError, LookupError) as error:
            problem = f"template {spec.template!r} raised {type(error).__name__}: {error}"
            raise _BadRow("template_error", problem) from None

    def _tokenize(self, batch: pa.Table, counts: dict[str, TokenizeCounts]) -> pa.Table:
        rows: list[Templated] = []
        columns = [
            batch.column(name).to_pylist() for name in ("_dataset", "_path", "_row", "_record")
        ]
        skips = (
            batch.column("_skip").to_pylist()
            if "_skip" in batch.column_names
            else [None] * batch.num_rows
        )
        for index, (name, path, row, record, skip) in enumerate(zip(*columns, skips, strict=True)):
            spec = self.datasets[name]
            counts[name].rows += 1
            if skip is not None:  # found bad by the parser; the record says what is wrong
                self._bad_row(counts, spec, (path, row), skip, record)
                continue
            try:
                segments = self._template(spec, record)
            except _BadRow as bad:
                self._bad_row(counts, spec, (path, row), bad.reason, bad.detail)
                continue
            # The file's place in the dataset's sorted file list, not its absolute path:
            # the same data elsewhere (another machine, a fresh clone) gets the same uids.
            origin = f"{name}\0{self.file_index[name].get(path, path)}\0{row}"
            rows.append(Templated(index, spec, origin, segments))
        task = self._task(batch)
        columns, kept = task.encode(self.tokenizer, rows, counts, self.fit)
        for tag in STREAM_TAGS:  # the streaming path's epoch and pass follow the sample
            if tag in batch.column_names:
                columns[tag] = batch.column(tag).take(pa.array(kept, type=pa.int64()))
        return pa.table(columns)


def sample_lengths(table: pa.Table) -> dict[str, list[int]]:
    """Each tokenized sample's tokens, by dataset (the ledger's length histogram)."""
    sources = table.column("source").to_numpy(zero_copy_only=False)
    lengths = table.column("num_tokens").to_numpy()
    return {str(name): lengths[sources == name].tolist() for name in np.unique(sources)}


STREAM_TAGS = ("_epoch", "_pass")
"""Columns the streaming path tags raw rows with (``reads._tag_epoch``)."""


def input_key(batch: pa.Table) -> str:
    """A Tokenize batch's identity for the ledger (``metrics.batch_key``): the place of every row
    it holds (bad rows included), with their epoch and pass when streamed."""
    columns = ["_dataset", "_path", "_row", *(t for t in STREAM_TAGS if t in batch.column_names)]
    return batch_key("tokenize", *(batch.column(name) for name in columns))
