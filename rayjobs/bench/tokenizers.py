"""``python -m rayjobs.bench.tokenizers [--data-dir DIR] [--repeats N]``: CPU seconds of encoding
the bundled sets with each ``tokenizer.backend`` library, in one process at one thread, as a
Tokenize actor does (docs/benchmarks.md, "Tokenizer backends").

Per set: ``encode``, the rows' rendered texts encoded whole (``Tokenizer.encode_batch``); and
``Tokenize``, the whole stage (templates, ``encode_parts``, labels, overflow) on the same rows;
each the best of ``--repeats`` passes, each on a fresh tokenizer, and the two libraries'
samples checked equal (a bench that timed different work would be no comparison).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rayjobs.bench.packing import BENCH_SETS, DEFAULT_DATA_DIR
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data.formats import parse_file
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize

BACKENDS = ("tokenizers", "fastokens")

WARM_UP = [f"warm up {i} zq" for i in range(200)]
"""A first batch for each fresh tokenizer: fastokens' first large batch costs it about 20 ms more
than later ones (set-up on first use), which would be timed against the sets otherwise."""


def cpu_seconds(fresh, work, repeats: int) -> float:
    """The least CPU time (every thread of the process) of ``repeats`` calls of ``work`` on a
    ``fresh()`` stage each, warmed up on ``WARM_UP`` (text of none of the sets: one-time set-up
    aside, no pass is helped by a word cache an earlier pass of the same rows filled)."""
    best = float("inf")
    for _ in range(repeats):
        stage = fresh()
        stage.tokenizer.encode_batch(WARM_UP)
        start = time.process_time()
        work(stage)
        best = min(best, time.process_time() - start)
    return best


def bench(data_dir: Path, repeats: int) -> list[dict]:
    results = []
    for name, relative, fmt, template, column_map, text_split in BENCH_SETS:
        if name == "hh_dpo_text":  # the packing bench's own rendering of the DPO set
            continue
        spec = DatasetConfig(
            name=name, source=str(data_dir / relative), format=fmt, template=template,
            column_map=column_map, on_bad_row="skip",
        )  # fmt: skip
        path = data_dir / relative
        rows, records = parse_file(
            path.read_bytes(), str(path), format=fmt, dataset=name, text_split=text_split
        )
        table = record_table(name, [str(path)] * len(rows), rows, records)
        tokenizer = str(data_dir / "tokenizers" / "gpt2")

        def fresh(backend: str, spec: DatasetConfig = spec, path: str = tokenizer) -> Tokenize:
            config = TokenizerConfig(path=path, backend=backend)
            return Tokenize([spec], config, 1 << 30, "truncate", threads=1)

        texts = fresh("tokenizers").texts(table)
        samples = [fresh(b).counted(table)[0] for b in BACKENDS]
        row = {"set": name, "rows": len(rows), "same_samples": samples[0].equals(samples[1])}
        for backend in BACKENDS:
            row[f"encode_{backend}"] = cpu_seconds(
                lambda b=backend: fresh(b), lambda s, t=texts: s.tokenizer.encode_batch(t), repeats
            )
            row[f"tokenize_{backend}"] = cpu_seconds(
                lambda b=backend: fresh(b), lambda s, t=table: s.counted(t), repeats
            )
        results.append(row)
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| set | rows | encode: tokenizers | fastokens | × | Tokenize stage: tokenizers | "
        "fastokens | × | same samples |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [r["set"], str(r["rows"])]
        for part in ("encode", "tokenize"):
            ours, theirs = r[f"{part}_tokenizers"], r[f"{part}_fastokens"]
            cells += [f"{ours:.3f} s", f"{theirs:.3f} s", f"{ours / theirs:.1f}×"]
        cells.append("yes" if r["same_samples"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayjobs.bench.tokenizers")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = bench(args.data_dir, args.repeats)
    print(table(results))
    return 0 if all(r["same_samples"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
