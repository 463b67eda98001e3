"""``rayjobs bench packing``: every packing strategy and two reference packers on real data.

Each real set under ``--data-dir`` (default: the subsets bundled in ``configs/data``; any folder
with the same layout, such as the full public sets, works) is tokenized with the GPT-2 tokenizer
through the same templates and Tokenize code the job uses (in-process, no Ray), over-length samples
truncated, and streamed as the set concatenated 10 times, each copy freshly shuffled. For seq_len
2048, 4096 and 8192 the bench packs that stream with the streaming path's packer at the job's window
(``stream``, windows of ``--window-tokens`` tokens), with every strategy of the planned path
(``StreamPacker``, windows of ``--window`` samples), with two reference packers implemented here
from their published behaviour, and with global best-fit decreasing over the whole stream (the
offline yardstick), and reports efficiency (non-pad tokens / slots), packs vs the lower bound
ceil(tokens / seq_len), samples/s of the packing function and the longest wait of any sample in
windows.

- ``trl``: TRL's ``pack_dataset(strategy="bfd")``: BFD inside each chunk of 1000 samples (the
  ``datasets.map`` batch), every bin emitted.
- ``torchtune``: the on-the-fly packer of torchtune PR 2819: a FIFO buffer of 100 samples; the
  oldest sample opens each pack, then the first buffered samples (oldest first) that still fit
  fill it; the pack is emitted when no buffered sample fits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rayjobs.config import DatasetConfig, PackingConfig, TokenizerConfig
from rayjobs.data.formats import parse_file
from rayjobs.data.pack import STRATEGIES, StreamPacker, pack_lengths
from rayjobs.data.sources import record_table

SEQ_LENS = (2048, 4096, 8192)
COPIES = 10

DEFAULT_WINDOW = 4096
"""Samples per window of the planned path's ``StreamPacker`` rows (``--window``)."""

DEFAULT_WINDOW_TOKENS = PackingConfig().window_tokens
"""The job's default streaming window (``packing.window_tokens``)."""

DEFAULT_WARMUP_TOKENS = PackingConfig().warmup_tokens
"""The job's default warm-up lane (``packing.warmup_tokens``)."""

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "configs" / "data"
"""The real subsets bundled with the repository (configs/data/SOURCES.md)."""

# name, file under the data folder, format, template, column_map, text_split
BENCH_SETS = [
    ("alpaca", "sft/alpaca_en_demo.json", "json", "alpaca", {}, "paragraph"),
    (
        "gpteacher",
        "sft/gpteacher_roleplay.json",
        "json",
        "alpaca",
        {"output": "response"},
        "paragraph",
    ),
    ("hh_chat", "chat/hh_rlhf_harmless_chosen.messages.jsonl", "jsonl", "chat", {}, "paragraph"),
    ("glaive_sharegpt", "chat/glaive_toolcall.sharegpt.json", "json", "chat", {}, "paragraph"),
    ("hh_dpo_text", "dpo/hh_rlhf_harmless.dpo.jsonl", "jsonl", "text", {}, "paragraph"),
    # task: dpo: each triple is one unit of P + C + R + 1 tokens (rayjobs.data.preference), never
    # split
    ("hh_dpo_triples", "dpo/hh_rlhf_harmless.dpo.jsonl", "jsonl", "preference", {}, "paragraph"),
    ("shakespeare", "text/tinyshakespeare.txt", "text", "text", {}, "paragraph"),
    ("c4", "text/c4_demo.jsonl", "jsonl", "text", {}, "paragraph"),
]


@dataclass
class BenchRow:
    dataset: str
    seq_len: int
    strategy: str
    window: int
    efficiency: float
    global_bfd_efficiency: float
    lower_bound_packs: int
    packs: int
    samples_per_s: float
    max_delay_windows: int
    first_row_tokens: int
    """Tokens the packer must be given before its first row can leave: the stream path's warm-up
    lane or first window, a window of the others (all of them for global BFD)."""


def load_lengths(data_dir: Path, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Token length of every sample of each bench set (GPT-2, job templates, EOS included)."""
    from rayjobs.data.tokenize import Tokenize

    tokenizer = TokenizerConfig(path=str(data_dir / "tokenizers" / "gpt2"))
    chosen = [entry for entry in BENCH_SETS if not names or entry[0] in names]
    specs = [
        DatasetConfig(
            name=name,
            source=str(data_dir / relative),
            format=fmt,
            template=template,
            column_map=column_map,
            # hh-rlhf has responses that are blank (row 87 of the bundled subset: chosen " "):
            # a triple with nothing to prefer is skipped, as dpo_demo.yaml does
            on_bad_row="skip" if template == "preference" else "error",
        )
        for name, relative, fmt, template, column_map, _ in chosen
    ]
    tokenize = Tokenize(specs, tokenizer, seq_len=1 << 30, overflow="truncate")
    lengths = {}
    for name, relative, fmt, _, _, text_split in chosen:
        path = data_dir / relative
        rows, records = parse_file(
            path.read_bytes(), str(path), format=fmt, dataset=name, text_split=text_split
        )
        if name == "hh_dpo_text":  # a DPO pair rendered as one text: prompt + chosen answer
            records = [
                json.dumps({"text": (r := json.loads(x))["prompt"] + r["chosen"]}) for x in records
            ]
        table = tokenize(record_table(name, [str(path)] * len(rows), rows, records))
        lengths[name] = table.column("num_tokens").to_numpy().astype(np.int64)
    return lengths


def stream(lengths: np.ndarray, copies: int = COPIES, seed: int = 0) -> np.ndarray:
    """The set concatenated ``copies`` times, each copy in its own random order."""
    rng = np.random.default_rng(seed)
    return np.concatenate([lengths[rng.permutation(len(lengths))] for _ in range(copies)])


def stream_pack(
    lengths: np.ndarray, seq_len: int, strategy: str, window: int, seed: int = 0
) -> tuple[list[np.ndarray], int]:
    """Pack a stream with ``StreamPacker`` over windows of ``window`` samples: (packs, max
    delay)."""
    packer = StreamPacker(seq_len, strategy, rng=np.random.default_rng(seed))
    packs: list[np.ndarray] = []
    ids = np.arange(len(lengths))
    for start in range(0, len(lengths), window):
        packs += packer.push(ids[start : start + window], lengths[start : start + window])
    packs += packer.flush()
    return packs, packer.max_delay_seen


def trl_chunk_bfd(lengths: np.ndarray, seq_len: int, chunk: int = 1000) -> list[np.ndarray]:
    packs: list[np.ndarray] = []
    for start in range(0, len(lengths), chunk):
        packs += [b + start for b in pack_lengths(lengths[start : start + chunk], seq_len, "bfd")]
    return packs


def torchtune_fifo(lengths: np.ndarray, seq_len: int, buffer_size: int = 100) -> list[np.ndarray]:
    packs: list[np.ndarray] = []
    buffer: list[int] = []
    upcoming: Iterator[int] = iter(range(len(lengths)))

    def refill() -> None:
        while len(buffer) < buffer_size and (index := next(upcoming, None)) is not None:
            buffer.append(index)

    refill()
    while buffer:
        pack = [buffer.pop(0)]
        room = seq_len - int(lengths[pack[0]])
        while True:
            fits = next((i for i, index in enumerate(buffer) if lengths[index] <= room), None)
            if fits is None:
                break
            pack.append(buffer.pop(fits))
            room -= int(lengths[pack[-1]])
            refill()
        packs.append(np.array(pack))
        refill()
    return packs


def _efficiency(lengths: np.ndarray, packs: list[np.ndarray], seq_len: int) -> float:
    placed = np.concatenate(packs)
    if len(placed) != len(lengths) or len(np.unique(placed)) != len(lengths):
        raise AssertionError("a packer lost or duplicated samples")
    return float(lengths.sum()) / (len(packs) * seq_len)


def default_path(
    lengths: np.ndarray,
    seq_len: int,
    window_tokens: int,
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
    seed: int = 0,
) -> tuple[list[np.ndarray], int, int, np.ndarray]:
    """The streaming path's packing as the job runs it (``packer.pack_batch`` per call): the
    warm-up lane where it runs (``packer.lane_tokens``: the first samples, up to its tokens, in
    one call), then windows sized as the job sizes them (``window_tokens`` over the mean sample
    length): (packs, window rows, the tokens given before the first row leaves, the first sample
    of each call)."""
    from rayjobs.data.packer import lane_tokens, pack_batch, window_rows

    rows = window_rows(window_tokens, float(lengths.mean()))
    lane = lane_tokens(float(lengths.sum()), warmup_tokens, seq_len)
    ends = [int(np.searchsorted(np.cumsum(lengths), lane)) + 1] if lane else []
    ends += list(range((ends or [0])[0] + rows, len(lengths), rows)) + [len(lengths)]
    rng = np.random.default_rng(seed)
    packs: list[np.ndarray] = []
    starts = [0]
    for end in ends:
        if end > starts[-1]:
            packs += [
                p + starts[-1] for p in pack_batch(lengths[starts[-1] : end], seq_len, "bfd", rng)
            ]
            starts.append(end)
    first = int(lengths[: starts[1] if len(starts) > 1 else 0].sum())
    return packs, rows, first, np.array(starts[:-1])


def packed_delay_windows(packs: list[np.ndarray], starts: int | np.ndarray) -> int:
    """The longest any sample waited, in packer calls, as the packs themselves show it: packs
    come out in order, so a pack was emitted no earlier than the latest call of any sample in it
    or in a pack before it, and a sample of an earlier call in it waited the difference. (A lower
    bound: a pack of carried samples only, emitted first in the next call, does not show its
    wait.) ``starts``: the first sample of each call, or the samples per call where all calls
    are that size. The streaming path's packer holds nothing back, so this is 0 there because
    its packs say so, not because the bench says so.

    >>> packed_delay_windows([np.array([0, 1]), np.array([2, 3]), np.array([4, 5])], 2)
    0
    >>> packed_delay_windows([np.array([0, 2]), np.array([1, 5]), np.array([3])], 2)
    2
    >>> packed_delay_windows([np.array([0, 2]), np.array([1, 5]), np.array([3])], np.array([0, 3]))
    1
    """
    latest = worst = 0
    for pack in packs:
        if isinstance(starts, np.ndarray):
            windows = np.searchsorted(starts, np.asarray(pack), side="right") - 1
        else:
            windows = np.asarray(pack) // starts
        latest = max(latest, int(windows.max()))
        worst = max(worst, latest - int(windows.min()))
    return worst


def bench_packing(
    all_lengths: dict[str, np.ndarray],
    seq_lens=SEQ_LENS,
    window: int = DEFAULT_WINDOW,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
) -> list[BenchRow]:
    rows = []
    for name, lengths in all_lengths.items():
        full = stream(lengths)
        for seq_len in seq_lens:
            clipped = np.minimum(full, seq_len)
            lower = int(-(-clipped.sum() // seq_len))
            global_packs = pack_lengths(clipped, seq_len, "bfd")
            global_efficiency = _efficiency(clipped, global_packs, seq_len)
            candidates = [("stream", 0)] + [(strategy, window) for strategy in STRATEGIES]
            candidates += [("trl", 1000), ("torchtune", 100), ("global_bfd", len(clipped))]
            for strategy, size in candidates:
                started = time.perf_counter()
                delay = 0
                if strategy == "trl":
                    packs = trl_chunk_bfd(clipped, seq_len)
                elif strategy == "torchtune":
                    packs = torchtune_fifo(clipped, seq_len)
                elif strategy == "global_bfd":
                    packs = pack_lengths(clipped, seq_len, "bfd")
                elif strategy == "stream":
                    packs, size, first, starts = default_path(clipped, seq_len, window_tokens)
                else:
                    packs, delay = stream_pack(clipped, seq_len, strategy, window)
                seconds = time.perf_counter() - started
                if strategy != "stream":
                    first = int(clipped[:size].sum())
                if strategy == "stream":  # its waits, read off its packs (not timed: ours)
                    delay = packed_delay_windows(packs, starts)
                rows.append(
                    BenchRow(
                        name,
                        seq_len,
                        strategy,
                        size,
                        _efficiency(clipped, packs, seq_len),
                        global_efficiency,
                        lower,
                        len(packs),
                        len(clipped) / seconds,
                        delay,
                        first,
                    )
                )
    return rows


def format_table(rows: list[BenchRow]) -> str:
    header = (
        f"{'dataset':<16}{'seq_len':>8} {'strategy':<11}{'window':>7}{'efficiency':>11}"
        f"{'vs global':>10}{'packs':>7}{'lower':>7}{'samples/s':>12}{'delay':>6}"
        f"{'first row':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.dataset:<16}{r.seq_len:>8} {r.strategy:<11}{r.window:>7}"
            f"{r.efficiency:>11.4%}{(r.efficiency - r.global_bfd_efficiency) * 100:>+9.2f}p"
            f"{r.packs:>7}{r.lower_bound_packs:>7}{r.samples_per_s:>12,.0f}"
            f"{r.max_delay_windows:>6}{r.first_row_tokens:>11,}"
        )
    return "\n".join(lines)


def write_json(rows: list[BenchRow], out: str) -> None:
    Path(out).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def select_sets(requested: list[str] | None) -> list[str] | None:
    """Bench set names from names or file paths (``sft/alpaca_en_demo.json``); None means all."""
    if not requested:
        return None
    by_file = {relative: name for name, relative, *_ in BENCH_SETS}
    names = {name for name, *_ in BENCH_SETS}
    chosen = []
    for item in requested:
        name = by_file.get(item, item if item in names else None)
        if name is None:
            raise ValueError(
                f"--data {item!r}: not a bench set; choose from {sorted(names)} "
                f"or {sorted(by_file)}"
            )
        chosen.append(name)
    return chosen


def packing_function_speed(
    all_lengths: dict[str, np.ndarray], seq_len: int = 2048, window: int = DEFAULT_WINDOW
) -> float:
    """Samples/s of ``pack_lengths`` (bfd) alone over windows of the bench streams, one core."""
    samples, seconds = 0, 0.0
    for lengths in all_lengths.values():
        full = np.minimum(stream(lengths), seq_len)
        for start in range(0, len(full), window):
            chunk = full[start : start + window]
            started = time.perf_counter()
            pack_lengths(chunk, seq_len, "bfd")
            seconds += time.perf_counter() - started
            samples += len(chunk)
    return samples / seconds


def format_verdict(
    rows: list[BenchRow],
    window: int,
    function_speed: float,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
) -> str:
    by_key: dict[tuple[str, int], dict[str, BenchRow]] = {}
    for row in rows:
        by_key.setdefault((row.dataset, row.seq_len), {})[row.strategy] = row
    gaps = [(k, r["bfd"].efficiency - r["bfd"].global_bfd_efficiency) for k, r in by_key.items()]
    worst_key, worst_gap = min(gaps, key=lambda item: item[1])
    beaten = [
        k
        for k, r in by_key.items()
        if r["bfd"].efficiency < max(r["trl"].efficiency, r["torchtune"].efficiency)
    ]
    delay = max(r["bfd"].max_delay_windows for r in by_key.values())
    stream_gaps = {}
    for (_, seq_len), r in by_key.items():
        gap = r["stream"].efficiency - r["stream"].global_bfd_efficiency
        stream_gaps[seq_len] = min(stream_gaps.get(seq_len, 0.0), gap)
    stream_beaten = [
        k
        for k, r in by_key.items()
        if r["stream"].efficiency < max(r["trl"].efficiency, r["torchtune"].efficiency)
    ]
    stream_line = ", ".join(f"{s}: {g * 100:+.3f}" for s, g in sorted(stream_gaps.items()))
    return (
        f"\nstream (the job's default path: a warm-up lane where it runs, then windows of "
        f"{window_tokens:,} tokens) vs "
        f"global BFD, worst points per seq_len: {stream_line}; behind a reference packer on "
        f"{len(stream_beaten)} of {len(by_key)} rows {stream_beaten or ''}"
        f"\nbfd (planned, window {window}) vs global BFD: worst {worst_gap * 100:+.3f} points "
        f"({worst_key[0]}, seq_len {worst_key[1]}); behind a reference packer on "
        f"{len(beaten)} of {len(by_key)} rows {beaten or ''}; longest wait {delay} window(s)\n"
        f"packing function (pack_lengths bfd, windows of {window}, one core): "
        f"{function_speed:,.0f} samples/s"
    )


def pipeline_config(data_dir: Path):
    """The config ``time_pipeline`` runs: every bench set that is one sample per row through the
    SFT path (not ``hh_dpo_text``, rendered by the bench itself, nor the preference triples, which
    need ``task: dpo``), GPT-2, planned mode at seq_len 2048."""
    from rayjobs.config import config_from_dict

    return config_from_dict(
        {
            "datasets": [
                {
                    "name": name,
                    "source": str(data_dir / relative),
                    "format": fmt,
                    "template": template,
                    "column_map": column_map,
                    **({"text_split": text_split} if fmt == "text" else {}),
                }
                for name, relative, fmt, template, column_map, text_split in BENCH_SETS
                if name != "hh_dpo_text" and template != "preference"
            ],
            "tokenizer": {"path": str(data_dir / "tokenizers/gpt2")},
            "packing": {"mode": "planned", "seq_len": 2048, "window": 4096},
        }
    )


def time_pipeline(data_dir: Path) -> dict[str, float]:
    """Stage timers of the real Ray pipeline over every bench set that needs no rendering (GPT-2,
    seq_len 2048): seconds in Tokenize calls vs packing (driver plan, plan join, row assembly)."""
    from rayjobs.job.pipeline import start_job

    job = start_job(pipeline_config(data_dir), prefix="bench")
    epochs = job.epochs
    plans = []
    for epoch in range(3):
        before = (epochs.plan_seconds, epochs.plan_cpu_seconds)
        epochs.packed(epoch).materialize()
        plans.append((epochs.plan_seconds - before[0], epochs.plan_cpu_seconds - before[1]))
    snapshot = job.snapshot()
    tokenized = snapshot["tokenize"].values()
    return {
        "tokenize_s": sum(c["seconds"] for c in tokenized),
        "tokenize_cpu_s": sum(c["cpu_seconds"] for c in tokenized),
        "samples": sum(c["samples"] for c in tokenized),
        "epochs": [
            {
                "plan_s": plans[epoch][0],
                "plan_cpu_s": plans[epoch][1],
                "assemble_s": snapshot["pack"][epoch]["seconds"],
                "assemble_cpu_s": snapshot["pack"][epoch]["cpu_seconds"],
                "packs": snapshot["pack"][epoch]["num_packs"],
            }
            for epoch in range(3)
        ],
    }


def format_stage_times(times: dict) -> str:
    """The pack stage against tokenization. CPU seconds are the work each stage costs; wall seconds
    per call also count the time a process waits for a core, which on a machine with fewer cores
    than Ray processes dominates short calls."""
    lines = [
        f"\nRay pipeline stage timers, {times['samples']} samples of every bench set but DPO, "
        f"GPT-2, seq_len 2048: tokenize (once) {times['tokenize_cpu_s']:.2f} s CPU, "
        f"{times['tokenize_s']:.2f} s wall"
    ]
    for epoch, stats in enumerate(times["epochs"]):
        wall = stats["plan_s"] + stats["assemble_s"]
        cpu = stats["plan_cpu_s"] + stats["assemble_cpu_s"]
        lines.append(
            f"  epoch {epoch}: pack (plan + join + assemble, {stats['packs']} packs) "
            f"{cpu:.3f} s CPU "
            f"= {cpu / times['tokenize_cpu_s']:.2%} of tokenize; {wall:.3f} s wall = "
            f"{wall / times['tokenize_s']:.2%}"
        )
    return "\n".join(lines)
