"""One decoder layer, the same attribute paths whatever its kinds (see glossary.py).

    Block:  h -> mixer_residual(mixer_norm -> mixer) -> ffn_residual(ffn_norm -> ffn) -> h

Where the norms sit is the model's `sublayer_norms`:
    pre       norm -> sub-layer                     (mixer_norm, ffn_norm; Llama)
    sandwich  norm -> sub-layer -> norm             (+ mixer_post_norm, ffn_post_norm; Gemma 2/3)
    post      sub-layer -> norm                     (mixer_post_norm, ffn_post_norm only; OLMo 2:
              mixer_norm and ffn_norm are identities)
    post_residual  h -> norm(h + sub-layer(h))      (the original Transformer's post-LN, GPT-1: the
              post norms act after the residual add; the model has no final norm)
The post norms act on the sub-layer output before the residual folds it in; absent (None) under pre.
A layer whose FFN kind is `none` (compiler/ffn/none.py: Mamba's mixer-only layers) stops after the
mixer's residual and has no ffn_norm / ffn_post_norm; one whose mixer kind is `none`
(compiler/mixers/none.py: NemotronH's MLP layers) runs only norm -> FFN -> residual, its one norm
kept at mixer_norm.

A parallel residual (residual kind's `parallel`, prenorm.py) feeds both sub-layers the block input:

    h -> h + mixer(mixer_norm(h)) + ffn(ffn_norm(h))     (ffn_norm None under shared_norm)

The first block of a model with learned absolute positions adds them to h on entry
(`positions`, model.py's LearnedPositions, owned by the model and only referenced here): the
engine hands blocks the positions, not the embedding.

Gemma 4's blocks end in two more steps, after the FFN's residual: the layer's per-layer input
gated in (`per_layer`, residual/per_layer_input.py: the model's `per_layer_dim`; the inputs come
in the step context as ctx["per_layer"] [B, L, Nl, Dp]), then the whole state times a stored scalar
(`layer_scalar`, the model's `layer_scalar`).

Three entry points, `prefill`, `decode` and `extend`, call the same-named entry points of the
mixer (the FFN, per position, runs its `prefill` under extend): the entry point decides the
algorithm, never the sequence length.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from .contracts import OwnInit
from .norm.norms import make_norm
from .registry import lookup
from .residual.per_layer_input import PerLayerGate
from .residual.prenorm import residual_kind
from .spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class BuildContext:
    """What a module may read from the model while it is built."""

    spec: ModelSpec
    rope_impl: Any
    layer: Optional[int] = None  # the index of the layer being built (a kind whose constants follow its depth)

    @property
    def dim(self) -> int:
        return self.spec.dim


class LayerScalar(nn.Module, OwnInit):
    """h [..., D] -> h * weight, weight [1] a stored scalar (Gemma 4's layer_scalar; init 1)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1))

    def init_weights(self, generator=None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class Block(nn.Module):
    def __init__(self, layer: LayerSpec, ctx: BuildContext):
        super().__init__()
        spec = ctx.spec
        ctx = replace(ctx, layer=layer.index)
        res = residual_kind(spec.residual)
        pre, post = spec.sublayer_norms in ("pre", "sandwich"), spec.sublayer_norms != "pre"
        self.after_add = spec.sublayer_norms == "post_residual"
        self.parallel = res.parallel(spec.residual)
        self.mixer_norm = make_norm(spec.norm, spec.dim) if pre else nn.Identity()
        self.mixer = lookup("mixer", layer.mixer.kind, f"mixers.{layer.mixer_name}")(layer.mixer, ctx)
        # an absent mixer (mixer kind `none`: NemotronH's MLP layers) runs the FFN alone, after the
        # layer's one norm, mixer_norm
        self.mixer_absent = getattr(self.mixer, "absent", False)
        shared = self.parallel == "shared_norm"
        ffn_cls = lookup("ffn", layer.ffn.kind, f"ffns.{layer.ffn_name}")
        # an absent FFN (ffn kind `none`: Mamba layers) has no norm, post norm or residual either
        self.ffn_absent = getattr(ffn_cls, "absent", False)
        has_ffn_norm = pre and not shared and not self.ffn_absent and not self.mixer_absent
        self.ffn_norm = make_norm(spec.norm, spec.dim) if has_ffn_norm else nn.Identity()
        self.ffn = ffn_cls(layer.ffn, ctx)
        self.mixer_residual = res.connection(spec.residual, ctx)
        self.ffn_residual = res.connection(spec.residual, ctx)
        # under tensor/expert parallelism a sharded sub-layer's output is a partial sum; the
        # sharding driver (parallel/plan.py) sets an all-reduce here, one per such sub-layer
        self.mixer_reduce: nn.Module | None = None
        self.ffn_reduce: nn.Module | None = None
        self.mixer_post_norm = make_norm(spec.norm, spec.dim) if post and not self.mixer_absent else None
        self.ffn_post_norm = make_norm(spec.norm, spec.dim) if post and not self.ffn_absent else None
        self.__dict__["positions"] = None  # set on the first block by the model (not a child module)
        self.per_layer = PerLayerGate(spec.per_layer_dim, spec.dim, spec.norm) if spec.per_layer_dim else None
        # the layer's index only where a per-layer input needs it: an int attribute is a constant to
        # dynamo, so it would give every layer a graph of its own (blocks of a kind share one)
        self.index = layer.index if self.per_layer is not None else None
        self.layer_scalar = LayerScalar() if spec.layer_scalar else None

    def _finish(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """After both sub-layers: the per-layer input gated in, then the layer scalar (when built)."""
        if self.per_layer is not None:
            h = self.per_layer(h, ctx["per_layer"][:, :, self.index])
        return h if self.layer_scalar is None else self.layer_scalar(h)

    @staticmethod
    def _out(y: torch.Tensor, reduce, norm) -> torch.Tensor:
        """A sub-layer's output: summed over ranks first (a sharded sub-layer), then post-normed."""
        if reduce is not None:
            y = reduce(y)
        return y if norm is None else norm(y)

    def prefill(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] -> same shape."""
        if self.positions is not None:
            h = h + self.positions(torch.arange(h.shape[1], device=h.device)).to(h.dtype)
        return self._finish(self._run(h, lambda x: self.mixer.prefill(x, cache, ctx),
                                      lambda x: self.ffn.prefill(x, ctx)), ctx)

    def decode(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, 1, ...D] -> same shape."""
        if self.positions is not None:
            h = h + self.positions(ctx["pos"])[:, None].to(h.dtype)
        return self._finish(self._run(h, lambda x: self.mixer.decode(x, cache, ctx),
                                      lambda x: self.ffn.decode(x, ctx)), ctx)

    def extend(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] at positions ctx["start"][b] + 0..L-1 -> same shape."""
        if self.positions is not None:
            h = h + self.positions(ctx["start"][:, None] + torch.arange(h.shape[1], device=h.device)).to(h.dtype)
        return self._finish(self._run(h, lambda x: self.mixer.extend(x, cache, ctx),
                                      lambda x: self.ffn.prefill(x, ctx)), ctx)

    def _run(self, h: torch.Tensor, mixer, ffn) -> torch.Tensor:
        if self.after_add:  # post-LN: h = norm(h + f(h)), each sub-layer in turn
            return self._run_post_residual(h, mixer, ffn)
        if self.mixer_absent:  # an FFN-only layer: its one norm is mixer_norm
            x, aux = self.ffn_residual.enter(h)
            y = self._out(ffn(self.mixer_norm(x)), self.ffn_reduce, self.ffn_post_norm)
            return self.ffn_residual.exit(h, y, aux)
        x, aux = self.mixer_residual.enter(h)
        xn = self.mixer_norm(x)
        y = self._out(mixer(xn), self.mixer_reduce, self.mixer_post_norm)
        if self.parallel is not None and not self.ffn_absent:
            xf = xn if self.parallel == "shared_norm" else self.ffn_norm(x)
            y = y + self._out(ffn(xf), self.ffn_reduce, self.ffn_post_norm)
            return self.mixer_residual.exit(h, y, aux)
        h = self.mixer_residual.exit(h, y, aux)
        if self.ffn_absent:
            return h
        x, aux = self.ffn_residual.enter(h)
        y = self._out(ffn(self.ffn_norm(x)), self.ffn_reduce, self.ffn_post_norm)
        return self.ffn_residual.exit(h, y, aux)

    def _run_post_residual(self, h: torch.Tensor, mixer, ffn) -> torch.Tensor:
        """sublayer_norms post_residual: h [B, L, D] -> norm2(n + ffn(n)), n = norm1(h + mixer(h))."""
        if not self.mixer_absent:
            x, aux = self.mixer_residual.enter(h)
            h = self.mixer_post_norm(self.mixer_residual.exit(h, self._out(mixer(x), self.mixer_reduce, None), aux))
        if self.ffn_absent:
            return h
        x, aux = self.ffn_residual.enter(h)
        return self.ffn_post_norm(self.ffn_residual.exit(h, self._out(ffn(x), self.ffn_reduce, None), aux))
