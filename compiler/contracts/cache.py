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

from ..errors import ContractError


@dataclass(frozen=True)
class CacheField:
    """One cache tensor of one layer.

    shape: full shape at (max_batch, max_seq), batch first.
    grows: True if it holds one slot per token (bytes per token), False for constant state.
    token_axis: the axis of a growing field whose index is the position (slot p holds token p),
        so that the first n tokens of a row are the slice [:n] there (a prefix store copies only
        those); None: no such axis (the field is copied whole).
    alias_of: the index of an earlier layer whose field of the same name this one is (KV shared
        across layers, Gemma 3n / 4): allocated once, there, and read here; it holds no bytes of
        its own, and row operations act on it through that layer.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    grows: bool
    token_axis: Optional[int] = None
    alias_of: Optional[int] = None

    @property
    def nbytes(self) -> int:
        if self.alias_of is not None:
            return 0  # layer alias_of holds the bytes
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
        """Zeroed tensors, one dict per layer; an aliased field is its source layer's tensor."""
        out: list[dict[str, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            out.append({})
            for name, f in layer.items():
                if f.alias_of is None:
                    out[i][name] = torch.zeros(f.shape, dtype=f.dtype, device=device)
                    continue
                src = self.layers[f.alias_of].get(name) if 0 <= f.alias_of < i else None
                if src is None or src.alias_of is not None or (src.shape, src.dtype) != (f.shape, f.dtype):
                    raise ContractError(f"cache plan: layers[{i}].{name} aliases layers[{f.alias_of}].{name}, which "
                                     f"is not an earlier layer's own field of shape {list(f.shape)} {f.dtype} "
                                     f"(got {src})")
                out[i][name] = out[f.alias_of][name]
        return out

    def own_fields(self, i: int) -> dict[str, CacheField]:
        """layers[i]'s fields without its aliases (what a row operation copies for that layer)."""
        return {name: f for name, f in self.layers[i].items() if f.alias_of is None}
