"""Which worker failures Ray Train retries (``train.max_failures``): a lost worker or node, yes;
a rayjobs ``UserError`` raised in a worker (a bad row, counts that do not add up), no: a restart
would read the data again only to meet it again."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from rayjobs.errors import user_error


class NoRetryOnUserError(UserCallback):
    """Ends the run at a worker's ``UserError``: raised in Ray Train's controller, it fails the
    run there and then (a controller error Ray Train does not retry), and ``fit`` raises it."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for failure in worker_exceptions.values():
            found = user_error(failure)
            if found is not None:
                raise found
