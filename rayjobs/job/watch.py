"""``rayjobs status JOB``: a submitted job's status, with its data side's counts.

How a job maps to its ledger: the Jobs API gives the submitted job's Ray job id; Ray's state API
(the dashboard's HTTP address, the same as the Jobs API's, token auth included) lists the live
``Ledger`` actors of that job in the ledgers' namespace (``ledger.NAMESPACE``), each named after
its run; the run's own is the one whose name is not an eval set's (``<run>-eval``). Its counts
are the last progress line it printed to its log (``monitor.format_line``, every
``ledger.LOG_INTERVAL`` seconds while they move): read over HTTP, with no driver connected to the
cluster. Once the job has ended, its counts are the run summary's (the last JSON line of its log).
"""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
from typing import Any

from ray._private.authentication.http_token_authentication import (  # what ray.util.state sends
    get_auth_headers_if_auth_enabled,
)
from ray.util.state import list_actors

from rayjobs.job.ledger import LOG_INTERVAL, NAMESPACE
from rayjobs.job.monitor import parse_line

INTERVAL = LOG_INTERVAL
"""``--watch``: seconds between two reports, the ledger's own line interval."""

LOG_LINES = 200
"""Lines read back from the end of the ledger's log for its last progress line."""


def run_ledger(address: str, job_id: str) -> tuple[str, str] | None:
    """The live ledger of the Ray job ``job_id``: its run name and actor id; None when it has
    none (not started yet, ended, or not a rayjobs run)."""
    actors = list_actors(
        address=address,
        filters=[("job_id", "=", job_id), ("state", "=", "ALIVE"), ("class_name", "=", "Ledger")],
        raise_on_missing_output=False,
    )
    for actor in actors:
        name = actor.name or ""
        if actor.ray_namespace == NAMESPACE and name and not name.endswith("-eval"):
            return name, actor.actor_id
    return None


def log_tail(address: str, actor_id: str, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of an actor's log (its stderr, where the ledger prints), over
    the state API's HTTP route (``ray.util.state.get_log`` takes a GCS address, not the
    dashboard's)."""
    query = urllib.parse.urlencode({"actor_id": actor_id, "lines": lines, "suffix": "err"})
    request = urllib.request.Request(
        f"{address}/api/v0/logs/file?{query}", headers=get_auth_headers_if_auth_enabled({})
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.read().decode("utf-8", "replace")


def live_counts(address: str, actor_id: str) -> dict[str, Any] | None:
    """The counts of the last progress line in a ledger's log; None before its first."""
    for line in reversed(log_tail(address, actor_id).splitlines()):
        counts = parse_line(line)
        if counts is not None:
            return counts
    return None


def final_counts(summary: dict[str, Any]) -> dict[str, Any]:
    """A run summary's totals, under the keys ``live_counts`` has."""
    datasets = summary.get("datasets", {}).values()
    counts = {key: sum(d.get(key, 0) for d in datasets) for key in ("rows", "samples", "tokens")}
    packed = summary.get("packed", {})
    return counts | {"packs": packed.get("num_packs", 0), "efficiency": packed.get("efficiency")}


def counts_line(counts: dict[str, Any] | None) -> str:
    """``status``'s counts line."""
    if counts is None:
        return "data: no counts yet (the ledger prints its first line once rows are read)"
    line = (
        f"data: rows {counts['rows']}  samples {counts['samples']}  tokens {counts['tokens']}"
        f"  packs {counts['packs']}"
    )
    if counts.get("efficiency") is not None:
        line += f"  packing {counts['efficiency']:.3f}"
    if counts.get("tokens_per_s") is not None:
        line += f"  ({counts['tokens_per_s']} tokens/s)"
    if counts.get("mix"):
        shares = " ".join(f"{name} {share:.3f}" for name, share in counts["mix"]["shares"].items())
        line += f"  mix (epoch {counts['mix']['epoch']}) {shares}"
    return line


def job_counts(
    address: str, info: Any, status: str, summary: dict[str, Any] | None
) -> dict[str, Any]:
    """``status``'s record beyond the Jobs API's: ``run``, ``live`` and ``counts`` (read from
    the running job's ledger, else the summary's final counts; None when there are none)."""
    if summary is not None:
        return {"run": summary.get("run_name"), "live": False, "counts": final_counts(summary)}
    found = run_ledger(address, info.job_id) if info.job_id and status == "RUNNING" else None
    if found is None:
        return {"run": None, "live": False, "counts": None}
    return {"run": found[0], "live": True, "counts": live_counts(address, found[1])}


def show(
    address: str,
    job: str,
    info: Any,
    status: str,
    summary: dict[str, Any] | None,
    as_json: bool,
) -> None:
    """Print ``rayjobs status``'s report of ``job``: its Jobs API info, ``status`` (the info's, as
    a string) and counts; with ``as_json`` one JSON object (``submission_id``, ``status``, the
    info's fields, ``run``, ``live``, ``counts``)."""
    counts = job_counts(address, info, status, summary)
    if as_json:
        fields = ("job_id", "entrypoint", "message", "start_time", "end_time", "driver_exit_code")
        record = {"submission_id": job, "status": status}
        record |= {name: getattr(info, name, None) for name in fields} | counts
        sys.stdout.flush()
        print(json.dumps(record, default=str), flush=True)
        return
    print(f"{job}: {status}" + (f" (run {counts['run']})" if counts["run"] else ""))
    if info.message:
        print(info.message)
    if counts["run"] or status == "RUNNING":
        print(counts_line(counts["counts"]))
    sys.stdout.flush()
