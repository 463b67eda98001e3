"""Exclusive use of an output folder: an export's ``--out``, a run's folder under
``train.storage_path``. Whoever writes there first holds a claim, a small JSON file beside the
folder (``.<name>.claim``: who holds it, since when, with which command); a second writer is
refused at once (``Claimed``, exit 2, naming the holder) before it touches anything.

How the claim is made atomic:

- on a local disk, with ``link(2)`` of a complete claim file (atomic, fails when the name exists,
  also on NFS), or ``O_CREAT | O_EXCL`` where a filesystem has no hard links; every acquire on one
  host runs under an ``flock`` of the parent folder, so two processes cannot both take over a
  stale claim;
- on an object store (no conditional put through pyarrow's filesystems): the claim object is put,
  then read back after ``SETTLE`` seconds; whoever's claim is there then holds it. Residual race:
  two writers whose check and put are more than ``SETTLE`` apart can both see their own
  (docs/cli.md, "Exclusive outputs").

A holder refreshes its claim every ``REFRESH`` seconds. A claim is stale, and taken over with a
warning, when its holder is gone: on the same host, its process is not running (a claim a store
outage kept its holder from deleting included); on another host, it was not refreshed for
``STALE_AFTER`` seconds. The holder deletes its
claim when done, however it ends.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs

from rayjobs.data import files
from rayjobs.errors import ConfigError, UserError, user_error

logger = logging.getLogger(__name__)

REFRESH = 60.0
"""Seconds between a holder's refreshes of its claim."""

STALE_AFTER = 600.0
"""Seconds without a refresh after which a claim of another host (or on an object store) is
taken to be a crashed holder's."""

SETTLE = 1.0
"""Seconds an object-store claim is left before it is read back (module note)."""


class Claimed(ConfigError):
    """The folder is held by another writer: the message names it (host, pid, start, command)."""


class StorageFailed(UserError):
    """The store under a claimed folder failed while a command wrote to it (``failure``)."""


def failure(error: BaseException, shown: str) -> StorageFailed | None:
    """A ``StorageFailed`` for ``error`` when it is a filesystem's ``OSError`` (however Ray
    wrapped it) and no ``UserError``, that says what is left at ``shown``; else None."""
    if user_error(error) is not None:
        return None
    found: BaseException | None = error
    for _ in range(16):  # Ray wraps a task's error in its own, once or twice
        if found is None or isinstance(found, OSError):
            break
        found = found.__cause__ or getattr(found, "cause", None) or found.__context__
    if not isinstance(found, OSError):
        return None
    text = str(found).strip().splitlines()
    said = text[0] if text else type(found).__name__
    return StorageFailed(
        f"{shown}: the export stopped on a storage error: {said}; nothing finished there "
        "(no _manifest.json): run it again once the store answers (it clears what this one left)"
    )


def claim_path(fs: pafs.FileSystem, path: str) -> str:
    """Where the claim of folder ``path`` on ``fs`` lies: ``.<name>.claim`` beside it (inside it,
    as ``.rayjobs.claim``, for a bucket's root)."""
    parent, name = os.path.split(path.rstrip("/"))
    if not parent:
        return f"{name}/.rayjobs.claim"
    return f"{parent}/.{name}.claim"


def holder_line(holder: dict[str, Any]) -> str:
    """A claim's holder, said for a person."""
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}, "
        f"running `{holder.get('command')}`"
    )


class Claim:
    """A claim held by this process (``take``): refreshed in the background, deleted by
    ``release`` (a context manager: released on leaving)."""

    def __init__(self, fs: pafs.FileSystem, path: str, holder: dict[str, Any]):
        self.fs, self.path, self.holder = fs, path, holder
        self.local = isinstance(fs, pafs.LocalFileSystem)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="rayjobs-claim", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH):
            with contextlib.suppress(OSError):
                if self.local:
                    os.utime(self.path)
                elif (_read(self.fs, self.path) or {}).get("token") == self.holder["token"]:
                    _write(self.fs, self.path, self.holder)

    def release(self) -> None:
        """Delete the claim, if it is still this process's (best effort)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if (_read(self.fs, self.path) or {}).get("token") == self.holder["token"]:
                self.fs.delete_file(self.path)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take(uri: str, what: str, hint: str = "") -> Claim:
    """Claim the folder ``uri`` (a local path or an object store's URI) for this process.
    ``what`` names it in messages (``--out /data/out``); ``hint``: what else the refused can do.

    Raises:
        Claimed: another live writer holds it.
        ConfigError: the claim cannot be written (no such bucket, access denied, ...).
    """
    try:
        fs, path = files.filesystem(uri)
        where = claim_path(fs, path)
        holder = _holder()
        if isinstance(fs, pafs.LocalFileSystem):
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with _locked(os.path.dirname(where)):
                _take_local(fs, where, holder, what, hint)
        else:
            _take_remote(fs, where, files.uri_of(uri, where), holder, what, hint)
    except OSError as error:  # a StorageError too
        said = str(error) if isinstance(error, files.StorageError) else files.explain(error, uri)
        named = files.shown(uri)  # said once: what names it already
        if named in what and said.startswith(named):
            raise ConfigError(f"{what}{said[len(named) :]}") from None
        raise ConfigError(f"{what}: {said}") from None
    return Claim(fs, where, holder)


def _holder() -> dict[str, Any]:
    command = [os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"]
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": started,
        "command": shlex.join(command + sys.argv[1:])[:300],
        "token": uuid.uuid4().hex,
    }


def _refusal(what: str, where: str, holder: dict[str, Any], hint: str) -> Claimed:
    return Claimed(
        f"{what} is in use: held by {holder_line(holder)} (claim {where}); wait for it to "
        f"finish{hint}, or, if that process is gone, delete {where}"
    )


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive ``flock`` of ``folder`` while this host's processes take claims in it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _take_local(
    fs: pafs.FileSystem, where: str, holder: dict[str, Any], what: str, hint: str
) -> None:
    for _ in range(2):  # a stale claim is removed once, then taken anew
        if _create_local(where, holder):
            return
        found = _read(fs, where)
        if found is None:  # released meanwhile
            continue
        if not _stale_local(where, found):
            raise _refusal(what, where, found, hint)
        logger.warning(
            "%s: taking over the claim of %s, which is gone (%s)", what, holder_line(found), where
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
    raise _refusal(what, where, _read(fs, where) or {}, hint)


def _create_local(where: str, holder: dict[str, Any]) -> bool:
    """Whether ``where`` was created holding ``holder`` (False: it exists)."""
    body = json.dumps(holder).encode()
    pending = f"{where}.{holder['token']}"
    with open(pending, "wb") as stream:
        stream.write(body)
    try:
        os.link(pending, where)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem
        try:
            fd = os.open(where, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as stream:
            stream.write(body)
        return True
    finally:
        os.unlink(pending)


def _parse(body: bytes) -> dict[str, Any]:
    try:
        found = json.loads(body)
    except ValueError:
        found = None
    return found if isinstance(found, dict) else {"command": "unknown (unreadable claim)"}


def _stale_local(where: str, found: dict[str, Any]) -> bool:
    try:
        return _gone(found, time.time() - os.stat(where).st_mtime)
    except FileNotFoundError:
        return True


def _gone(found: dict[str, Any], age: float) -> bool:
    """Whether a claim's holder is gone: on this host, its process is not running; elsewhere,
    it has not refreshed the claim (``age`` seconds ago) for ``STALE_AFTER`` seconds."""
    if found.get("host") == socket.gethostname() and isinstance(found.get("pid"), int):
        return not _running(found["pid"])
    return age > STALE_AFTER


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _take_remote(
    fs: pafs.FileSystem, where: str, shown: str, holder: dict[str, Any], what: str, hint: str
) -> None:
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.File:
        found = _read(fs, where) or {}
        age = time.time() - info.mtime.timestamp() if info.mtime else 0.0
        if not _gone(found, age):
            raise _refusal(what, shown, found, hint)
        logger.warning(
            "%s: taking over the claim of %s, which is gone (%s)", what, holder_line(found), shown
        )
    _write(fs, where, holder)
    time.sleep(SETTLE)
    found = _read(fs, where) or {}
    if found.get("token") != holder["token"]:
        raise _refusal(what, shown, found, hint)


def _read(fs: pafs.FileSystem, where: str) -> dict[str, Any] | None:
    try:
        with fs.open_input_stream(where, compression=None) as stream:
            return _parse(stream.read())
    except FileNotFoundError:
        return None


def _write(fs: pafs.FileSystem, where: str, holder: dict[str, Any]) -> None:
    with fs.open_output_stream(where, compression=None) as stream:
        stream.write(json.dumps(holder).encode())
