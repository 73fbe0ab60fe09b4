"""Kinds outside the package: where the modules that register them are named.

A kind zoo does not ship is a class in the user's own module, registered with
`@register(slot, kind)` (registry.py) exactly as a built-in one is. Two places name such modules,
and the registry imports each once, before it answers its first lookup:

    entry points   the group `zoo.kinds` of an installed distribution (its entry_points.txt):
                       [zoo.kinds]
                       lab_norms = lab_kinds.norms      # each value a module (no `:attr`)
    plugins.yaml   in the user conf dir (conf_root.py): `plugins: [lab_kinds.norms, ...]`,
                   module names importable from sys.path

Nothing is guessed or skipped: a bad plugins.yaml, a module that fails to import or registers
no kind, and a kind that breaks its slot's contract or takes a built-in kind's name are each a
PluginError naming where the module was named, the module and what is wrong (registry.py imports
and checks). Configs name kinds, never modules: a checkpoint's config.json and every conf file
but plugins.yaml still cannot import anything (docs/security.md).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .conf_root import user_conf_dir
from .errors import PluginError

GROUP = "zoo.kinds"  # the entry-point group
PLUGINS_FILE = "plugins.yaml"  # in the user conf dir; config.conf_files does not take it for a preset


@dataclass(frozen=True)
class Plugin:
    """A module to import, and where it was named (how errors name it)."""

    module: str
    origin: str


def plugins_file() -> Path:
    return user_conf_dir() / PLUGINS_FILE


def discovery_key() -> tuple:
    """What discover() reads, cheaply: the import path (entry points are found on it) and the
    plugins file's identity. The registry asks again when it changes (a process that sets
    $ZOO_CONF_DIR or extends sys.path after its first lookup)."""
    path = plugins_file()
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    return tuple(sys.path), str(path), stamp


def discover() -> list[Plugin]:
    """Every plugin module, entry points first, then plugins.yaml's list; a module named twice is
    imported once (under its first origin)."""
    found: dict[str, Plugin] = {}
    for plugin in [*entry_point_plugins(), *conf_plugins(plugins_file())]:
        found.setdefault(plugin.module, plugin)
    return list(found.values())


def entry_point_plugins() -> list[Plugin]:
    out = []
    for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unnamed distribution"
        origin = f"entry point {ep.name} = {ep.value} (group {GROUP}, distribution {dist})"
        if ep.attr:  # `module:attr` would name an object to call; a plugin is a module to import
            raise PluginError(f"{origin}: the value names {ep.attr!r} inside {ep.module!r}; expected a module "
                              f"name (importing it registers its kinds), e.g. {ep.name} = {ep.module}")
        out.append(Plugin(_module_name(ep.value, origin), origin))
    return out


def conf_plugins(path: Path) -> list[Plugin]:
    """plugins.yaml's `plugins:` list ([] when the file is absent)."""
    import yaml

    if not path.is_file():
        return []
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PluginError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict) or set(data) - {"plugins"}:
        extra = sorted(map(str, set(data) - {"plugins"})) if isinstance(data, dict) else data
        raise PluginError(f"{path}: expected a mapping with the one key `plugins` (a list of module names), "
                          f"got {extra!r}")
    names = data.get("plugins") or []
    if not isinstance(names, list):
        raise PluginError(f"{path}: plugins = {names!r}: expected a list of module names")
    return [Plugin(_module_name(name, f"{path}: plugins[{i}]"), f"{path}: plugins[{i}] {name!r}")
            for i, name in enumerate(names)]


def _module_name(name: object, origin: str) -> str:
    if not isinstance(name, str) or not name or not all(part.isidentifier() for part in name.split(".")):
        raise PluginError(f"{origin}: {name!r} is not a module name; expected a dotted Python module name "
                          f"such as lab_kinds.norms")
    return name
