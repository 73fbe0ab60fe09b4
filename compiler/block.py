"""One decoder layer, the same attribute paths whatever its kinds (see glossary.py).

    Block:  h -> mixer_residual(mixer_norm -> mixer) -> ffn_residual(ffn_norm -> ffn) -> h

Two entry points, `prefill` and `decode`, call the same-named entry points of the mixer and FFN:
the entry point decides the algorithm, never the sequence length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .norm.norms import make_norm
from .registry import lookup
from .residual.prenorm import residual_kind
from .spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class BuildContext:
    """What a module may read from the model while it is built."""

    spec: ModelSpec
    rope_impl: Any

    @property
    def dim(self) -> int:
        return self.spec.dim


class Block(nn.Module):
    def __init__(self, layer: LayerSpec, ctx: BuildContext):
        super().__init__()
        spec = ctx.spec
        res = residual_kind(spec.residual)
        self.mixer_norm = make_norm(spec.norm, spec.dim)
        self.mixer = lookup("mixer", layer.mixer.kind, f"mixers.{layer.mixer_name}")(layer.mixer, ctx)
        self.ffn_norm = make_norm(spec.norm, spec.dim)
        self.ffn = lookup("ffn", layer.ffn.kind, f"ffns.{layer.ffn_name}")(layer.ffn, ctx)
        self.mixer_residual = res.connection(spec.residual, ctx)
        self.ffn_residual = res.connection(spec.residual, ctx)
        # under tensor/expert parallelism a sharded sub-layer's output is a partial sum; the
        # sharding driver (parallel/plan.py) sets an all-reduce here, one per such sub-layer
        self.mixer_reduce: nn.Module | None = None
        self.ffn_reduce: nn.Module | None = None

    def _mixed(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.mixer_reduce is None else self.mixer_reduce(y)

    def _fed(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.ffn_reduce is None else self.ffn_reduce(y)

    def prefill(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] -> same shape."""
        x, aux = self.mixer_residual.enter(h)
        h = self.mixer_residual.exit(h, self._mixed(self.mixer.prefill(self.mixer_norm(x), cache, ctx)), aux)
        x, aux = self.ffn_residual.enter(h)
        return self.ffn_residual.exit(h, self._fed(self.ffn.prefill(self.ffn_norm(x), ctx)), aux)

    def decode(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, 1, ...D] -> same shape."""
        x, aux = self.mixer_residual.enter(h)
        h = self.mixer_residual.exit(h, self._mixed(self.mixer.decode(self.mixer_norm(x), cache, ctx)), aux)
        x, aux = self.ffn_residual.enter(h)
        return self.ffn_residual.exit(h, self._fed(self.ffn.decode(self.ffn_norm(x), ctx)), aux)
