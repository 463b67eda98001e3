"""The errors a user can cause and fix: every one is a ``UserError``, which the command line
reports as one ``rayjobs:`` line (no traceback) with exit status 2 when nothing has started yet and
1 once Ray has (``exit_status``)."""

from __future__ import annotations

import signal


class UserError(Exception):
    """A problem of the user's input (config, data, tokenizer, cluster inputs); its message says
    what is wrong and where, and what to do."""

    exit_status = 1


class ConfigError(UserError, ValueError):
    """A config problem; the message names the dotted key or file. Raised before Ray starts."""

    exit_status = 2


class SourceError(UserError, ValueError):
    """A file or row that cannot be parsed; names dataset, file and (where known) row."""


class DataError(UserError, ValueError):
    """A bad row under ``on_bad_row: error``: names dataset, file, row and field."""


class AccountingError(UserError, RuntimeError):
    """The run's counts do not add up (a lost or double-counted batch, an eval set with nothing
    to evaluate): the run fails rather than report figures that are wrong."""


class SubmitError(UserError, ValueError):
    """A submission refused before anything reaches the cluster; the message says what to do."""

    exit_status = 2


class RunFailed(UserError, RuntimeError):
    """Training failed for a reason that is not the input's (a worker or node lost more often
    than ``train.max_failures`` allows): the message says why, where the checkpoints are and how
    to continue."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command; ``left`` says what it left behind and where. A
    ``KeyboardInterrupt``: no ``except Exception`` on the way catches it, and Ray's blocking calls
    stop for it as for Ctrl-C (Ray raises a ``KeyboardInterrupt`` of its own then: the command
    line remembers which signal came). It exits 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT, left: str = ""):
        super().__init__(signum, left)
        self.signum, self.left = int(signum), left

    @classmethod
    def of(cls, interrupt: KeyboardInterrupt, left: str) -> Interrupted:
        """``interrupt`` (Ctrl-C's, or an ``Interrupted``) with what the command left."""
        return cls(getattr(interrupt, "signum", signal.SIGINT), left)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def user_error(error: BaseException) -> UserError | None:
    """The ``UserError`` behind ``error``, however Ray wrapped it: a task's or actor's exception
    comes back as a ``RayTaskError`` that is also an instance of its cause, Ray Data chains it
    under its own, and Ray Train reports each worker's in ``worker_failures``."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # a RayTaskError's own exception
        cause = cause or getattr(current, "controller_failure", None)  # Ray Train's controller
        if isinstance(cause, UserError):
            return cause
        if isinstance(current, UserError):
            return current
        pending += [current.__cause__, current.__context__, cause]
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            pending += [f for f in failures.values() if isinstance(f, BaseException)]
    return None
