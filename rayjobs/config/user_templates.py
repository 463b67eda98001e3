"""A config's ``template_modules``: the user's own templates, imported before the datasets that
name them are validated.

Each module is imported by name, from the config's folder first (a ``my_templates.py`` beside the
config), then from the installed packages, and must register at least one template with
``@register_template``, each declaring the ``fields`` it reads (``column_map`` and the unused-column
check rely on them) and taking ``(row, column_map, render_chat)``. A problem is a ``ConfigError``
naming ``template_modules.<index>``, before Ray starts. How the templates reach the Tokenize actors:
``rayjobs.data.stream.shipped_templates``; docs/data.md, "Your own templates".
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from rayjobs.data import templates
from rayjobs.errors import ConfigError


def import_template_modules(names: Any, base_dir: Path) -> None:
    """Import each of ``names`` (the config's ``template_modules``) and check what it registers.

    Raises:
        ConfigError: a name that is not a module name, a module not found or raising on import,
            one that registers no template, or a template without declared fields or whose
            function does not take ``(row, column_map, render_chat)``.
    """
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"template_modules: expected a list of module names, e.g. [my_templates], got "
            f"{names!r:.80}"
        )
    for index, name in enumerate(names):
        key = f"template_modules.{index}"
        module = _import(name, base_dir, key)
        own = [
            t
            for t in templates.TEMPLATES.values()
            if t.render.__module__ == name or t.render.__module__.startswith(f"{name}.")
        ]
        if not own:
            raise ConfigError(
                f"{key}: module {name!r} ({module.__file__}) registers no template; decorate a "
                "function with @register_template(name, fields=(...)) from rayjobs.data.templates"
            )
        for template in own:
            _check(template, key)


def _import(name: str, base_dir: Path, key: str) -> ModuleType:
    """``name`` imported with ``base_dir`` first on the path; a copy of it imported earlier from
    elsewhere (another config's folder) is imported anew from ``base_dir``."""
    top = name.split(".")[0]
    here = [p.resolve() for p in (base_dir / f"{top}.py", base_dir / top / "__init__.py")]
    cached = sys.modules.get(top)
    elsewhere = cached is not None and Path(getattr(cached, "__file__", "") or "").resolve()
    if elsewhere and elsewhere not in here and any(p.is_file() for p in here):
        for loaded in [m for m in sys.modules if m == top or m.startswith(f"{top}.")]:
            del sys.modules[loaded]
    folder = str(base_dir)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):
            raise ConfigError(
                f"{key}: no module {name!r} in the config's folder {base_dir} or among the "
                "installed packages"
            ) from None
        raise ConfigError(
            f"{key}: importing {name!r} failed: {error} (what a template module imports must "
            "be installed wherever the job runs)"
        ) from None
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises on import
        raise ConfigError(
            f"{key}: importing {name!r} raised {type(error).__name__}: {error}"
        ) from None
    finally:
        sys.path.remove(folder)


def _check(template: templates.Template, key: str) -> None:
    where = f"{key}: template {template.name!r} ({template.render.__module__})"
    if template.fields is None:
        raise ConfigError(
            f"{where} declares no fields; register it with fields=(...), the fields it reads "
            "(the keys column_map may map to the dataset's columns)"
        )
    try:
        inspect.signature(template.render).bind({}, {}, None)
    except TypeError as error:
        raise ConfigError(
            f"{where}: its function must take (row, column_map, render_chat) ({error})"
        ) from None
    except ValueError:  # a builtin or C function without a signature: not checked
        pass


def unshipped(names: list[str], working_dir: Path, shipped: Mapping[str, int]) -> list[str]:
    """What keeps ``template_modules`` (imported already) from a job submitted with
    ``working_dir``: the job's driver imports them again on the cluster, from the upload
    (``shipped``: its files, relative POSIX paths) or from the cluster's installed packages.

    Returns:
        One problem per module that lies outside the working directory and is no installed
        package, or whose file the upload leaves out.
    """
    problems = []
    for index, name in enumerate(names):
        file = Path(sys.modules[name].__file__ or "").resolve()
        key = f"template_modules.{index} ({name!r}, {file})"
        if any(part in ("site-packages", "dist-packages") for part in file.parts):
            continue  # installed: the cluster's image must have it, as rayjobs' dependencies
        try:
            relative = file.relative_to(working_dir).as_posix()
        except ValueError:
            problems.append(
                f"{key} lies outside the working directory {working_dir}; put it beside the "
                "config, or install it on the cluster"
            )
            continue
        if relative not in shipped:
            problems.append(
                f"{key} is left out of the upload ({relative}: a .gitignore, a .rayignore or "
                "rayjobs' excludes)"
            )
    return problems
