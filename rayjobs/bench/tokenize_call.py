"""``python -m rayjobs.bench.tokenize_call``: the Tokenize actor's call offline, on one core.

The pipeline bench's data (the bundled alpaca and hh chat sets, one copy: ``pipeline.write_shards``)
read in-process into the actors' 256-row batches, then, in this process with the tokenizer at one
thread and the encoder ``--backend`` (fastokens, the default where it loads, or tokenizers), the
best of ``--repeats`` passes in CPU time of: the whole ``Tokenize.__call__``; the call with the
tokenizer's encodings cached (what the call costs besides the encoder); and the tokenizers and
fastokens encoders alone on the same texts (docs/benchmarks.md, "Streaming pipeline").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


class _Cached:
    """The run's tokenizer with ``encode_parts_flat`` answered from a cache after its first call
    on the same texts: the call's cost besides the encoder."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode_parts_flat(self, texts):
        key = tuple(map(tuple, texts))
        if key not in self.cache:
            self.cache[key] = self.tokenizer.encode_parts_flat(texts)
        return self.cache[key]


def _best(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        work()
        times.append(time.process_time() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import pyarrow as pa

    from rayjobs.bench.packing import DEFAULT_DATA_DIR
    from rayjobs.bench.pipeline import write_shards
    from rayjobs.bench.reference import TOKENIZE_BATCH_ROWS, fast_encoder
    from rayjobs.config import config_from_dict
    from rayjobs.data.sources import open_row_file, read_tables
    from rayjobs.data.tokenize import Tokenize

    parser = argparse.ArgumentParser(prog="python -m rayjobs.bench.tokenize_call")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", choices=("fastokens", "tokenizers"), default="fastokens")
    args = parser.parse_args(argv)
    folders = write_shards(args.data_dir, Path(tempfile.mkdtemp()), 1)
    config = config_from_dict(
        {
            "datasets": [
                {"name": "alpaca", "source": str(folders["alpaca"]), "template": "alpaca"},
                {"name": "hh_chat", "source": str(folders["hh_chat"]), "template": "chat"},
            ],
            "tokenizer": {
                "path": str(args.data_dir / "tokenizers" / "gpt2"),
                "backend": args.backend,
            },
        }
    )
    batches = []
    for spec in config.datasets:
        for path in spec.files:
            with open_row_file(path, spec.format) as file:
                table = pa.concat_tables(read_tables(file, path, format=spec.format,
                                                     dataset=spec.name))  # fmt: skip
            batches += [table.slice(i, TOKENIZE_BATCH_ROWS)
                        for i in range(0, table.num_rows, TOKENIZE_BATCH_ROWS)]  # fmt: skip
    tokenize = Tokenize(config.datasets, config.tokenizer, 2048, "truncate", threads=1)
    tokens = sum(int(tokenize(b).column("num_tokens").to_numpy().sum()) for b in batches)
    texts = [
        ["".join(s.text for s in tokenize._template(tokenize.datasets[name], record))
         for name, record in zip(*(b.column(c).to_pylist() for c in ("_dataset", "_record")),
                                 strict=True)]
        for b in batches
    ]  # fmt: skip
    whole = _best(lambda: [tokenize(b) for b in batches], args.repeats)
    backend = tokenize.tokenizer.backend
    tokenize.tokenizer = _Cached(tokenize.tokenizer)
    besides = _best(lambda: [tokenize(b) for b in batches], args.repeats)
    alone = _best(lambda: [backend.encode_batch(t, add_special_tokens=False) for t in texts],
                  args.repeats)  # fmt: skip
    name, encode = fast_encoder(backend)
    fast = _best(lambda: [encode(t) for t in texts], args.repeats)
    print(f"one pass: {len(batches)} batches, {tokens:,} tokens, encoded by {args.backend}; "
          f"CPU ms, best of {args.repeats}")  # fmt: skip
    print(f"  Tokenize call                                 {whole * 1e3:8.1f}")
    print(f"  the call less the tokenizer (cached encodings) {besides * 1e3:7.1f}")
    print(f"  tokenizers encode_batch alone                 {alone * 1e3:8.1f}")
    print(f"  {name} alone{' ' * (36 - len(name))}{fast * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
