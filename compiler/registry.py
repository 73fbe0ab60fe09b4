"""Kind registry: `kind:` in a config node -> the module class that builds it.

A config names what it wants by `kind` (`mixer: {kind: gqa, ...}`); each concept module registers
its classes here with the dataclass `Spec` that validates the node. No `_target_` import paths:
configs cannot import or run anything.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from .errors import ConfigError

SLOTS = ("mixer", "ffn", "norm", "rope", "residual")
_REGISTRY: dict[str, dict[str, type]] = {slot: {} for slot in SLOTS}

T = TypeVar("T", bound=type)


def register(slot: str, kind: str) -> Callable[[T], T]:
    """Class decorator: make `cls` (which has a dataclass `cls.Spec`) buildable as `kind`."""

    def deco(cls: T) -> T:
        if kind in _REGISTRY[slot]:
            raise RuntimeError(f"{slot} kind {kind!r} registered twice")
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


def _import_components() -> None:
    # Importing the concept modules runs their @register decorators.
    from . import components  # noqa: F401
