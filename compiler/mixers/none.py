"""No mixer: a layer that is its FFN alone (NemotronH's MLP layers).

    x [B, L, D] -> (nothing: the block skips the mixer sub-layer and its residual)

`absent = True` tells the block (compiler/block.py) to run no mixer; the layer's one norm is then
the one before the FFN, kept at `mixer_norm` (a one-sub-layer layer keeps its norm there whichever
sub-layer it has, so checkpoint rules name one path per layer). No attention weights, no cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contracts import CacheField, KindSpec, Mixer
from ..registry import register


@register("mixer", "none")
class NoMixer(Mixer):
    """The absent mixer; its entry points are never called by a block (they return zeros if asked)."""

    absent = True

    @dataclass
    class Spec(KindSpec):
        kind: str = "none"

    def __init__(self, spec: "NoMixer.Spec", model):
        super().__init__()

    def rope_dims(self) -> list[int]:
        return []

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {}

    def attention_flops(self, context):
        return 0 * context

    def shard(self, plan) -> bool:
        """Nothing to split, nothing to reduce."""
        return False

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """Nothing mixes here: no statistics."""
        return {}

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        return torch.zeros_like(x)

    decode = prefill

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        return torch.zeros_like(x)
