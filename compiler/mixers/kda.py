"""Kimi Delta Attention (KDA, Kimi Linear's linear layers): the gated delta rule with one decay
per key channel instead of Gated DeltaNet's one per head.

    x [B, L, D] -> in_proj -> f, r [B, L, Dk] (low-rank) | b [B, L, H] | q, k, v [B, L, H, Dk]
    [q|k|v] (Cc = 3*H*Dk channels) -> causal depthwise conv (width W) -> SiLU
    q, k l2-normalised (q also scaled by Dk^-0.5); H heads, no key/value grouping (Dv = Dk)
    decay g = -exp(A_log[h]) * softplus(f_b(f) + dt_bias)   [B, L, H, Dk] (log space, <= 0)
    beta = sigmoid(b)

    gated delta rule, per head, state S [Dk, Dk]:
        S_t = diag(exp(g_t)) S_{t-1}                           per-channel decay of the key rows
        S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T             delta rule write
        o_t = S_t^T q_t

    o [B, L, H, Dk] -> rmsnorm(o) * w * sigmoid(g_b(r)) -> wo -> [B, L, D]

Everything but the projections and the gates is Gated DeltaNet's (gated_deltanet.py): the conv
and its cache, the l2 norms, the chunked prefill and recurrent decode (both take a per-channel
decay), the gated output norm (with a sigmoid gate) and the cache fields
  conv   [B, Cc, W-1]     the last W-1 conv inputs (cache dtype)
  state  [B, H, Dk, Dk]   the recurrent state, always float32
both constant per sequence.

Parameters: in_proj [2*Dk + H + 3*H*Dk, D] (rows f | r | b | q | k | v, heads in order),
conv_weight [Cc, 1, W], f_b [H*Dk, Dk], dt_bias [H*Dk], A_log [H], g_b [H*Dk, Dk],
norm.weight [Dk], wo [D, H*Dk]. (The gate rows come first and the output projection is `wo`, as
in the MLA layers it alternates with, so a checkpoint rule keyed on a KDA-only tensor claims a
KDA layer's q/k/v, and o_proj maps to one name whatever the layer's mixer.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .gated_deltanet import GatedDeltaNet, GatedRMSNorm, check_conv_and_chunk
from ..contracts import KindSpec, span
from ..registry import register


@register("mixer", "kda")
class KimiDeltaAttention(GatedDeltaNet):
    @dataclass
    class Spec(KindSpec):
        kind: str = "kda"
        n_heads: int = "???"  # type: ignore[assignment]  # H: query/key/value heads
        head_dim: int = "???"  # type: ignore[assignment]  # Dk (= Dv), also the gates' low rank
        conv_kernel: int = 4  # W: causal depthwise conv width over [q|k|v]
        chunk_size: int = 64  # Lc: tokens per chunk of the chunked prefill
        norm_eps: float = 1e-5  # eps of the gated output RMSNorm

        def check(self, model: dict) -> Optional[str]:
            if self.n_heads <= 0 or self.head_dim <= 0:
                return f"n_heads={self.n_heads} and head_dim={self.head_dim} must be positive"
            return check_conv_and_chunk(self)

        @property
        def conv_dim(self) -> int:
            """Cc: channels of the conv, [q | k | v]."""
            return 3 * self.n_heads * self.head_dim

    def shard(self, plan) -> bool:
        """Heads split over the ranks (no key/value grouping): in_proj's b, q, k, v rows by head,
        its low-rank gate inputs f, r replicated (every head reads them); the conv channels, f_b
        and g_b (column-parallel), dt_bias and A_log by head; the per-head output norm
        replicated; wo row-parallel. The conv and recurrent state hold local heads only."""
        H, Dk = self.Hv, self.Dk
        h = plan.units(H, "n_heads")
        qkv = [span(2 * Dk + H, h, Dk), span(2 * Dk + H + H * Dk, h, Dk), span(2 * Dk + H + 2 * H * Dk, h, Dk)]
        plan.column(self.in_proj, [(0, 2 * Dk), span(2 * Dk, h, 1)] + qkv)
        plan.param(self, "conv_weight", {0: [span(0, h, Dk), span(H * Dk, h, Dk), span(2 * H * Dk, h, Dk)]})
        plan.column(self.f_b, [span(0, h, Dk)])
        plan.column(self.g_b, [span(0, h, Dk)])
        plan.param(self, "dt_bias", {0: [span(0, h, Dk)]})
        plan.param(self, "A_log", {0: [h]})
        plan.row(self.wo, [span(0, h, Dk)])
        n = h[1] - h[0]
        self.Hk = self.Hv = n
        self.qkv_split = [n * Dk] * 3
        self.split = [Dk, Dk, n, 3 * n * Dk]
        return True

    def __init__(self, spec: "KimiDeltaAttention.Spec", model):
        nn.Module.__init__(self)
        s = self.spec = spec
        H, Dk = s.n_heads, s.head_dim
        self.Hk = self.Hv = H
        self.Dk = self.Dv = Dk
        self.kernel, self.chunk_size = s.conv_kernel, s.chunk_size
        self.qkv_split = [H * Dk] * 3
        self.split = [Dk, Dk, H, s.conv_dim]  # in_proj rows: forget-gate f, output-gate r, b, qkv
        self.in_proj = nn.Linear(model.dim, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.f_b = nn.Linear(Dk, H * Dk, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * Dk))
        self.A_log = nn.Parameter(torch.empty(H))
        self.g_b = nn.Linear(Dk, H * Dk, bias=False)
        self.norm = GatedRMSNorm(Dk, s.norm_eps, gate="sigmoid")
        self.wo = nn.Linear(H * Dk, model.dim, bias=False)

    @property
    def out_proj(self) -> nn.Linear:
        """Gated DeltaNet's name for the output projection (its _out reads it)."""
        return self.wo

    def _project(self, x: torch.Tensor):
        """x [B, L, D] -> conv input [B, L, Cc], output gate [B, L, H*Dk], decay g [B, L, H, Dk]
        (log space, float32), beta [B, L, H] (float32)."""
        f, r, b, qkv = self.in_proj(x).split(self.split, dim=-1)
        return (qkv, self.g_b(r), *self._gates(f, b))

    def _gates(self, f: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f [..., Dk] (the forget gate's low-rank input), b [..., H] -> per-channel decay g
        [..., H, Dk] (log space, float32), beta [..., H] (float32)."""
        a = (self.f_b(f).float() + self.dt_bias.float()).unflatten(-1, (self.Hv, self.Dk))
        g = -self.A_log.float().exp()[:, None] * F.softplus(a)
        return g, b.float().sigmoid()
