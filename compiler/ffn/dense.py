"""Dense feed-forward networks. SwiGLU: y = w2(act(x w1) * (x w3)), with w1|w3 fused as w13.

`activation` is the gate's: silu (SwiGLU) or gelu_tanh (GeGLU with the tanh approximation, Gemma).
`swiglu_limit` (DeepSeek-V4, gpt-oss) clamps the pre-activations first: the gate from above at
+limit, the up projection to [-limit, limit]. gpt-oss's variant (MoE experts, see moe.py) also
sharpens the gate, gate * sigmoid(alpha * gate), and offsets the up projection: (up + 1).
µP multipliers (Falcon-H1's mlp_multipliers): `gate_scale` on the gate pre-activation, `out_scale`
on w2's output: y = out_scale * w2(act(gate_scale * x w1) * (x w3)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..activation import swiglu
from ..contracts import FFN, KindSpec, span
from ..registry import register


ACTIVATIONS = ("silu", "gelu_tanh")


@register("ffn", "swiglu")
class SwiGLU(FFN):
    """x [..., D] -> [..., D]. w13 [2F, D] holds the gate rows (w1) then the up rows (w3)."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "swiglu"
        ffn_dim: int = "???"  # type: ignore[assignment]
        bias: bool = False
        swiglu_limit: Optional[float] = None  # clamp gate <= limit, up to [-limit, limit] (DeepSeek-V4)
        activation: str = "silu"  # the gate's: silu | gelu_tanh (GeGLU, Gemma)
        gate_scale: float = 1.0  # on the gate pre-activation (µP, Falcon-H1)
        out_scale: float = 1.0  # on the output (µP, Falcon-H1)

        def check(self, model: dict) -> Optional[str]:
            if self.activation not in ACTIVATIONS:
                return f"activation={self.activation!r}: expected one of {list(ACTIVATIONS)}"
            if self.swiglu_limit is not None and self.swiglu_limit <= 0:
                return f"swiglu_limit must be positive (or null), got {self.swiglu_limit}"
            return None if self.ffn_dim > 0 else f"ffn_dim must be positive, got {self.ffn_dim}"

    def __init__(self, spec: "SwiGLU.Spec", model):
        super().__init__()
        self.ffn_dim = spec.ffn_dim
        self.limit = spec.swiglu_limit
        self.activation = spec.activation
        self.gate_scale, self.out_scale = float(spec.gate_scale), float(spec.out_scale)
        self.w13 = nn.Linear(model.dim, 2 * spec.ffn_dim, bias=spec.bias)
        self.w2 = nn.Linear(spec.ffn_dim, model.dim, bias=spec.bias)

    def shard(self, plan, parts: int | None = None) -> bool:
        """Column-parallel w13 (its gate and up rows each split), row-parallel w2: F split `parts`
        ways (default tp); the output is then a partial sum."""
        parts = plan.mesh.tp if parts is None else parts
        if parts == 1:
            return False
        F_ = self.ffn_dim
        f = plan.units(F_, "ffn_dim", parts=parts)
        plan.column(self.w13, [f, span(F_, f, 1)])
        plan.row(self.w2, [f])
        self.ffn_dim = f[1] - f[0]
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        if self.gate_scale != 1.0:
            gate = gate * self.gate_scale
        y = self.w2(swiglu(gate, up, self.limit, self.activation))
        return y * self.out_scale if self.out_scale != 1.0 else y

    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self(x)

    decode = prefill
