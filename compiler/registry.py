"""Kind registry: `kind:` in a config node -> the module class that builds it.

A config names what it wants by `kind` (`mixer: {kind: gqa, ...}`); each concept module registers
its classes here with the dataclass `Spec` that validates the node. No `_target_` import paths:
configs cannot import or run anything.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, TypeVar

from .errors import ConfigError, ContractError

SLOTS = ("mixer", "ffn", "norm", "rope", "residual")
_REGISTRY: dict[str, dict[str, type]] = {slot: {} for slot in SLOTS}

T = TypeVar("T", bound=type)


def register(slot: str, kind: str) -> Callable[[T], T]:
    """Class decorator: make `cls` buildable as `kind` in `slot`; `cls` must meet the slot's
    contract (compiler/contracts/slots.py), checked here."""

    def deco(cls: T) -> T:
        from .contracts import contract_problems

        if kind in _REGISTRY[slot]:
            raise ContractError(f"{slot} kind {kind!r} registered twice ({_REGISTRY[slot][kind].__module__} "
                                f"and {cls.__module__})")
        problems = contract_problems(slot, cls)
        if problems:
            raise ContractError(f"{slot} kind {kind!r} ({cls.__module__}.{cls.__qualname__}) "
                                f"{'; '.join(problems)}")
        cls.kind = kind
        _REGISTRY[slot][kind] = cls
        return cls

    return deco


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
