"""``rayjobs bench WHAT``: the options each bench takes, checked, then the bench."""

from __future__ import annotations

import argparse
import sys

BENCH_OPTIONS = {
    "packing": ("data", "data_dir", "seq_len", "window", "window_tokens", "json", "no_pipeline"),
    "pipeline": (
        "scales",
        "window_tokens",
        "tokenize_actors",
        "pace",
        "data_dir",
        "json",
        "weights",
    ),  # fmt: skip
    "peers": ("scales", "num_proc", "repeats", "paths", "data_dir", "json"),
    "read": ("size_mb", "json"),
    "attention": ("seq_len", "mean_length", "json"),
}
"""The options of the ``bench`` parser each bench takes (``bench train`` has its own parser)."""


def usage_error(args: argparse.Namespace) -> str | None:
    """An option given that the chosen bench does not take (the benches share one parser, and
    another bench's option was dropped without a word: ``bench pipeline --seq-len 8192`` ran at
    2048), or a bad value of ``bench packing``'s; the other benches check their own values."""
    if args.what in ("train", "sft"):  # only ``rayjobs bench train|sft ...`` reach their parsers
        return (
            f"bench {args.what} takes its options after `bench {args.what}` "
            f"(rayjobs bench {args.what} --help)"
        )
    # (``started``: the CLI's clock for validate's wall time, set on every command's args)
    foreign = [
        "--" + dest.replace("_", "-")
        for dest, value in vars(args).items()
        if dest not in (*BENCH_OPTIONS[args.what], "command", "what", "started")
        and value is not None
        and value is not False
    ]
    if foreign:
        return f"bench {args.what} does not take {', '.join(foreign)}"
    if args.what != "packing":
        return None
    if args.seq_len is not None and not args.seq_len:
        return "--seq-len needs at least one length"
    if any(seq_len < 1 for seq_len in args.seq_len or ()):
        return f"--seq-len must be positive, got {args.seq_len}"
    for flag, value in (("--window", args.window), ("--window-tokens", args.window_tokens)):
        if value is not None and value < 1:
            return f"{flag} must be positive, got {value}"
    return None


def bench_command(args: argparse.Namespace) -> int:
    if error := usage_error(args):
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    if args.what == "attention":
        from rayjobs.bench import attention as bench_attention

        if args.seq_len is None:
            args.seq_len = list(bench_attention.SEQ_LENS)
        if args.mean_length is None:
            args.mean_length = bench_attention.MEAN_LENGTH
        if error := bench_attention.argument_error(args.seq_len, args.mean_length):
            print(f"rayjobs: {error}", file=sys.stderr)  # before asking for a GPU
            return 2
        return _attention(args)
    if args.what == "read":
        from rayjobs.bench import read as bench_read

        argv = ["--size-mb", str(args.size_mb)] if args.size_mb is not None else []
        return bench_read.main(argv + (["--json", args.json] if args.json else []))
    if args.what == "pipeline":
        from rayjobs.bench import pipeline as bench_pipeline

        # Every value given is passed on, 0 too (bench_pipeline refuses what it cannot run):
        # a 0 was dropped, and the bench ran with the job's default instead.
        argv = ["--scales", *map(str, args.scales)] if args.scales else []
        for flag, value in (
            ("--window-tokens", args.window_tokens),
            ("--tokenize-actors", args.tokenize_actors),
            ("--pace", args.pace),
            ("--data-dir", args.data_dir),
            ("--json", args.json),
        ):
            argv += [flag, str(value)] if value is not None else []
        argv += ["--weights", *map(str, args.weights)] if args.weights else []
        return bench_pipeline.main(argv)
    if args.what == "peers":
        from rayjobs.bench import peers as bench_peers

        argv = ["--scales", *map(str, args.scales)] if args.scales else []
        for flag, value in (
            ("--num-proc", args.num_proc),
            ("--repeats", args.repeats),
            ("--data-dir", args.data_dir),
            ("--json", args.json),
        ):
            argv += [flag, str(value)] if value is not None else []
        argv += ["--paths", *args.paths] if args.paths else []
        return bench_peers.main(argv)
    from pathlib import Path

    from rayjobs.bench import packing as bench

    data_dir = Path(args.data_dir) if args.data_dir else bench.DEFAULT_DATA_DIR
    if not data_dir.is_dir():
        print(
            f"rayjobs: --data-dir {data_dir} is not a folder (the bench reads real data there)",
            file=sys.stderr,
        )
        return 2
    try:
        names = bench.select_sets(args.data)
    except ValueError as error:
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    seq_lens = bench.SEQ_LENS if args.seq_len is None else args.seq_len
    window = bench.DEFAULT_WINDOW if args.window is None else args.window
    window_tokens = args.window_tokens or bench.DEFAULT_WINDOW_TOKENS  # (0 is refused above)
    lengths = bench.load_lengths(data_dir, names)
    rows = bench.bench_packing(lengths, seq_lens, window, window_tokens)
    print(bench.format_table(rows))
    speed = bench.packing_function_speed(lengths, window=window)
    print(bench.format_verdict(rows, window, speed, window_tokens))
    if args.json:
        bench.write_json(rows, args.json)
    if not args.no_pipeline:
        print(bench.format_stage_times(bench.time_pipeline(data_dir)))
    return 0


def _attention(args: argparse.Namespace) -> int:
    import torch

    from rayjobs.bench import attention as bench_attention

    if not torch.cuda.is_available():
        print(
            "rayjobs: bench attention needs a CUDA GPU (FlexAttention's training path)",
            file=sys.stderr,
        )
        return 2
    argv = ["--seq-len", *map(str, args.seq_len), "--mean-length", str(args.mean_length)]
    bench_attention.main(argv + (["--json", args.json] if args.json else []))
    return 0
