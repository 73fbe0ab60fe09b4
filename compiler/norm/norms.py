"""Normalisation layers: RMSNorm (plain or zero-centred weight) and LayerNorm."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..contracts import KindSpec, Norm
from ..registry import lookup, register


@register("norm", "rmsnorm")
class RMSNorm(Norm):
    """y = x / rms(x) * w (or * (1 + w) when zero_centered), computed in float32.

    x: [..., D] -> [..., D]
    """

    @dataclass
    class Spec(KindSpec):
        kind: str = "rmsnorm"
        eps: float = 1e-6
        zero_centered: bool = False  # checkpoint stores w - 1 (Qwen3-Next)

    def __init__(self, spec: "RMSNorm.Spec", dim: int):
        super().__init__()
        self.eps = spec.eps
        self.zero_centered = spec.zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            # the reference scales in float32, then casts back
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


@register("norm", "layernorm")
class LayerNorm(Norm):
    """Standard LayerNorm with weight and bias, computed in float32. x: [..., D] -> [..., D]"""

    @dataclass
    class Spec(KindSpec):
        kind: str = "layernorm"
        eps: float = 1e-6

    def __init__(self, spec: "LayerNorm.Spec", dim: int):
        super().__init__()
        self.eps = spec.eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def make_norm(spec, dim: int) -> nn.Module:
    return lookup("norm", spec.kind, "norm")(spec, dim)
