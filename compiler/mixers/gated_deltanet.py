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

Both forms below also take one decay per key channel, g [.., Hv, Dk] (S_t = diag(exp(g_t)) S_{t-1}):
Kimi Delta Attention (kda.py) is this module with other projections and gates.

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

from ..contracts import CacheField, KindSpec, Mixer, span
from ..registry import register

L2NORM_EPS = 1e-6  # q/k l2 normalisation: x * rsqrt(sum(x^2) + eps), as the reference kernels


# ---------------------------------------------------------------------------- the two forms

@torch.library.custom_op("zoo::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor,
                           chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel gated delta rule, float32.

    q, k [B, Hv, L, Dk] (q already scaled), v [B, Hv, L, Dv], beta [B, Hv, L],
    g [B, Hv, L] (one decay per head: Gated DeltaNet) or [B, Hv, L, Dk] (one per key channel:
    Kimi Delta Attention), initial_state [B, Hv, Dk, Dv] -> (o [B, Hv, L, Dv], final state).

    Per chunk (Lc tokens) with cumulative decay G_i = g_1 + ... + g_i (per channel c) and start
    state S0, the writes u_i = beta_i (v_i - k_i^T S'_{i-1}) solve (I + A) U = beta V - beta
    (K * exp(G)) S0 with A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) (j < i); then
        O   = (Q * exp(G)) S0 + P U,     P_ij = sum_c q_ic k_jc exp(G_ic - G_jc) (j <= i)
        S_end = diag(exp(G_Lc)) S0 + (K * exp(G_Lc - G))^T U.
    With one decay per head the exponent leaves the channel sum (A = beta (K K^T) * exp(G_i - G_j)),
    so every chunk is done at once; per channel the [Lc, Lc, Dk] decay products are formed one
    chunk at a time (memory O(Lc^2 Dk) per head, independent of L). Zero padding to whole
    chunks (g = beta = 0) leaves the state unchanged.

    A custom op: the sequential loop over chunks runs eagerly inside, so the compiled prefill
    graph keeps one op for it whatever the (dynamic) prompt length.
    """
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    Lc = chunk_size
    n = -(-L // Lc)
    pad = n * Lc - L
    channelwise = g.dim() == 4
    if not channelwise:
        g = g[..., None]  # [B, Hv, L, 1]: the same decay on every key channel
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    q, k, v = q.reshape(B, H, n, Lc, Dk), k.reshape(B, H, n, Lc, Dk), v.reshape(B, H, n, Lc, Dv)
    G = g.reshape(B, H, n, Lc, g.shape[-1]).cumsum(-2)  # [B, Hv, n, Lc, 1 or Dk]
    beta = beta.reshape(B, H, n, Lc)

    idx = torch.arange(Lc, device=q.device)
    above = idx[:, None] < idx[None, :]  # [Lc, Lc]: j > i
    # The [.., Lc, Lc] blocks dominate memory (O(L * Lc)): built in place, one temporary at a time.
    # exp(G_i - G_j) on and below the diagonal, masked before exp so it never overflows
    if channelwise:
        A = q.new_empty(B, H, n, Lc, Lc)
        attn = q.new_empty(B, H, n, Lc, Lc)
        for i in range(n):
            Gi = G[:, :, i]
            decay = (Gi[..., :, None, :] - Gi[..., None, :, :]).masked_fill_(above[..., None], float("-inf")) \
                .exp_()  # [B, Hv, Lc, Lc, Dk]
            kd = decay.mul_(k[:, :, i, None, :, :])  # exp(G_i - G_j) k_j
            A[:, :, i] = (kd @ k[:, :, i, :, :, None])[..., 0]
            attn[:, :, i] = (kd @ q[:, :, i, :, :, None])[..., 0]
            del decay, kd
        A.mul_(beta[..., None])
    else:
        Gs = G[..., 0]
        decay = (Gs[..., :, None] - Gs[..., None, :]).masked_fill_(above, float("-inf")).exp_()
        A = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., None])  # zero above the diagonal
        attn = (q @ k.transpose(-1, -2)).mul_(decay)  # [B, Hv, n, Lc, Lc]
        del decay
    eG = G.exp()
    rhs = torch.cat((v * beta[..., None], k * eG * beta[..., None]), dim=-1)  # [B, Hv, n, Lc, Dv+Dk]
    # solve (I + strictly-lower A) W = rhs: a unit-triangular solve reads only A's strict lower part
    w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    del A, rhs
    wv, wk = w.split([Dv, Dk], dim=-1)  # U = wv - wk @ S0
    q_dec = q * eG
    k_dec = k * (G[..., -1:, :] - G).exp()
    chunk_decay = eG[..., -1, :, None]  # [B, Hv, n, 1 or Dk, 1]: scales the state's key rows

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

    q, k [B, Hv, Dk] (q already scaled), v [B, Hv, Dv], beta [B, Hv], g [B, Hv] (per head) or
    [B, Hv, Dk] (per key channel), state [B, Hv, Dk, Dv] -> (o [B, Hv, Dv], new state [B, Hv, Dk, Dv]).
    """
    S = state * (g[..., None] if g.dim() == 3 else g[..., None, None]).exp()
    delta = beta[..., None] * (v - (k[..., None] * S).sum(-2))  # [B, H, V]
    S = S + k[..., None] * delta[..., None, :]
    return (q[..., None] * S).sum(-2), S


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def causal_conv_prefill(mixed: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv) from a zero history (a prefill starts new sequences).

    mixed [B, Cc, L], weight [Cc, 1, W] -> [B, Cc, L]; leaves the last W-1 inputs in
    conv_cache [B, Cc, W-1].
    """
    W = weight.shape[-1]
    padded = F.pad(mixed, (W - 1, 0))
    conv_cache.copy_(padded[:, :, padded.shape[2] - (W - 1):])
    return F.silu(F.conv1d(padded, weight.to(padded.dtype), groups=padded.shape[1]))


def causal_conv_extend(mixed: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor) -> torch.Tensor:
    """The same conv over L new inputs after the cached W-1: mixed [B, Cc, L] -> [B, Cc, L];
    leaves the last W-1 inputs in conv_cache [B, Cc, W-1]."""
    W = weight.shape[-1]
    padded = torch.cat((conv_cache.to(mixed.dtype), mixed), dim=-1)  # [B, Cc, W-1+L]
    conv_cache.copy_(padded[:, :, padded.shape[2] - (W - 1):])
    return F.silu(F.conv1d(padded, weight.to(padded.dtype), groups=padded.shape[1]))


def causal_conv_step(new: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor) -> torch.Tensor:
    """One decode step of the same conv: new [B, Cc, 1] -> [B, Cc]; shifts conv_cache [B, Cc, W-1]."""
    window = torch.cat((conv_cache.to(new.dtype), new), dim=-1)  # [B, Cc, W]
    conv_cache.copy_(window[:, :, 1:])
    return F.silu((window * weight[:, 0].to(window.dtype)).sum(-1))


# ---------------------------------------------------------------------------- modules

def check_conv_and_chunk(spec) -> Optional[str]:
    """The conv width and chunk size checks every delta-rule Spec shares."""
    if spec.conv_kernel < 2:
        return f"conv_kernel={spec.conv_kernel} must be >= 2"
    if spec.chunk_size <= 0:
        return f"chunk_size={spec.chunk_size} must be positive"
    return None


class GatedRMSNorm(nn.Module):
    """y = rmsnorm(x) * w * act(z) over the last dim, plain weight (not zero-centred); act is
    silu (Gated DeltaNet) or sigmoid (Kimi Delta Attention).

    x, z [..., Dv] -> [..., Dv]; normalised in float32, gated in float32, cast back.
    """

    def __init__(self, dim: int, eps: float, gate: str = "silu"):
        super().__init__()
        self.eps = eps
        self.act = {"silu": F.silu, "sigmoid": torch.sigmoid}[gate]
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * y).float() * self.act(z.float())).to(x.dtype)


@register("mixer", "gated_deltanet")
class GatedDeltaNet(Mixer):
    @dataclass
    class Spec(KindSpec):
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
            return check_conv_and_chunk(self)

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
        self.qkv_split = [key, key, value]  # the conv channels [q | k | v]
        self.split = [s.conv_dim, value, s.n_v_heads, s.n_v_heads]  # in_proj rows: qkv z b a
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

    def shard(self, plan) -> bool:
        """Value heads split over the ranks, with the key heads they read: in_proj by head in each
        of its q | k | v | z | b | a parts, the conv channels, A_log and dt_bias alike, out_proj
        row-parallel. With fewer key heads than ranks each rank keeps the one key head its value
        heads read (replicated over tp / Hk ranks). The state holds local value heads only."""
        Hk, Hv, Dk, Dv = self.Hk, self.Hv, self.Dk, self.Dv
        v = plan.units(Hv, "n_v_heads")
        k = plan.units(Hk, "n_k_heads", replicate=True)
        key, value = Hk * Dk, Hv * Dv
        qkv = [span(0, k, Dk), span(key, k, Dk), span(2 * key, v, Dv)]
        plan.param(self.in_proj, "weight", {0: qkv + [span(2 * key + value, v, Dv),
                                                      span(2 * key + 2 * value, v, 1),
                                                      span(2 * key + 2 * value + Hv, v, 1)]})
        plan.param(self, "conv_weight", {0: qkv})
        plan.param(self, "A_log", {0: [v]})
        plan.param(self, "dt_bias", {0: [v]})
        plan.row(self.out_proj, [span(0, v, Dv)])
        self.Hk, self.Hv = k[1] - k[0], v[1] - v[0]
        key, value = self.Hk * Dk, self.Hv * Dv
        self.qkv_split = [key, key, value]  # local conv channels [q | k | v]
        self.split = [2 * key + value, value, self.Hv, self.Hv]  # in_proj rows: qkv z b a (local)
        return True

    def attention_flops(self, context):
        """Per token, whatever the context (int or array): the recurrence's work on each value
        head's state S [Dk, Dv], three multiply-adds per state element (S^T k, the rank-1 write
        k delta^T, S^T q), 2 FLOPs each; the decay scaling is elementwise (not counted, as norms)."""
        return 0 * context + 6 * self.Hv * self.Dk * self.Dv

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        conv_dim = self.conv_weight.shape[0]  # Cc (of this rank's heads under tensor parallelism)
        return {"conv": CacheField((max_batch, conv_dim, self.kernel - 1), dtype, grows=False),
                "state": CacheField((max_batch, self.Hv, self.Dk, self.Dv), torch.float32, grows=False)}

    # ------------------------------------------------------------------ pieces
    # (KimiDeltaAttention overrides _project and _gates; the rest is the same recurrence)

    def _project(self, x: torch.Tensor):
        """x [B, L, D] -> conv input [B, L, Cc], output gate z [B, L, Hv*Dv], decay g [B, L, Hv]
        (log space, float32), beta [B, L, Hv] (float32)."""
        qkv, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        return (qkv, z, *self._gates(b, a))

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b, a [..., Hv] -> decay g (log space, float32), beta (float32)."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, b.float().sigmoid()

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [B, L, Cc] -> q, k [B, Hv, L, Dk] (normalised, q scaled), v [B, Hv, L, Dv], float32."""
        B, L, _ = qkv.shape
        q, k, v = qkv.float().split(self.qkv_split, dim=-1)
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

    def _prefill_recurrence(self, x: torch.Tensor, cache: dict):
        """x [B, L, D] (new sequences) -> (the final state from zero [B, Hv, Dk, Dv], o [B, Hv, L, Dv],
        decay g [B, Hv, L] (or [B, Hv, L, Dk] per channel), beta [B, Hv, L], z); the conv inputs of
        the last W-1 positions go to cache["conv"]."""
        qkv, z, g, beta = self._project(x)
        conv = causal_conv_prefill(qkv.transpose(1, 2), self.conv_weight, cache["conv"])  # [B, Cc, L]
        q, k, v = self._heads(conv.transpose(1, 2))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(cache["state"]), self.chunk_size)
        return state, o, g, beta, z

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (new sequences, positions 0..L-1) -> [B, L, D]; leaves the conv inputs of
        the last W-1 positions and the final recurrent state in the cache."""
        state, o, _, _, z = self._prefill_recurrence(x, cache)
        cache["state"].copy_(state)
        return self._out(o, z, x.dtype)

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """prefill's recurrence, summarised per value head [B, Hv] (contracts.MixerStatistics):
        decay, the mean share exp(g) of the state kept per token (and channel, per-channel decay); write, the mean beta; state_norm,
        the final state's Frobenius norm; output_norm, the mean |o_t|."""
        scratch = {name: torch.zeros(f.shape, dtype=f.dtype, device=x.device)  # the layer's cache stays as it is
                   for name, f in self.cache_fields(x.shape[0], x.shape[1], x.dtype).items()}
        state, o, g, beta, _ = self._prefill_recurrence(x, scratch)
        return {"decay": g.exp().flatten(2).mean(-1), "write": beta.mean(-1),
                "state_norm": state.flatten(-2).norm(dim=-1), "output_norm": o.norm(dim=-1).mean(-1)}

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] after the rows' cached tokens -> [B, L, D]: the chunked form from the cached
        conv inputs and state (prefill's, started where the rows are), leaving both updated."""
        qkv, z, g, beta = self._project(x)
        conv = causal_conv_extend(qkv.transpose(1, 2), self.conv_weight, cache["conv"])  # [B, Cc, L]
        q, k, v = self._heads(conv.transpose(1, 2))
        o, state = chunk_gated_delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), cache["state"],
                                          self.chunk_size)
        cache["state"].copy_(state)
        return self._out(o, z, x.dtype)

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; one recurrent step from the cached conv inputs and state."""
        qkv, z, g, beta = self._project(x)
        conv = causal_conv_step(qkv.transpose(1, 2), self.conv_weight, cache["conv"])  # [B, Cc]
        q, k, v = self._heads(conv[:, None, :])
        o, state = recurrent_gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, 0], beta[:, 0],
                                              cache["state"])
        cache["state"].copy_(state)
        return self._out(o[:, :, None], z, x.dtype)
