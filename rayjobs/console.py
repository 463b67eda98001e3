"""What a command prints where: rayjobs' log lines on stderr, Ray's output kept off stdout
(``--json`` output parses whatever Ray says), Ray Data's progress bars off."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def ray_output_to_stderr() -> Iterator[None]:
    """While a job runs, whatever Ray prints in this process (workers' log lines, raylet
    warnings such as "N PYTHON worker processes have been started") goes to stderr: stdout holds
    the report alone, so ``--json`` output parses whatever Ray says. Ray looks ``sys.stdout`` up
    on every print, from its own threads too; file descriptor 1 points at stderr as well, for
    what writes to it directly (a handler that kept the stdout it was created with, native code,
    child processes)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 (a daemon): sys.stdout alone
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def no_ray_data_progress_bars() -> None:
    """Ray Data's progress bars off (thousands of lines in a job's log, around the progress
    lines that say the same from exact counts), unless ``RAY_DATA_DISABLE_PROGRESS_BARS`` says
    otherwise. The datasets a job builds take the setting with them to the actors that run
    them."""
    if "RAY_DATA_DISABLE_PROGRESS_BARS" not in os.environ:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False


class _Lines(logging.Formatter):
    """``rayjobs: warning: ...`` for warnings and errors, ``rayjobs: ...`` for progress."""

    def format(self, record: logging.LogRecord) -> str:
        warning = "warning: " if record.levelno >= logging.WARNING else ""
        return f"rayjobs: {warning}{record.getMessage()}"


class _Stderr(logging.StreamHandler):
    """A handler writing to the ``sys.stderr`` of the moment (a test's capture, a redirect)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@contextlib.contextmanager
def log_on_stderr() -> Iterator[None]:
    """rayjobs' log lines (``logging.getLogger("rayjobs")``) on stderr while a command runs:
    warnings (columns no template reads, samples lost to seq_len, ...) as ``rayjobs: warning:
    ...``, and progress (INFO: the data side's start-up and counts, ``rayjobs.data``) as
    ``rayjobs: ...``; ``--quiet`` sets the level back to WARNING (the command line)."""
    handler = _Stderr()
    handler.setFormatter(_Lines())
    logger = logging.getLogger("rayjobs")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(level)
