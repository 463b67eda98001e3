"""The data side's progress on the driver: a line every few seconds from the run's ledger.

While a job streams, the driver asks the run's ``Ledger`` for its counts every ``INTERVAL``
seconds and logs what moved (``logging.getLogger("rayjobs.data")``, level INFO): rows read,
samples and tokens tokenized with the tokens per second since the last line, packs and packing
efficiency, and the realized mix of the epoch being packed. The counts are the ledger's exact
ones, the same the run summary ends with. The lines go where the driver's logging sends them:
``rayjobs run`` prints them on stderr as ``rayjobs: data: ...`` (docs/cli.md), so a submitted
job's log (``rayjobs logs``, the Ray dashboard's job page) holds them. Nothing polls unless
INFO is enabled for the logger.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import ray

logger = logging.getLogger("rayjobs.data")

INTERVAL = 5.0
"""Seconds between two lines (a line only when the counts moved)."""


def totals(snapshot: dict[str, Any]) -> dict[str, float]:
    """A ledger snapshot's totals over its datasets and epochs."""
    tokenize = snapshot["tokenize"].values()
    packs = snapshot["pack"].values()
    found = {key: sum(c[key] for c in tokenize) for key in ("rows", "samples", "tokens")}
    found["packs"] = sum(p["num_packs"] for p in packs)
    slots = sum(p["num_slots"] for p in packs)
    found["efficiency"] = sum(p["num_tokens"] for p in packs) / slots if slots else 0.0
    return found


def mix_so_far(snapshot: dict[str, Any], by: str) -> tuple[int, dict[str, float]] | None:
    """The epoch being packed (the latest one with packs) and each dataset's share of what was
    packed of it so far, in ``mix.by`` units; None before any pack."""
    packed = [(epoch, c) for epoch, c in snapshot["pack"].items() if c["num_packs"]]
    if not packed:
        return None
    epoch, counts = max(packed, key=lambda item: int(item[0]))
    units = counts["tokens_by_source" if by == "tokens" else "documents_by_source"]
    total = sum(units.values()) or 1
    return int(epoch), {name: value / total for name, value in sorted(units.items())}


def format_line(now: dict[str, float], rate: float | None, mix: Any) -> str:
    """One data line (without the ``rayjobs:`` prefix)."""
    line = (
        f"data: rows {now['rows']}  samples {now['samples']}  tokens {now['tokens']}"
        + (f" ({rate:.0f}/s)" if rate is not None else "")
        + f"  packs {now['packs']}  packing {now['efficiency']:.3f}"
    )
    if mix is not None and len(mix[1]) > 1:
        shares = " ".join(f"{name} {share:.3f}" for name, share in mix[1].items())
        line += f"  mix (epoch {mix[0]}) {shares}"
    return line


def next_line(
    snapshot: dict[str, Any],
    last: dict[str, float] | None,
    last_time: float,
    moment: float,
    by: str,
) -> tuple[str | None, dict[str, float]]:
    """The progress line of ``snapshot`` taken at ``moment`` (tokens per second since ``last``,
    the totals of the line before, at ``last_time``) and its totals; the line is None when
    nothing moved since ``last`` or nothing is read yet. What the driver's ``DataMonitor`` and
    the ledger's own log both print."""
    now = totals(snapshot)
    if now == last or not now["rows"]:
        return None, now
    rate = None
    if moment > last_time:
        rate = (now["tokens"] - (last["tokens"] if last else 0)) / (moment - last_time)
    return format_line(now, rate, mix_so_far(snapshot, by)), now


LINE = re.compile(
    r"data: rows (?P<rows>\d+)  samples (?P<samples>\d+)  tokens (?P<tokens>\d+)"
    r"(?: \((?P<rate>\d+)/s\))?  packs (?P<packs>\d+)  packing (?P<efficiency>[\d.]+)"
    r"(?:  mix \(epoch (?P<epoch>\d+)\) (?P<mix>.*))?$"
)


def parse_line(line: str) -> dict[str, Any] | None:
    """The counts of a line ``format_line`` wrote (``totals``' keys, ``tokens_per_s``, and
    ``mix``: epoch and shares, when the line has them); None for any other line."""
    found = LINE.search(line.rstrip())
    if found is None:
        return None
    counts: dict[str, Any] = {key: int(found[key]) for key in ("rows", "samples", "tokens")}
    counts |= {"packs": int(found["packs"]), "efficiency": float(found["efficiency"])}
    counts["tokens_per_s"] = int(found["rate"]) if found["rate"] is not None else None
    if found["mix"]:
        words = found["mix"].split()
        shares = {name: float(share) for name, share in zip(words[::2], words[1::2], strict=True)}
        counts["mix"] = {"epoch": int(found["epoch"]), "shares": shares}
    return counts


class DataMonitor:
    """Logs the data side's progress from ``ledger`` every ``interval`` seconds on a thread of
    the driver, from ``start`` to ``stop`` (which logs the counts reached since the last line,
    if any). ``by``: the unit of the mix's shares (``mix.by``)."""

    def __init__(self, ledger: Any, by: str = "tokens", interval: float = INTERVAL):
        self.ledger, self.by, self.interval = ledger, by, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[str, float] | None = None
        self._last_time = self._started = 0.0
        self._first_packs = False

    def start(self) -> DataMonitor:
        if logger.isEnabledFor(logging.INFO) and self._thread is None:
            self._started = self._last_time = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="rayjobs-data", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, then log the counts reached since its last line (the ledger must
        still be alive)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.tick()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.tick():
                return

    def tick(self) -> bool:
        """Log a line if the counts moved; False once the ledger cannot be read (it is gone)."""
        try:
            snapshot = ray.get(self.ledger.snapshot.remote(), timeout=max(1.0, self.interval))
        except Exception:  # noqa: BLE001 - a dead or busy ledger ends the lines, not the run
            return False
        moment = time.monotonic()
        line, now = next_line(snapshot, self._last, self._last_time, moment, self.by)
        if now["packs"] and not self._first_packs:
            self._first_packs = True
            logger.info("data: first packed rows after %.1f s", moment - self._started)
        if line is None:
            return True  # nothing moved, or nothing read yet
        logger.info("%s", line)
        self._last, self._last_time = now, moment
        return True
