"""No FFN: a layer that is its mixer alone (Mamba, Mamba2, the SSM layers of hybrids such as
Jamba / NemotronH / Zamba2 whose FFN is a layer of its own).

    x [..., D] -> (nothing: the block skips the FFN sub-layer, its norm and its residual)

`absent = True` tells the block (compiler/block.py) to build no `ffn_norm` / `ffn_post_norm`
and to run no FFN residual, so the layer has exactly the mixer's and one norm's parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contracts import FFN, KindSpec
from ..registry import register


@register("ffn", "none")
class NoFFN(FFN):
    """The absent FFN; prefill / decode are never called by a block (they return zeros if asked)."""

    absent = True

    @dataclass
    class Spec(KindSpec):
        kind: str = "none"

    def __init__(self, spec: "NoFFN.Spec", model):
        super().__init__()

    def shard(self, plan) -> bool:
        """Nothing to split, nothing to reduce."""
        return False

    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        return torch.zeros_like(x)

    decode = prefill
