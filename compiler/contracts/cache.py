"""What a mixer keeps between steps: its cache fields, and the plan of every layer's.

Every mixer declares its cache as named fields (`CacheField`, Mixer.cache_fields): a shape at
(max_batch, max_seq), a dtype, and whether it grows with tokens (a KV cache) or is a constant
per-sequence state (a recurrent state). The engine allocates the plan once (engine/cache.py) and
passes the per-layer dicts to the graphs, which update them in place. Nothing is attached to modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class CacheField:
    """One cache tensor of one layer.

    shape: full shape at (max_batch, max_seq), batch first.
    grows: True if it holds one slot per token (bytes per token), False for constant state.
    token_axis: the axis of a growing field whose index is the position (slot p holds token p),
        so that the first n tokens of a row are the slice [:n] there (a prefix store copies only
        those); None: no such axis (the field is copied whole).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    grows: bool
    token_axis: Optional[int] = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CachePlan:
    """The caches of every layer: layers[i] maps field name -> CacheField."""

    layers: tuple[dict[str, CacheField], ...]
    max_batch: int
    max_seq: int

    def bytes_per_token(self) -> int:
        """Bytes added per token per sequence by all caches that grow with context."""
        total = sum(f.nbytes for layer in self.layers for f in layer.values() if f.grows)
        return total // (self.max_batch * self.max_seq)

    def state_bytes_per_sequence(self) -> int:
        """Constant bytes per sequence (recurrent state, conv state), independent of context."""
        total = sum(f.nbytes for layer in self.layers for f in layer.values() if not f.grows)
        return total // self.max_batch

    def total_bytes(self) -> int:
        return sum(f.nbytes for layer in self.layers for f in layer.values())

    def allocate(self, device) -> list[dict[str, torch.Tensor]]:
        """Zeroed tensors, one dict per layer."""
        return [{name: torch.zeros(f.shape, dtype=f.dtype, device=device) for name, f in layer.items()}
                for layer in self.layers]
