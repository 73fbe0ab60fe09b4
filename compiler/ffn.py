"""Dense feed-forward networks. SwiGLU: y = w2(silu(x w1) * (x w3)), with w1|w3 fused as w13."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .registry import register


@register("ffn", "swiglu")
class SwiGLU(nn.Module):
    """x [..., D] -> [..., D]. w13 [2F, D] holds the gate rows (w1) then the up rows (w3)."""

    @dataclass
    class Spec:
        kind: str = "swiglu"
        ffn_dim: int = "???"  # type: ignore[assignment]
        bias: bool = False

        def check(self, model: dict) -> Optional[str]:
            return None if self.ffn_dim > 0 else f"ffn_dim must be positive, got {self.ffn_dim}"

    def __init__(self, spec: "SwiGLU.Spec", model):
        super().__init__()
        self.ffn_dim = spec.ffn_dim
        self.w13 = nn.Linear(model.dim, 2 * spec.ffn_dim, bias=spec.bias)
        self.w2 = nn.Linear(spec.ffn_dim, model.dim, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        return self.w2(F.silu(gate) * up)

    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self(x)

    decode = prefill
