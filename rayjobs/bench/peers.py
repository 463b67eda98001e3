"""``rayjobs bench peers``: rayjobs' export beside the path a TRL user takes, on the same files.

For each scale the bench writes the bundled alpaca and hh chat sets repeated ``scale`` times as
JSONL shards (``pipeline.write_shards``: one file per copy) and runs, each in its own process,
started from nothing (imports, start-up and a cold cache included):

- ``rayjobs``: ``rayjobs export CONFIG --out DIR --epochs 1`` on the two sets (GPT-2 tokenizer,
  seq_len 2048, every other setting the job's default: ``--runner auto``, which takes the local
  runner for these sizes; ``$RAY_ADDRESS`` is not passed on: the bench compares paths on one
  machine);
- ``rayjobs-ray``: the same with ``--runner ray``, on an embedded local Ray;
- ``trl``: ``datasets.load_dataset("json", data_files=...)`` of each set, ``.map(tokenize,
  batched=True, num_proc=N)``, ``concatenate_datasets``, ``trl.pack_dataset(seq_length=2048,
  strategy="bfd", map_kwargs={"num_proc": N})`` (as ``SFTTrainer`` packs with
  ``dataset_num_proc``) and ``.to_parquet``, with a fresh datasets cache. Its ``tokenize`` renders
  each row through rayjobs' own templates (``alpaca``; ``chat`` with the tokenizer's chat
  template, ChatML where it has none, as the job does) and tokenizes the text with transformers'
  ``AutoTokenizer`` (offsets for the trained spans, EOS appended: TRL's ``input_ids`` and
  ``labels``). Both paths then encode the same samples, so their token totals must be equal: the
  bench says so when they are not, and compares nothing else it measured as if they were.

Reported for each (scale, path), from the process's start:

- ``wall_s``: until the last packed row was written (the latest modification of an output
  Parquet file); ``exit_s``: until the process ended (Ray's shutdown included);
  ``first_output_s``: until the first Parquet file was written (its modification time, which
  ``rayjobs export``'s rename of its staging folder into place keeps);
- ``peak_pss_mb``: the peak of the process tree's proportional set size (PSS: a page shared
  between processes, such as forked workers' inherited pages or Ray's object store, is split
  between them, so it counts once), sampled every ``SAMPLE_S``; ``peak_rss_mb``: the tree's RSS
  summed at the same sweeps (shared pages counted once per process); ``peak_by_process``: the PSS
  of each kind of process at the peak sweep;
- ``rows``, ``tokens``, ``efficiency``: packed rows, non-pad tokens and tokens / (rows ×
  seq_len), read back from the written Parquet files (rayjobs' ``num_tokens`` column; TRL's
  ``input_ids`` lengths: its rows are not padded, so each is counted as a full row of seq_len);
- ``cpu_s``: CPU seconds of the whole tree, and ``cpu_by_process``: the same by kind of process
  (``tree_label``), the breakdown without a profiler;
- ``load``: the host's 1-minute load average before and after the run, and ``steal_share``: the
  CPU time its hypervisor took meanwhile. Other work on the host slows either path; the two paths
  of a scale run back to back, their order alternating between repeats (``--repeats``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rayjobs.bench.pipeline import LABEL_SWEEPS, _Memory, cpu_ticks, process_label, steal_between

RAYJOBS_PATHS = ("rayjobs", "rayjobs-ray")
"""rayjobs' paths: the default export (``--runner auto``) and its Ray runner."""
PATHS = (*RAYJOBS_PATHS, "trl")
SEQ_LEN = 2048
SAMPLE_S = 0.5
"""Seconds between the sampler's sweeps over the process tree."""
WATCH_S = 0.1
"""Seconds between looks at whether the path has ended."""
RUN_TIMEOUT_S = 3600
"""A path still running after this long is stopped (its process group) and the bench fails."""

EXTRAS = ("psutil", "datasets", "trl", "transformers")
"""The modules the bench needs beyond rayjobs' own (the ``bench`` extra)."""


@dataclass
class PeerRun:
    scale: int
    path: str
    wall_s: float
    exit_s: float
    first_output_s: float | None
    peak_pss_mb: float
    peak_rss_mb: float
    rows: int
    tokens: int
    efficiency: float
    repeat: int = 0
    load: tuple[float, float] = (0.0, 0.0)
    steal_share: float | None = None
    peak_by_process: dict[str, float] = field(default_factory=dict)
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    processes: int = 0
    """Processes seen in the tree over the run (a Ray worker started and ended counts once)."""

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the whole tree: the path's work, which other load on the host slows
        down less than its wall time."""
        return sum(self.cpu_by_process.values())


@dataclass
class TreeFigures:
    """What ``run_tree`` measured of a process tree (module note)."""

    exit_s: float
    peak_pss_mb: float
    peak_rss_mb: float
    load: tuple[float, float]
    steal_share: float | None
    peak_by_process: dict[str, float]
    cpu_by_process: dict[str, float]
    processes: int

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_by_process.values())

    def describe(self) -> str:
        """The host's load, the tree's processes and where its CPU and memory went, one line."""
        steal = "" if self.steal_share is None else f", steal {self.steal_share:.1%}"
        top = ", ".join(f"{k} {v:,.1f}" for k, v in list(self.cpu_by_process.items())[:5])
        memory = ", ".join(f"{k} {v:,.0f}" for k, v in list(self.peak_by_process.items())[:3])
        return (
            f"load {self.load[0]:.1f} -> {self.load[1]:.1f}{steal}; {self.processes} processes, "
            f"CPU s {self.cpu_s:,.1f}: {top}; MB at the peak: {memory}"
        )


def missing_extras() -> list[str]:
    """The bench's modules that are not installed."""
    return [name for name in EXTRAS if importlib.util.find_spec(name) is None]


def tree_label(cmdline: list[str], root: bool, root_cmdline: list[str]) -> str:
    """What a process of a path's tree is: the path's own process, a worker it forked (same
    command line: ``datasets``' ``num_proc`` pool), a Python program by its script or module
    (Ray's dashboard, monitors), else ``pipeline.process_label`` (Ray's workers and binaries).

    >>> tree_label(["python", "-m", "rayjobs.cli", "export"], True, [])
    'main process'
    >>> tree_label(["python", "-m", "x"], False, ["python", "-m", "x"])
    'forked worker'
    >>> tree_label(["ray::MapWorker(MapBatches(Tokenize))"], False, ["python"])
    'MapWorker(MapBatches(Tokenize))'
    >>> tree_label(["/bin/python3.11", "-u", "/ray/_private/log_monitor.py", "--x"], False, [])
    'log_monitor.py'
    >>> tree_label(["ray-dashboard-NodeHead-0", "(/bin/python", "-c"], False, [])
    'dashboard modules'
    >>> tree_label(["ray::MapWorker(MapBatches(Tokenize)).submit"], False, [])
    'MapWorker(MapBatches(Tokenize))'
    >>> tree_label(["/bin/python", "-B", "-c", "from multiprocessing import ..."], False, [])
    'python -c'
    """
    if root:
        return "main process"
    if cmdline and cmdline == root_cmdline:
        return "forked worker"
    name = process_label(cmdline)
    if name.startswith("ray-dashboard-"):
        return "dashboard modules"
    if ")." in name:  # an actor's method (``.submit``, ``.__init__``): the actor
        return name[: name.rindex(")") + 1]
    if name.startswith("python"):
        arguments = cmdline[1:]
        if "-m" in arguments[:-1]:
            return arguments[arguments.index("-m") + 1]
        if "-c" in arguments:
            return "python -c"
        return next((Path(a).name for a in arguments if a.endswith(".py")), name)
    return name


class _Tree(_Memory):
    """Samples a process and everything under it: PSS and RSS summed per sweep (the peaks, and
    the PSS by ``tree_label`` at the peak sweep), and CPU time by label (``_Memory.account``)."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid
        self.peak_rss_mb = 0.0
        self.peak_by_process: dict[str, float] = {}

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            root_cmdline = root.cmdline()
        except psutil.Error:  # it ended before the first sweep
            return
        sweep = 0
        while self.running:
            try:
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:  # it ended, or a child did while the tree was walked
                processes = [root] if root.is_running() else []
            pss, rss, by_label = 0.0, 0.0, {}
            for process in processes:
                try:
                    if process.pid not in self.labels or sweep % LABEL_SWEEPS == 0:
                        self.labels[process.pid] = tree_label(
                            process.cmdline(), process.pid == self.pid, root_cmdline
                        )
                    label = self.labels[process.pid]
                    with process.oneshot():
                        memory = process.memory_full_info()
                        times = process.cpu_times()
                except psutil.Error:  # it ended between listing and reading
                    continue
                pss += memory.pss / 2**20
                rss += memory.rss / 2**20
                by_label[label] = by_label.get(label, 0.0) + memory.pss / 2**20
                self.account(process.pid, label, times.user + times.system, sweep == 0)
            sweep += 1
            if pss > self.peak_mb:
                self.peak_mb = pss
                self.peak_by_process = dict(sorted(by_label.items(), key=lambda kv: -kv[1]))
            self.peak_rss_mb = max(self.peak_rss_mb, rss)
            time.sleep(SAMPLE_S)


def _parquet_files(out: Path) -> list[Path]:
    return sorted(out.rglob("*.parquet")) if out.exists() else []


def run_tree(command: list[str], log: Path, env: dict[str, str],
             stdout: Path | None = None) -> tuple[int, float, TreeFigures]:  # fmt: skip
    """Run ``command`` in its own process group, its output to ``log`` (its stdout to
    ``stdout`` where given), and sample its process tree (module note): its exit code, the
    ``time.time()`` just before it started, and what was measured."""
    ticks, load_before = cpu_ticks(), os.getloadavg()[0]
    started = time.time()
    with contextlib.ExitStack() as files:
        output = files.enter_context(log.open("wb"))
        out = files.enter_context(stdout.open("wb")) if stdout else output
        process = subprocess.Popen(
            command, stdout=out, stderr=output, env=env, start_new_session=True
        )
        tree = _Tree(process.pid)
        tree.start()
        while process.poll() is None:
            if time.time() - started > RUN_TIMEOUT_S:
                os.killpg(process.pid, 9)  # the group this bench started, and only it
                break
            time.sleep(WATCH_S)
        code = process.wait()
    exit_s = time.time() - started
    tree.running = False
    tree.join()
    return (
        code,
        started,
        TreeFigures(
            exit_s=exit_s,
            peak_pss_mb=tree.peak_mb,
            peak_rss_mb=tree.peak_rss_mb,
            load=(load_before, os.getloadavg()[0]),
            steal_share=steal_between(ticks, cpu_ticks()),
            peak_by_process=tree.peak_by_process,
            cpu_by_process=tree.cpu_by_process(),
            processes=len(tree.last_cpu),
        ),
    )


def failure(command: list[str], code: int, log: Path) -> RuntimeError:
    """The error of a path that failed: its command, exit code and the tail of its log."""
    tail = log.read_text(errors="replace")[-3000:]
    return RuntimeError(f"{' '.join(command[:4])} ... exited {code}; its log {log}:\n{tail}")


def run_measured(command: list[str], out: Path, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``command`` (it writes Parquet under ``out``) and measure it (``run_tree``). Raises
    RuntimeError naming the log when it fails."""
    code, started, measured = run_tree(command, log, env)
    files = _parquet_files(out)
    if code != 0 or not files:
        raise failure(command, code, log)
    return {
        "wall_s": max(f.stat().st_mtime for f in files) - started,
        "first_output_s": min(f.stat().st_mtime for f in files) - started,
        **asdict(measured),
    }


def packed_counts(files: list[Path], seq_len: int) -> tuple[int, int, float]:
    """(rows, non-pad tokens, efficiency) of packed Parquet files: rayjobs' rows carry
    ``num_tokens``; TRL's rows are their tokens (``input_ids`` unpadded, one row each)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = tokens = 0
    for file in files:
        names = pq.read_schema(file).names
        column = "num_tokens" if "num_tokens" in names else "input_ids"
        values = pq.read_table(file, columns=[column]).column(column)
        rows += len(values)
        lengths = values if column == "num_tokens" else pc.list_value_length(values)
        tokens += int(pc.sum(lengths).as_py() or 0)
    return rows, tokens, tokens / max(1, rows * seq_len)


def child_env() -> dict[str, str]:
    """The paths' environment: this process's, with this checkout's rayjobs first on the path
    (the one the bench runs, not another install's), no ``$RAY_ADDRESS`` (the export starts its
    own local Ray) and the Hugging Face Hub offline (everything is local; no lookups)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def export_config(folders: dict[str, Path], tokenizer: Path, seq_len: int) -> dict[str, Any]:
    """The rayjobs side's config: the two sets, the tokenizer, seq_len; the job's defaults."""
    return {
        "datasets": [
            {"name": "alpaca", "source": str(folders["alpaca"]), "template": "alpaca"},
            {"name": "hh_chat", "source": str(folders["hh_chat"]), "template": "chat"},
        ],
        "tokenizer": {"path": str(tokenizer)},
        "packing": {"seq_len": seq_len},
        "train": {"epochs": 1},
    }


def path_command(path: str, work: Path, folders: dict[str, Path], tokenizer: Path,
                 num_proc: int) -> tuple[list[str], Path]:  # fmt: skip
    """The command of one path and the folder it writes its Parquet files under."""
    out = work / f"{path}-out"
    if path in RAYJOBS_PATHS:
        import yaml

        config = work / "export.yaml"
        config.write_text(yaml.safe_dump(export_config(folders, tokenizer, SEQ_LEN)))
        runner = ["--runner", "ray"] if path == "rayjobs-ray" else []
        command = [sys.executable, "-m", "rayjobs.cli", "export", str(config), "--out", str(out),
                   "--epochs", "1", *runner]  # fmt: skip
        return command, out
    command = [
        sys.executable, "-m", "rayjobs.bench.peers", "--alpaca", str(folders["alpaca"]),
        "--chat", str(folders["hh_chat"]), "--tokenizer", str(tokenizer), "--seq-len",
        str(SEQ_LEN), "--num-proc", str(num_proc), "--out", str(out / "packed.parquet"),
        "--cache-dir", str(work / "hf-cache"),
    ]  # fmt: skip
    return command, out


def bench_peers(data_dir: Path, scales: list[int], num_proc: int, repeats: int = 1,
                paths: tuple[str, ...] = PATHS) -> list[PeerRun]:  # fmt: skip
    """Every path at every scale, ``repeats`` times, the order of the paths alternating."""
    from rayjobs.bench.pipeline import write_shards

    tokenizer = data_dir / "tokenizers" / "gpt2"
    runs = []
    with tempfile.TemporaryDirectory(prefix="rayjobs-peers-") as tmp:
        for scale in scales:
            folders = write_shards(data_dir, Path(tmp) / f"{scale}x-data", scale)
            for repeat in range(repeats):
                order = paths if repeat % 2 == 0 else tuple(reversed(paths))
                for path in order:
                    work = Path(tmp) / f"{scale}x-{path}-{repeat}"
                    work.mkdir()
                    command, out = path_command(path, work, folders, tokenizer, num_proc)
                    print(f"{scale}x {path} (repeat {repeat})...", file=sys.stderr, flush=True)
                    measured = run_measured(command, out, work / "log.txt", child_env())
                    rows, tokens, efficiency = packed_counts(_parquet_files(out), SEQ_LEN)
                    counts = {"rows": rows, "tokens": tokens, "efficiency": efficiency}
                    runs.append(PeerRun(scale, path, repeat=repeat, **counts, **measured))
                    shutil.rmtree(work)  # the next run's disk and page cache
    return runs


def token_mismatches(runs: list[PeerRun]) -> list[str]:
    """Each scale whose runs did not pack the same number of tokens, with the totals.

    >>> runs = [PeerRun(1, p, 1.0, 1.0, 1.0, 1.0, 1.0, 1, 10, 0.5) for p in PATHS]
    >>> token_mismatches(runs)
    []
    >>> runs[2].tokens = 11
    >>> token_mismatches(runs)
    ['1x: rayjobs 10, rayjobs-ray 10, trl 11']
    """
    found = []
    for scale in dict.fromkeys(r.scale for r in runs):
        totals = {}
        for r in runs:
            if r.scale == scale:
                totals.setdefault(r.path, set()).add(r.tokens)
        if len({t for values in totals.values() for t in values}) > 1:
            shown = ", ".join(f"{p} {'/'.join(map(str, sorted(t)))}" for p, t in totals.items())
            found.append(f"{scale}x: {shown}")
    return found


def _median(runs: list[PeerRun], name: str) -> float | None:
    values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
    return statistics.median(values) if values else None


def format_table(runs: list[PeerRun]) -> str:
    """The table (the median of repeats in each cell), the ratios rayjobs / TRL per scale, the
    token check and where each path's CPU went."""
    header = (
        f"{'scale':>6}  {'path':<12}{'wall s':>8}{'first out s':>12}{'exit s':>8}{'CPU s':>8}"
        f"{'peak MB':>9}{'(RSS)':>8}{'efficiency':>11}{'rows':>7}{'tokens':>12}"
    )
    lines = [header, "-" * len(header)]
    groups: dict[tuple[int, str], list[PeerRun]] = {}
    for r in runs:
        groups.setdefault((r.scale, r.path), []).append(r)
    for (scale, path), group in groups.items():
        first = _median(group, "first_output_s")
        lines.append(
            f"{scale:>5}x  {path:<12}{_median(group, 'wall_s'):>8.1f}"
            f"{'-' if first is None else f'{first:.1f}':>12}{_median(group, 'exit_s'):>8.1f}"
            f"{_median(group, 'cpu_s'):>8.1f}"
            f"{_median(group, 'peak_pss_mb'):>9,.0f}{_median(group, 'peak_rss_mb'):>8,.0f}"
            f"{_median(group, 'efficiency'):>11.4f}{group[0].rows:>7}{group[0].tokens:>12,}"
        )
    lines.append("")
    for scale, name in itertools.product(dict.fromkeys(r.scale for r in runs), RAYJOBS_PATHS):
        ours, theirs = groups.get((scale, name)), groups.get((scale, "trl"))
        if not ours or not theirs:
            continue
        ratio = {n: _median(ours, n) / _median(theirs, n)
                 for n in ("wall_s", "exit_s", "cpu_s", "peak_pss_mb")}  # fmt: skip
        points = 100 * (_median(ours, "efficiency") - _median(theirs, "efficiency"))
        per_repeat = [a.wall_s / b.wall_s for a, b in zip(ours, theirs, strict=False)]
        spread = (f" (each repeat: {', '.join(f'{x:.2f}x' for x in per_repeat)})"
                  if len(per_repeat) > 1 else "")  # fmt: skip
        lines.append(
            f"{scale}x {name} / trl: wall {ratio['wall_s']:.2f}x{spread}, exit "
            f"{ratio['exit_s']:.2f}x, CPU {ratio['cpu_s']:.2f}x, peak memory "
            f"{ratio['peak_pss_mb']:.2f}x, efficiency {points:+.2f} points"
        )
    mismatches = token_mismatches(runs)
    lines.append(
        "token totals differ, so the paths did not pack the same samples: " + "; ".join(mismatches)
        if mismatches
        else "token totals: identical on every path at every scale"
    )
    for r in runs:
        top = ", ".join(f"{k} {v:,.1f}" for k, v in list(r.cpu_by_process.items())[:6])
        memory = ", ".join(f"{k} {v:,.0f}" for k, v in list(r.peak_by_process.items())[:4])
        steal = "" if r.steal_share is None else f", steal {r.steal_share:.1%}"
        lines.append(
            f"{r.scale}x {r.path} #{r.repeat}: load {r.load[0]:.1f} -> {r.load[1]:.1f}{steal}; "
            f"{r.processes} processes, CPU s {r.cpu_s:,.1f}: {top}; MB at the peak: {memory}"
        )
    return "\n".join(lines)


_TOKENIZERS: dict[str, Any] = {}
"""Per process: tokenizer folder → (transformers tokenizer, rayjobs' chat renderer, EOS id)."""


def _tokenizer(path: str) -> tuple[Any, Any, int]:
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        from rayjobs.config import TokenizerConfig
        from rayjobs.data.tokenizer import Tokenizer

        ours = Tokenizer(TokenizerConfig(path=path))
        _TOKENIZERS[path] = (AutoTokenizer.from_pretrained(path), ours.render_chat, ours.eos_id)
    return _TOKENIZERS[path]


def tokenize_batch(batch: dict[str, list], template: str, tokenizer: str) -> dict[str, list]:
    """The TRL side's ``map`` function: rows rendered by rayjobs' ``template`` (module note),
    tokenized in one call with their character offsets; ``labels`` are the tokens that start in
    a trained segment (-100 elsewhere, TRL's unshifted convention), EOS appended and trained as
    the last segment is (as the job's ``samples.encode_segments``)."""
    import numpy as np

    from rayjobs.data.templates import TEMPLATES

    hf, render_chat, eos = _tokenizer(tokenizer)
    render = TEMPLATES[template].render
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    segments = [render({k: v for k, v in row.items() if v is not None}, {}, render_chat)
                for row in rows]  # fmt: skip
    encoded = hf(["".join(s.text for s in each) for each in segments], add_special_tokens=False,
                 return_offsets_mapping=True)  # fmt: skip
    input_ids, labels = [], []
    for each, ids, offsets in zip(segments, encoded["input_ids"], encoded["offset_mapping"],
                                  strict=True):  # fmt: skip
        ends = np.cumsum([len(s.text) for s in each])
        trainable = np.array([s.trainable for s in each], dtype=bool)
        starts = np.array([start for start, _ in offsets], dtype=np.int64)
        which = np.minimum(np.searchsorted(ends, starts, side="right"), len(trainable) - 1)
        ids = [*ids, eos]
        trained = [*trainable[which].tolist(), bool(trainable[-1])]
        input_ids.append(ids)
        labels.append([t if keep else -100 for t, keep in zip(ids, trained, strict=True)])
    return {"input_ids": input_ids, "labels": labels}


def trl_path(alpaca: Path, chat: Path, tokenizer: str, seq_len: int, num_proc: int, out: Path,
             cache_dir: Path) -> None:  # fmt: skip
    """The path a TRL user takes on one machine (module note), written to ``out``."""
    from datasets import concatenate_datasets, load_dataset
    from trl import pack_dataset

    parts = []
    for folder, template in ((alpaca, "alpaca"), (chat, "chat")):
        files = sorted(str(f) for f in folder.glob("*.jsonl"))
        dataset = load_dataset("json", data_files=files, split="train", cache_dir=str(cache_dir))
        parts.append(dataset.map(
            tokenize_batch, batched=True, num_proc=num_proc, remove_columns=dataset.column_names,
            fn_kwargs={"template": template, "tokenizer": tokenizer},
        ))  # fmt: skip
    packed = pack_dataset(concatenate_datasets(parts), seq_length=seq_len, strategy="bfd",
                          map_kwargs={"num_proc": num_proc})  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    packed.to_parquet(str(out))


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's arguments, naming the argument, or None."""
    if not Path(args.data_dir).is_dir():
        return f"--data-dir {args.data_dir} is not a folder (the bench reads real data there)"
    if not args.scales or any(scale < 1 for scale in args.scales):
        return f"--scales must be positive numbers of copies of the data, got {args.scales}"
    if args.num_proc < 1:
        return f"--num-proc must be positive, got {args.num_proc}"
    if args.repeats < 1:
        return f"--repeats must be positive, got {args.repeats}"
    return None


def main(argv: list[str] | None = None) -> int:
    """``rayjobs bench peers``."""
    from rayjobs.bench.packing import DEFAULT_DATA_DIR

    parser = argparse.ArgumentParser(prog="rayjobs bench peers", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 30])
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count() or 1,
        help="the TRL path's datasets num_proc (default: the machine's CPUs)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path per scale")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if error := argument_error(args):
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    if missing := missing_extras():
        print(
            f"rayjobs: bench peers needs {', '.join(missing)} (the TRL side and the memory "
            "sampler): pip install 'rayjobs[bench]'",
            file=sys.stderr,
        )
        return 2
    runs = bench_peers(args.data_dir, args.scales, args.num_proc, args.repeats, tuple(args.paths))
    print(f"machine: {os.cpu_count()} CPUs; load average at the end {os.getloadavg()}")
    print(format_table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return 1 if token_mismatches(runs) else 0


def _trl_main(argv: list[str]) -> int:
    """``python -m rayjobs.bench.peers ...``: the TRL path alone (what the bench runs)."""
    parser = argparse.ArgumentParser(prog="python -m rayjobs.bench.peers")
    for name in ("--alpaca", "--chat", "--out", "--cache-dir"):
        parser.add_argument(name, type=Path, required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    # (this file runs as __main__: the map function is sent to datasets' workers by reference
    # to the module, not by value)
    from rayjobs.bench.peers import trl_path

    trl_path(args.alpaca, args.chat, args.tokenizer, args.seq_len, args.num_proc, args.out,
             args.cache_dir)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(_trl_main(sys.argv[1:]))
