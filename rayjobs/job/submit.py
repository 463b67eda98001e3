"""``rayjobs submit``: run a config on a Ray cluster through Ray's Jobs API, and ``status``,
``logs`` and ``stop`` for the jobs it started.

rayjobs submit CONFIG [dotted.key=value ...] [--address URL] [--working-dir DIR] [--no-wait]
               [--json] [--allow-absolute] [--max-upload-mib N] [--max-file-mib N]
               [--submission-id ID] [--runtime-env-json JSON] [--dry-run] [--follow-links]
rayjobs status JOB [--address URL] [--json] [--watch]
rayjobs logs JOB [--address URL] [--follow]
rayjobs stop JOB [--address URL]

What runs on the cluster is ``python -m rayjobs.cli run <CONFIG relative to the working
directory> <overrides> --json``, the same command as a local run, on an uploaded copy of the
working directory. Design notes:

- **The working directory** (``--working-dir``, default: the nearest folder above the config that
  holds ``.git`` or ``pyproject.toml``, i.e. the checkout the config belongs to, else the config's
  own folder) is shipped as the job's ``working_dir``. The config and every input path it names
  relative to itself then resolve on the cluster exactly as they do here. Ray honours
  ``.gitignore`` and ``.rayignore`` files; ``upload.EXCLUDES`` adds version control, virtual
  environments, caches and ``runs/`` (checkpoints), and ``upload.SECRET_EXCLUDES`` files that
  commonly hold secrets (``.env*``, private keys, ``*credential*``, ``*secret*``, ``.aws/``, ...;
  a link out of the working directory unless ``--follow-links``, a secret by a link's target or
  by content: ``upload.screen``; those left out are named on stderr). At most ``MAX_UPLOAD_MIB``
  MiB are shipped (``--max-upload-mib``), no file over ``MAX_FILE_MIB`` (``--max-file-mib``): a
  working directory is for code, configs and small data; big data belongs on storage every node
  reads.
  ``--dry-run`` lists the upload (bytes and path, one file a line) and submits nothing.
- **The code** is the ``rayjobs`` package that validated the config here. When it sits at the top
  of the working directory (a checkout), ``working_dir`` already carries it; otherwise it is
  shipped as ``py_modules`` (and a ``rayjobs/`` folder of the working directory is left out so it
  cannot shadow it). Either way the cluster runs this code, whatever version of rayjobs (if any)
  its image has installed; the cluster needs only rayjobs' dependencies (torch, Ray, ...). The
  entrypoint is ``python -m rayjobs.cli``, not the ``rayjobs`` script, because a shipped package is
  importable but has no console script.
- **Checked before anything is submitted**: the config validates (``ConfigError``, exit 2, as
  ``rayjobs run``); the config and every local input (dataset files, a local tokenizer or ``hf``
  folder) lie under the working directory and survive the excludes; the upload fits the limit.
  Refusals exit 2 and name the key and path. An input named by an *absolute* path is read from the
  cluster's filesystem, not from the upload, so it is refused unless ``--allow-absolute`` says
  every node has it at that path (a shared filesystem, the same machine). Hub names and URIs pass
  through. ``train.storage_path`` is an output: a relative one ends up inside Ray's session folder
  on the cluster, which is said on stderr.
- **Address**: ``--address``, else ``$RAY_API_SERVER_ADDRESS`` (the ``ray job`` CLI's own
  variable), else ``$RAY_ADDRESS`` when it is an http(s) URL (a GCS address there is for drivers),
  else ``http://127.0.0.1:8265``. It is the dashboard's HTTP address, not the GCS port.
- **Token auth** is Ray's: ``JobSubmissionClient`` sends ``Authorization: Bearer <token>`` when
  ``RAY_AUTH_MODE=token``, the token read from ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or
  ``~/.ray/auth_token``, exactly as ``ray job`` does. A 401/403 says how to turn it on.
- **Outcome**: the job's logs are followed on stdout (Ray's and rayjobs' own lines on stderr) and
  the exit code is the job's: 0 SUCCEEDED, 1 FAILED or STOPPED (the error shown), 130 on Ctrl-C,
  which leaves the job running and prints how to stop it. With ``--json`` the last stdout line is
  one object: ``submission_id``, ``status``, ``address``, ``dashboard_url``, ``message`` (Ray's job
  message), ``error`` and ``summary`` (the run summary: the last JSON line of the job's log).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayjobs.config import _apply_override, load_config, yaml_load
from rayjobs.config.llamafactory import expand
from rayjobs.config.user_templates import unshipped
from rayjobs.data import formats
from rayjobs.errors import ConfigError, SubmitError
from rayjobs.job.upload import (
    EXCLUDES,
    MAX_FILE_MIB,
    MAX_UPLOAD_MIB,
    SECRET_EXCLUDES,
    left_out_notes,
    listing,
    screen,
    shipped_files,
    size_problems,
)

__all__ = ["EXCLUDES", "MAX_FILE_MIB", "MAX_UPLOAD_MIB", "SECRET_EXCLUDES", "shipped_files"]

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PACKAGE_DIR = Path(__file__).resolve().parents[1]
OWNED_KEYS = ("working_dir", "py_modules")
"""runtime_env keys ``submit`` sets itself (``--runtime-env-json`` may set the others)."""


@dataclass
class Plan:
    """What ``submit`` sends: the entrypoint and runtime_env, and what it found on the way."""

    working_dir: Path
    config: str
    """The config's path relative to the working directory (POSIX)."""
    overrides: list[str]
    entrypoint: str
    runtime_env: dict[str, Any]
    upload_bytes: int
    notes: list[str] = field(default_factory=list)
    """Things worth saying on stderr that do not stop the submission."""
    files: dict[str, int] = field(default_factory=dict)
    """The upload: each file's path relative to the working directory → bytes."""


def resolve_address(flag: str | None, environ: dict[str, str] | None = None) -> str:
    """The Jobs API (dashboard) URL: ``--address``, ``$RAY_API_SERVER_ADDRESS``, an http(s)
    ``$RAY_ADDRESS``, else the local default. A bare ``host:port`` gets ``http://``."""
    environ = os.environ if environ is None else environ
    ray_address = environ.get("RAY_ADDRESS", "")
    address = (
        flag
        or environ.get("RAY_API_SERVER_ADDRESS")
        or (ray_address if ray_address.startswith(("http://", "https://")) else None)
        or DEFAULT_ADDRESS
    )
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


def dashboard_url(address: str, submission_id: str) -> str:
    return f"{address}/#/jobs/{submission_id}"


def repository_root(config_path: str | os.PathLike) -> Path:
    """The default working directory: the nearest folder at or above the config's that holds
    ``.git`` or ``pyproject.toml``, else the config's folder."""
    folder = Path(config_path).resolve().parent
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists() or (candidate / "pyproject.toml").is_file():
            return candidate
    return folder


def entrypoint(config: str, overrides: Iterable[str]) -> str:
    """The job's shell command: a local run of the shipped config, summary as JSON last."""
    return shlex.join(["python", "-m", "rayjobs.cli", "run", config, *overrides, "--json"])


def plan_submission(
    config_path: str | os.PathLike,
    overrides: Iterable[str] = (),
    working_dir: str | os.PathLike | None = None,
    allow_absolute: bool = False,
    max_upload_mib: float = MAX_UPLOAD_MIB,
    runtime_env: dict[str, Any] | None = None,
    max_file_mib: float = MAX_FILE_MIB,
    follow_links: bool = False,
) -> Plan:
    """Validate the config and work out what to ship.

    Raises:
        ConfigError: the config is invalid (as ``rayjobs run`` reports it).
        SubmitError: it validates, but the job could not find its inputs on the cluster, or the
            upload is too large; the message lists every problem.
    """
    overrides = list(overrides)
    config = load_config(config_path, overrides)
    config_file = Path(config_path).parent.resolve() / Path(config_path).name  # as load_config
    wd = Path(working_dir).resolve() if working_dir else repository_root(config_file)
    if not wd.is_dir():
        raise SubmitError(f"--working-dir {wd} is not a folder")
    extra = dict(runtime_env or {})
    owned = [key for key in OWNED_KEYS if key in extra]
    if owned:
        raise SubmitError(
            f"--runtime-env-json sets {', '.join(owned)}, which rayjobs submit sets itself "
            f"(the working directory, and the rayjobs package when it is not in it)"
        )
    own_excludes = extra.pop("excludes", [])
    if not isinstance(own_excludes, list) or not all(isinstance(e, str) for e in own_excludes):
        raise SubmitError(
            f"--runtime-env-json: excludes must be a list of patterns, got {own_excludes!r}"
        )
    ships_package = (wd / "rayjobs").resolve() == PACKAGE_DIR
    if not ships_package:  # py_modules carries the package; no other copy may shadow it
        own_excludes = [*own_excludes, "/rayjobs/"]
    # own last: "!name" re-includes; links out of wd, secrets by target or content screened out
    base = [*EXCLUDES, *SECRET_EXCLUDES]
    files, excludes, left_out = screen(wd, base, own_excludes, follow_links)

    problems: list[str] = []
    config_rel = _relative(config_file, wd)
    if config_rel is None:
        problems.append(
            f"the config {config_file} is outside the working directory {wd}; "
            f"pass --working-dir with a folder that holds it"
        )
    elif config_rel not in files:
        problems.append(f"the config {config_rel} {_left_out()}")
    raw = _raw(config_file, overrides)
    checker = _InputCheck(wd, config_file.parent, files, allow_absolute, problems)
    held_out = (raw.get("eval") or {}).get("datasets") or []
    for section, specs, spelled_specs in (
        ("datasets", config.datasets, raw["datasets"]),
        ("eval.datasets", config.eval.datasets, held_out),
    ):
        for index, spec in enumerate(specs):
            key = f"{section}.{index}.source (dataset {spec.name!r})"
            spelled = expand(spelled_specs[index], config_file.parent, section)
            if spelled.get("dataset_info"):  # its registry travels too: the job reads it again
                info = str(spelled["dataset_info"]).partition("#")[0]
                checker.files(f"{section}.{index}.dataset_info", info, "json")
            spelled = spelled["source"]
            for source in [spelled] if isinstance(spelled, str) else spelled:
                if spec.format == formats.HF:
                    checker.folder_or_name(key, str(source))
                else:
                    checker.files(key, str(source), spec.format)
    checker.folder_or_name("tokenizer.path", str(raw["tokenizer"]["path"]))
    problems += unshipped(config.template_modules, wd, files)  # the job imports them again
    model = (raw.get("train") or {}).get("model") or {}
    for name in ("path", "config_path"):  # a checkpoint or config.json to start from
        if model.get("kind") == "hf" and model.get(name) is not None:
            checker.folder_or_name(f"train.model.{name}", str(model[name]))

    problems += size_problems(files, wd, max_upload_mib, max_file_mib)
    if problems:
        raise SubmitError("cannot submit:\n" + "\n".join(f"  {p}" for p in problems))

    env: dict[str, Any] = {**extra, "working_dir": str(wd), "excludes": excludes}
    if not ships_package:
        env["py_modules"] = [str(PACKAGE_DIR)]
    notes = []
    storage = str((raw.get("train") or {}).get("storage_path", "runs"))
    if "://" not in storage and not os.path.isabs(os.path.expanduser(storage)):
        notes.append(
            f"train.storage_path {storage!r} is relative: checkpoints go under the job's copy of "
            f"the working directory, inside Ray's session folder on the cluster; pass "
            f"train.storage_path=<a shared absolute path> to keep them"
        )
    notes += left_out_notes(left_out)
    total = sum(files.values())
    command = entrypoint(config_rel, overrides)
    return Plan(wd, config_rel, overrides, command, env, total, notes, files)


def _relative(path: str | os.PathLike, root: Path) -> str | None:
    """``path`` (made absolute and normalised, symlinks kept) relative to ``root``, or None when it
    lies outside."""
    rel = os.path.relpath(os.path.normpath(os.path.abspath(path)), root)
    return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else Path(rel).as_posix()


def _left_out() -> str:
    return (
        "is left out of the upload (rayjobs' excludes, secrets' included, a .gitignore or a "
        ".rayignore, a link out of the working directory: --follow-links ships its target; "
        "RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 ships git-ignored files, and "
        '--runtime-env-json \'{"excludes": ["!<path>"]}\' one file rayjobs leaves out)'
    )


def _raw(config_file: Path, overrides: list[str]) -> dict[str, Any]:
    """The config as written, overrides applied, before paths are resolved (already valid)."""
    raw = yaml_load(config_file.read_text(encoding="utf-8")) or {}
    for override in overrides:
        _apply_override(raw, override)
    return raw


@dataclass
class _InputCheck:
    """Checks that an input the config names will be found by the job on the cluster."""

    wd: Path
    base: Path
    """The config's folder: relative paths resolve against it."""
    shipped: dict[str, int]
    allow_absolute: bool
    problems: list[str]

    def files(self, key: str, source: str, fmt: str | None) -> None:
        """A dataset source: a file, folder or glob, matched as ``config`` matches it."""
        if "://" in source or self._absolute(key, source):
            return
        full = self.base / source
        if full.is_dir():
            matches = [
                p for p in full.rglob("*") if p.is_file() and formats.format_of(p.name) == fmt
            ]
        else:
            matches = [Path(m) for m in sorted(glob.glob(str(full), recursive=True))]
        self._shipped(key, source, matches)

    def folder_or_name(self, key: str, source: str) -> None:
        """A tokenizer or ``hf`` source: a local file or folder, else a Hub name (passes)."""
        if "://" in source or self._absolute(key, source):
            return
        full = self.base / source
        if full.is_dir():
            self._shipped(key, source, [p for p in full.rglob("*") if p.is_file()])
        elif full.exists():
            self._shipped(key, source, [full])

    def _absolute(self, key: str, source: str) -> bool:
        """True when ``source`` is absolute (then it is the cluster's path: allowed, or a
        problem is recorded)."""
        expanded = os.path.expanduser(source)
        if not os.path.isabs(expanded):
            return False
        if self.allow_absolute:
            return True
        inside = _relative(expanded, self.wd)
        if inside is None:
            self.problems.append(
                f"{key}: {source} is outside the working directory shipped to the cluster "
                f"({self.wd}); put it under that folder and name it relative to the config, "
                f"or pass --allow-absolute if every cluster node can read {source}"
            )
        else:
            suggestion = os.path.relpath(os.path.normpath(expanded), self.base)
            self.problems.append(
                f"{key}: {source} is an absolute path, so the job would read it from the "
                f"cluster's filesystem, not from the shipped working directory; name it relative "
                f"to the config ({suggestion}), or pass --allow-absolute if every cluster node "
                f"has it at that path"
            )
        return True

    def _shipped(self, key: str, source: str, paths: list[Path]) -> None:
        for path in paths:
            rel = _relative(path, self.wd)
            if rel is None:
                resolved = os.path.normpath(os.path.abspath(path))
                self.problems.append(
                    f"{key}: {source} ({resolved}) is outside the working directory shipped to "
                    f"the cluster ({self.wd}); put it under that folder, or name it by an "
                    f"absolute path every cluster node can read (with --allow-absolute)"
                )
                return
            if rel not in self.shipped:
                self.problems.append(f"{key}: {rel} {_left_out()}")
                return


# -- talking to the cluster ---------------------------------------------------------------------


def _client(address: str):
    """A ``JobSubmissionClient`` (Ray adds the auth header when ``RAY_AUTH_MODE=token``)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def _status(value: Any) -> str:
    return str(getattr(value, "value", value))


def _explain(error: Exception, address: str) -> str:
    """A one-paragraph reason for a failed request, with what to try."""
    text = str(error).strip() or type(error).__name__
    if "Authentication" in text or type(error).__name__ == "AuthenticationError":
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            text += (
                "\nThe cluster uses token authentication: export RAY_AUTH_MODE=token (the token "
                "is read from $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)."
            )
    elif isinstance(error, ConnectionError) or "Failed to connect" in text:
        text += (
            f"\nIs a Ray dashboard listening at {address}? --address (or "
            f"$RAY_API_SERVER_ADDRESS) is its HTTP address, port 8265 by default, not the GCS "
            f"port."
        )
    return text


def summary_from_logs(logs: str) -> dict[str, Any] | None:
    """The run summary: the last log line that is a JSON object (``rayjobs run --json`` prints it
    last; a line Ray prints after it is skipped), or None."""
    for line in reversed(logs.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def error_from_logs(logs: str) -> str | None:
    """What a failed run said last: its ``rayjobs: ...`` error line (without the prefix), else the
    last line of the log (a traceback's exception line), or None for an empty log."""
    lines = [line.strip() for line in logs.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("rayjobs: "):
            return line[len("rayjobs: ") :]
    return lines[-1] if lines else None


async def _tail(client: Any, submission_id: str) -> None:
    ended_line = True
    async for chunk in client.tail_job_logs(submission_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()
        if chunk:
            ended_line = chunk.endswith("\n")
    if not ended_line:
        sys.stdout.write("\n")


def _wait(client: Any, submission_id: str, timeout: float | None) -> str:
    """Poll until the job is in a terminal state (or ``timeout`` s, None: no limit); its last
    status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    status = _status(client.get_job_status(submission_id))
    while status not in TERMINAL and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.5)
        status = _status(client.get_job_status(submission_id))
    return status


def _emit_json(record: dict[str, Any]) -> None:
    sys.stdout.flush()
    print(json.dumps(record, default=str), flush=True)


def _interrupted(submission_id: str, address: str) -> None:
    print(
        f"\nrayjobs: stopped following; job {submission_id} keeps running on the cluster.\n"
        f"  stop it:   rayjobs stop {submission_id} --address {address}\n"
        f"  follow it: rayjobs logs {submission_id} --follow --address {address}",
        file=sys.stderr,
    )


def submit_command(args: argparse.Namespace) -> int:
    """``rayjobs submit``: see the module docstring for what is shipped and the exit codes."""
    try:
        extra = json.loads(args.runtime_env_json) if args.runtime_env_json else None
        if extra is not None and not isinstance(extra, dict):
            raise SubmitError("--runtime-env-json must be a JSON object")
        plan = plan_submission(
            args.config,
            args.overrides,
            working_dir=args.working_dir,
            allow_absolute=args.allow_absolute,
            max_upload_mib=args.max_upload_mib or MAX_UPLOAD_MIB,
            runtime_env=extra,
            max_file_mib=args.max_file_mib or MAX_FILE_MIB,
            follow_links=args.follow_links,
        )
    except (ConfigError, SubmitError, json.JSONDecodeError) as error:
        message = str(error)
        if isinstance(error, json.JSONDecodeError):
            message = f"--runtime-env-json is not JSON: {error}"
        print(f"rayjobs: {message}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"rayjobs: note: {note}", file=sys.stderr)
    address = resolve_address(args.address)
    if args.dry_run:
        return _dry_run(plan, address, args.json)
    try:
        client = _client(address)
        submission_id = client.submit_job(
            entrypoint=plan.entrypoint,
            runtime_env=plan.runtime_env,
            submission_id=args.submission_id,
            metadata={"rayjobs.config": plan.config},
        )
    except Exception as error:  # noqa: BLE001 - connection, auth, duplicate id: reported, exit 1
        print(f"rayjobs: cannot submit to {address}: {_explain(error, address)}", file=sys.stderr)
        return 1
    url = dashboard_url(address, submission_id)
    print(
        f"rayjobs: submitted job {submission_id} to {address} "
        f"({plan.upload_bytes / 2**20:.1f} MiB from {plan.working_dir})\n"
        f"  entrypoint: {plan.entrypoint}\n"
        f"  dashboard:  {url}",
        file=sys.stderr,
    )
    record: dict[str, Any] = {"submission_id": submission_id, "address": address}
    record["dashboard_url"] = url
    if args.no_wait:
        print(
            f"  follow:     rayjobs logs {submission_id} --follow --address {address}\n"
            f"  stop:       rayjobs stop {submission_id} --address {address}",
            file=sys.stderr,
        )
        if args.json:
            _emit_json({**record, "status": "PENDING"})
        return 0
    try:
        try:
            asyncio.run(_tail(client, submission_id))
        except Exception as error:  # noqa: BLE001 - the log stream broke; the job may go on
            print(
                f"rayjobs: lost the log stream ({error}); waiting for the job to end",
                file=sys.stderr,
            )
        status = _wait(client, submission_id, timeout=None)  # the stream ends when the job does
    except KeyboardInterrupt:
        _interrupted(submission_id, address)
        if args.json:
            _emit_json({**record, "status": "RUNNING", "interrupted": True})
        return 130
    try:
        info = client.get_job_info(submission_id)
        logs = client.get_job_logs(submission_id)
    except Exception as error:  # noqa: BLE001
        print(
            f"rayjobs: job {submission_id} {status}; cannot read its info: {error}", file=sys.stderr
        )
        info, logs = None, ""
    message = getattr(info, "message", None) or ""
    error = None
    if status != "SUCCEEDED":
        first = message.strip().splitlines()[0] if message.strip() else status
        error = error_from_logs(logs) if status == "FAILED" else None
        error = error or first
    summary = summary_from_logs(logs)
    outcome = f"rayjobs: job {submission_id} {status}"
    print(outcome + (f": {error}" if error else ""), file=sys.stderr)
    if args.json:
        record.update(status=status, message=message, error=error, summary=summary)
        _emit_json(record)
    return 0 if status == "SUCCEEDED" else 1


def _dry_run(plan: Plan, address: str, as_json: bool) -> int:
    """``submit --dry-run``: the upload on stdout (one file a line, bytes then path), what would
    run on stderr; nothing is sent."""
    if plan.files:
        print(listing(plan.files))
    print(
        f"rayjobs: dry run: would upload {len(plan.files)} files, "
        f"{plan.upload_bytes / 2**20:.1f} MiB from {plan.working_dir} to {address}; nothing "
        f"submitted\n  entrypoint: {plan.entrypoint}",
        file=sys.stderr,
    )
    if as_json:
        record = {"dry_run": True, "address": address, "working_dir": str(plan.working_dir)}
        record |= {"entrypoint": plan.entrypoint, "upload_bytes": plan.upload_bytes}
        _emit_json(record | {"files": plan.files})
    return 0


def job_command(args: argparse.Namespace) -> int:
    """``rayjobs status|logs|stop JOB``: thin wrappers over the Jobs API."""
    address = resolve_address(args.address)
    job = args.job
    try:
        client = _client(address)
        if args.command == "status":  # with its counts; --watch: again until it ends
            from rayjobs.job import watch  # Ray's state API, imported with the client (_client)

            while True:
                info = client.get_job_info(job)
                status = _status(info.status)
                ended = status in TERMINAL
                summary = summary_from_logs(client.get_job_logs(job)) if ended else None
                watch.show(address, job, info, status, summary, args.json)
                if ended or not args.watch:
                    return 0
                time.sleep(watch.INTERVAL)
        if args.command == "logs":
            if not args.follow:
                sys.stdout.write(client.get_job_logs(job))
                return 0
            try:
                asyncio.run(_tail(client, job))
            except KeyboardInterrupt:
                _interrupted(job, address)
                return 130
            return 0
        stopping = client.stop_job(job)
        if not stopping:
            status = _status(client.get_job_status(job))
            print(f"rayjobs: job {job} had already ended: {status}", file=sys.stderr)
            return 0
        status = _wait(client, job, timeout=30.0)
        if status not in TERMINAL:
            print(
                f"rayjobs: job {job} is still {status} 30 s after the stop request; "
                f"see rayjobs status {job}",
                file=sys.stderr,
            )
            return 1
        print(f"rayjobs: job {job} {status}", file=sys.stderr)
        return 0
    except Exception as error:  # noqa: BLE001 - unknown job, connection, auth: reported, exit 1
        print(
            f"rayjobs: {args.command} {job} at {address}: {_explain(error, address)}",
            file=sys.stderr,
        )
        return 1
