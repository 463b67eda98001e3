"""What ``rayjobs submit`` uploads: the working directory less the excludes, checked for size.

Design note: the upload is a zip of a folder on a user's machine, stored in the cluster's GCS and
unpacked on every node a job runs on, so anything in it is readable by whoever can read the
cluster. Files that commonly hold secrets (``SECRET_EXCLUDES``) are left out by default, and a
single large file (``MAX_FILE_MIB``, the size at which Ray itself starts warning) is refused:
it is rarely code or a config, more often a checkpoint or a data dump that belongs on storage the
nodes read. A file one of them catches that the job needs is shipped with a negated pattern
(``--runtime-env-json '{"excludes": ["!data/secret_santa.jsonl"]}'``), a larger one with
``--max-file-mib``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

MAX_UPLOAD_MIB = 100.0
"""Default limit on what the working directory uploads (``--max-upload-mib``)."""
MAX_FILE_MIB = 10.0
"""Default limit on one file of the upload (``--max-file-mib``); Ray warns from this size on."""
EXCLUDES = (
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "runs/",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    ".mypy_cache",
    ".benchmarks",
)
"""Left out of every upload, on top of ``.gitignore`` / ``.rayignore`` (gitignore syntax)."""
SECRET_EXCLUDES = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "*[Cc]redential*",
    "*CREDENTIAL*",
    "*[Cc]reds*",
    "*[Ss]ecret*",
    "*SECRET*",
    "auth_token",
    ".netrc",
    ".pgpass",
    ".pypirc",
    ".npmrc",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    ".kube/",
    ".docker/",
    ".azure/",
    "gcloud/",
)
"""Files that commonly hold secrets (environment files, private keys and certificates, cloud and
package-index credentials, Ray's ``auth_token``), left out of every upload too."""


def shipped_files(working_dir: str | os.PathLike, excludes: Iterable[str]) -> dict[str, int]:
    """Every file the upload of ``working_dir`` holds (POSIX path relative to it → bytes).

    Walks the folder with Ray's own traversal (the one that builds the zip: ``excludes``, then each
    folder's ``.gitignore`` unless ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``, and ``.rayignore``), so
    what is checked here is what the cluster gets. Ray is pinned, and a test compares the result
    with the zip Ray builds."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    root = Path(working_dir).absolute()
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    quiet = logging.getLogger("rayjobs.job.submit.scan")  # Ray logs each ignore file it reads
    quiet.setLevel(logging.WARNING)
    files: dict[str, int] = {}

    def handler(path: Path) -> None:
        if path.is_file():
            files[path.relative_to(root).as_posix()] = path.stat().st_size

    _dir_travel(
        root, [_get_excludes(root, list(excludes))], handler, include_gitignore, logger=quiet
    )
    return files


def secrets_left_out(working_dir: Path, excludes: list[str], shipped: dict[str, int]) -> list[str]:
    """The files ``SECRET_EXCLUDES`` kept out of the upload (and nothing else would have)."""
    others = [e for e in excludes if e not in SECRET_EXCLUDES]
    return sorted(set(shipped_files(working_dir, others)) - set(shipped))


def size_problems(
    files: dict[str, int], working_dir: Path, max_upload_mib: float, max_file_mib: float
) -> list[str]:
    """What makes the upload too large: one file over ``max_file_mib``, or all of them over
    ``max_upload_mib``."""
    problems = []
    too_big = sorted(
        (item for item in files.items() if item[1] > max_file_mib * 2**20), key=lambda i: -i[1]
    )
    if too_big:
        listed = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in too_big[:5])
        problems.append(
            f"{len(too_big)} file(s) of {working_dir} are over the {max_file_mib:g} MiB limit on "
            f"one file (--max-file-mib): {listed}. Leave them out with a .rayignore, keep large "
            "data on storage every cluster node reads, or raise --max-file-mib"
        )
    total = sum(files.values())
    if total > max_upload_mib * 2**20:
        largest = sorted(files.items(), key=lambda item: -item[1])[:5]
        listed = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in largest)
        problems.append(
            f"the working directory {working_dir} would upload {total / 2**20:.1f} MiB, over the "
            f"{max_upload_mib:g} MiB limit (--max-upload-mib); largest: {listed}. Leave files "
            f"out with a .rayignore, or keep large data on storage every cluster node reads"
        )
    return problems


def listing(files: dict[str, int]) -> str:
    """The upload, one file a line: its size in bytes, then its path, in path order."""
    width = len(f"{max(files.values(), default=0):,}")
    return "\n".join(f"{size:>{width},}  {name}" for name, size in sorted(files.items()))
