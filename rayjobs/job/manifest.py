"""An export's commit marker, without Ray: readers of an export (``rayjobs bench train``, which
runs where only torch, numpy and pyarrow are installed) check it here."""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from rayjobs.data import files
from rayjobs.errors import ConfigError

MANIFEST = "manifest.json"
"""An export's manifest, written last: an export is finished when it exists, and only then."""


def require_finished(folder: str | os.PathLike) -> None:
    """Refuse a folder (or object-store prefix) that holds no finished export: without
    ``manifest.json`` it is missing, still being written, or what an interrupted export left.

    Raises:
        ConfigError: naming the folder and what to do.
    """
    folder = str(folder)
    try:
        fs, path = files.filesystem(folder)
        found = fs.get_file_info(f"{path.rstrip('/')}/{MANIFEST}").type == pafs.FileType.File
    except (OSError, files.StorageError) as error:
        raise ConfigError(files.explain(error, folder)) from None
    if not found:
        raise ConfigError(
            f"{files.shown(folder)} is not a finished export (no {MANIFEST}: none was made "
            f"there, or one is still being written or was interrupted); make one with "
            f"`rayjobs export CONFIG --out {files.shown(folder)}`"
        )
