"""Gathers what ``run_ray_gpu.sh`` left in its work folder into one ``results.json`` and prints
the figures: the Ray Train run's tokens/s against ``bench train``'s bare loop on the same model and
rows (the GPU acceptance: at least 90%), and ``bench pipeline``'s steady tokens/s by Tokenize
actors against linear scaling from one actor (at least 80% at 8). Run after every step, so the
file holds whatever has finished when a later step runs out of time. Standard library only.

    python tests/gpu/ray_gpu_results.py WORK_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RUN_VS_BARE = 0.90
"""The Ray run's tokens/s at least this share of the bare loop's (issue 36, acceptance 5)."""

LINEAR_AT = 8
LINEAR_SHARE = 0.80
"""Steady tokens/s with ``LINEAR_AT`` Tokenize actors at least this share of that many times
one actor's."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_summary(log: Path) -> dict[str, Any] | None:
    """The summary ``rayjobs run --json`` printed: the last line of its output that is a JSON
    object with ``steps`` (Ray may log after it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                summary = json.loads(line)
            except ValueError:
                continue
            if isinstance(summary, dict) and "steps" in summary:
                return summary
    return None


def train_figures(work: Path, variant: str) -> dict[str, Any]:
    summary = run_summary(work / "run.log")
    bench = read_json(work / "bench_train.json")
    out: dict[str, Any] = {"run": None, "bare": None, "ratio": None, "bound": RUN_VS_BARE}
    if summary:
        keys = ("steps", "attention", "precision", "model", "packing_efficiency", "stopped_early")
        out["run"] = {key: summary.get(key) for key in keys} | {
            "throughput": summary.get("throughput"),
            "run_name": summary.get("run_name"),
        }
    if bench:
        rows = {row["variant"]: row for row in bench.get("bench", [])}
        if variant in rows:
            row = rows[variant]
            out["bare"] = {
                key: row[key]
                for key in ("variant", "steps", "ms_per_step", "tokens_per_s", "peak_gib")
            }
        checks = {row["variant"]: row["max_loss_diff"] for row in bench.get("fp32_check", [])}
        out["fp32_max_loss_diff"] = checks or None
    run_rate = ((out["run"] or {}).get("throughput") or {}).get("tokens_per_s")
    if run_rate and out["bare"]:
        out["ratio"] = run_rate / out["bare"]["tokens_per_s"]
        out["passed"] = out["ratio"] >= RUN_VS_BARE
    return out


def pipeline_figures(work: Path) -> dict[str, Any]:
    rows = []
    for path in work.glob("pipeline_*.json"):
        measured = read_json(path)
        if not measured:
            continue
        row = measured[-1]
        actors = int(path.stem.split("_")[1])
        rows.append(
            {
                "actors": actors,
                "scale": row["scale"],
                "steady_tokens_per_s": row["steady_tokens_per_s"],
                "tokens_per_s": row["tokens_per_s"],
                "first_batch_s": row["first_batch_s"],
                "last_batch_s": row["last_batch_s"],
                "tokens": row["tokens"],
                "reference_tokens_per_s": row["reference_tokens_per_s"],
                "tokenize_cpu_s": row["tokenize_cpu_s"],
                "pack_cpu_s": row["pack_cpu_s"],
                "steal_share": row.get("steal_share"),
                "cpu_by_process": dict(list(row.get("cpu_by_process", {}).items())[:8]),
            }
        )
    rows.sort(key=lambda r: r["actors"])
    one = next((r["steady_tokens_per_s"] for r in rows if r["actors"] == 1), None)
    for row in rows:
        row["per_actor"] = row["steady_tokens_per_s"] / row["actors"]
        row["of_linear"] = row["steady_tokens_per_s"] / (row["actors"] * one) if one else None
    out: dict[str, Any] = {"rows": rows, "bound": {"actors": LINEAR_AT, "of_linear": LINEAR_SHARE}}
    at = next((r for r in rows if r["actors"] == LINEAR_AT), None)
    if at and at["of_linear"] is not None:
        out["passed"] = at["of_linear"] >= LINEAR_SHARE
    return out


def steps(work: Path) -> list[dict[str, Any]]:
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        name, rc, seconds, load = line.split("\t")
        out.append({"step": name, "exit": rc, "seconds": int(seconds), "load_average": load})
    return out


def gather(work: Path) -> dict[str, Any]:
    params = read_json(work / "params.json") or {}
    return {
        "params": params,
        "device": read_json(work / "device.json"),
        "steps": steps(work),
        "train": train_figures(work, params.get("variant", "packed_flex")),
        "pipeline": pipeline_figures(work),
        "run_summary": run_summary(work / "run.log"),
        "bench_train": read_json(work / "bench_train.json"),
    }


def report(results: dict[str, Any]) -> str:
    lines = []
    train = results["train"]
    throughput = ((train["run"] or {}).get("throughput")) or {}
    if throughput.get("tokens_per_s"):
        lines.append(
            f"Ray Train run: {throughput['tokens_per_s']:,.0f} tokens/s over {throughput['steps']} "
            f"steps after {throughput['warmup_steps']} ({throughput['seconds']:.1f} s; first "
            f"step {throughput['first_step_s']:.1f} s)"
        )
    if train["bare"]:
        bare = train["bare"]
        lines.append(
            f"bare loop ({bare['variant']}): {bare['tokens_per_s']:,.0f} tokens/s over "
            f"{bare['steps']} steps, {bare['ms_per_step']:.1f} ms a step"
        )
    if train["ratio"] is not None:
        verdict = "pass" if train["passed"] else "FAIL"
        lines.append(f"run / bare loop: {train['ratio']:.1%} (bound {RUN_VS_BARE:.0%}: {verdict})")
    pipeline = results["pipeline"]
    if pipeline["rows"]:
        header = ("actors", "scale", "steady tok/s", "per actor", "linear")
        lines.append("{:>6} {:>6} {:>13} {:>10} {:>7}".format(*header))
        for row in pipeline["rows"]:
            share = f"{row['of_linear']:.0%}" if row["of_linear"] is not None else "-"
            lines.append(
                f"{row['actors']:>6} {row['scale']:>5}x {row['steady_tokens_per_s']:>13,.0f} "
                f"{row['per_actor']:>10,.0f} {share:>7}"
            )
        if "passed" in pipeline:
            verdict = "pass" if pipeline["passed"] else "FAIL"
            lines.append(f"{LINEAR_AT} actors vs linear: bound {LINEAR_SHARE:.0%}: {verdict}")
    for step in results["steps"]:
        lines.append(
            f"step {step['step']}: exit {step['exit']}, {step['seconds']} s "
            f"(load average {step['load_average']} at its end)"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = gather(Path(argv[0]))
    Path(argv[1]).write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
