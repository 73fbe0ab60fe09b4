"""Gated DeltaNet: linear attention with a gated delta-rule state (Qwen3-Next linear layers).

    x [B, L, D] -> in_proj -> q, k [B, L, Hk, Dk] | v, z [B, L, Hv, Dv] | b, a [B, L, Hv]
    [q|k|v] (Cc = 2*Hk*Dk + Hv*Dv channels) -> causal depthwise conv (width W) -> SiLU
    q, k l2-normalised (q also scaled by Dk^-0.5), each key head serving Hv/Hk value heads
    decay g = -exp(A_log) * softplus(a + dt_bias) (log space, <= 0), beta = sigmoid(b)

    gated delta rule, per value head, state S [Dk, Dv]:
        S_t = exp(g_t) * S_{t-1}                               decay
        S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T           delta rule write
        o_t = S_t^T q_t

    o [B, L, Hv, Dv] -> rmsnorm(o) * w * silu(z) -> out_proj -> [B, L, D]

Two execution forms of the same recurrence, chosen by the entry point:
  prefill  chunked parallel (`chunk_gated_delta_rule`): within a chunk of Lc = `chunk_size`
           tokens the writes are solved at once (a unit lower-triangular system, the WY form), and
           only the state crosses chunk boundaries. Memory O(L * Lc), never [L, L]. Starts from a
           zero state (a prefill starts new sequences) and leaves the final state in the cache.
  decode   recurrent (`recurrent_gated_delta_step`): one step of the recurrence from the cached
           state, O(1) per token.

Cache per layer, constant per sequence (grows=False):
  conv   [B, Cc, W-1]     the last W-1 conv inputs (cache dtype)
  state  [B, Hv, Dk, Dv]  the recurrent state, always float32

Parameters: in_proj [2*Hk*Dk + 2*Hv*Dv + 2*Hv, D] (rows q | k | v | z | b | a, heads in order;
value head h reads key head h // (Hv/Hk)), conv_weight [Cc, 1, W], A_log [Hv], dt_bias [Hv],
norm.weight [Dv] (plain weight), out_proj [D, Hv*Dv].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import Mixer
from ..engine.cache import CacheField
from ..registry import register

L2NORM_EPS = 1e-6  # q/k l2 normalisation: x * rsqrt(sum(x^2) + eps), as the reference kernels


# ---------------------------------------------------------------------------- the two forms

@torch.library.custom_op("zoo::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor,
                           chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel gated delta rule, float32.

    q, k [B, Hv, L, Dk] (q already scaled), v [B, Hv, L, Dv], g, beta [B, Hv, L],
    initial_state [B, Hv, Dk, Dv] -> (o [B, Hv, L, Dv], final state [B, Hv, Dk, Dv]).

    Per chunk (Lc tokens) with cumulative decay G_i = g_1 + ... + g_i and start state S0, the writes
    u_i = beta_i (v_i - k_i^T S'_{i-1}) solve (I + A) U = beta V - beta exp(G) K S0 with
    A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i); then
        O   = exp(G) Q S0 + (Q K^T * exp(G_i - G_j))_{j <= i} U
        S_end = exp(G_Lc) S0 + (K * exp(G_Lc - G))^T U.
    Zero padding to whole chunks (g = beta = 0) leaves the state unchanged.

    A custom op: the sequential loop over chunks runs eagerly inside, so the compiled prefill
    graph keeps one op for it whatever the (dynamic) prompt length.
    """
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    Lc = chunk_size
    n = -(-L // Lc)
    pad = n * Lc - L
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = q.reshape(B, H, n, Lc, Dk), k.reshape(B, H, n, Lc, Dk), v.reshape(B, H, n, Lc, Dv)
    G = g.reshape(B, H, n, Lc).cumsum(-1)
    beta = beta.reshape(B, H, n, Lc)

    idx = torch.arange(Lc, device=q.device)
    above = idx[:, None] < idx[None, :]  # [Lc, Lc]: j > i
    # The [.., Lc, Lc] blocks dominate memory (O(L * Lc)): built in place, one temporary at a time.
    # exp(G_i - G_j) on and below the diagonal; masked before exp so it never overflows
    decay = (G[..., :, None] - G[..., None, :]).masked_fill_(above, float("-inf")).exp_()
    A = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., None])  # zero above the diagonal
    eG = G.exp()
    rhs = torch.cat((v * beta[..., None], k * (beta * eG)[..., None]), dim=-1)  # [B, Hv, n, Lc, Dv+Dk]
    # solve (I + strictly-lower A) W = rhs: a unit-triangular solve reads only A's strict lower part
    w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    del A, rhs
    wv, wk = w.split([Dv, Dk], dim=-1)  # U = wv - wk @ S0
    attn = (q @ k.transpose(-1, -2)).mul_(decay)  # [B, Hv, n, Lc, Lc]
    del decay
    q_dec = q * eG[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = eG[..., -1, None, None]  # [B, Hv, n, 1, 1]

    S = initial_state.to(torch.float32).clone()
    o = torch.empty(B, H, n, Lc, Dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = wv[:, :, i] - wk[:, :, i] @ S
        o[:, :, i] = q_dec[:, :, i] @ S + attn[:, :, i] @ u
        S = S.mul_(chunk_decay[:, :, i]).add_(k_dec[:, :, i].transpose(-1, -2) @ u)
    return o.reshape(B, H, n * Lc, Dv)[:, :, :L].contiguous(), S


@chunk_gated_delta_rule.register_fake
def _chunk_gated_delta_rule_fake(q, k, v, g, beta, initial_state, chunk_size):
    B, H, L, _ = q.shape
    return (v.new_empty(B, H, L, v.shape[-1], dtype=torch.float32),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32))


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, float32.

    q, k [B, Hv, Dk] (q already scaled), v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv]
    -> (o [B, Hv, Dv], new state [B, Hv, Dk, Dv]).
    """
    S = state * g.exp()[..., None, None]
    delta = beta[..., None] * (v - (k[..., None] * S).sum(-2))  # [B, H, V]
    S = S + k[..., None] * delta[..., None, :]
    return (q[..., None] * S).sum(-2), S


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


# ---------------------------------------------------------------------------- modules

class GatedRMSNorm(nn.Module):
    """y = rmsnorm(x) * w * silu(z) over the last dim, plain weight (not zero-centred).

    x, z [..., Dv] -> [..., Dv]; normalised in float32, gated in float32, cast back.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * y).float() * F.silu(z.float())).to(x.dtype)


@register("mixer", "gated_deltanet")
class GatedDeltaNet(Mixer):
    @dataclass
    class Spec:
        kind: str = "gated_deltanet"
        n_k_heads: int = "???"  # type: ignore[assignment]  # query/key heads (Hk)
        n_v_heads: Optional[int] = None  # value heads (Hv), a multiple of n_k_heads; None: n_k_heads
        k_head_dim: int = "???"  # type: ignore[assignment]  # Dk
        v_head_dim: Optional[int] = None  # Dv; None: k_head_dim
        conv_kernel: int = 4  # W: causal depthwise conv width over [q|k|v]
        chunk_size: int = 64  # Lc: tokens per chunk of the chunked prefill
        norm_eps: float = 1e-6  # eps of the gated output RMSNorm

        def resolve(self, model: dict) -> "GatedDeltaNet.Spec":
            return replace(self, n_v_heads=self.n_v_heads or self.n_k_heads,
                           v_head_dim=self.v_head_dim or self.k_head_dim)

        def check(self, model: dict) -> Optional[str]:
            if self.n_k_heads <= 0 or self.n_v_heads <= 0:
                return f"n_k_heads={self.n_k_heads} and n_v_heads={self.n_v_heads} must be positive"
            if self.n_v_heads % self.n_k_heads:
                return (f"n_v_heads={self.n_v_heads} must be a multiple of n_k_heads={self.n_k_heads} "
                        f"(each key head serves n_v_heads / n_k_heads value heads)")
            if self.k_head_dim <= 0 or self.v_head_dim <= 0:
                return f"k_head_dim={self.k_head_dim} and v_head_dim={self.v_head_dim} must be positive"
            if self.conv_kernel < 2:
                return f"conv_kernel={self.conv_kernel} must be >= 2"
            if self.chunk_size <= 0:
                return f"chunk_size={self.chunk_size} must be positive"
            return None

        @property
        def conv_dim(self) -> int:
            """Cc: channels of the conv, [q | k | v]."""
            return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    def __init__(self, spec: "GatedDeltaNet.Spec", model):
        super().__init__()
        s = self.spec = spec
        self.Hk, self.Hv, self.Dk, self.Dv = s.n_k_heads, s.n_v_heads, s.k_head_dim, s.v_head_dim
        self.kernel, self.chunk_size = s.conv_kernel, s.chunk_size
        key, value = s.n_k_heads * s.k_head_dim, s.n_v_heads * s.v_head_dim
        self.split = [key, key, value, value, s.n_v_heads, s.n_v_heads]  # q k v z b a
        self.in_proj = nn.Linear(model.dim, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(s.n_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(s.n_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, s.norm_eps)
        self.out_proj = nn.Linear(value, model.dim, bias=False)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random-build values: a unit-sum causal conv, decay rates exp(A_log) spread over 1..16."""
        nn.init.constant_(self.conv_weight, 1.0 / self.kernel)
        self.A_log.data.copy_(torch.linspace(0.0, math.log(16.0), self.Hv))
        nn.init.ones_(self.dt_bias)

    def rope_dims(self) -> list[int]:
        return []

    def attention_flops(self, context):
        """Per token, whatever the context (int or array): the recurrence's work on each value
        head's state S [Dk, Dv], three multiply-adds per state element (S^T k, the rank-1 write
        k delta^T, S^T q), 2 FLOPs each; the decay scaling is elementwise (not counted, as norms)."""
        return 0 * context + 6 * self.Hv * self.Dk * self.Dv

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {"conv": CacheField((max_batch, self.spec.conv_dim, self.kernel - 1), dtype, grows=False),
                "state": CacheField((max_batch, self.Hv, self.Dk, self.Dv), torch.float32, grows=False)}

    # ------------------------------------------------------------------ pieces

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b, a [..., Hv] -> decay g (log space, float32), beta (float32)."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, b.float().sigmoid()

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [B, L, Cc] -> q, k [B, Hv, L, Dk] (normalised, q scaled), v [B, Hv, L, Dv], float32."""
        B, L, _ = qkv.shape
        q, k, v = qkv.float().split(self.split[:3], dim=-1)
        rep = self.Hv // self.Hk
        q = l2norm(q.view(B, L, self.Hk, self.Dk)) * self.Dk ** -0.5
        k = l2norm(k.view(B, L, self.Hk, self.Dk))
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.view(B, L, self.Hv, self.Dv).transpose(1, 2)

    def _out(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [B, Hv, L, Dv] float32, z [B, L, Hv*Dv] -> [B, L, D]."""
        B, _, L, _ = o.shape
        o = o.transpose(1, 2).to(dtype)
        y = self.norm(o, z.view(B, L, self.Hv, self.Dv))
        return self.out_proj(y.reshape(B, L, self.Hv * self.Dv))

    # ------------------------------------------------------------------ entry points

    def _prefill_recurrence(self, x: torch.Tensor):
        """x [B, L, D] (new sequences) -> (the conv input after zero history [B, Cc, W-1+L], the
        final state from zero [B, Hv, Dk, Dv], o [B, Hv, L, Dv], decay g and beta [B, Hv, L], z)."""
        q, k, v, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        mixed = torch.cat((q, k, v), dim=-1).transpose(1, 2)  # [B, Cc, L]
        padded = F.pad(mixed, (self.kernel - 1, 0))  # zero history: a prefill starts from scratch
        conv = F.silu(F.conv1d(padded, self.conv_weight.to(padded.dtype), groups=padded.shape[1]))
        q, k, v = self._heads(conv.transpose(1, 2))
        g, beta = (t.transpose(1, 2) for t in self._gates(b, a))
        zero = q.new_zeros(x.shape[0], self.Hv, self.Dk, self.Dv)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, zero, self.chunk_size)
        return padded, state, o, g, beta, z

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (new sequences, positions 0..L-1) -> [B, L, D]; leaves the conv inputs of
        the last W-1 positions and the final recurrent state in the cache."""
        padded, state, o, _, _, z = self._prefill_recurrence(x)
        cache["conv"].copy_(padded[:, :, padded.shape[2] - (self.kernel - 1):])
        cache["state"].copy_(state)
        return self._out(o, z, x.dtype)

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """prefill's recurrence, summarised per value head [B, Hv] (contracts.MixerStatistics):
        decay, the mean share exp(g) of the state kept per token; write, the mean beta; state_norm,
        the final state's Frobenius norm; output_norm, the mean |o_t|."""
        _, state, o, g, beta, _ = self._prefill_recurrence(x)
        return {"decay": g.exp().mean(-1), "write": beta.mean(-1), "state_norm": state.flatten(-2).norm(dim=-1),
                "output_norm": o.norm(dim=-1).mean(-1)}

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; one recurrent step from the cached conv inputs and state."""
        q, k, v, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        new = torch.cat((q, k, v), dim=-1).transpose(1, 2)  # [B, Cc, 1]
        window = torch.cat((cache["conv"].to(new.dtype), new), dim=-1)  # [B, Cc, W]
        cache["conv"].copy_(window[:, :, 1:])
        conv = F.silu((window * self.conv_weight[:, 0].to(window.dtype)).sum(-1))  # [B, Cc]
        q, k, v = self._heads(conv[:, None, :])
        g, beta = self._gates(b[:, 0], a[:, 0])
        o, state = recurrent_gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g, beta, cache["state"])
        cache["state"].copy_(state)
        return self._out(o[:, :, None], z, x.dtype)
