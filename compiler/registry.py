"""Kind registry: `kind:` in a config node -> the module class that builds it.

A config names what it wants by `kind` (`mixer: {kind: gqa, ...}`); each concept module registers
its classes here with the dataclass `Spec` that validates the node. No `_target_` import paths:
configs cannot import or run anything.

Kinds outside the package register the same way, from the modules plugins.py discovers (an
entry point of the group `zoo.kinds`, the user conf dir's plugins.yaml): the registry imports
them after its own folders, before it answers a lookup. Every kind is checked against its
slot's contract when it registers (contracts.contract_problems); a kind from outside the package
also needs a Spec OmegaConf reads as a schema, and may not take a built-in kind's name.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from typing import Callable, TypeVar

from . import plugins
from .errors import ConfigError, ContractError, PluginError

SLOTS = ("mixer", "ffn", "norm", "rope", "residual")
_REGISTRY: dict[str, dict[str, type]] = {slot: {} for slot in SLOTS}

T = TypeVar("T", bound=type)


def register(slot: str, kind: str) -> Callable[[T], T]:
    """Class decorator: make `cls` buildable as `kind` in `slot`; `cls` must meet the slot's
    contract (compiler/contracts/slots.py), checked here, and a class from outside zoo's
    package may not take a built-in kind's name (no silent replacement)."""

    def deco(cls: T) -> T:
        from .contracts import contract_problems

        where = f"{cls.__module__}.{cls.__qualname__}"
        if slot not in _REGISTRY:
            raise ContractError(f"{where}: unknown slot {slot!r} for kind {kind!r}; expected one of {list(SLOTS)}")
        if not _builtin(cls):
            _import_components()  # the built-in kinds first, so a clash is found whatever imports first
        if kind in _REGISTRY[slot]:
            other = _REGISTRY[slot][kind]
            if _builtin(other) and not _builtin(cls):
                raise ContractError(f"{slot} kind {kind!r} ({where}) has the name of a built-in {slot} kind "
                                    f"({other.__module__}.{other.__qualname__}); a kind from outside zoo may not "
                                    f"replace a built-in one: register it under another name")
            raise ContractError(f"{slot} kind {kind!r} registered twice ({other.__module__} and {cls.__module__})")
        problems = contract_problems(slot, cls, kind)
        if not problems and not _builtin(cls):  # a built-in's schema is read by its shipped configs
            problems = _schema_problems(cls.Spec)  # (tests/test_contracts.py), not at each start-up
        if problems:
            raise ContractError(f"{slot} kind {kind!r} ({where}) {'; '.join(problems)}")
        cls.kind = kind
        _REGISTRY[slot][kind] = cls
        return cls

    return deco


def _builtin(cls: type) -> bool:
    """A kind shipped in zoo's compiler package (its module is one of the package's)."""
    return cls.__module__.startswith(f"{__package__}.")


def _schema_problems(spec: type) -> list[str]:
    """The Spec is read as an OmegaConf structured schema (spec.py): a field type OmegaConf cannot
    hold would otherwise fail at the first config that names the kind."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.structured(spec)
    except (OmegaConfBaseException, ValueError) as e:
        return [f"its Spec is no valid config schema ({str(e).splitlines()[0]})"]
    return []


def lookup(slot: str, kind: object, where: str) -> type:
    """The class registered for `kind` in `slot`; `where` (a config key path) names the node."""
    _import_components()
    known = _REGISTRY[slot]
    if not isinstance(kind, str) or kind not in known:
        raise ConfigError(
            f"{where}.kind: unknown {slot} kind {kind!r}; expected one of {sorted(known)}"
        )
    return known[kind]


def kinds(slot: str) -> list[str]:
    _import_components()
    return sorted(_REGISTRY[slot])


def registered(slot: str) -> dict[str, type]:
    """kind -> class for every kind of `slot`."""
    _import_components()
    return dict(_REGISTRY[slot])


# the concept folders, one per slot; a kind is a module in its folder
FOLDERS = {"mixer": "mixers", "ffn": "ffn", "norm": "norm", "rope": "position", "residual": "residual"}


def register_folder(package: str, path) -> None:
    """Import every module of a concept folder (called from its __init__): each module's
    @register decorators run, so adding a kind is adding one file."""
    for info in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{info.name}")


def _import_components() -> None:
    for folder in FOLDERS.values():
        importlib.import_module(f"{__package__}.{folder}")
    _import_plugins()


class _Plugins:
    key: tuple | None = None  # plugins.discovery_key() of the last complete import
    loading = False  # a plugin's own import asks for the registry: no second pass inside it
    imported: dict[str, str] = {}  # module -> where it was named


_LOCK = threading.RLock()  # one thread imports; another looking up meanwhile waits for its kinds


def _import_plugins() -> None:
    """Import every plugin module plugins.py names (once each; again only when what it reads
    changed), each under _import_plugin's checks."""
    key = plugins.discovery_key()
    if key == _Plugins.key:
        return
    with _LOCK:
        if _Plugins.loading or key == _Plugins.key:
            return  # a plugin's own import (re-entering on this thread), or another thread did it
        _import_plugins_locked(key)


def _import_plugins_locked(key: tuple) -> None:
    _Plugins.loading = True
    try:
        for plugin in plugins.discover():
            if plugin.module not in _Plugins.imported:
                _import_plugin(plugin)
                _Plugins.imported[plugin.module] = plugin.origin
        _Plugins.key = key
    finally:
        _Plugins.loading = False


def _import_plugin(plugin: "plugins.Plugin") -> None:
    """Import one plugin module: its kinds register (and are checked) as it runs. A failure
    takes back the kinds it registered before failing and names the plugin; a module that
    registers no kind is an error too (a forgotten decorator, a wrong module name)."""
    before = {slot: set(kinds) for slot, kinds in _REGISTRY.items()}
    fresh = plugin.module not in sys.modules
    try:
        importlib.import_module(plugin.module)
    except BaseException as e:
        for slot, kinds in _REGISTRY.items():
            for kind in set(kinds) - before[slot]:
                del kinds[kind]
        if isinstance(e, ContractError):
            raise PluginError(f"{plugin.origin}: module {plugin.module!r}: {e}") from e
        if isinstance(e, PluginError):
            raise
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt, SystemExit: not the plugin's error
        raise PluginError(f"{plugin.origin}: importing module {plugin.module!r} failed: "
                          f"{type(e).__name__}: {e}") from e
    added = any(set(kinds) - before[slot] for slot, kinds in _REGISTRY.items())
    if fresh and not added:
        sys.modules.pop(plugin.module, None)  # as a failed import is: the next pass fails the same way
        raise PluginError(f"{plugin.origin}: module {plugin.module!r} registered no kind; a plugin module "
                          f"registers its classes with @zoo.compiler.registry.register(slot, kind) when imported")
