"""Differential attention (DiffLlama; arXiv 2410.05258): grouped-query attention whose query heads
come in pairs (h, h + H/2) and subtract one's output from the other's. Shapes (glossary letters):

    q [B, H, L, Dh], k, v [B, Hkv, T, Dh] (the cache: k, v as gqa's)
    values of kv head j: [v_{j mod Hkv/2} | v_{Hkv/2 + j mod Hkv/2}]   [B, Hkv, T, 2 Dh]
    o = softmax(q k^T * scale) @ values                                  [B, H, L, 2 Dh]
    d_i = o_i - lambda * o_{i + H/2}, i < H/2                            [B, L, H/2, 2 Dh]
    y = wo((1 - lambda_init) * rmsnorm(d_i) over 2 Dh, no weight)        [B, L, D]
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
    lambda_init = 0.8 - 0.6 exp(-0.3 * layer)                            (the layer's depth)

Every entry point (prefill, decode, extend: chunked prefill, prefix reuse, speculation) goes
through gqa's explicit scores-softmax-mix path with the doubled values (SDPA and the CPU decode
kernel assume values as wide as keys); the two subtracted maps are one softmax, so gqa's
attention probe is this kind's. `reference` beside it is the naive whole-sequence form.
lambda_init is a plain attribute, part of a layer's structure: compiled, each layer is a graph of
its own (a buffer would let them share one, but storage is materialised empty and only the
checkpoint fills it; DiffLlama's checkpoints do not hold it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..contracts import no_sharding_plan
from ..registry import register
from .attention import Attention


def lambda_init(layer: int) -> float:
    """DiffLlama's depth schedule of lambda's constant part."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


@register("mixer", "diff_attn")
class DifferentialAttention(Attention):
    """gqa's projections, rope, cache and masks; values doubled and heads paired (module docstring).
    Parameters: gqa's, plus lambda_q1, lambda_k1, lambda_q2, lambda_k2 [Dh]."""

    @dataclass
    class Spec(Attention.Spec):
        kind: str = "diff_attn"
        group_norm_eps: float = 1e-5  # the weightless RMSNorm over each pair's 2 Dh channels

        def check(self, model: dict) -> Optional[str]:
            problem = super().check(model)
            if problem:
                return problem
            if self.n_kv_heads % 2 or self.n_heads % 2:
                return (f"diff_attn pairs heads and splits the values over kv heads: n_heads={self.n_heads} and "
                        f"n_kv_heads={self.n_kv_heads} must be even")
            if self.output_gate or self.sinks or self.softcap is not None or self.alibi:
                return "diff_attn has no output_gate, sinks, softcap or alibi"
            return None

    def __init__(self, spec: "DifferentialAttention.Spec", model):
        super().__init__(spec, model)
        if model.layer is None:
            raise ValueError("diff_attn is built by a Block, which gives it its layer index")
        self.lambda_init = lambda_init(model.layer)
        Dh = spec.head_dim
        self.lambda_q1, self.lambda_k1 = nn.Parameter(torch.empty(Dh)), nn.Parameter(torch.empty(Dh))
        self.lambda_q2, self.lambda_k2 = nn.Parameter(torch.empty(Dh)), nn.Parameter(torch.empty(Dh))
        self.explicit = True  # every path attends through scores / probabilities / mix (doubled values)

    def shard(self, plan) -> bool:
        # heads pair across the two halves and values across kv heads: no split keeps both local
        return no_sharding_plan(self, plan)

    def attention_flops(self, context):
        """q.k scores over Dh and the weighted sum of values twice as wide: 6 H Dh per key seen."""
        return 1.5 * super().attention_flops(context)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, Dh] over k, v [B, Hkv, T, Dh] -> o [B, H, L, 2 Dh] (the doubled values)."""
        half = self.n_kv_heads // 2
        j = torch.arange(self.n_kv_heads, device=v.device) % half
        values = torch.cat((v[:, j], v[:, half + j]), dim=-1)  # [B, Hkv, T, 2 Dh]
        return self.mix(self.probabilities(self.scores(q, k, visible)), values)

    def _lambda(self, dtype: torch.dtype) -> torch.Tensor:
        l1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32))
        l2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32))
        return (l1 - l2 + self.lambda_init).to(dtype)

    def _out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """o [B, H, L, 2 Dh] -> [B, L, D]: pairs subtracted, normed, scaled, projected."""
        B, H, L, W = o.shape
        o = o.transpose(1, 2)  # [B, L, H, 2 Dh]
        d = o[:, :, : H // 2] - self._lambda(o.dtype) * o[:, :, H // 2:]
        d = d * torch.rsqrt(d.float().pow(2).mean(-1, keepdim=True) + self.spec.group_norm_eps).to(d.dtype)
        return self.wo(((1 - self.lambda_init) * d).reshape(B, L, H // 2 * W))


@torch.no_grad()
def reference(m: DifferentialAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Naive whole-sequence differential attention of `m`'s weights, written as the paper's
    (softmax_1 - lambda softmax_2) V per head pair, head by head, float64: x [B, L, D] -> [B, L, D].
    cos, sin: the rope table [L, R/2] (prefill's)."""
    q, k, v, _ = m._project(x, cos, sin)
    q, k, v = q.double(), k.double(), v.double()
    B, H, L, Dh = q.shape
    g, half = H // m.n_kv_heads, m.n_kv_heads // 2
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    heads = []
    for h in range(H):
        j = h // g  # this head's kv head
        p = (q[:, h] @ k[:, j].transpose(-1, -2) * m.scale).masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(torch.cat((p @ v[:, j % half], p @ v[:, half + j % half]), dim=-1))  # [B, L, 2 Dh]
    lam = float(m._lambda(torch.float64))
    out = []
    for i in range(H // 2):
        d = heads[i] - lam * heads[i + H // 2]
        d = d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + m.spec.group_norm_eps)
        out.append((1 - m.lambda_init) * d)
    y = torch.cat(out, dim=-1).to(x.dtype)  # [B, L, H/2 * 2 Dh]
    return m.wo(y)
