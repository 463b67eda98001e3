"""``rayjobs init``: the example configs and the data they read, for an installed package.

The repository's ``configs/`` (the example configs, ``configs/demo/`` and the bundled data of
``configs/data/``) is packaged as ``rayjobs/examples`` (pyproject.toml's ``package-dir`` and
``package-data``, which list ``PATTERNS``); a checkout that was not built reads ``configs/``
itself. ``init`` copies them into a folder of the user's, keeping their layout, so every config's
relative paths still resolve.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rayjobs.errors import ConfigError

PATTERNS = ("*.yaml", "demo/*", "data/**/*")
"""The example files, as globs under ``configs/`` (pyproject.toml's ``package-data`` of
``rayjobs.examples`` says the same)."""


def examples_root() -> Path:
    """Where the examples are: the installed package's ``rayjobs/examples``, else the checkout's
    ``configs/``."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "examples"
    return installed if installed.is_dir() else package.parent / "configs"


def example_files(root: Path | None = None) -> list[Path]:
    """The example files under ``root`` (default ``examples_root()``), relative to it, sorted."""
    root = root or examples_root()
    found = {
        path.relative_to(root)
        for pattern in PATTERNS
        for path in root.glob(pattern)
        if path.is_file() and "__pycache__" not in path.parts
    }
    return sorted(found)


def init(folder: str | Path) -> list[Path]:
    """Copy the examples into ``folder`` (new or empty) and return the files written.

    Raises:
        ConfigError: ``folder`` is a file or holds anything (nothing of the user's is
            overwritten), or there are no examples to copy (a broken install).
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"init: {folder} is not an empty folder; name a new one")
    root = examples_root()
    names = example_files(root)
    if not any(name.name == "demo.yaml" for name in names):
        raise ConfigError(f"init: no example configs found at {root} (reinstall rayjobs)")
    written = []
    for name in names:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, target)
        written.append(target)
    return written
