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
import re
from collections.abc import Iterable
from pathlib import Path

# Ray's own matcher for runtime_env excludes (gitignore syntax), so a link's target is judged by
# the rules that judge the link
from ray._private.thirdparty.pathspec import PathSpec

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
    "**/huggingface/token",
    "**/huggingface/stored_tokens",
    "*service-account*.json",
    "*service_account*.json",
    ".s3cfg",
    ".boto",
    "*kubeconfig*",
    ".dockercfg",
    ".my.cnf",
    ".mylogin.cnf",
    "rclone.conf",
    "*.tfstate",
    "*.tfstate.backup",
    ".terraform/",
    ".vault-token",
    "_netrc",
)
"""Files that commonly hold secrets (environment files, private keys and certificates, cloud,
cluster, database and package-index credentials, the Hugging Face token cache, Terraform state,
Ray's ``auth_token``), left out of every upload too; ``screen`` also catches them as a link's
target and by content (``SECRET_CONTENT``)."""

SECRET_CONTENT = {
    "a PEM private key": re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----"),
    'a service-account key ("type": "service_account")': re.compile(
        rb'"type"\s*:\s*"service_account"'
    ),
    "an AWS secret key (aws_secret_access_key)": re.compile(rb"aws_secret_access_key\s*="),
}
"""What a file's first ``SNIFF_BYTES`` give away when its name says nothing."""
SNIFF_MAX_BYTES = 64 << 10
"""Files up to this size are sniffed (``SECRET_CONTENT``): key files are small, data is not."""
SNIFF_BYTES = 8 << 10


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


def screen(
    working_dir: Path, excludes: list[str], own: list[str], follow_links: bool = False
) -> tuple[dict[str, int], list[str], dict[str, str]]:
    """The upload of ``working_dir`` with ``excludes``, then the user's ``own`` (a ``!path`` of
    theirs re-includes), less what no name gives away: a link that leads out of the working
    directory (its target shipped only with ``follow_links``), a link to a likely secret, a
    small file whose content is one (``SECRET_CONTENT``). Returns the files shipped (as
    ``shipped_files``), the excludes that ship them (each file screened out anchored) and what
    was left out (path → why: those and ``SECRET_EXCLUDES``' names)."""
    files = shipped_files(working_dir, [*excludes, *own])
    root = os.path.realpath(working_dir)
    secret = PathSpec.from_lines("gitwildmatch", SECRET_EXCLUDES)
    flagged = {}
    for rel in files:
        reason = _suspect(root, rel, secret, follow_links)
        if reason:
            flagged[rel] = reason
    final = [*excludes, *(_anchored(rel) for rel in sorted(flagged)), *own]
    shipped = shipped_files(working_dir, final) if flagged else files
    left = {rel: why for rel, why in flagged.items() if rel not in shipped}
    for rel in secrets_left_out(working_dir, final, shipped):
        left.setdefault(rel, "a likely secret, by its name")
    return shipped, final, dict(sorted(left.items()))


def _suspect(root: str, rel: str, secret: PathSpec, follow_links: bool) -> str | None:
    """Why ``rel`` (a file of the upload of folder ``root``, real path) must stay out, or None."""
    real = os.path.realpath(os.path.join(root, rel))
    if real != os.path.join(root, *rel.split("/")):  # itself, or a folder above it, a link
        inside = os.path.commonpath([root, real]) == root
        if not inside and not follow_links:
            return f"a link to {real}, outside the working directory (--follow-links ships it)"
        if secret.match_file(os.path.relpath(real, root) if inside else real.lstrip(os.sep)):
            return f"a link to {real}, a likely secret by its name"
    try:
        if os.path.getsize(real) > SNIFF_MAX_BYTES:
            return None
        with open(real, "rb") as stream:
            head = stream.read(SNIFF_BYTES)
    except OSError:
        return None
    for what, pattern in SECRET_CONTENT.items():
        if pattern.search(head):
            return f"holds {what}"
    return None


def _anchored(rel: str) -> str:
    """An exclude (gitignore syntax) that matches exactly ``rel``, from the working directory."""
    return "/" + re.sub(r"([\\*?\[\]!# ])", r"\\\1", rel)


def left_out_notes(left: dict[str, str]) -> list[str]:
    """What ``screen`` left out, said on stderr: the names ``SECRET_EXCLUDES`` caught on one
    line (8 named, then a count), each other file on its own with why."""
    named = [rel for rel, why in left.items() if why == "a likely secret, by its name"]
    notes = []
    if named:
        more = f" and {len(named) - 8} more" if len(named) > 8 else ""
        notes.append(
            f"left out as likely secrets: {', '.join(named[:8])}{more} (a job that needs one: "
            '--runtime-env-json \'{"excludes": ["!<path>"]}\')'
        )
    notes += [f"left out: {rel}: {why}" for rel, why in left.items() if rel not in named]
    return notes
