"""The pipeline bench's references, measured in the same run as the pipeline (``bench.pipeline``):

- ``reference_rates``: the job's Tokenize callable (templates, tokenizer, samples) alone on one
  core over the 1x data;
- ``tokenizer_rates``: the fast tokenizer alone on the same rows' texts (rendered by the same
  templates beforehand, outside the timing), one core, Tokenize's batches: ``fastokens`` where it
  is installed (``encode_batch_flat``, the library the job's ``tokenizer.backend: fastokens``
  encodes with), else ``tokenizers`` (``encode_batch``). What the whole path delivers per data CPU
  over this is the share of a core the rest of the path leaves the tokenizer.
"""

from __future__ import annotations

import os
import statistics
import time


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) CPU ticks of this host since boot (``/proc/stat``; None where there is none):
    the time a hypervisor ran something else on this machine's vCPUs."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def steal_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two ``cpu_ticks``.

    >>> steal_between((10, 1000), (40, 1200))
    0.15
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


REFERENCE_REPEATS = 5
"""Passes over the 1× data of each reference measurement (one pass is about half a CPU second)."""


def reference_rates(config, repeats: int = REFERENCE_REPEATS) -> list[tuple[float, float]]:
    """The job's templates and tokenizer alone on one core: a 1-CPU Ray task whose tokenizer runs
    one thread (``tokenize.THREADS_ENV``), ``repeats`` passes over one copy of the data, each
    pass's (tokens per second, tokens per CPU second). Nothing else runs meanwhile (the pipeline
    is not started or has ended), so the first is what one core delivers on this machine, the
    time its host takes from it included, as it is from the pipeline."""
    import ray

    from rayjobs.data.tokenize import THREADS_ENV

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {THREADS_ENV: "1"}})
    def measure(config, repeats: int) -> list[float]:
        import pyarrow as pa

        from rayjobs.data.sources import read_dataset
        from rayjobs.data.tokenize import Tokenize

        tokenize = Tokenize(config.datasets, config.tokenizer, config.packing.seq_len, "truncate")
        tables = [
            pa.concat_tables(ray.get(read_dataset(spec).to_arrow_refs()))
            for spec in config.datasets
        ]
        tokenize(tables[0].slice(0, 8))  # the tokenizer's thread pool is built here
        rates = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            tokens = sum(int(tokenize(t).column("num_tokens").to_numpy().sum()) for t in tables)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rates.append((tokens / wall, tokens / cpu))
        return rates

    return ray.get(measure.remote(config, repeats))


def reference(rates: list[float]) -> float:
    """The reference rate: the median of every pass measured before and after the runs (this
    machine's speed drifts by a third over minutes; one short pass was as likely an outlier).

    >>> reference([250.0, 240.0, 400.0, 260.0, 255.0, 245.0])
    252.5
    """
    return statistics.median(rates)


def measure_reference(config, repeats: int = REFERENCE_REPEATS) -> tuple[list[tuple], float | None]:
    """``reference_rates`` and the share of CPU time stolen while they ran."""
    ticks = cpu_ticks()
    rates = reference_rates(config, repeats)
    return rates, steal_between(ticks, cpu_ticks())


TOKENIZE_BATCH_ROWS = 256
"""Rows per encode call of the tokenizer-alone reference (the Tokenize actors' batch,
``stream.TOKENIZE_BATCH_ROWS``)."""


def tokenizer_rates(config, repeats: int = REFERENCE_REPEATS) -> tuple[str, list[tuple]]:
    """The fast tokenizer alone on one core (see module note): which library, and each pass's
    (tokens per second, tokens per CPU second) over the 1x data's texts."""
    import ray

    from rayjobs.data.tokenize import THREADS_ENV

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {THREADS_ENV: "1"}})
    def measure(config, repeats: int) -> tuple[str, list[tuple[float, float]]]:
        import pyarrow as pa

        from rayjobs.data.sources import read_dataset
        from rayjobs.data.tokenize import Tokenize, _BadRow

        tokenize = Tokenize(config.datasets, config.tokenizer, config.packing.seq_len, "truncate")
        batches = []
        for spec in config.datasets:
            table = pa.concat_tables(ray.get(read_dataset(spec).to_arrow_refs()))
            for start in range(0, table.num_rows, TOKENIZE_BATCH_ROWS):
                texts = []
                for record in table.column("_record").to_pylist()[start:][:TOKENIZE_BATCH_ROWS]:
                    try:
                        segments = tokenize._template(spec, record)
                    except _BadRow:
                        continue
                    texts.append("".join(segment.text for segment in segments))
                batches.append(texts)
        backend = tokenize.tokenizer.backend
        name, encode = fast_encoder(backend)
        encode(batches[0])  # thread pools, caches of first use
        rates = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            tokens = sum(encode(texts) for texts in batches)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rates.append((tokens / wall, tokens / max(cpu, 1e-9)))
        return name, rates

    return ray.get(measure.remote(config, repeats))


def fast_encoder(backend):
    """(library, encode) where encode(texts) → their token count, without special tokens:
    fastokens where it is installed (loaded from ``backend``, a ``tokenizers.Tokenizer``), else
    ``backend`` itself."""
    try:
        import fastokens

        fast = fastokens.Tokenizer.from_json_str(backend.to_str())
    except Exception:  # noqa: BLE001 - not installed, or it cannot read this tokenizer
        fast = None
    if fast is not None:
        import numpy as np

        def encode_fast(texts: list[str]) -> int:
            _, offsets = fast.encode_batch_flat(texts, add_special_tokens=False)
            return int(np.frombuffer(offsets, np.uint64)[-1]) if texts else 0

        return "fastokens", encode_fast

    def encode(texts: list[str]) -> int:
        return sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))

    return "tokenizers", encode


def data_cpus() -> int:
    """The cores this host gives the bench's processes: the whole data path (Ray's processes,
    reads, Tokenize, packer, consumers) runs on them, whatever number of logical CPUs Ray is told
    it has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
