"""The non-gated MLP (GPT-2, OPT, GPT-NeoX, Falcon, Phi-1/2, StarCoder 2, Persimmon):

    x [..., D] -> w1 [F, D] -> act -> w2 [D, F] -> [..., D]

The activation is data (`activation`, a name in ACTIVATIONS); both projections carry a bias
unless `bias: false` (transformers' names for each activation are the import maps' business).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import FFN, KindSpec
from ..registry import register


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# name -> elementwise function, each as transformers' ACT2FN computes it
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # gelu_new, gelu_pytorch_tanh, gelu_fast
    "relu": F.relu,
    "relu2": _relu2,  # squared ReLU (Persimmon)
    "silu": F.silu,
}


@register("ffn", "mlp")
class MLP(FFN):
    """x [..., D] -> [..., D]: w2(act(w1 x + b1)) + b2."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "mlp"
        ffn_dim: int = "???"  # type: ignore[assignment]
        activation: str = "gelu"  # a name in ACTIVATIONS
        bias: bool = True

        def check(self, model: dict) -> Optional[str]:
            if self.activation not in ACTIVATIONS:
                return f"activation={self.activation!r}: expected one of {list(ACTIVATIONS)}"
            return None if self.ffn_dim > 0 else f"ffn_dim must be positive, got {self.ffn_dim}"

    def __init__(self, spec: "MLP.Spec", model):
        super().__init__()
        self.ffn_dim = spec.ffn_dim
        self.act = ACTIVATIONS[spec.activation]
        self.w1 = nn.Linear(model.dim, spec.ffn_dim, bias=spec.bias)
        self.w2 = nn.Linear(spec.ffn_dim, model.dim, bias=spec.bias)

    def shard(self, plan, parts: int | None = None) -> bool:
        """Column-parallel w1 (its bias split with it), row-parallel w2: F split `parts` ways
        (default tp); the output is then a partial sum."""
        parts = plan.mesh.tp if parts is None else parts
        if parts == 1:
            return False
        f = plan.units(self.ffn_dim, "ffn_dim", parts=parts)
        plan.column(self.w1, [f])
        plan.row(self.w2, [f])
        self.ffn_dim = f[1] - f[0]
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))

    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self(x)

    decode = prefill
