"""A dataset defined in a LLaMA-Factory ``dataset_info.json`` (``datasets[].dataset_info``): its
entry (``file_name`` or ``hf_hub_url``, ``formatting``, ``columns``, ``tags``, ``subset``,
``split``) becomes the dataset's ``source``, ``template``, ``column_map``, ``message_keys`` and
``roles`` before the config is validated, so a LLaMA-Factory user points a config at their
registry and its files as they are (docs/data.md, "LLaMA-Factory's dataset_info.json").

Design note: the entry is expanded into rayjobs' own keys rather than read by a template of its
own: the keys it sets are the ones a user would have written, so ``rayjobs validate`` and the
run summary show a LLaMA-Factory dataset as any other, and a key the user sets beside
``dataset_info`` (``weight``, ``on_bad_row``, an extra ``column_map`` entry) applies on top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rayjobs.errors import ConfigError

ALPACA_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": "history",
    "system": "system",
}
"""LLaMA-Factory's alpaca column names → the ``alpaca`` template's fields."""
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools"}
"""LLaMA-Factory's sharegpt column names → the ``chat`` template's fields (its default messages
column is ``conversations``)."""
TAG_ROLES = {
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "assistant",
    "system_tag": "system",
}
"""LLaMA-Factory's sharegpt role tags → the roles the chat template sees."""
READ = {"file_name", "hf_hub_url", "formatting", "columns", "tags", "subset", "split"}
"""The entry keys read; any other (``ranking``, ``images``, ``ms_hub_url``...) is refused."""


def expand(spec: dict[str, Any], base_dir: Path, key: str) -> dict[str, Any]:
    """``spec`` (a dataset mapping of the config) with its ``dataset_info`` entry expanded into
    rayjobs keys (the keys ``spec`` sets itself win; ``column_map`` and ``roles`` merged);
    ``spec`` as it is without ``dataset_info``. ``dataset_info`` is ``PATH`` (the entry named
    as the dataset) or ``PATH#ENTRY``, relative to ``base_dir`` (the config's folder).

    Raises:
        ConfigError: naming ``key`` (``datasets.N``) and the file: a missing file or entry, an
            entry key or formatting rayjobs does not read.
    """
    given = spec.get("dataset_info") if isinstance(spec, dict) else None
    if given is None:
        return spec
    if not isinstance(given, str) or not given:
        raise ConfigError(f"{key}.dataset_info: expected PATH or PATH#ENTRY, got {given!r:.80}")
    path, _, entry_name = given.partition("#")
    entry_name = entry_name or spec.get("name")
    file = Path(path) if os.path.isabs(path) else base_dir / path
    where = f"{key}.dataset_info ({file}"
    try:
        registry = json.loads(file.read_text())
    except OSError as error:
        raise ConfigError(f"{where}): cannot read it ({error.strerror})") from None
    except ValueError as error:
        raise ConfigError(f"{where}): not valid JSON ({error})") from None
    if not isinstance(registry, dict) or entry_name not in registry:
        known = sorted(registry) if isinstance(registry, dict) else []
        raise ConfigError(
            f"{where}): no entry {entry_name!r}; it has {known[:20]} (name the entry as the "
            "dataset's name, or write dataset_info: PATH#ENTRY)"
        )
    entry = registry[entry_name]
    where = f"{where}, entry {entry_name!r})"
    unread = sorted(set(entry) - READ)
    if unread:
        raise ConfigError(
            f"{where}: {unread} not supported (rayjobs reads {sorted(READ)}); define the "
            "dataset with rayjobs' own keys (docs/data.md)"
        )
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"{where}: formatting {formatting!r}: alpaca or sharegpt")
    expanded: dict[str, Any] = {"template": "alpaca" if formatting == "alpaca" else "chat"}
    if "file_name" in entry:
        folder = os.path.dirname(path)
        expanded["source"] = (
            os.path.join(folder, entry["file_name"]) if folder else entry["file_name"]
        )
    elif "hf_hub_url" in entry:
        expanded |= {"source": entry["hf_hub_url"], "format": "hf"}
        expanded |= {k: entry[k] for k in ("subset", "split") if k in entry}
    else:
        raise ConfigError(f"{where}: neither file_name nor hf_hub_url")
    fields = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    columns = entry.get("columns") or {}
    unknown = sorted(set(columns) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: columns {unknown} not supported with formatting {formatting} (it reads "
            f"{sorted(fields)})"
        )
    column_map = {fields[name]: column for name, column in columns.items() if column}
    column_map = {field: column for field, column in column_map.items() if field != column}
    if formatting == "sharegpt" and column_map.get("conversations") == "messages":
        del column_map["conversations"]  # the chat template reads a messages column as it is
    tags = entry.get("tags") or {}
    message_keys = {}
    if "role_tag" in tags or "content_tag" in tags:  # LLaMA-Factory's defaults: from, value
        message_keys = {
            "role": tags.get("role_tag", "from"),
            "content": tags.get("content_tag", "value"),
        }
    roles = {tags[tag]: role for tag, role in TAG_ROLES.items() if tag in tags}
    merged = {"column_map": column_map, "message_keys": message_keys, "roles": roles}
    for name, found in merged.items():
        if found or spec.get(name):
            expanded[name] = found | (spec.get(name) or {})
    return expanded | {k: v for k, v in spec.items() if k not in merged}


def expand_all(raw: Any, base_dir: Path) -> Any:
    """The config mapping ``raw`` with every dataset of ``datasets`` and ``eval.datasets`` that
    names a ``dataset_info`` entry expanded (``expand``)."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    if isinstance(raw.get("datasets"), list):
        out["datasets"] = [
            expand(spec, base_dir, f"datasets.{i}") for i, spec in enumerate(raw["datasets"])
        ]
    held_out = raw.get("eval")
    if isinstance(held_out, dict) and isinstance(held_out.get("datasets"), list):
        out["eval"] = held_out | {
            "datasets": [
                expand(spec, base_dir, f"eval.datasets.{i}")
                for i, spec in enumerate(held_out["datasets"])
            ]
        }
    return out
