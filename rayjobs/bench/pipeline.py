"""``rayjobs bench pipeline``: the streaming path end to end at growing data sizes, in one run.

For each scale the bench writes the real alpaca and hh chat sets repeated ``scale`` times as JSONL
shards (one file per copy), streams two epochs through the job's own data path (``start_job``:
read → mix → Tokenize pool → PackStream pool) into two consumers standing in for trainers
(``streaming_split(2, equal=True)``; each takes its batches as ``train.rank_batches`` does,
read ahead in a thread with Ray's prefetch off, ``rayjobs.train.ahead``), and reports from job
start:

- ``first_batch_s``: seconds until the first packed batch reaches a consumer;
  ``every_first_batch_s``: until every consumer has had its first (trainers that step together
  start when the last of them has one);
- ``tokens_per_s``: non-pad tokens consumed per second from job start to the last batch (start-up
  included); ``steady_tokens_per_s``: the same from the first batch to the last (the steady state;
  ``last_batch_s`` is when the last batch came). A packer call emits its whole window at once, so
  at a scale of only a few windows the rows come in a few bursts and these rates are over the run,
  not over a moment;
- ``median_batch_s`` and ``epoch_gap_s``: unpaced, the consumers take batches as fast as they
  come, so batches arrive in bursts of a block and the median wait is near 0; the epoch-boundary
  criterion is read off a **paced** pass at the last scale instead (``paced_*``): each consumer
  spends a fixed step per batch, set so that both together ask for ``pace`` (default 0.6) of the
  unpaced steady throughput, as trainers slower than their data do. Then the time between batches
  is the step plus any wait for data, and ``paced_gap_s`` (the time between a consumer's last
  batch of epoch 0 and its first of epoch 1, the worse consumer) is compared with
  ``paced_median_s``;
- ``peak_rss_mb``: peak resident memory of the driver and every process under it (the local Ray
  it started; not another Ray on the host), sampled every 0.5 s, plus the object store in use at
  that moment;
- ``tokenize_cpu_s`` / ``pack_cpu_s``: CPU seconds of the Tokenize and PackStream stages (their
  stage timers, all actors; the tokenizer's threads included);
- ``cpu_by_process``: CPU seconds of the same processes from job start to the last batch, by
  kind (an actor's class, a task's name, ``raylet``, …): where the cores went besides
  tokenization;
- ``reference_tokens_per_s``: the same tokenizer and templates alone on one core (a 1-CPU Ray task
  with the tokenizer's thread pool at one thread, nothing else running) over the 1× data, tokens
  per second of wall time, the median of passes before and after the runs;
  ``reference_cpu_tokens_per_s``: the same passes per CPU second; ``tokenize_cpus``: the CPUs the
  job gives tokenization (Tokenize actors at most × 1 CPU each; ``--tokenize-actors`` sets it), so
  ``steady / (tokenize_cpus × reference)`` is the share of the tokenizers' capacity the whole path
  delivers. Both are wall-clock rates: on a virtual machine the host takes some of each vCPU's
  time (``steal``, in ``/proc/stat``), from the pipeline and the reference alike, and CPU time
  leaves that out; ``steal_share`` (during the run) and ``reference_steal_share`` (during the
  reference's passes) say how much it took.
- ``tokenizer_tokens_per_s``: the fast tokenizer alone (fastokens where installed, else
  tokenizers; ``tokenizer`` says which) on one core over the same rows' texts, rendered beforehand
  (``reference.tokenizer_rates``); the report sets the steady rate per data CPU (``data_cpus``: the
  cores the whole path ran on) against it: the share of a core the rest of the path leaves the
  tokenizer.

Ratios between scales are measured in the same run, on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rayjobs.bench.reference import (
    REFERENCE_REPEATS,
    cpu_ticks,
    data_cpus,
    measure_reference,
    reference,
    steal_between,
    tokenizer_rates,
)
from rayjobs.train.ahead import read_ahead

BATCH_ROWS = 4

CPU_TABLE_PROCESSES = 8
"""Process kinds listed in the CPU line of each scale (the busiest)."""


@dataclass
class PipelineRow:
    scale: int
    samples_per_epoch: int
    first_batch_s: float
    tokens_per_s: float
    steady_tokens_per_s: float
    median_batch_s: float
    epoch_gap_s: float
    peak_rss_mb: float
    reference_tokens_per_s: float
    tokenize_cpus: int
    tokenize_cpu_s: float = 0.0
    last_batch_s: float = 0.0
    pack_cpu_s: float = 0.0
    paced_step_s: float | None = None
    paced_median_s: float | None = None
    paced_gap_s: float | None = None
    tokens: int = 0
    """Non-pad tokens the consumers took (both epochs)."""
    reference_min: float = 0.0
    reference_max: float = 0.0
    every_first_batch_s: float | None = None
    """Seconds from job start until every consumer has had its first batch."""
    reference_cpu_tokens_per_s: float = 0.0
    """The reference's passes per CPU second (their median)."""
    steal_share: float | None = None
    """Share of the host's CPU time stolen by the hypervisor from job start to the last batch."""
    reference_steal_share: float | None = None
    """The same during the reference's passes (the mean of the passes before and after)."""
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each kind of process from job start to the last batch (``process_label``)."""
    data_cpus: int = 0
    """Cores the whole data path ran on (``reference.data_cpus``)."""
    tokenizer: str = ""
    """The library of the tokenizer-alone reference (``reference.tokenizer_rates``)."""
    tokenizer_tokens_per_s: float = 0.0
    """That reference: the median of its passes, tokens per second of wall time."""
    tokenizer_cpu_tokens_per_s: float = 0.0
    """The same per CPU second (all its threads): what the report compares with."""


def write_shards(data_dir: Path, out: Path, scale: int) -> dict[str, Path]:
    """The alpaca and hh chat sets, ``scale`` copies each, one JSONL shard per copy."""
    alpaca = json.loads((data_dir / "sft" / "alpaca_en_demo.json").read_text())
    chat = (data_dir / "chat" / "hh_rlhf_harmless_chosen.messages.jsonl").read_text()
    folders = {"alpaca": out / "alpaca", "hh_chat": out / "hh_chat"}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(row) + "\n" for row in alpaca)
    for copy in range(scale):
        (folders["alpaca"] / f"part-{copy:04d}.jsonl").write_text(lines)
        (folders["hh_chat"] / f"part-{copy:04d}.jsonl").write_text(chat)
    return folders


SAMPLE_S = 0.5
"""Seconds between the memory and CPU sampler's sweeps over the processes."""

LABEL_SWEEPS = 4
"""A process's title is read again every this many sweeps (a Ray worker's title names the task it
runs, so it changes; reading every title at every sweep cost the driver a twentieth of a core).
The tree is walked at every sweep (walked every 4th, a worker's start-up CPU went to the task it
was first seen running, and short read tasks to ``IDLE``); its processes are kept from sweep to
sweep (a ``psutil.Process`` made anew reads its start time: a quarter of the sampler's samples)."""


class _Memory(threading.Thread):
    """Samples the RSS of this driver and every process under it (the local Ray it started:
    GCS, raylet, workers, agents), and the object store in use; and each process's CPU time, for
    ``cpu_by_process``. Only the driver's own process tree: matching "ray" in command lines also
    counted other Ray sessions on the host (and any program with "ray" in its arguments), so a
    second cluster's memory and CPU showed up as the bench's. (Connected to a running cluster,
    ``$RAY_ADDRESS``, the tree is the driver alone.) The sampler runs in the driver, beside the
    consumers, so it is kept cheap: a sweep every ``SAMPLE_S``, titles every ``LABEL_SWEEPS``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_mb, self.running = 0.0, True
        self.last_cpu: dict[int, float] = {}  # pid → CPU s at its last sample
        self.labels: dict[int, str] = {}  # pid → label (``process_label``)
        self.totals: dict[str, float] = {}  # label → CPU s while sampling
        self.last_task: dict[int, str] = {}  # pid → the last label it had other than IDLE

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        sweep, processes = 0, [me]
        while self.running:
            rss = 0
            try:  # the same Process objects from sweep to sweep (a new one reads its start time)
                known = {process.pid: process for process in processes}
                found = [me, *me.children(recursive=True)]
                processes = [known.get(process.pid, process) for process in found]
            except psutil.Error:  # a child ended while the tree was walked: next sweep
                pass
            for process in processes:
                try:
                    if process.pid not in self.labels or sweep % LABEL_SWEEPS == 0:
                        self.labels[process.pid] = process_label(
                            process.cmdline(), process.pid == me.pid
                        )
                    label = self.labels[process.pid]
                    with process.oneshot():
                        rss += process.memory_info().rss
                        times = process.cpu_times()
                except psutil.Error:  # it ended (or cannot be read) between listing and reading
                    continue
                self.account(process.pid, label, times.user + times.system, sweep == 0)
            sweep += 1
            store = _object_store_used()
            self.peak_mb = max(self.peak_mb, (rss + store) / 2**20)
            time.sleep(SAMPLE_S)

    def account(self, pid: int, label: str, cpu: float, first_sweep: bool = False) -> None:
        """A process's CPU time at a sweep: what it used since its last sample goes to its label
        then. A task worker's title is ``IDLE`` between tasks, and its tasks are often shorter
        than a sweep: its CPU goes to the last task seen on it (a Ray worker idle for a whole
        sweep uses next to nothing), to ``IDLE`` only before it has run one.

        >>> memory = _Memory()
        >>> for pid, label, cpu in [(7, "IDLE", 1.0), (7, "ReadRowFile", 1.5), (7, "IDLE", 2.5),
        ...                         (8, "Ledger", 0.25), (8, "Ledger", 0.5)]:
        ...     memory.account(pid, label, cpu)
        >>> memory.cpu_by_process()
        {'ReadRowFile': 1.5, 'IDLE': 1.0, 'Ledger': 0.5}
        """
        if label == "IDLE":
            label = self.last_task.get(pid, label)
        else:
            self.last_task[pid] = label
        # (a process first seen at the first sweep counts from there; one started later, from 0)
        start = self.last_cpu.get(pid, cpu if first_sweep else 0.0)
        self.totals[label] = self.totals.get(label, 0.0) + cpu - start
        self.last_cpu[pid] = cpu

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds spent while sampling, by process label, largest first."""
        return dict(sorted(self.totals.items(), key=lambda item: -item[1]))


def process_label(cmdline: list[str], driver: bool = False) -> str:
    """What a process is, for the CPU table: a Ray worker's title less ``ray::`` (its actor or
    last task), else the program's name; this process is the driver (consumers included).

    >>> process_label(["ray::MapWorker(MapBatches(Tokenize))"])
    'MapWorker(MapBatches(Tokenize))'
    >>> process_label(["/usr/lib/python3/site-packages/ray/core/src/ray/raylet/raylet", "--x"])
    'raylet'
    >>> process_label(["python", "-m", "rayjobs.cli"], driver=True)
    'driver (consumers)'
    >>> process_label(["python3.11", "/site-packages/ray/_private/workers/default_worker.py"])
    'worker start-up'
    """
    if driver:
        return "driver (consumers)"
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].removeprefix("ray::").split(" ")[0]
    if any(part.endswith("default_worker.py") for part in cmdline):
        return "worker start-up"  # a Ray worker before its title: importing, connecting
    return Path(cmdline[0]).name if cmdline else "?"


def _object_store_used() -> int:
    """Bytes of the object store in use (Ray is up: the bench starts it before sampling)."""
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0)
    return int(total - ray.available_resources().get("object_store_memory", total))


def _consume(iterator, stamps: list, tokens: list, step_s: float = 0.0) -> None:
    """Take every batch of one split, recording (arrival, highest epoch, lowest epoch) and its
    tokens; with ``step_s`` spend that long on each batch, as a trainer's step would."""
    # As the trainers take theirs (train.rank_batches): read ahead in a thread, not Ray's prefetch
    # (whole batches only, as with train.drop_last: a bench of the stream's pace, not of its tail).
    batches = iterator.iter_batches(batch_size=BATCH_ROWS, drop_last=True, prefetch_batches=0)
    for batch in read_ahead(batches):
        stamps.append((time.perf_counter(), int(batch["epoch"].max()), int(batch["epoch"].min())))
        tokens.append(int(batch["num_tokens"].sum()))
        if step_s:
            time.sleep(step_s)


def epoch_gap(stamps: list[tuple[float, int, int]]) -> tuple[float, float]:
    """One consumer's (median time between batches, time between its last batch of epoch 0 and
    its first batch holding epoch 1).

    >>> epoch_gap([(0.0, 0, 0), (1.0, 0, 0), (2.0, 0, 0), (5.0, 1, 1), (6.0, 1, 1)])
    (1.0, 3.0)
    """
    times = [t for t, _, _ in stamps]
    waits = [b - a for a, b in zip(times, times[1:], strict=False)]
    boundary = next((i for i, (_, high, _) in enumerate(stamps) if high >= 1), None)
    gap = waits[boundary - 1] if boundary else 0.0
    return (statistics.median(waits) if waits else 0.0), gap


def every_first(stamps: list[list], started: float) -> float | None:
    """Seconds from ``started`` until every consumer had its first batch; None if one had none.

    >>> every_first([[(3.0, 0, 0), (4.0, 0, 0)], [(7.5, 0, 0)]], started=1.0)
    6.5
    >>> every_first([[(3.0, 0, 0)], []], started=1.0) is None
    True
    """
    if not all(stamps):
        return None
    return max(consumer[0][0] for consumer in stamps) - started


def first_tokens(stamps: list[list], tokens: list[list]) -> int:
    """Tokens of the first batch consumed (it arrived at the start of the steady state)."""
    first = min(range(len(stamps)), key=lambda i: stamps[i][0][0] if stamps[i] else float("inf"))
    return tokens[first][0] if tokens[first] else 0


def run_scale(config, scale: int, step_s: float = 0.0) -> dict:
    """Stream two epochs of the config into two consumers; timings from job start."""
    from rayjobs.job.pipeline import start_job

    memory = _Memory()
    memory.start()
    ticks = cpu_ticks()
    started = time.perf_counter()
    job = start_job(config, prefix=f"bench-{scale}x")
    iterators = job.rows.streaming_split(2, equal=True)
    stamps: list[list] = [[], []]
    tokens: list[list] = [[], []]
    threads = [
        threading.Thread(target=_consume, args=(it, stamps[i], tokens[i], step_s))
        for i, it in enumerate(iterators)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steal = steal_between(ticks, cpu_ticks())
    memory.running = False
    memory.join()
    times = sorted(t for consumer in stamps for t, _, _ in consumer)
    medians, gaps = zip(*(epoch_gap(consumer) for consumer in stamps), strict=True)
    snapshot = job.snapshot()
    return {
        "samples_per_epoch": snapshot["pack"][0]["num_documents"],
        "first_batch_s": times[0] - started,
        "every_first_batch_s": every_first(stamps, started),
        "tokens_per_s": sum(map(sum, tokens)) / max(1e-9, times[-1] - started),
        "steady_tokens_per_s": (sum(map(sum, tokens)) - first_tokens(stamps, tokens))
        / max(1e-9, times[-1] - times[0]),
        "last_batch_s": times[-1] - started,
        "tokens": sum(map(sum, tokens)),
        "median_batch_s": statistics.median(medians),
        "epoch_gap_s": max(gaps),
        "peak_rss_mb": memory.peak_mb,
        "tokenize_cpu_s": sum(c["cpu_seconds"] for c in snapshot["tokenize"].values()),
        "pack_cpu_s": sum(c["cpu_seconds"] for c in snapshot["pack"].values()),
        "cpu_by_process": memory.cpu_by_process(),
        "steal_share": steal,
    }


def bench_pipeline(
    data_dir: Path,
    scales: list[int],
    window_tokens: int | None = None,
    tokenize_actors: int | None = None,
    pace: float = 0.6,
    weights: list[float] | None = None,
) -> list[PipelineRow]:
    """Each scale unpaced; then the last scale again with consumers paced at ``pace`` of its
    unpaced steady throughput (``pace`` 0: no paced pass). ``weights``: the alpaca and hh chat
    sets' weights (by tokens), else their natural proportions."""
    import ray.data

    from rayjobs.config import config_from_dict
    from rayjobs.data import backends
    from rayjobs.data.placement import cluster_cpus
    from rayjobs.data.stream import TOKENIZE_CPUS
    from rayjobs.job.pipeline import init_ray, load_tokenizer

    ray.data.DataContext.get_current().enable_progress_bars = False  # the table is the output
    runs = []  # (scale, tokenize CPUs, what run_scale measured), in scale order

    def scale_config(folder: Path, scale: int):
        folders = write_shards(data_dir, folder, scale)
        return config_from_dict(
            {
                "datasets": [
                    {"name": "alpaca", "source": str(folders["alpaca"]), "template": "alpaca"}
                    | ({"weight": weights[0]} if weights else {}),
                    {"name": "hh_chat", "source": str(folders["hh_chat"]), "template": "chat"}
                    | ({"weight": weights[1]} if weights else {}),
                ],
                "tokenizer": {"path": str(data_dir / "tokenizers" / "gpt2")},
                "packing": {"seq_len": 2048}
                | ({"window_tokens": window_tokens} if window_tokens else {}),
                "train": {"epochs": 2},
                "ray": {"tokenize_concurrency": tokenize_actors} if tokenize_actors else {},
            }
        )

    with tempfile.TemporaryDirectory() as tmp:
        for scale in scales:
            config = scale_config(Path(tmp) / f"{scale}x", scale)
            load_tokenizer(config)
            init_ray(config)
            if not runs:
                # The reference's passes are over one copy of the data (the 1x shards), whatever
                # the first scale: the first scale's own data was `scale` copies, so with
                # --scales 30 each pass took 30 times as long (and its steal share was of that).
                reference_config = config if scale == 1 else scale_config(Path(tmp) / "1x", 1)
                # with the encoder the job decides (tokenizer.backend auto), as its actors do
                reference_config, _ = backends.choose(reference_config, load_tokenizer(config))
                rates, steal_before = measure_reference(reference_config)
                library, alone = tokenizer_rates(reference_config)
            actors = config.ray.tokenize_concurrency or max(1, int(cluster_cpus(config)) // 2)
            runs.append((scale, actors * TOKENIZE_CPUS, run_scale(config, scale)))
        if pace:
            last = runs[-1][2]
            batch_tokens = BATCH_ROWS * 2048 * 0.99
            step = batch_tokens / (pace * last["steady_tokens_per_s"] / 2)  # 2 consumers
            paced = run_scale(config, runs[-1][0], step_s=step)
            last |= {
                "paced_step_s": step,
                "paced_median_s": paced["median_batch_s"],
                "paced_gap_s": paced["epoch_gap_s"],
            }
        after, steal_after = measure_reference(reference_config)
        rates += after
        alone += tokenizer_rates(reference_config)[1]
    wall, cpu = [rate for rate, _ in rates], [rate for _, rate in rates]
    steals = [share for share in (steal_before, steal_after) if share is not None]
    return [
        PipelineRow(scale, reference_tokens_per_s=reference(wall), tokenize_cpus=cpus,
                    reference_min=min(wall), reference_max=max(wall),
                    reference_cpu_tokens_per_s=reference(cpu),
                    reference_steal_share=statistics.mean(steals) if steals else None,
                    data_cpus=data_cpus(), tokenizer=library,
                    tokenizer_tokens_per_s=reference([rate for rate, _ in alone]),
                    tokenizer_cpu_tokens_per_s=reference([rate for _, rate in alone]), **measured)
        for scale, cpus, measured in runs
    ]  # fmt: skip


def format_rows(rows: list[PipelineRow]) -> str:
    header = (
        f"{'scale':>6}{'samples/epoch':>14}{'first batch s':>14}{'tokens/s':>11}{'steady':>10}"
        f"{'median wait s':>14}{'epoch gap s':>12}{'peak MB':>9}{'1-core tok/s':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.scale:>5}x{r.samples_per_epoch:>14}{r.first_batch_s:>14.1f}{r.tokens_per_s:>11,.0f}"
            f"{r.steady_tokens_per_s:>10,.0f}"
            f"{r.median_batch_s:>14.3f}{r.epoch_gap_s:>12.3f}{r.peak_rss_mb:>9,.0f}"
            f"{r.reference_tokens_per_s:>13,.0f}"
        )
    lines.append("")
    for r in rows:
        busy = r.tokenize_cpu_s / max(1e-9, r.last_batch_s) / r.tokenize_cpus
        per_cpu_s = r.tokens / max(1e-9, r.tokenize_cpu_s)
        lines.append(
            f"{r.scale}x: tokenize {r.tokenize_cpu_s:,.1f} CPU s ({busy:.0%} of its "
            f"{r.tokenize_cpus} CPU(s) from job start to the last batch; {per_cpu_s:,.0f} tokens "
            f"per CPU s), pack {r.pack_cpu_s:,.1f} CPU s"
        )
        if r.cpu_by_process:
            top = list(r.cpu_by_process.items())[:CPU_TABLE_PROCESSES]
            total = sum(r.cpu_by_process.values())
            lines.append(
                f"    CPU s by process ({total:,.1f} in all): "
                + ", ".join(f"{label} {seconds:,.1f}" for label, seconds in top)
            )
    last = rows[-1]
    if len(rows) > 1:
        first = rows[0]
        first_batch = last.first_batch_s / first.first_batch_s
        memory = last.peak_rss_mb / first.peak_rss_mb
        lines.append(
            f"\n{last.scale}x vs {first.scale}x: first batch {first_batch:.2f}x, "
            f"peak memory {memory:.2f}x"
        )
        if first.every_first_batch_s and last.every_first_batch_s:
            lines.append(
                f"first batch at every consumer: {first.every_first_batch_s:.1f} s at "
                f"{first.scale}x, {last.every_first_batch_s:.1f} s at {last.scale}x "
                f"({last.every_first_batch_s / first.every_first_batch_s:.2f}x)"
            )
    lines.append(
        f"steady throughput at {last.scale}x = "
        f"{last.steady_tokens_per_s / (last.tokenize_cpus * last.reference_tokens_per_s):.0%}"
        f" of {last.tokenize_cpus} tokenize CPU(s) x the 1-core reference"
    )
    if last.reference_max:
        lines.append(
            f"1-core reference: {last.reference_tokens_per_s:,.0f} tokens/s, the median of "
            f"{2 * REFERENCE_REPEATS} passes before and after the runs "
            f"({last.reference_min:,.0f}-{last.reference_max:,.0f}); "
            f"{last.reference_cpu_tokens_per_s:,.0f} per CPU second"
        )
    if last.tokenizer_cpu_tokens_per_s and last.data_cpus:  # (per CPU s: fastokens may thread)
        per_cpu = last.steady_tokens_per_s / last.data_cpus
        lines.append(
            f"steady at {last.scale}x per data CPU: {per_cpu:,.0f} tokens/s ({last.data_cpus} "
            f"cores) = {per_cpu / last.tokenizer_cpu_tokens_per_s:.1%} of the tokenizer alone on "
            f"the same texts ({last.tokenizer}: {last.tokenizer_cpu_tokens_per_s:,.0f} tokens per "
            f"CPU second; {last.tokenizer_tokens_per_s:,.0f} tokens/s of wall time in a 1-CPU task)"
        )
    steals = [(f"{r.scale}x", r.steal_share) for r in rows]
    steals.append(("the reference", last.reference_steal_share))
    if any(share is not None for _, share in steals):
        lines.append(
            "CPU time taken by the host (steal): "
            + ", ".join(f"{share:.1%} during {what}" for what, share in steals if share is not None)
        )
    if last.paced_gap_s is not None:
        lines.append(
            f"paced at {last.scale}x (step {last.paced_step_s:.3f} s a batch): epoch gap "
            f"{last.paced_gap_s:.3f} s = {last.paced_gap_s / last.paced_median_s:.2f}x the median "
            f"time between batches ({last.paced_median_s:.3f} s)"
        )
    return "\n".join(lines)


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's arguments, naming the argument, or None. Checked before
    anything runs: a zero ``--window-tokens`` or ``--tokenize-actors`` fell back to the job's
    default, a zero scale failed in the config with a traceback, and a negative ``--pace`` only
    at the end, after every run (a negative step for the paced consumers)."""
    if not Path(args.data_dir).is_dir():
        return f"--data-dir {args.data_dir} is not a folder (the bench reads real data there)"
    if any(scale < 1 for scale in args.scales):
        return f"--scales must be positive numbers of copies of the data, got {args.scales}"
    for flag, value in (
        ("--window-tokens", args.window_tokens),
        ("--tokenize-actors", args.tokenize_actors),
    ):
        if value is not None and value < 1:
            return f"{flag} must be positive, got {value}"
    if args.pace < 0:
        return f"--pace must be 0 (no paced pass) or a positive share, got {args.pace:g}"
    if args.weights is not None and (len(args.weights) != 2 or min(args.weights) <= 0):
        return f"--weights takes two positive weights (alpaca, hh chat), got {args.weights}"
    return None


def main(argv: list[str] | None = None) -> int:
    from rayjobs.bench.packing import DEFAULT_DATA_DIR

    parser = argparse.ArgumentParser(prog="rayjobs bench pipeline", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 30])
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--window-tokens", type=int, help="packing.window_tokens (default: job's)")
    parser.add_argument(
        "--tokenize-actors",
        type=int,
        help="ray.tokenize_concurrency: Tokenize actors at most (default: the job's, half the "
        "cluster's CPUs)",
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=0.6,
        help="the paced pass's demand, as a share of the last scale's unpaced steady "
        "throughput (0: no paced pass)",
    )
    parser.add_argument("--weights", type=float, nargs="+", help="alpaca, hh chat (by tokens)")
    args = parser.parse_args(argv)
    if error := argument_error(args):
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    rows = bench_pipeline(
        args.data_dir, args.scales, args.window_tokens, args.tokenize_actors, args.pace,
        args.weights,
    )  # fmt: skip
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
