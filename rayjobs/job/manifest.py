"""An export's layout and commit marker, without Ray: readers of an export (``rayjobs bench
train``, which runs where only torch, numpy and pyarrow are installed) find its files here.

The layout is the one the ecosystem's readers open as it is (docs/cli.md, "rayjobs export"):
``train/*.parquet`` (every epoch's packed rows, an ``epoch`` column telling them apart) and
``_validation/*.parquet`` (the packed eval sets) are the splits ``datasets.load_dataset(OUT)``
finds by their folders' names; pyarrow's dataset discovery (``pq.read_table(OUT)``) skips names
starting with ``_`` or ``.``, so it reads the training rows alone and never the manifest, the card
or the tokenizer. An export made before this layout (``epoch=<e>/``, ``eval/``, ``manifest.json``)
is still read.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from rayjobs.data import files
from rayjobs.errors import ConfigError

MANIFEST = "_manifest.json"
"""An export's manifest, written last: an export is finished when it exists, and only then."""
TRAIN = "train"
"""The folder of the packed training rows, every epoch's (``datasets``' ``train`` split)."""
VALIDATION = "_validation"
"""The folder of the packed ``eval.datasets`` (``datasets``' ``validation`` split; hidden from
pyarrow's discovery by its ``_``)."""
TOKENIZER = "_tokenizer"
"""The run's tokenizer, as ``AutoTokenizer.from_pretrained`` and ``tokenizer.path`` load it."""
CARD = "_README.md"
"""The export's dataset card: columns, label convention, epochs and each consumer's recipe; with
its YAML ``configs:`` it is the Hub's card once renamed ``README.md`` (a ``README.md`` in the
folder would be read as Parquet by ``pq.read_table(OUT)``)."""
LEGACY_MANIFEST = "manifest.json"
"""The manifest of an export in the layout before this one (``epoch=<e>/``, ``eval/``)."""


def manifest_path(folder: str) -> str | None:
    """The manifest of the finished export at ``folder`` (a path on its filesystem as
    ``files.filesystem`` gives it, or a local folder), the current name or the legacy one; None
    when there is none."""
    fs, path = files.filesystem(folder)
    for name in (MANIFEST, LEGACY_MANIFEST):
        if fs.get_file_info(f"{path.rstrip('/')}/{name}").type == pafs.FileType.File:
            return f"{folder.rstrip('/')}/{name}"
    return None


def require_finished(folder: str | os.PathLike) -> None:
    """Refuse a folder (or object-store prefix) that holds no finished export: without
    ``_manifest.json`` it is missing, still being written, or what an interrupted export left.

    Raises:
        ConfigError: naming the folder and what to do.
    """
    folder = str(folder)
    try:
        found = manifest_path(folder) is not None
    except (OSError, files.StorageError) as error:
        raise ConfigError(files.explain(error, folder)) from None
    if not found:
        raise ConfigError(
            f"{files.shown(folder)} is not a finished export (no {MANIFEST}: none was made "
            f"there, or one is still being written or was interrupted); make one with "
            f"`rayjobs export CONFIG --out {files.shown(folder)}`"
        )
