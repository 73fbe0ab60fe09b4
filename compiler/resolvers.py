"""zoo's OmegaConf resolvers: `${zoo.sqrt:${dim}}` in presets (Gemma's embed_scale follows dim
when an import changes it) and `${zoo.add:...}`, `zoo.mul`, `zoo.div`, `zoo.or`, `zoo.not`, `zoo.eq` in
checkpoint rule files. OmegaConf keeps resolvers in one registry per process, so they are
registered on first use (compose, validate, rule loading), not as a side effect of an import.
"""
from __future__ import annotations

import math

from omegaconf import OmegaConf


def _exact_div(a: int, b: int) -> int:
    if not b or a % b:
        raise ValueError(f"zoo.div: {a} is not a multiple of {b}")
    return a // b


RESOLVERS = {
    "zoo.sqrt": lambda x: float(x) ** 0.5,
    "zoo.not": lambda x: not x,
    "zoo.eq": lambda a, b: a == b,  # a rule's `when` on a config choice (Falcon's residual.parallel)
    "zoo.add": lambda *xs: sum(xs),
    # first argument that is set (not null/0/false), e.g. n_kv_heads or else n_heads
    "zoo.or": lambda *xs: next((x for x in xs if x), xs[-1]),
    "zoo.mul": lambda *xs: math.prod(xs),
    "zoo.div": _exact_div,  # exact integer division
}


def register_resolvers() -> None:
    """Register every zoo.* resolver that is not registered yet (idempotent, cheap)."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
