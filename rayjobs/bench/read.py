"""``python -m rayjobs.bench.read``: peak memory of reading one large JSONL file through Ray.

Writes a JSONL file of ``--size-mb`` MiB (the bundled alpaca demo set's rows, repeated) into a
temporary folder and reads it through the job's own read path (``sources.read_dataset`` on a
``DatasetConfig``: one ``RowFileDatasource`` read task), the driver pulling every block and
counting the rows, in two modes, each in a fresh local Ray:

- ``chunked``: the read task streams the file ``--chunk-mb`` at a time (default
  ``formats.CHUNK_BYTES``);
- ``whole``: the same code with one chunk as large as the file: the file in memory at once and
  parsed in one go, as the read task did before it streamed (``f.readall()``, then the whole file's
  lines and records).

While a mode runs, a thread samples every 0.2 s the resident memory (RSS) of this driver and of
every process under it (Ray's GCS, raylet, workers, agents: not other sessions' Ray) and reports
the largest any one process reached, which process it was, the part of it that was shared memory
(``RssShmem`` in ``/proc/<pid>/status``: the object store's pages it had mapped, as the store lives
in ``/dev/shm``), rows read and seconds. Not psutil's ``memory_info().shared``, which is
``RssFile`` + ``RssShmem``: it also counted the libraries every Ray worker maps. The ratio of the
two modes' peaks comes from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_DATA = (
    Path(__file__).resolve().parents[2] / "configs" / "data" / "sft" / "alpaca_en_demo.json"
)
MiB = 1 << 20


@dataclass
class ReadRow:
    mode: str
    chunk_bytes: int
    rows: int
    seconds: float
    peak_rss_mb: float
    """The largest RSS any one process reached."""
    peak_shmem_mb: float | None
    """Of which shared memory (``RssShmem``: object store pages mapped by the process), at that
    sample; None where ``/proc/<pid>/status`` has no ``RssShmem`` (not Linux)."""
    peak_process: str
    """Which process: its command line (Ray names workers by their task, ``ray::...``)."""
    driver_peak_rss_mb: float
    samples: int
    top: list[str]
    """The three processes with the largest peaks: "peak MiB command"."""


def write_jsonl(path: Path, size_mb: int, data: Path = DEFAULT_DATA) -> int:
    """A JSONL file of about ``size_mb`` MiB (whole rows): ``data``'s rows repeated, each copy's
    instructions numbered so that rows differ. Returns the rows written."""
    rows = json.loads(data.read_text())
    target, written, count, copy = size_mb * MiB, 0, 0, 0
    with path.open("wb") as out:
        while written < target:
            for row in rows:
                line = json.dumps(
                    {**row, "instruction": f"{row['instruction']} ({copy})"}, ensure_ascii=False
                ).encode()
                out.write(line + b"\n")
                written += len(line) + 1
                count += 1
                if written >= target:
                    break
            copy += 1
    return count


def rss_shmem(pid: int) -> int | None:
    """Bytes of shared memory resident in process ``pid`` (``RssShmem``, Linux 4.5+), or None
    where there is no such figure."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):  # the process has exited, or no /proc: no figure
        return None
    return None


class _Sampler(threading.Thread):
    """Every ``interval`` s: the RSS of this process and all its descendants; the peak per pid."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.running, self.samples = interval, True, 0
        self.peaks: dict[int, tuple[int, int | None, str]] = {}  # pid → (rss, shmem, command)

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while self.running:
            for process in [me, *me.children(recursive=True)]:
                try:
                    memory = process.memory_info()
                    if memory.rss > self.peaks.get(process.pid, (0,))[0]:
                        command = " ".join(" ".join(process.cmdline()).split())
                        shmem = rss_shmem(process.pid)
                        self.peaks[process.pid] = (memory.rss, shmem, command[:80])
                except psutil.Error:  # gone meanwhile
                    continue
            self.samples += 1
            time.sleep(self.interval)

    def stop(self) -> None:
        self.running = False
        self.join()


def measure(path: Path, mode: str, chunk_bytes: int) -> ReadRow:
    """Read ``path`` through ``sources.read_dataset`` in a fresh local Ray; count its rows."""
    import ray

    from rayjobs.config import DatasetConfig
    from rayjobs.data.sources import read_dataset

    root = str(Path(__file__).resolve().parents[2])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local Ray, as in tests
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": root}},
    )
    try:
        spec = DatasetConfig(
            name="bench", source=str(path), format="jsonl", template="alpaca", files=(str(path),)
        )
        sampler = _Sampler()
        sampler.start()
        started = time.perf_counter()
        rows = 0
        dataset = read_dataset(spec, chunk_bytes=chunk_bytes)
        for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            rows += batch.num_rows
        seconds = time.perf_counter() - started
        sampler.stop()
    finally:
        ray.shutdown()
    peaks = sorted(sampler.peaks.items(), key=lambda item: -item[1][0])
    pid, (rss, shmem, command) = peaks[0]
    return ReadRow(
        mode=mode,
        chunk_bytes=chunk_bytes,
        rows=rows,
        seconds=round(seconds, 1),
        peak_rss_mb=round(rss / MiB),
        peak_shmem_mb=None if shmem is None else round(shmem / MiB),
        peak_process=f"{command} (pid {pid})",
        driver_peak_rss_mb=round(sampler.peaks.get(os.getpid(), (0,))[0] / MiB),
        samples=sampler.samples,
        top=[
            f"{peak / MiB:,.0f} MiB {command} (pid {pid})" for pid, (peak, _, command) in peaks[:3]
        ],
    )


def format_rows(rows: list[ReadRow], size: int, written: int) -> str:
    lines = [
        f"JSONL file: {size / MiB:,.0f} MiB, {written:,} rows",
        f"{'mode':<8}{'chunk MiB':>10}{'rows':>11}{'seconds':>9}{'peak RSS MiB':>14}"
        f"{'of it shmem':>14}{'driver MiB':>12}  process at peak",
    ]
    for r in rows:
        shmem = "?" if r.peak_shmem_mb is None else f"{r.peak_shmem_mb:,.0f}"
        lines.append(
            f"{r.mode:<8}{r.chunk_bytes / MiB:>10,.0f}{r.rows:>11,}{r.seconds:>9.1f}"
            f"{r.peak_rss_mb:>14,.0f}{shmem:>14}{r.driver_peak_rss_mb:>12,.0f}"
            f"  {r.peak_process}"
        )
    for r in rows:
        lines.append(f"{r.mode}: largest peaks: " + "; ".join(r.top))
    by_mode = {r.mode: r for r in rows}
    if {"chunked", "whole"} <= by_mode.keys():
        ratio = by_mode["whole"].peak_rss_mb / max(1, by_mode["chunked"].peak_rss_mb)
        lines.append(f"peak RSS of one process, whole file / chunked: {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from rayjobs.data import formats

    parser = argparse.ArgumentParser(prog="python -m rayjobs.bench.read", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=1024, help="JSONL file size (MiB)")
    parser.add_argument(
        "--chunk-mb", type=float, default=formats.CHUNK_BYTES / MiB, help="chunked mode's chunk"
    )
    parser.add_argument("--modes", nargs="+", choices=["chunked", "whole"], default=None)
    parser.add_argument("--dir", type=Path, help="where to write the file (default: a temp dir)")
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    # A chunk under one byte was read as the default (0 is "none given" to the reader) and a
    # negative one as the whole file, either labelled chunked.
    for flag, value in (("--size-mb", args.size_mb), ("--chunk-mb", args.chunk_mb)):
        if not value > 0:
            print(f"rayjobs: {flag} must be positive, got {value:g}", file=sys.stderr)
            return 2
    if int(args.chunk_mb * MiB) < 1:
        print(f"rayjobs: --chunk-mb {args.chunk_mb:g} is under one byte", file=sys.stderr)
        return 2
    modes = args.modes or ["chunked", "whole"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_read_") as folder:
        path = Path(folder) / "rows.jsonl"
        written = write_jsonl(path, args.size_mb)
        size = path.stat().st_size
        chunks = {"chunked": int(args.chunk_mb * MiB), "whole": size + 1}
        rows = []
        for mode in modes:
            rows.append(measure(path, mode, chunks[mode]))
            print(format_rows(rows[-1:], size, written).splitlines()[2], flush=True)
            if rows[-1].rows != written:
                raise SystemExit(f"{mode}: read {rows[-1].rows} rows of {written}")
    print(format_rows(rows, size, written))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
