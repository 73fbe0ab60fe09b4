"""Cache plan of a built model: each layer's mixer is asked for its fields (contracts/cache.py),
allocated once, passed to the graphs as data."""
from __future__ import annotations

import torch

from ..contracts.cache import CachePlan


def plan_caches(model, max_batch: int, max_seq: int, dtype: torch.dtype) -> CachePlan:
    """Ask each layer's mixer for its cache fields (works on a meta-device model)."""
    return CachePlan(
        layers=tuple(block.mixer.cache_fields(max_batch, max_seq, dtype) for block in model.layers),
        max_batch=max_batch, max_seq=max_seq,
    )
