"""Mamba2: the state-space dual (SSD) mixer (Mamba2, Bamba, NemotronH, Zamba2, Falcon-H1, Granite 4
hybrids).

    x [B, L, D] -> in_proj -> z [B, L, Ci] | xbc [B, L, Ci + 2 Gs Ns] | dt' [B, L, Hs]
    xbc -> causal depthwise conv (width W, bias) -> SiLU -> u [B, L, Hs, Ps] | b, c [B, L, Gs, Ns]
    dt = clamp(softplus(dt' + dt_bias), time_step_limit)  [B, L, Hs];  A = -exp(A_log) [Hs]
    per head h (reading the b, c of its group h // (Hs / Gs)), state [Ps, Ns]:
        S_t = exp(dt_t A) S_{t-1} + dt_t u_t b_t^T
        y_t = S_t c_t + D u_t
    rmsnorm(y * SiLU(z)) per group of Ci / Gs channels, times a weight -> out_proj -> [B, L, D]
    (`gated_norm: false`, Falcon-H1: y * SiLU(z), no norm)

`in_multipliers` [5] (µP, Falcon-H1's ssm_multipliers): in_proj's output slices z | u | b | c | dt'
each times its multiplier, before anything reads them.

No attention weights (a scalar-decay recurrence per head), so `zoo patterns` has no map to draw;
it reports the recurrence through `mixer_statistics`.

Three forms of the same recurrence:
  prefill    chunked SSD (`ssd_scan`): within a chunk of Lc tokens the outputs are one masked
             [Lc, Lc] product per head (scores c_i . b_j exp(G_i - G_j), j <= i, G the cumulative
             log decay), plus the start state's contribution; only the state crosses chunk
             boundaries. Starts from a given state (zeros for new sequences, the cached one to
             continue a sequence).
  decode     recurrent (`ssd_step`): one step from the cached state.
  reference  `ssd_reference`, the token loop the tests hold both to.

Cache per layer, constant per sequence (grows=False):
  conv   [B, Ci + 2 Gs Ns, W-1]  the last W-1 conv inputs (cache dtype)
  state  [B, Hs, Ps, Ns]         the SSM state, always float32

Parameters: in_proj [2 Ci + 2 Gs Ns + Hs, D] (rows z | u | b | c | dt'), conv_weight
[Ci + 2 Gs Ns, 1, W], conv_bias (with `conv_bias`), dt_bias [Hs], A_log [Hs], D [Hs],
norm.weight [Ci] (with `gated_norm`), out_proj [D, Ci] (its bias: `out_bias`, default `bias`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import CacheField, KindSpec
from ..registry import register
from .short_conv import check_conv, conv_from_history, conv_step
from .ssm_scan import ScanMixer


# ---------------------------------------------------------------------------- the three forms

@torch.library.custom_op("zoo::ssd_scan", mutates_args=())
def ssd_scan(u: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, initial_state: torch.Tensor,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD, float32.

    u [B, Hs, L, Ps] (already scaled by dt), a [B, Hs, L] (log decay dt * A, <= 0), b, c
    [B, Hs, L, Ns] (per head), initial_state [B, Hs, Ps, Ns] -> (y [B, Hs, L, Ps] = S_t c_t (no D
    term), the final state).

    Per chunk, with G_i = a_1 + ... + a_i and start state S0:
        Y = ((C B^T) * exp(G_i - G_j) [j <= i]) U + exp(G) * (C S0^T)
        S_end = exp(G_Lc) S0 + (U * exp(G_Lc - G))^T B
    A custom op: the loop over chunks runs eagerly inside (one op in a compiled prefill).
    """
    u, a, b, c = u.float(), a.float(), b.float(), c.float()
    L = u.shape[2]
    S = initial_state.float()
    y = u.new_empty(u.shape)
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        G = torch.cumsum(a[:, :, s:e], dim=-1)  # [B, Hs, l]
        above = torch.ones(e - s, e - s, dtype=torch.bool, device=u.device).triu_(1)
        decay = (G[..., :, None] - G[..., None, :]).masked_fill_(above, float("-inf")).exp_()  # [B, Hs, l, l]
        cs, bs, us = c[:, :, s:e], b[:, :, s:e], u[:, :, s:e]
        scores = (cs @ bs.transpose(-1, -2)) * decay
        y[:, :, s:e] = scores @ us + torch.exp(G)[..., None] * (cs @ S.transpose(-1, -2))
        w = torch.exp(G[..., -1:] - G)[..., None]  # [B, Hs, l, 1]
        S = torch.exp(G[..., -1])[..., None, None] * S + (us * w).transpose(-1, -2) @ bs
    return y, S.contiguous()


@ssd_scan.register_fake
def _ssd_scan_fake(u, a, b, c, initial_state, chunk_size):
    return (u.new_empty(u.shape, dtype=torch.float32),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32))


def ssd_step(u: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token, float32: u [B, Hs, Ps] (scaled by dt), a [B, Hs], b, c [B, Hs, Ns], state
    [B, Hs, Ps, Ns] -> (y [B, Hs, Ps], the new state)."""
    S = torch.exp(a.float())[..., None, None] * state.float() + u.float()[..., None] * b.float()[..., None, :]
    return (S * c.float()[..., None, :]).sum(-1), S


def ssd_reference(u, a, b, c, initial_state):
    """The naive token loop of `ssd_scan` (same arguments, no chunks)."""
    S, ys = initial_state.float(), []
    for t in range(u.shape[2]):
        y, S = ssd_step(u[:, :, t], a[:, :, t], b[:, :, t], c[:, :, t], S)
        ys.append(y)
    return torch.stack(ys, dim=2), S


class GroupedGatedRMSNorm(nn.Module):
    """y = rmsnorm(x * SiLU(z)) over groups of `group` channels, times a plain weight (Mamba2's
    norm_before_gate=False). x, z [..., Ci] -> [..., Ci]; in float32, cast back before the weight."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------- the mixer

@register("mixer", "mamba2")
class Mamba2(ScanMixer):
    """Mamba2's SSD mixer; no attention weights (see the module docstring)."""

    naive_scan = staticmethod(ssd_reference)

    @dataclass
    class Spec(KindSpec):
        kind: str = "mamba2"
        n_heads: int = "???"  # type: ignore[assignment]  # Hs
        head_dim: int = 64  # Ps (Ci = Hs * Ps)
        d_state: int = 128  # Ns
        n_groups: int = 1  # Gs: b / c groups, each serving Hs / Gs heads
        conv_kernel: int = 4  # W
        conv_bias: bool = True
        bias: bool = False  # in_proj / out_proj biases
        chunk_size: int = 256  # Lc
        norm_eps: float = 1e-5  # eps of the gated RMSNorm
        time_step_limit: List[float] = field(default_factory=lambda: [0.0, math.inf])  # dt clamp
        gated_norm: bool = True  # rmsnorm(y * SiLU(z)) * w; false: y * SiLU(z) (Falcon-H1)
        out_bias: Optional[bool] = None  # out_proj's bias; None: `bias`
        in_multipliers: Optional[List[float]] = None  # z | u | b | c | dt' slices of in_proj (µP)

        def check(self, model: dict) -> Optional[str]:
            for key in ("n_heads", "head_dim", "d_state", "n_groups", "chunk_size"):
                if getattr(self, key) <= 0:
                    return f"{key}={getattr(self, key)} must be positive"
            if self.n_heads % self.n_groups:
                return (f"n_heads={self.n_heads} must be a multiple of n_groups={self.n_groups} "
                        f"(each b / c group serves n_heads / n_groups heads)")
            if len(self.time_step_limit) != 2 or self.time_step_limit[0] > self.time_step_limit[1]:
                return f"time_step_limit={list(self.time_step_limit)}: expected [min, max] with min <= max"
            if self.in_multipliers is not None and len(self.in_multipliers) != 5:
                return (f"in_multipliers={list(self.in_multipliers)}: expected 5 values, for in_proj's "
                        f"z | x | B | C | dt slices (or null)")
            return check_conv(self)

        @property
        def d_inner(self) -> int:
            """Ci = Hs * Ps."""
            return self.n_heads * self.head_dim

    def __init__(self, spec: "Mamba2.Spec", model):
        super().__init__()
        s = self.spec = spec
        self.Hs, self.Ps, self.Ns, self.Gs = s.n_heads, s.head_dim, s.d_state, s.n_groups
        self.kernel, self.chunk_size = s.conv_kernel, s.chunk_size
        Ci = s.d_inner
        self.conv_dim = Ci + 2 * s.n_groups * s.d_state
        self.split = [Ci, self.conv_dim, s.n_heads]  # in_proj rows: z | xbc | dt'
        self.in_proj = nn.Linear(model.dim, sum(self.split), bias=s.bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(s.n_heads))
        self.A_log = nn.Parameter(torch.empty(s.n_heads))
        self.D = nn.Parameter(torch.empty(s.n_heads))
        self.norm = GroupedGatedRMSNorm(Ci, Ci // s.n_groups, s.norm_eps) if s.gated_norm else None
        self.out_proj = nn.Linear(Ci, model.dim, bias=s.bias if s.out_bias is None else s.out_bias)
        GN = s.n_groups * s.d_state
        # [z | u | b | c | dt'] slice widths of in_proj, each scaled by its multiplier (µP)
        self.in_slices = None if s.in_multipliers is None else list(zip(
            [Ci, Ci, GN, GN, s.n_heads], [float(m) for m in s.in_multipliers]))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random-build values: a unit-sum conv, A = 1..Hs, D = 1, dt near 0.01."""
        nn.init.constant_(self.conv_weight, 1.0 / self.kernel)
        if self.conv_bias is not None:
            nn.init.zeros_(self.conv_bias)
        self.A_log.data.copy_(torch.log(torch.arange(1, self.Hs + 1, dtype=torch.float32)))
        nn.init.ones_(self.D)
        nn.init.constant_(self.dt_bias, math.log(math.expm1(0.01)))

    def rope_dims(self) -> list[int]:
        return []

    def attention_flops(self, context):
        """Per token, whatever the context: 3 multiply-adds per state element [Hs, Ps, Ns]."""
        return 0 * context + 6 * self.Hs * self.Ps * self.Ns

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {"conv": CacheField((max_batch, self.conv_dim, self.kernel - 1), dtype, grows=False),
                "state": CacheField((max_batch, self.Hs, self.Ps, self.Ns), torch.float32, grows=False)}

    # ------------------------------------------------------------------ pieces

    def _project(self, x: torch.Tensor):
        """x [B, L, D] -> z [B, L, Ci], xbc [B, L, Cc], dt' [B, L, Hs] (each slice times its
        in_multiplier, where given)."""
        p = self.in_proj(x)
        if self.in_slices is not None:
            parts = p.split([w for w, _ in self.in_slices], dim=-1)
            p = torch.cat([t * m for t, (_, m) in zip(parts, self.in_slices)], dim=-1)
        return p.split(self.split, dim=-1)

    def _split(self, conv: torch.Tensor, dt: torch.Tensor):
        """Conv output [B, L, Cc] (after SiLU), dt' [B, L, Hs] -> u [B, Hs, L, Ps] (not scaled),
        b, c [B, Hs, L, Ns] (per head), dt [B, Hs, L] float32."""
        B, L, _ = conv.shape
        Ci, GN = self.Hs * self.Ps, self.Gs * self.Ns
        u, b, c = conv.float().split([Ci, GN, GN], dim=-1)
        rep = self.Hs // self.Gs
        b = b.view(B, L, self.Gs, self.Ns).repeat_interleave(rep, dim=2).transpose(1, 2)
        c = c.view(B, L, self.Gs, self.Ns).repeat_interleave(rep, dim=2).transpose(1, 2)
        lo, hi = self.spec.time_step_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(lo, hi).transpose(1, 2)
        return u.view(B, L, self.Hs, self.Ps).transpose(1, 2), b, c, dt

    def _out(self, y: torch.Tensor, u: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [B, Hs, L, Ps] float32 (S c), u [B, Hs, L, Ps], z [B, L, Ci] -> [B, L, D]."""
        y = y + u * self.D.float()[:, None, None]
        B, _, L, _ = y.shape
        y = y.transpose(1, 2).reshape(B, L, -1).to(dtype)
        if self.norm is None:
            return self.out_proj((y.float() * F.silu(z.float())).to(dtype))
        return self.out_proj(self.norm(y, z))

    def _prefill_scan(self, x: torch.Tensor, conv_history: torch.Tensor, state: torch.Tensor, cache: dict,
                      scan=None):
        """x [B, L, D] continuing after `conv_history` and `state` -> (y, u, z, dt, final state);
        the new conv history goes to cache["conv"]."""
        z, xbc, dtr = self._project(x)
        conv, history = conv_from_history(xbc.transpose(1, 2), self.conv_weight, self.conv_bias, conv_history)
        cache["conv"].copy_(history)
        u, b, c, dt = self._split(F.silu(conv).transpose(1, 2), dtr)
        a = dt * -torch.exp(self.A_log.float())[:, None]
        if scan is None:
            y, final = ssd_scan(u * dt[..., None], a, b, c, state, self.chunk_size)
        else:
            y, final = scan(u * dt[..., None], a, b, c, state)
        return y, u, z, dt, final

    # ------------------------------------------------------------------ entry points

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; one recurrent step from the cached conv inputs and state."""
        z, xbc, dtr = self._project(x)
        conv = F.silu(conv_step(xbc[:, 0], self.conv_weight, self.conv_bias, cache["conv"]))[:, None]
        u, b, c, dt = self._split(conv, dtr)
        a = dt * -torch.exp(self.A_log.float())[:, None]
        y, state = ssd_step((u * dt[..., None])[:, :, 0], a[:, :, 0], b[:, :, 0], c[:, :, 0], cache["state"])
        cache["state"].copy_(state)
        return self._out(y[:, :, None], u, z, x.dtype)

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """prefill's scan, summarised per head [B, Hs] (contracts.MixerStatistics): decay, the mean
        share exp(dt A) of the state kept per token; write, the mean dt; state_norm, the final
        state's Frobenius norm; output_norm, the mean |y_t|."""
        scratch = self._scratch(x)  # the layer's cache stays as it is
        y, _, _, dt, final = self._prefill_scan(x, scratch["conv"], scratch["state"], scratch)
        decay = torch.exp(dt * -torch.exp(self.A_log.float())[:, None])
        return {"decay": decay.mean(-1), "write": dt.mean(-1), "state_norm": final.flatten(-2).norm(dim=-1),
                "output_norm": y.norm(dim=-1).mean(-1)}
