"""Manifold-constrained hyper-connections (mHC, as in DeepSeek-V4): n residual streams.

The residual state is [B, L, N, D]: N parallel streams. Around each sub-layer (mixer, FFN) one
hyper-connection reads all streams and derives three weights from them with a one-layer
perceptron: `pre` [N] collapses the streams into the sub-layer input, `post` [N] expands the
sub-layer output back into N streams, and `comb` [N, N] mixes the residual streams. `comb` is
projected onto the doubly-stochastic matrices (rows and columns sum to 1) by Sinkhorn-Knopp, so
the residual mixing can neither amplify nor vanish the signal across depth.

      streams h [B,L,N,D] --flatten, unweighted RMSNorm, fn, *scale + base--> pre, post, comb
         |   \\
         |    `--(pre-weighted sum)--> x [B,L,D] --> norm --> sub-layer --> y [B,L,D]
         |                                                                    |
         `-- comb^T @ h  ----------------------(+)<------- post (x) y --------'
                                                |
                                          new streams [B,L,N,D]

The embedding enters as N copies; a head collapses the last streams (its own `pre`) before the
final norm. All mixing weights are computed in float32; the parameters stay in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import KeepFloat32, KindSpec, Residual
from ..registry import register


def _unweighted_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] logits -> doubly-stochastic [..., N, N] (float32).

    softmax over rows (+eps), then alternately normalise columns and rows; the last step
    normalises columns, as DeepSeek-V4 does.
    """
    comb = torch.softmax(logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class _StreamProjection(nn.Module, KeepFloat32):
    """The perceptron both mHC modules read the streams with: fn [M, N*D], base [M], scale [S];
    mixes = fn @ rmsnorm(flattened streams), in float32."""

    def __init__(self, n: int, dim: int, outputs: int, scales: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.eps, self.norm_eps = n, eps, norm_eps
        self.fn = nn.Parameter(torch.empty(outputs, n * dim))
        self.base = nn.Parameter(torch.empty(outputs))
        self.scale = nn.Parameter(torch.empty(scales))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        self.fn.data.normal_(0.0, 0.02, generator=generator)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def mixes(self, h: torch.Tensor) -> torch.Tensor:
        """streams [..., N, D] -> [..., M] float32."""
        return F.linear(_unweighted_rmsnorm(h.flatten(-2).float(), self.norm_eps), self.fn.float())


class HyperConnection(_StreamProjection):
    """One hyper-connection around a sub-layer. Parameters (DeepSeek-V4 layout):
    fn [(2+N)*N, N*D], base [(2+N)*N], scale [3] (pre, post, comb)."""

    def __init__(self, n: int, dim: int, iters: int, eps: float, norm_eps: float):
        super().__init__(n, dim, (2 + n) * n, 3, eps, norm_eps)
        self.iters = iters

    def token_flops(self) -> int:
        """Per token, beyond 2 x fn's parameters (analysis.py): the pre-weighted sum of the N
        streams (N*D multiply-adds), comb^T @ h (N*N*D) and post (x) y added in (N*D), 2 FLOPs each."""
        n, d = self.n, self.fn.shape[1] // self.n
        return 2 * n * d * (n + 2)

    def weights(self, h: torch.Tensor):
        """h [..., N, D] -> pre [..., N], post [..., N], comb [..., N, N] (float32)."""
        n = self.n
        pre_w, post_w, comb_w = self.mixes(h).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn((comb_w * s_comb + comb_b).unflatten(-1, (n, n)), self.iters, self.eps)
        return pre, post, comb

    def mixing(self, h: torch.Tensor) -> torch.Tensor:
        """streams [..., N, D] -> comb [..., N, N], the doubly stochastic stream mixing that `exit`
        applies (contracts.StreamMixing; `zoo patterns`)."""
        return self.weights(h)[2]

    def enter(self, h: torch.Tensor):
        """streams [..., N, D] -> (sub-layer input [..., D], (post, comb))."""
        pre, post, comb = self.weights(h)
        x = (pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype)
        return x, (post, comb)

    def exit(self, h: torch.Tensor, y: torch.Tensor, aux) -> torch.Tensor:
        """new streams = post (x) y + comb^T @ h   ([..., N, D])."""
        post, comb = aux
        return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead(_StreamProjection):
    """Collapses the last streams before the final norm. fn [N, N*D], base [N], scale [1]."""

    def __init__(self, n: int, dim: int, eps: float, norm_eps: float):
        super().__init__(n, dim, n, 1, eps, norm_eps)

    def token_flops(self) -> int:
        """Per token, beyond 2 x fn's parameters: the pre-weighted sum of the N streams."""
        return 2 * self.fn.shape[1]

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        """embedding [..., D] -> N identical streams [..., N, D]."""
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.n, h.shape[-1]).contiguous()

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """streams [..., N, D] -> [..., D]."""
        pre = torch.sigmoid(self.mixes(h) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype)


@register("residual", "mhc")
class MHC(Residual):
    @dataclass
    class Spec(KindSpec):
        kind: str = "mhc"
        streams: int = 4
        sinkhorn_iters: int = 20
        eps: float = 1e-6
        norm_eps: Optional[float] = None  # RMSNorm eps of the stream projection; None: the model's

        def check(self, model: dict) -> Optional[str]:
            if self.streams < 1:
                return f"streams must be >= 1, got {self.streams}"
            if self.sinkhorn_iters < 1:
                return f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}"
            return None

    @staticmethod
    def n_streams(spec) -> int:
        return spec.streams

    @staticmethod
    def _norm_eps(spec, ctx) -> float:
        return spec.norm_eps if spec.norm_eps is not None else ctx.spec.norm.eps

    @staticmethod
    def connection(spec, ctx) -> nn.Module:
        return HyperConnection(spec.streams, ctx.dim, spec.sinkhorn_iters, spec.eps, MHC._norm_eps(spec, ctx))

    @staticmethod
    def model_streams(spec, ctx) -> nn.Module:
        return HyperHead(spec.streams, ctx.dim, spec.eps, MHC._norm_eps(spec, ctx))
