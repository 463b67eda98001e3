"""Command line: ``rayjobs run CONFIG [dotted.key=value ...] [--json] [--address ADDR]``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rayjobs.config import ConfigError, load_config

USER_ERRORS = ("DataError", "SourceError", "ConfigError")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayjobs", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="build the packed pipeline and train on Ray")
    run.add_argument("config", help="YAML config file (see configs/)")
    run.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                     help="config overrides, e.g. packing.seq_len=4096 train.max_steps=20")
    run.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else local)")
    run.add_argument("--json", action="store_true",
                     help="print the summary as one JSON object on the last line of stdout")
    return parser


def _user_error(error: BaseException) -> str | None:
    """The message of a rayjobs user error, even when Ray wrapped it in its own exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in USER_ERRORS:
            return str(error)
        for name in USER_ERRORS:
            marker = f"{name}: "
            text = str(error)
            if marker in text:
                return text[text.rindex(marker) + len(marker):].strip().splitlines()[0]
        error = error.__cause__ or error.__context__
    return None


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"steps {summary['steps']} per rank {summary['steps_per_rank']}  "
        f"loss {summary['loss_first']:.4f} → {summary['loss_last']:.4f}",
        f"packs {summary['num_packs']}  packing efficiency {summary['packing_efficiency']:.4f}  "
        f"tokens trained {summary['tokens_trained']}",
    ]
    for name, stats in summary["datasets"].items():
        lines.append(f"  {name}: samples {stats['samples']} tokens {stats['tokens']} "
                     f"truncated_tokens {stats['truncated_tokens']} dropped_samples "
                     f"{stats['dropped_samples']} skipped_rows {stats['skipped_rows']}")
    lines.append(f"checkpoint {summary['checkpoint']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.address:
            config = config.model_copy(update={"ray": config.ray.model_copy(
                update={"address": args.address})})
    except ConfigError as error:
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    from rayjobs.pipeline import run

    try:
        summary = run(config)
    except Exception as error:  # noqa: BLE001 - user errors are reported without a traceback
        message = _user_error(error)
        if message is None:
            raise
        print(f"rayjobs: {message}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.json:
        print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
