"""Loading a config: YAML plus dotted overrides, validated once before Ray starts.

A config is a YAML mapping with the sections below; ``load_config`` reads it, applies
``dotted.key=value`` overrides (values parsed as YAML scalars), and validates everything with
pydantic. Unknown keys, wrong types and missing local files fail here with a ``ConfigError`` whose
message names the dotted key, the bad value and what would be valid, so no Ray work starts on a bad
config. Relative paths (dataset sources, the tokenizer, ``train.storage_path``) are resolved
against the directory of the config file, which makes a config and its data movable together
(``configs/demo.yaml`` points at ``configs/demo/``); overrides are resolved the same way.

A dataset's ``source`` is resolved to its ``files`` here, once: directories and globs expanded and
sorted, and a file reached twice (listed twice, under a relative and an absolute spelling, through
a symlink or a hard link, or by a glob and a path: the same device and inode) kept once, under its
first spelling. Design note: a file read twice is a silent duplication of its samples, almost
always an accident of overlapping sources; training on a dataset more than once is what
``weight`` is for. For the same reason one file read by two datasets (two training datasets, or an
eval dataset and any other) is refused, naming both, unless ``allow_duplicate_sources`` is set.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rayjobs.config.advice import describe, idle_keys
from rayjobs.config.llamafactory import expand_all
from rayjobs.config.models import HFModelConfig, ModelConfig
from rayjobs.config.schema import Config, DatasetConfig
from rayjobs.config.user_templates import import_template_modules
from rayjobs.data import files, formats
from rayjobs.errors import ConfigError

logger = logging.getLogger(__name__)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, less two YAML 1.1 surprises: a key written twice in one mapping is
    refused (PyYAML keeps the last, so a second ``train:`` section silently replaced the
    first), and ``1e-5`` is a float as in YAML 1.2 and JSON (1.1 wants ``1.0e-5``; typed keys
    coerce the string, but ``train.model.config`` passes it to transformers as text)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeats the key of line {seen[key]}",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """YAML as rayjobs reads configs and overrides (see :class:`_YamlLoader`)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply ``dotted.key=value`` overrides, validate and resolve paths.

    Raises:
        ConfigError: naming the file, dotted key or value at fault.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:
        where = f"{error.reason} at byte {error.start}"
        raise ConfigError(f"{path} is not UTF-8 text ({where})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (datasets, tokenizer, ...)")
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw, base_dir=path.parent)


def config_from_dict(raw: dict[str, Any], base_dir: str | os.PathLike = ".") -> Config:
    """Validate a config mapping and resolve its paths against ``base_dir`` (the templates of
    ``template_modules`` are imported first, from it: ``user_templates``); warn (the
    ``rayjobs`` logger) of the keys it sets that have no effect (``advice.idle_keys``)."""
    import_template_modules(raw.get("template_modules"), Path(base_dir).resolve())
    raw = expand_all(raw, Path(base_dir).resolve())
    try:
        config = Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(describe(error, raw)) from None
    resolved = _resolve(config, Path(base_dir).resolve())
    for message in idle_keys(config, resolved):
        logger.warning(message)
    return resolved


def _resolve(config: Config, base_dir: Path) -> Config:
    """``config`` with its datasets' files, formats and every path resolved against
    ``base_dir``."""
    datasets = [_resolve_dataset(d, i, base_dir) for i, d in enumerate(config.datasets)]
    held_out = [
        _resolve_dataset(spec, i, base_dir, "eval.datasets")
        for i, spec in enumerate(config.eval.datasets)
    ]
    if not config.allow_duplicate_sources:
        _refuse_shared_files([("datasets", datasets), ("eval.datasets", held_out)])
    tokenizer_path = _resolve_tokenizer(config.tokenizer.path, base_dir)
    storage_path = _resolve_storage(config.train.storage_path, base_dir)
    return config.model_copy(
        update={
            "datasets": datasets,
            "eval": config.eval.model_copy(update={"datasets": held_out}),
            "tokenizer": config.tokenizer.model_copy(update={"path": tokenizer_path}),
            "train": config.train.model_copy(
                update={
                    "storage_path": storage_path,
                    "model": _resolve_model(config.train.model, base_dir),
                }
            ),
        }
    )


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like dotted.key=value")
    node: Any = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override {key}: {'.'.join(parts[: depth + 1])} is not an index "
                    f"of a list of {len(node)}"
                )
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key}: {'.'.join(parts[: depth + 1])} is not a section")
    last = parts[-1]
    try:
        parsed = yaml_load(value) if value else ""
    except yaml.YAMLError:
        parsed = value  # not a YAML scalar (a Jinja template, say): take it as text
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}: {last} is not an index of a list of {len(node)}")
        node[int(last)] = parsed
    else:
        node[last] = parsed


def _resolve_dataset(
    spec: DatasetConfig, index: int, base_dir: Path, section: str = "datasets"
) -> DatasetConfig:
    key = f"{section}.{index}.source"
    if spec.files:  # the field exists so workers get the list validation resolved, once
        raise ConfigError(
            f"{section}.{index}.files: filled in from {key}, not set in a config; "
            f"list the files in {key} instead"
        )
    sources = [spec.source] if isinstance(spec.source, str) else list(spec.source)
    if spec.format == formats.HF:
        if len(sources) != 1:
            raise ConfigError(
                f"{key} (dataset {spec.name!r}): format hf reads one dataset (a Hub name or a "
                f"folder), got {len(sources)}; list each as a dataset of its own"
            )
        return _resolve_hf(spec, key, base_dir)
    if not sources:
        raise ConfigError(f"{key} (dataset {spec.name!r}): an empty list names no file")
    found: list[files.Found] = []
    seen: set[Any] = set()  # identities (URIs) of the files kept
    for source in sources:
        try:
            matches = _matches(spec, source, base_dir)
        except files.StorageError as error:
            raise ConfigError(f"{key} (dataset {spec.name!r}): {error}") from None
        if not matches:
            where = source if files.is_remote(source) else _local(source, base_dir)
            raise ConfigError(f"{key} (dataset {spec.name!r}): no file matches {where}")
        for match in matches:  # a file reached twice is read once, under its first spelling
            real = _real(match.uri)
            if real not in seen:
                seen.add(real)
                found.append(match)
    if all(_is_empty(f) for f in found):
        raise ConfigError(
            f"{key} (dataset {spec.name!r}): every file is empty "
            f"({[files.shown(f.uri) for f in found[:3]]}); a dataset in the mix needs at least "
            "one row"
        )
    paths = [f.uri for f in found]
    fmt = spec.format
    if fmt is None:
        inferred = {formats.format_of(f) for f in paths}
        if len(inferred) != 1 or None in inferred:
            raise ConfigError(
                f"{section}.{index}.format (dataset {spec.name!r}): cannot infer the "
                f"format from the extensions of {[files.shown(p) for p in paths[:3]]}; set "
                f"format to one of {', '.join(formats.FORMATS)}"
            )
        fmt = inferred.pop()
    return spec.model_copy(update={"format": fmt, "files": tuple(paths)})


def _real(uri: str) -> Any:
    """What tells two spellings of one file apart from two files: a URI as written, a local
    file's identity (device and inode: a symlink or a hard link to it is the same file), else
    its path with symlinks resolved."""
    if files.is_remote(uri):
        return uri
    try:
        found = os.stat(uri)
    except OSError:
        return os.path.realpath(uri)
    return (found.st_dev, found.st_ino)


def _refuse_shared_files(sections: list[tuple[str, list[DatasetConfig]]]) -> None:
    """One file (or Hugging Face dataset) read by two datasets: a ``ConfigError`` naming both
    and the file. Training on a file twice doubles its samples without a word (``weight`` is
    how to read a dataset more often); an eval dataset that shares a file with a training
    one evaluates on trained data."""
    owner: dict[Any, tuple[str, str]] = {}  # what is read → (its key and dataset, as spelled)
    for section, specs in sections:
        for index, spec in enumerate(specs):
            where = f"{section}.{index} (dataset {spec.name!r})"
            if spec.files:
                read = [(_real(f), f) for f in spec.files]
            else:  # a Hugging Face dataset loaded in the driver: its source and split
                source = str(spec.source)
                key = (_real(source) if os.path.exists(source) else source, spec.subset,
                       spec.split, spec.revision)  # fmt: skip
                read = [(key, f"{source} (split {spec.split!r})")]
            for key, spelled in read:
                if key in owner and owner[key][0] != where:
                    first, first_spelled = owner[key]
                    also = "" if first_spelled == spelled else f" (as {files.shown(first_spelled)})"
                    raise ConfigError(
                        f"{where} reads {files.shown(spelled)}, which {first} reads too{also}: "
                        "one file read by two datasets trains (or evaluates on) its rows twice. "
                        "Remove it from one of them (weight reads a dataset more often), or set "
                        "allow_duplicate_sources: true if that is meant"
                    )
                owner.setdefault(key, (where, spelled))


def _local(source: str, base_dir: Path) -> Path:
    full = Path(os.path.expanduser(files.local_path(source)))
    return full if full.is_absolute() else base_dir / full


def _matches(spec: DatasetConfig, source: str, base_dir: Path) -> list[files.Found]:
    """The files one source names, sorted: on its object store (``files.resolve``), or on the
    local disk: a folder's files of the dataset's format, or a glob's matches."""

    def accept(name: str) -> bool:
        found = formats.format_of(name)
        return found is not None and spec.format in (None, found)

    if files.is_remote(source):
        return files.resolve(source, accept, spec.storage)
    full = _local(source, base_dir)
    if full.is_dir():
        paths = sorted(str(p) for p in full.rglob("*") if p.is_file() and accept(p.name))
    else:
        paths = sorted(glob.glob(str(full), recursive=True))
    return [files.Found(p, os.path.getsize(p) if os.path.isfile(p) else 0) for p in paths]


def _is_empty(found: files.Found) -> bool:
    """No rows for sure: zero bytes, or (small local files only: a remote one is not read here)
    just whitespace or an empty JSON list."""
    if found.size == 0:
        return True
    if files.is_remote(found.uri) or found.size > 1 << 16:
        return False
    return Path(found.uri).read_bytes().strip() in (b"", b"[]")


HF_FILE_FORMATS = ("parquet", "jsonl", "csv")
"""Formats of a Hugging Face dataset's data files that read tasks read in parallel, as any file
dataset. ``.json`` files join them by their first character (``json_kind``): the Hub uses the
suffix for JSON lines as well as for one JSON list. The rest (scripts, arrow files, a mix) is
loaded by ``datasets`` in the driver."""

SNIFF_BYTES = 1 << 12


def json_kind(uri: str) -> str | None:
    """The format a ``.json`` data file holds, as ``datasets``' JSON builder reads it: ``json``
    (one list of objects) if its first character is ``[``, ``jsonl`` (an object a line) if it is
    ``{``; None otherwise (an empty file, or only whitespace in its first ``SNIFF_BYTES``)."""
    stream, raw = files.open_file(uri, random_access=False, read_ahead=False)
    try:
        head = stream.read(SNIFF_BYTES).removeprefix(formats.BOM).lstrip()
    finally:
        stream.close()
        raw.close()
    return {b"[": "json", b"{": "jsonl"}.get(head[:1])


def _resolve_hf(spec: DatasetConfig, key: str, base_dir: Path) -> DatasetConfig:
    """A Hugging Face dataset: a ``save_to_disk`` folder as is (loaded in the driver); else its
    data files for ``split``, as ``load_dataset`` finds them (``subset``, ``data_files``,
    ``revision``; a local Hub-layout folder or a Hub name, offline the revision's folder in the
    Hub cache, ``files.hub_snapshot``): Parquet, JSONL or CSV files become the dataset's
    ``files``, read by read tasks in parallel with row numbers of their own."""
    source = str(spec.source)
    local = _local(source, base_dir)
    where = f"{key} (dataset {spec.name!r})"
    if local.exists():
        if spec.revision is not None:
            raise ConfigError(
                f"{where}: revision applies to a dataset on the Hub; the folder {local} is read "
                "as it is"
            )
        source = str(local)
        if files.saved_dataset(source):
            return spec.model_copy(update={"source": source})  # save_to_disk: read as it was
    revision = spec.revision
    if not local.exists() and (snapshot := files.hub_snapshot(source, revision)) is not None:
        source, revision = snapshot, None  # offline: the cached revision's folder
    import datasets

    data_files = spec.data_files
    if source in PACKAGED_BUILDERS:  # the files are the config's, not a dataset's
        data_files = _under(data_files, base_dir)
    try:
        builder = datasets.load_dataset_builder(
            source, name=spec.subset, data_files=data_files, revision=revision
        )
    except Exception as error:  # noqa: BLE001 - datasets raises many kinds for a bad source
        raise ConfigError(
            f"{where}: cannot load the Hugging Face dataset {source!r} "
            f"({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''})"
        ) from None
    split_files = (builder.config.data_files or {}).get(spec.split)
    if split_files is None:
        known = sorted(builder.config.data_files or {})
        raise ConfigError(f"{where}: {source!r} has no split {spec.split!r} (it has {known})")
    found = [str(f) for f in split_files]
    fmts = {formats.format_of(f) for f in found}
    readable = set(HF_FILE_FORMATS)
    if fmts == {"json"} and not any(files.is_remote(f) for f in found):
        fmts, readable = {json_kind(f) for f in found}, readable | {"json"}
    if len(fmts) == 1 and fmts <= readable:
        return spec.model_copy(
            update={"source": source, "format": fmts.pop(), "files": tuple(sorted(found))}
        )
    return spec.model_copy(update={"source": source})


PACKAGED_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``datasets``' builders by format (``source: json`` with ``data_files``), whose data files
are the config's own (a Hub dataset's are relative to it)."""


def _under(data_files: Any, base_dir: Path) -> Any:
    """``data_files`` (a pattern, a list, or ``{split: patterns}``) with each relative local
    pattern resolved against ``base_dir`` (the config's folder), as every other path of a config;
    a URI or an absolute path as it is."""
    if isinstance(data_files, str):
        relative = "://" not in data_files and not Path(data_files).is_absolute()
        return str(base_dir / data_files) if relative else data_files
    if isinstance(data_files, dict):
        return {split: _under(patterns, base_dir) for split, patterns in data_files.items()}
    if isinstance(data_files, list | tuple):
        return [_under(pattern, base_dir) for pattern in data_files]
    return data_files


def _resolve_storage(path: str, base_dir: Path) -> str:
    """``train.storage_path``: a URI (``s3://…``) as is, a folder against ``base_dir``."""
    if "://" in path:
        return path
    local = Path(os.path.expanduser(path))
    return str(local if local.is_absolute() else base_dir / local)


def _resolve_model(
    spec: ModelConfig | HFModelConfig, base_dir: Path
) -> ModelConfig | HFModelConfig:
    """``train.model.path`` / ``config_path`` of ``kind: hf`` against ``base_dir``. ``path`` may
    also be a Hub name (anything that does not look like a path); ``config_path`` must exist."""
    if not isinstance(spec, HFModelConfig):
        return spec
    update = {}
    if spec.path is not None:
        local = Path(os.path.expanduser(spec.path))
        local = local if local.is_absolute() else base_dir / local
        if local.exists():
            update["path"] = str(local)
        elif spec.path.startswith((".", "/", "~")):
            raise ConfigError(f"train.model.path: no checkpoint directory at {local}")
    if spec.config_path is not None:
        local = Path(os.path.expanduser(spec.config_path))
        local = local if local.is_absolute() else base_dir / local
        if not local.exists():
            raise ConfigError(f"train.model.config_path: no config.json or folder at {local}")
        update["config_path"] = str(local)
    return spec.model_copy(update=update)


def _resolve_tokenizer(path: str, base_dir: Path) -> str:
    local = Path(os.path.expanduser(path))
    local = local if local.is_absolute() else base_dir / local
    if local.exists():
        return str(local)
    looks_local = path.startswith((".", "/", "~")) or path.endswith(".json")
    if looks_local:
        raise ConfigError(f"tokenizer.path: no tokenizer file or directory at {local}")
    return path  # a Hugging Face hub name; resolved by transformers at load time
