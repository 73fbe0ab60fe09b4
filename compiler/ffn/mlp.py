"""The non-gated MLP (GPT-2, OPT, GPT-NeoX, Falcon, Phi-1/2, StarCoder 2, Persimmon):

    x [..., D] -> w1 [F, D] -> act -> w2 [D, F] -> [..., D]

The activation is data (`activation`, a name in ACTIVATIONS, or in LEARNED_ACTIVATIONS for one
with weights of its own: Apertus's xIELU); both projections carry a bias unless `bias: false`
(transformers' names for each activation are the import maps' business).
"""
from __future__ import annotations

import math
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


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010), elementwise with two learned scalars per MLP:
    x > 0: a_p x^2 + beta x;  else: (expm1(min(x, eps)) - x) a_n + beta x,
    a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n). beta and eps are transformers'
    constants (XIELUActivation's defaults, which Apertus always builds).
    x [..., F] -> [..., F]"""

    BETA, EPS = 0.5, -1e-6

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        # transformers' initial a_p = 0.8 and a_n = 0.8 (softplus inverses)
        self.alpha_p.data.fill_(math.log(math.expm1(0.8)))
        self.alpha_n.data.fill_(math.log(math.expm1(0.8 - self.BETA)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.BETA + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.BETA * x,
                           (torch.expm1(x.clamp(max=self.EPS)) - x) * alpha_n + self.BETA * x)


# name -> module class, for activations with weights (loaded with the MLP's: ffn.act.*)
LEARNED_ACTIVATIONS: dict[str, type[nn.Module]] = {"xielu": XIELU}


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
            if self.activation not in ACTIVATIONS and self.activation not in LEARNED_ACTIVATIONS:
                return f"activation={self.activation!r}: expected one of {list(ACTIVATIONS) + list(LEARNED_ACTIVATIONS)}"
            return None if self.ffn_dim > 0 else f"ffn_dim must be positive, got {self.ffn_dim}"

    def __init__(self, spec: "MLP.Spec", model):
        super().__init__()
        self.ffn_dim = spec.ffn_dim
        learned = LEARNED_ACTIVATIONS.get(spec.activation)
        self.act = learned() if learned is not None else ACTIVATIONS[spec.activation]
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
