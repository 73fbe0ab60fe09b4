"""Normalisation layers: RMSNorm (plain or zero-centred weight) and LayerNorm."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..contracts import KindSpec, Norm
from ..errors import ConfigError
from ..registry import lookup, register


@register("norm", "rmsnorm")
class RMSNorm(Norm):
    """y = x / rms(x) * w (or * (1 + w) when zero_centered; no weight when affine is false:
    NanoChat's, Llama 4's L2 norm), computed in float32.

    x: [..., D] -> [..., D]
    """

    @dataclass
    class Spec(KindSpec):
        kind: str = "rmsnorm"
        eps: float = 1e-6
        zero_centered: bool = False  # checkpoint stores w - 1 (Qwen3-Next)
        affine: bool = True  # false: no weight (x / rms(x) alone)

        def check(self, model: dict):
            if not self.affine and self.zero_centered:
                return "zero_centered=true needs affine=true (an RMSNorm without weight has none to centre)"
            return None

    def __init__(self, spec: "RMSNorm.Spec", dim: int):
        super().__init__()
        self.eps = spec.eps
        self.zero_centered = spec.zero_centered
        self.weight = nn.Parameter(torch.empty(dim)) if spec.affine else None

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return y.to(x.dtype)
        if self.zero_centered:
            # the reference scales in float32, then casts back
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


@register("norm", "layernorm")
class LayerNorm(Norm):
    """LayerNorm, computed in float32: with weight and bias (GPT-2, OPT), weight only (`bias:
    false`; Cohere, StableLM 2's q/k norms) or neither (`affine: false`; OLMo's non-parametric
    norm); `zero_centered`: the scale is 1 + weight (Nemotron's LayerNorm1P).
    x: [..., D] -> [..., D]"""

    @dataclass
    class Spec(KindSpec):
        kind: str = "layernorm"
        eps: float = 1e-6
        bias: bool = True
        affine: bool = True  # false: no weight and no bias
        zero_centered: bool = False  # checkpoint stores w - 1 (Nemotron's LayerNorm1P)

        def check(self, model: dict):
            if not self.affine and self.bias:
                return "bias=true needs affine=true (a non-parametric LayerNorm has neither weight nor bias)"
            if not self.affine and self.zero_centered:
                return "zero_centered=true needs affine=true (a non-parametric LayerNorm has no weight)"
            return None if self.eps > 0 else f"eps must be positive, got {self.eps}"

    def __init__(self, spec: "LayerNorm.Spec", dim: int):
        super().__init__()
        self.eps = spec.eps
        self.weight = nn.Parameter(torch.empty(dim)) if spec.affine else None
        self.bias = nn.Parameter(torch.empty(dim)) if spec.bias else None
        self.zero_centered = spec.zero_centered

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        if self.zero_centered:
            w = 1.0 + w
        b = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), x.shape[-1:], w, b, self.eps).to(x.dtype)


def weightless(spec):
    """The same norm kind without learned parameters (a q/k norm that carries no weight: Llama 4's
    L2 norm is an RMSNorm without weight). A kind without an `affine` field (a plugin's) has no
    such form: refused by name rather than built with a weight nobody loads."""
    if not hasattr(spec, "affine"):
        raise ConfigError(f"norm: kind {spec.kind!r} has no `affine` field, so it has no form without weight; "
                          f"qk_norm_affine=false builds the model's norm kind without weight (give the kind an "
                          f"`affine: bool` field, or keep qk_norm_affine=true)")
    return replace(spec, affine=False, **{k: False for k in ("zero_centered", "bias") if hasattr(spec, k)})


def make_norm(spec, dim: int) -> nn.Module:
    return lookup("norm", spec.kind, "norm")(spec, dim)
