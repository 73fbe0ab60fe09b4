"""One decoder layer, the same attribute paths whatever its kinds (see glossary.py).

    Block:  h -> mixer_residual(mixer_norm -> mixer) -> ffn_residual(ffn_norm -> ffn) -> h

Where the norms sit is the model's `sublayer_norms`:
    pre       norm -> sub-layer                     (mixer_norm, ffn_norm; Llama)
    sandwich  norm -> sub-layer -> norm             (+ mixer_post_norm, ffn_post_norm; Gemma 2/3)
    post      sub-layer -> norm                     (mixer_post_norm, ffn_post_norm only; OLMo 2:
              mixer_norm and ffn_norm are identities)
The post norms act on the sub-layer output before the residual folds it in; absent (None) under pre.

A parallel residual (residual kind's `parallel`, prenorm.py) feeds both sub-layers the block input:

    h -> h + mixer(mixer_norm(h)) + ffn(ffn_norm(h))     (ffn_norm None under shared_norm)

The first block of a model with learned absolute positions adds them to h on entry
(`positions`, model.py's LearnedPositions, owned by the model and only referenced here): the
engine hands blocks the positions, not the embedding.

Three entry points, `prefill`, `decode` and `extend`, call the same-named entry points of the
mixer (the FFN, per position, runs its `prefill` under extend): the entry point decides the
algorithm, never the sequence length.
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
        pre, post = spec.sublayer_norms != "post", spec.sublayer_norms != "pre"
        self.parallel = res.parallel(spec.residual)
        self.mixer_norm = make_norm(spec.norm, spec.dim) if pre else nn.Identity()
        self.mixer = lookup("mixer", layer.mixer.kind, f"mixers.{layer.mixer_name}")(layer.mixer, ctx)
        shared = self.parallel == "shared_norm"
        self.ffn_norm = make_norm(spec.norm, spec.dim) if pre and not shared else nn.Identity()
        self.ffn = lookup("ffn", layer.ffn.kind, f"ffns.{layer.ffn_name}")(layer.ffn, ctx)
        self.mixer_residual = res.connection(spec.residual, ctx)
        self.ffn_residual = res.connection(spec.residual, ctx)
        # under tensor/expert parallelism a sharded sub-layer's output is a partial sum; the
        # sharding driver (parallel/plan.py) sets an all-reduce here, one per such sub-layer
        self.mixer_reduce: nn.Module | None = None
        self.ffn_reduce: nn.Module | None = None
        self.mixer_post_norm = make_norm(spec.norm, spec.dim) if post else None
        self.ffn_post_norm = make_norm(spec.norm, spec.dim) if post else None
        self.__dict__["positions"] = None  # set on the first block by the model (not a child module)

    @staticmethod
    def _out(y: torch.Tensor, reduce, norm) -> torch.Tensor:
        """A sub-layer's output: summed over ranks first (a sharded sub-layer), then post-normed."""
        if reduce is not None:
            y = reduce(y)
        return y if norm is None else norm(y)

    def prefill(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] -> same shape."""
        if self.positions is not None:
            h = h + self.positions(torch.arange(h.shape[1], device=h.device))
        return self._run(h, lambda x: self.mixer.prefill(x, cache, ctx), lambda x: self.ffn.prefill(x, ctx))

    def decode(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, 1, ...D] -> same shape."""
        if self.positions is not None:
            h = h + self.positions(ctx["pos"])[:, None]
        return self._run(h, lambda x: self.mixer.decode(x, cache, ctx), lambda x: self.ffn.decode(x, ctx))

    def extend(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] at positions ctx["start"][b] + 0..L-1 -> same shape."""
        if self.positions is not None:
            h = h + self.positions(ctx["start"][:, None] + torch.arange(h.shape[1], device=h.device))
        return self._run(h, lambda x: self.mixer.extend(x, cache, ctx), lambda x: self.ffn.prefill(x, ctx))

    def _run(self, h: torch.Tensor, mixer, ffn) -> torch.Tensor:
        x, aux = self.mixer_residual.enter(h)
        xn = self.mixer_norm(x)
        y = self._out(mixer(xn), self.mixer_reduce, self.mixer_post_norm)
        if self.parallel is not None:
            xf = xn if self.parallel == "shared_norm" else self.ffn_norm(x)
            y = y + self._out(ffn(xf), self.ffn_reduce, self.ffn_post_norm)
            return self.mixer_residual.exit(h, y, aux)
        h = self.mixer_residual.exit(h, y, aux)
        x, aux = self.ffn_residual.enter(h)
        y = self._out(ffn(self.ffn_norm(x)), self.ffn_reduce, self.ffn_post_norm)
        return self.ffn_residual.exit(h, y, aux)
