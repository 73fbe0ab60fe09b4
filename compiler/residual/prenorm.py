"""Residual connections around each mixer and FFN, and the model-level stream adapters.

A residual kind provides two modules (built from its spec and the model's BuildContext):
  connection: per block, `enter(h) -> (x, aux)` gives the sub-layer input, and
              `exit(h, y, aux) -> h` folds the sub-layer output back into the residual state.
  streams:    per model, `expand(h)` turns the embedding into the residual state and
              `collapse(h)` turns the last residual state into the final norm's input.
The plain pre-norm residual has one stream and no parameters (mhc.py has the n-stream kind):

    h ---------------------------+---> h + scale * y     (scale 1 but for Granite)
     `--> norm -> sub-layer -> y -'

With `parallel` the mixer and the FFN read the same block input and one update adds both
(block.py): h + mixer(norm1(h)) + ffn(norm2(h)), norm2 = norm1 under shared_norm (GPT-J, Phi-1/2,
Falcon-7B, Cohere), each its own under two_norms (GPT-NeoX, Falcon-40B's new architecture).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..contracts import KindSpec, Residual
from ..registry import lookup, register


PARALLEL = ("shared_norm", "two_norms")


class _Identity(nn.Module):
    def expand(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        return h


class _Add(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale

    def enter(self, h: torch.Tensor):
        return h, None

    def exit(self, h: torch.Tensor, y: torch.Tensor, aux) -> torch.Tensor:
        return h + y * self.scale if self.scale != 1.0 else h + y


@register("residual", "prenorm")
class PreNorm(Residual):
    @dataclass
    class Spec(KindSpec):
        kind: str = "prenorm"
        scale: float = 1.0  # h + scale * y (Granite's residual_multiplier)
        parallel: Optional[str] = None  # null (sequential) | shared_norm | two_norms

        def check(self, model: dict) -> Optional[str]:
            if self.parallel is not None and self.parallel not in PARALLEL:
                return f"parallel={self.parallel!r}: expected null or one of {list(PARALLEL)}"
            return None

    @staticmethod
    def parallel(spec) -> Optional[str]:
        return spec.parallel

    @staticmethod
    def n_streams(spec) -> int:
        return 1

    @staticmethod
    def connection(spec, ctx) -> nn.Module:
        return _Add(spec.scale)

    @staticmethod
    def model_streams(spec, ctx) -> nn.Module:
        return _Identity()


def residual_kind(spec):
    return lookup("residual", spec.kind, "residual")
