"""Command line (the same usage as README.md, "Command line").

rayjobs run CONFIG [dotted.key=value ...] [--address ADDR] [--json] [--resume [RUN]] [--quiet]
rayjobs export CONFIG [dotted.key=value ...] --out DIR [--epochs N] [--overwrite]
               [--labels hf|shifted] [--runner auto|local|ray] [--address ADDR] [--quiet]
rayjobs inspect CONFIG [dotted.key=value ...] [--limit N] [--json] [--plot OUT.png] [--address ADDR]
                [--runner auto|local|ray] [--quiet]  (--plot needs pip install -e '.[plot]')
rayjobs validate CONFIG [dotted.key=value ...] [--rows N]        (no Ray: config, files, first rows)
rayjobs init [DIR]                       (writes the example configs and their data to DIR)
rayjobs bench packing [--data NAME|FILE ...] [--data-dir DIR] [--seq-len N ...] [--window N]
                      [--window-tokens N] [--json OUT] [--no-pipeline]  (--data-dir: configs/data)
rayjobs bench pipeline [--scales N ...] [--window-tokens N] [--tokenize-actors N] [--pace F]
                       [--weights W W] [--data-dir DIR] [--json OUT]
                                                       (pipeline needs pip install -e '.[bench]')
rayjobs bench peers [--scales N ...] [--num-proc N] [--repeats N] [--paths P ...]
                    [--data-dir DIR] [--json OUT]
                                        (rayjobs export beside TRL's path; needs '.[bench]')
rayjobs bench read [--size-mb N] [--json OUT]       (peak memory of a read task; needs '.[bench]')
rayjobs bench attention [--seq-len N ...] [--mean-length L] [--json OUT]        (needs a CUDA GPU)
rayjobs bench train --export DIR [--rows N] [--variants V ...] [--steps N] [--warmup N]
                    [--dim D --layers L --heads H] [--vocab-size V] [--json OUT]
                                                               (packed vs padded train steps)
rayjobs bench sft [--scales N ...] [--steps N] [--repeats N] [--num-workers 0|1] [--threads N]
                  [--sides S ...] [--data-dir DIR] [--json OUT]
                               (rayjobs run beside TRL's SFTTrainer, same model; needs '.[bench]')
rayjobs submit CONFIG [dotted.key=value ...] [--address URL] [--working-dir DIR] [--no-wait]
               [--json] [--allow-absolute] [--max-upload-mib N] [--max-file-mib N]
               [--submission-id ID] [--runtime-env-json JSON] [--dry-run] [--follow-links]
                                                    (a Ray job on a cluster: "Run on a cluster")
rayjobs status JOB [--address URL] [--json] [--watch]
rayjobs logs JOB [--address URL] [--follow]
rayjobs stop JOB [--address URL]
rayjobs --version
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from rayjobs import console
from rayjobs.bench.command import bench_command
from rayjobs.config import load_config
from rayjobs.errors import ConfigError, Interrupted, user_error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayjobs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"rayjobs {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="build the packed pipeline and train on Ray")
    export = commands.add_parser("export", help="write the packed rows as Parquet + _manifest.json")
    inspect = commands.add_parser(
        "inspect",
        help="data side only: per-dataset counts and lengths, packing, a decoded packed row",
    )
    for command in (run, export, inspect):
        command.add_argument("config", help="YAML config file (see configs/)")
        command.add_argument(
            "overrides",
            nargs="*",
            metavar="dotted.key=value",
            help="config overrides, e.g. packing.seq_len=4096 train.max_steps=20",
        )
        command.add_argument(
            "--address",
            help="Ray cluster address (default: ray.address, else $RAY_ADDRESS, else local)",
        )
    run.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object, alone on stdout (the text summary goes to "
        "stderr)",
    )
    for command in (run, export, inspect):
        command.add_argument(
            "--quiet",
            action="store_true",
            help="no progress lines (the data side's every few seconds; run: also rank 0's every "
            "train.report_every steps); warnings, errors and the result only",
        )
    run.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="RUN",
        help="continue run RUN (a folder under train.storage_path; default: the latest) from its "
        "last periodic checkpoint (train.checkpoint_every, checkpoint_every_minutes)",
    )
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--epochs", type=int, help="epochs to export (default: train.epochs)")
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="empty --out first when it holds an earlier export (and nothing else)",
    )
    export.add_argument(
        "--labels",
        choices=["hf", "shifted"],
        default="hf",
        help="labels convention: hf (default; unshifted, -100 on prompts, padding and each "
        "document's first token, as Hugging Face models, TRL, Axolotl and torchtune read them) "
        "or shifted (labels[t] the target of position t, as rayjobs trains); _manifest.json and "
        "each Parquet file's metadata say which",
    )
    for command in (export, inspect):
        command.add_argument(
            "--runner",
            choices=["auto", "local", "ray"],
            default="auto",
            help="where the data path runs: ray (the cluster named by ray.address or "
            "RAY_ADDRESS, else an embedded local Ray), local (this process, no Ray; file "
            "datasets, stream mode), or auto (default: local for a small job with no cluster "
            "named, else ray); the manifest or report says which and why",
        )
    inspect.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="read only the first N rows of each dataset (in file order, bad rows included)",
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object on the last line of stdout",
    )
    inspect.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write histograms of sample lengths (one panel per dataset) and pack fill "
        "(needs matplotlib: pip install 'rayjobs[plot]')",
    )
    validate = commands.add_parser(
        "validate",
        help="check a config without Ray: keys, files and sizes, tokenizer, templates on the "
        "first rows",
    )
    validate.add_argument("config", help="YAML config file")
    validate.add_argument(
        "overrides", nargs="*", metavar="dotted.key=value", help="config overrides, as for run"
    )
    validate.add_argument(
        "--rows",
        type=int,
        default=32,
        metavar="N",
        help="rows of each dataset's first file to template and tokenize (default 32)",
    )
    init = commands.add_parser(
        "init", help="write the example configs and the data they read (configs/ of the repo)"
    )
    init.add_argument(
        "dir",
        nargs="?",
        default="rayjobs-examples",
        metavar="DIR",
        help="folder to write them to, new or empty (default: rayjobs-examples)",
    )
    bench = commands.add_parser("bench", help="benchmarks")
    bench.add_argument(
        "what",
        choices=["packing", "pipeline", "peers", "attention", "read", "train", "sft"],
        help="packing: efficiency and speed on real data; pipeline: the streaming path end to "
        "end at growing data sizes; peers: rayjobs export beside the path a TRL user takes "
        "(datasets map + trl.pack_dataset) on the same files; attention: the document mask on "
        "a CUDA GPU, FlexAttention vs dense SDPA; read: peak memory of one read task on a large "
        "JSONL file; train: training steps on an export's packed rows vs the same samples padded "
        "(`rayjobs bench train --help`); sft: rayjobs run beside TRL's SFTTrainer on the same "
        "model, data and steps (`rayjobs bench sft --help`)",
    )
    # No defaults here for options a bench has its own defaults for (applied in _bench): an
    # option given to a bench that does not take it is refused there, so it must show as given.
    bench.add_argument("--size-mb", type=int, help="read: the JSONL file's size (MiB)")
    bench.add_argument("--scales", type=int, nargs="+", help="pipeline, peers: copies of the data")
    bench.add_argument(
        "--num-proc", type=int, help="peers: the TRL path's num_proc (default: the CPUs)"
    )
    bench.add_argument("--repeats", type=int, help="peers: runs of each path per scale")
    bench.add_argument(
        "--paths", nargs="+", help="peers: which of rayjobs, rayjobs-ray, trl (default: all)"
    )
    bench.add_argument(
        "--data",
        nargs="*",
        metavar="NAME",
        help="bench sets by name or file (default: all; see rayjobs/bench/packing.py)",
    )
    bench.add_argument(
        "--data-dir",
        help="folder of real data sets in the layout of configs/data "
        "(default: the subsets bundled there)",
    )
    bench.add_argument("--seq-len", type=int, nargs="*")
    bench.add_argument("--window", type=int, help="planned path: samples per packing window")
    bench.add_argument(
        "--window-tokens",
        type=int,
        help="stream path: tokens per packer call (default: the job's packing.window_tokens)",
    )
    bench.add_argument(
        "--tokenize-actors", type=int, help="pipeline: Tokenize actors at most (default: job's)"
    )
    bench.add_argument(
        "--weights", type=float, nargs="+", help="pipeline: weights of the alpaca and hh chat sets"
    )
    bench.add_argument(
        "--pace",
        type=float,
        help="pipeline: paced pass's demand as a share of the unpaced steady throughput "
        "(default 0.6; 0: none)",
    )
    bench.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    bench.add_argument(
        "--mean-length", type=float, help="attention: mean document length in tokens"
    )
    bench.add_argument(
        "--no-pipeline",
        action="store_true",
        help="skip timing the pack stage against tokenize in the Ray pipeline",
    )
    address_help = (
        "Ray Jobs API (dashboard) URL (default: $RAY_API_SERVER_ADDRESS, else an http(s) "
        "$RAY_ADDRESS, else http://127.0.0.1:8265)"
    )
    submit = commands.add_parser("submit", help="run CONFIG on a Ray cluster as a Ray job")
    submit.add_argument("config", help="YAML config file, under the working directory")
    submit.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="as for run")
    submit.add_argument("--address", help=address_help)
    submit.add_argument(
        "--working-dir",
        help="folder shipped as the job's working directory (default: the checkout holding "
        "CONFIG: the nearest folder above it with .git or pyproject.toml, else its folder)",
    )
    submit.add_argument("--no-wait", action="store_true", help="submit and return")
    submit.add_argument(
        "--json",
        action="store_true",
        help="print the outcome (submission_id, status, summary, ...) as one JSON object on the "
        "last line of stdout",
    )
    submit.add_argument(
        "--allow-absolute",
        action="store_true",
        help="let inputs named by absolute paths through: every cluster node has them there",
    )
    submit.add_argument("--max-upload-mib", type=float, help="limit on the upload (default 100)")
    submit.add_argument(
        "--max-file-mib", type=float, help="limit on one file of the upload (default 10)"
    )
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would be uploaded (bytes and path, one file a line) and submit nothing",
    )
    submit.add_argument(
        "--follow-links",
        action="store_true",
        help="ship what a link out of the working directory points to (default: it is left "
        "out and said); a link to a likely secret stays out either way",
    )
    submit.add_argument("--submission-id", help="the job's id (default: Ray makes one)")
    submit.add_argument(
        "--runtime-env-json",
        help='more runtime_env, e.g. \'{"pip": [...], "env_vars": {...}}\' (not working_dir '
        "or py_modules; excludes are added to rayjobs')",
    )
    for name, text in (
        ("status", "a submitted job's status"),
        ("logs", "a submitted job's logs"),
        ("stop", "stop a submitted job"),
    ):
        job = commands.add_parser(name, help=text)
        job.add_argument("job", metavar="JOB", help="the job's submission id")
        job.add_argument("--address", help=address_help)
        if name == "status":
            job.add_argument("--json", action="store_true", help="one JSON object on stdout")
            job.add_argument(
                "--watch", action="store_true", help="print it again every few seconds till it ends"
            )
        if name == "logs":
            job.add_argument("--follow", action="store_true", help="follow until the job ends")
    return parser


def _version() -> str:
    """The installed package's version (its metadata), or ``unknown`` in a checkout that was
    never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rayjobs")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _validate(args: argparse.Namespace, config: Any) -> int:
    """``rayjobs validate``: the report, and the wall time it took (no Ray is started)."""
    from rayjobs.job.validate import validate

    if args.rows < 1:
        print(
            f"rayjobs: --rows must be a positive number of rows, got {args.rows}", file=sys.stderr
        )
        return 2
    for line in validate(config, args.rows):
        print(line)
    print(f"valid: {args.config} (no Ray started, {time.perf_counter() - args.started:.1f} s)")
    return 0


def _dataset_line(name: str, stats: dict[str, Any]) -> str:
    return (
        f"  {name}: samples {stats['samples']} tokens {stats['tokens']} "
        f"truncated_tokens {stats['truncated_tokens']} dropped_samples "
        f"{stats['dropped_samples']} skipped_rows {stats['skipped_rows']}"
    )


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"steps {summary['steps']} per rank {summary['steps_per_rank']}  "
        f"loss {summary['loss_first']:.4f} → {summary['loss_last']:.4f}",
        f"packs {summary['num_packs']}  packing efficiency {summary['packing_efficiency']:.4f}  "
        f"tokens trained {summary['tokens_trained']}",
    ]
    if summary.get("untrained_packs"):
        lines[-1] += f"  ({summary['untrained_packs']} packs made, not trained: untrained_packs)"
    if "parameters" in summary:
        counts = summary["parameters"]
        share = f"{counts['trainable'] / max(1, counts['total']):.2%}"
        if "lora" in summary:
            share += f", LoRA r {summary['lora']['r']}"
        lines.append(
            f"model {summary['model']}: {counts['trainable']:,} of {counts['total']:,} parameters "
            f"trainable ({share})  parameters {summary['param_dtype']}, compute "
            f"{summary['precision']}"
        )
    for name, stats in summary["datasets"].items():
        lines.append(_dataset_line(name, stats))
    if "dpo" in summary:
        dpo = summary["dpo"]
        lines.append(
            f"dpo: reward accuracy {dpo['reward_accuracy_first']:.3f} → "
            f"{dpo['reward_accuracy']:.3f}  reward margin {dpo['reward_margin_first']:.3f} → "
            f"{dpo['reward_margin']:.3f}  (beta {dpo['beta']}, {dpo['triples']} triples trained)"
        )
    if "eval" in summary:
        evaluation = summary["eval"]
        losses = " → ".join(f"{e['loss']:.4f} (step {e['step']})" for e in evaluation["history"])
        last = evaluation["history"][-1]
        lines.append(f"eval: loss {losses}  over {last['rows']} packs, {last['tokens']} tokens")
        if "reward_accuracy" in last:
            lines[-1] += f", reward accuracy {last['reward_accuracy']:.3f}"
        for name, stats in evaluation.get("datasets", {}).items():  # none: eval.datasets gone
            lines.append(_dataset_line(name, stats))
    for resume in summary.get("resumes", []):
        lines.append(
            f"resumed from step {resume['step']} (skipped {resume['rows_skipped_per_rank']} "
            "rows per rank of the stream it re-read)"
        )
    if summary.get("tokenizer"):
        from rayjobs.job.report import tokenizer_line

        lines.append(tokenizer_line(summary["tokenizer"]))
    lines.append(f"run {summary['run_name']}  checkpoint {summary['checkpoint']}")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace, config: Any) -> int:
    """``rayjobs inspect``: the report as text, then (``--json``) as one JSON object on the last
    line of stdout, printed after Ray is shut down (as ``run --json``), so no Ray log line can
    follow it."""
    import ray

    from rayjobs.job.inspection import inspect
    from rayjobs.job.report import format_report, require_matplotlib

    if args.limit is not None and args.limit < 1:
        print(
            f"rayjobs: --limit must be a positive number of rows, got {args.limit}", file=sys.stderr
        )
        return 2
    if args.plot:
        from pathlib import Path

        try:
            require_matplotlib()
        except ConfigError as error:
            print(f"rayjobs: {error}", file=sys.stderr)
            return 2
        if not Path(args.plot).absolute().parent.is_dir():
            print(f"rayjobs: --plot {args.plot}: no such folder", file=sys.stderr)
            return 2
    owns_ray = not ray.is_initialized()
    with console.ray_output_to_stderr():
        console.no_ray_data_progress_bars()
        report = inspect(config, limit=args.limit, plot_path=args.plot, runner=args.runner)
        if owns_ray:  # Ray's last lines (raylet warnings, log dedup) come out before the report
            ray.shutdown()
    print(format_report(report))
    if args.json:
        print(json.dumps(report, default=str))
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    with console.log_on_stderr():
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    started = time.perf_counter()  # validate reports its wall time from here
    if argv[:2] == ["bench", "train"]:  # its own options (model shape, steps): bench_train.py
        from rayjobs.bench import train as bench_train

        return bench_train.main(argv[2:])
    if argv[:2] == ["bench", "sft"]:  # its own options (steps, threads, sides): bench/sft.py
        from rayjobs.bench import sft as bench_sft

        return bench_sft.main(argv[2:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("status", "logs", "stop"):
        from rayjobs.job import submit

        return submit.job_command(parser.parse_args(argv))
    # Overrides may also follow options (`run CONFIG --address auto a.b=1`), which argparse does
    # not interleave with positionals on its own.
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if args.command == "bench" or len(overrides) != len(extra):
        parser.parse_args(argv)  # reports what it does not recognise and exits 2
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    args.started = started
    if args.command == "bench":
        return bench_command(args)
    if args.command == "submit":
        from rayjobs.job import submit

        return submit.submit_command(args)
    if args.command == "init":
        from rayjobs.job.examples import init

        try:
            written = init(args.dir)
        except ConfigError as error:
            print(f"rayjobs: {error}", file=sys.stderr)
            return 2
        print(f"wrote {len(written)} files to {args.dir}; next: rayjobs validate "
              f"{args.dir}/demo.yaml && rayjobs run {args.dir}/demo.yaml")  # fmt: skip
        return 0
    with _signals():
        return _job_command(args)


RECEIVED: list[int] = []
"""The signals ``_signals`` turned into ``Interrupted``, in order: Ray's blocking calls stop for
one with a ``KeyboardInterrupt`` of their own, which does not say which signal it was."""


@contextlib.contextmanager
def _signals() -> Iterator[None]:
    """While ``run``, ``export`` or ``inspect`` works, SIGTERM raises ``Interrupted`` in the
    main thread, as SIGINT raises ``KeyboardInterrupt``: both unwind the command, which says
    what it left where and exits 128 + the signal (``init_ray`` keeps this handler)."""

    def terminated(signum: int, frame: Any) -> None:
        RECEIVED.append(signum)
        raise Interrupted(signum)

    RECEIVED.clear()
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _job_command(args: argparse.Namespace) -> int:
    """``run``, ``export`` and ``inspect``: validate the config, then the command."""
    try:
        return _checked_job_command(args)
    except KeyboardInterrupt as interrupt:
        left = getattr(interrupt, "left", "") or "nothing written"
        signum = RECEIVED[-1] if RECEIVED else getattr(interrupt, "signum", signal.SIGINT)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # Ray's last lines before this one
        with contextlib.suppress(Exception):
            ray.shutdown()
    print(f"rayjobs: interrupted ({signal.Signals(signum).name}): {left}", file=sys.stderr)
    return Interrupted(signum).exit_status


def _checked_job_command(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):
        logging.getLogger("rayjobs").setLevel(logging.WARNING)
    try:
        config = load_config(args.config, args.overrides)
        if getattr(args, "address", None):
            config = config.model_copy(
                update={"ray": config.ray.model_copy(update={"address": args.address})}
            )
    except ConfigError as error:
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    try:
        if args.command == "validate":
            return _validate(args, config)
        if args.command == "inspect":
            return _inspect(args, config)
        if args.command == "export":
            from rayjobs.job.export import export

            console.no_ray_data_progress_bars()
            manifest = export(
                config, args.out, args.epochs, overwrite=args.overwrite, labels=args.labels,
                runner=args.runner,
            )  # fmt: skip
            packed = manifest["packed"]
            print(
                f"wrote {packed['num_packs']} packs ({packed['efficiency']:.4f} efficiency) "
                f"over {len(manifest['epochs'])} epoch(s) to {args.out}, labels {args.labels}"
            )
            return 0
        import ray

        from rayjobs.job.pipeline import run

        owns_ray = not ray.is_initialized()
        with console.ray_output_to_stderr():
            console.no_ray_data_progress_bars()
            summary = run(config, resume=args.resume)
            if owns_ray:  # Ray's last lines (raylet warnings, log dedup) come before the summary
                ray.shutdown()
    except Exception as error:  # noqa: BLE001 - user errors are reported without a traceback
        found = user_error(error)
        if found is None:
            raise
        print(f"rayjobs: {found}", file=sys.stderr)
        # a config refused before anything started is 2; anything found once Ray runs, 1
        return found.exit_status if found is error else 1
    if args.json:  # stdout: the JSON alone
        print(format_summary(summary), file=sys.stderr)
        sys.stderr.flush()
        print(json.dumps(summary, default=str))
    else:
        print(format_summary(summary))
    sys.stdout.flush()  # before anything the interpreter's exit may print on stderr
    return 0


if __name__ == "__main__":
    sys.exit(main())
