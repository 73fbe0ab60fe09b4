"""Mamba (Mamba-1): the selective state-space scan (state-spaces/mamba, Falcon-Mamba, Jamba's
SSM layers).

    x [B, L, D] -> in_proj -> x', z [B, L, Ci]
    x' -> causal depthwise conv (width W, bias) -> SiLU -> u [B, L, Ci]
    u -> x_proj -> dt' [B, L, Rt], b, c [B, L, Ns]     (`bcdt_norm`: each RMS-normalised, without a
                                                       weight (Falcon-Mamba) or with one (Jamba))
    dt = softplus(dt_proj(dt'))  [B, L, Ci]   (dt_proj has a bias)
    per channel i and state entry n, A = -exp(A_log) [Ci, Ns]:
        h_t = exp(dt_t A) * h_{t-1} + dt_t b_t u_t          h [B, Ci, Ns]
        y_t = c_t . h_t + D * u_t
    y * SiLU(z) -> out_proj -> [B, L, D]

No attention weights: the mixing is a per-channel recurrence, so `zoo patterns` has no map to
draw (it reports the recurrence through `mixer_statistics` instead).

Three forms of the same recurrence:
  prefill    chunked parallel scan (`selective_scan`): within a chunk of Lc tokens the affine maps
             h -> a_t h + b_t are composed by a Hillis-Steele prefix scan (log2 Lc steps, products
             of decays only: no division, stable), and only the state crosses chunk boundaries.
             Memory O(Lc * Ci * Ns), independent of L. Starts from a given state (zeros for new
             sequences; the cached one to continue a sequence).
  decode     recurrent (`selective_step`): one step from the cached state.
  reference  `selective_scan_reference`, the token-by-token loop the tests hold both to.

Cache per layer, constant per sequence (grows=False):
  conv   [B, Ci, W-1]  the last W-1 conv inputs (cache dtype)
  state  [B, Ci, Ns]   the SSM state, always float32

Parameters: in_proj [2 Ci, D] (rows x' | z; bias with `bias`), conv_weight [Ci, 1, W], conv_bias
[Ci] (with `conv_bias`), x_proj [Rt + 2 Ns, Ci] (rows dt' | b | c), dt_proj [Ci, Rt] + bias [Ci],
A_log [Ci, Ns], D [Ci], out_proj [D, Ci] (bias with `bias`); with bcdt_norm=weighted also
dt_norm [Rt], b_norm [Ns], c_norm [Ns].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import CacheField, KindSpec
from ..registry import register
from .short_conv import check_conv, conv_from_history, conv_step
from .ssm_scan import ScanMixer


# ---------------------------------------------------------------------------- the three forms

@torch.library.custom_op("zoo::selective_scan", mutates_args=())
def selective_scan(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   initial_state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel selective scan, float32.

    u, dt [B, Ci, L] (dt after softplus), A [Ci, Ns] (negative), b, c [B, L, Ns], initial_state
    [B, Ci, Ns] -> (y [B, Ci, L] = c_t . h_t (no D term, no gate), the final state [B, Ci, Ns]).

    A custom op: the loop over chunks runs eagerly inside, so a compiled prefill keeps one op for
    it whatever the (dynamic) prompt length.
    """
    u, dt, A, b, c = u.float(), dt.float(), A.float(), b.float(), c.float()
    L = u.shape[-1]
    S = initial_state.float()
    y = u.new_empty(u.shape)
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        dts = dt[:, :, s:e, None]  # [B, Ci, l, 1]
        a = torch.exp(dts * A[:, None, :])  # [B, Ci, l, Ns]
        w = dts * u[:, :, s:e, None] * b[:, None, s:e, :]  # [B, Ci, l, Ns]
        d = 1
        while d < e - s:  # inclusive prefix scan: token t composed with the maps before it
            w = torch.cat((w[:, :, :d], w[:, :, d:] + a[:, :, d:] * w[:, :, :-d]), dim=2)
            a = torch.cat((a[:, :, :d], a[:, :, d:] * a[:, :, :-d]), dim=2)
            d *= 2
        h = a * S[:, :, None] + w  # every state of the chunk [B, Ci, l, Ns]
        y[:, :, s:e] = (h * c[:, None, s:e, :]).sum(-1)
        S = h[:, :, -1]
    return y, S.contiguous()


@selective_scan.register_fake
def _selective_scan_fake(u, dt, A, b, c, initial_state, chunk_size):
    return (u.new_empty(u.shape, dtype=torch.float32),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32))


def selective_step(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token, float32: u, dt [B, Ci], A [Ci, Ns], b, c [B, Ns], state [B, Ci, Ns] ->
    (y [B, Ci] = c . h, the new state h [B, Ci, Ns])."""
    dt = dt.float()[..., None]
    h = torch.exp(dt * A.float()) * state.float() + dt * b.float()[:, None, :] * u.float()[..., None]
    return (h * c.float()[:, None, :]).sum(-1), h


def selective_scan_reference(u, dt, A, b, c, initial_state):
    """The naive token loop of `selective_scan` (same arguments, no chunks)."""
    S, ys = initial_state.float(), []
    for t in range(u.shape[-1]):
        y, S = selective_step(u[:, :, t], dt[:, :, t], A, b[:, t], c[:, t], S)
        ys.append(y)
    return torch.stack(ys, dim=-1), S


def weightless_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, cast back (Falcon-Mamba's b / c / dt norms; Jamba's
    then times a weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ---------------------------------------------------------------------------- the mixer

BCDT_NORMS = ("none", "weightless", "weighted")


@register("mixer", "mamba")
class Mamba(ScanMixer):
    """Mamba-1's selective scan; no attention weights (see the module docstring)."""

    naive_scan = staticmethod(selective_scan_reference)

    @dataclass
    class Spec(KindSpec):
        kind: str = "mamba"
        d_inner: int = "???"  # type: ignore[assignment]  # Ci (expand * D)
        d_state: int = 16  # Ns
        dt_rank: int = "???"  # type: ignore[assignment]  # Rt
        conv_kernel: int = 4  # W
        conv_bias: bool = True
        bias: bool = False  # in_proj / out_proj biases
        chunk_size: int = 64  # Lc: tokens per chunk of the chunked prefill scan
        bcdt_norm: str = "none"  # RMSNorm on dt', b, c: none | weightless (Falcon-Mamba) | weighted (Jamba)
        norm_eps: float = 1e-6  # eps of those norms

        def check(self, model: dict) -> Optional[str]:
            if self.bcdt_norm not in BCDT_NORMS:
                return f"bcdt_norm={self.bcdt_norm!r}: expected one of {list(BCDT_NORMS)}"
            for key in ("d_inner", "d_state", "dt_rank", "chunk_size"):
                if getattr(self, key) <= 0:
                    return f"{key}={getattr(self, key)} must be positive"
            return check_conv(self)

    def __init__(self, spec: "Mamba.Spec", model):
        super().__init__()
        s = self.spec = spec
        Ci, Ns, Rt = s.d_inner, s.d_state, s.dt_rank
        self.Ci, self.Ns, self.Rt, self.kernel, self.chunk_size = Ci, Ns, Rt, s.conv_kernel, s.chunk_size
        self.in_proj = nn.Linear(model.dim, 2 * Ci, bias=s.bias)
        self.conv_weight = nn.Parameter(torch.empty(Ci, 1, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(Ci)) if s.conv_bias else None
        self.x_proj = nn.Linear(Ci, Rt + 2 * Ns, bias=False)
        self.dt_proj = nn.Linear(Rt, Ci, bias=True)
        self.A_log = nn.Parameter(torch.empty(Ci, Ns))
        self.D = nn.Parameter(torch.empty(Ci))
        self.out_proj = nn.Linear(Ci, model.dim, bias=s.bias)
        if s.bcdt_norm == "weighted":
            self.dt_norm = nn.Parameter(torch.empty(Rt))
            self.b_norm = nn.Parameter(torch.empty(Ns))
            self.c_norm = nn.Parameter(torch.empty(Ns))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random-build values: a unit-sum conv, S4D-real A (1..Ns), D = 1, dt near 0.01, norms 1."""
        if self.spec.bcdt_norm == "weighted":
            for w in (self.dt_norm, self.b_norm, self.c_norm):
                nn.init.ones_(w)
        nn.init.constant_(self.conv_weight, 1.0 / self.kernel)
        if self.conv_bias is not None:
            nn.init.zeros_(self.conv_bias)
        self.A_log.data.copy_(torch.log(torch.arange(1, self.Ns + 1, dtype=torch.float32)).expand(self.Ci, -1))
        nn.init.ones_(self.D)
        nn.init.constant_(self.dt_proj.bias, math.log(math.expm1(0.01)))

    def rope_dims(self) -> list[int]:
        return []

    def attention_flops(self, context):
        """Per token, whatever the context: the state update and read, 3 multiply-adds per state
        element [Ci, Ns] (2 FLOPs each)."""
        return 0 * context + 6 * self.Ci * self.Ns

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {"conv": CacheField((max_batch, self.Ci, self.kernel - 1), dtype, grows=False),
                "state": CacheField((max_batch, self.Ci, self.Ns), torch.float32, grows=False)}

    # ------------------------------------------------------------------ pieces

    def _ssm_inputs(self, u: torch.Tensor):
        """Conv output u [B, L, Ci] -> dt [B, L, Ci] (after softplus, float32), b, c [B, L, Ns]."""
        dtr, b, c = self.x_proj(u).split([self.Rt, self.Ns, self.Ns], dim=-1)
        if self.spec.bcdt_norm != "none":
            eps = self.spec.norm_eps
            dtr, b, c = weightless_rmsnorm(dtr, eps), weightless_rmsnorm(b, eps), weightless_rmsnorm(c, eps)
            if self.spec.bcdt_norm == "weighted":
                dtr, b, c = self.dt_norm * dtr, self.b_norm * b, self.c_norm * c
        dt = F.softplus(self.dt_proj(dtr).float())
        return dt, b, c

    def _out(self, y: torch.Tensor, u: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [B, L, Ci] (float32, c . h), u, z [B, L, Ci] -> [B, L, D]."""
        y = (y + u.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(dtype))

    def _prefill_scan(self, x: torch.Tensor, conv_history: torch.Tensor, state: torch.Tensor, cache: dict,
                      scan=None):
        """x [B, L, D] continuing after `conv_history` [B, Ci, W-1] and `state` [B, Ci, Ns] ->
        (y [B, L, Ci] float32, u, z, dt, the final state); the new conv history goes to cache["conv"]."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        u, history = conv_from_history(xs.transpose(1, 2), self.conv_weight, self.conv_bias, conv_history)
        cache["conv"].copy_(history)
        u = F.silu(u).transpose(1, 2)  # [B, L, Ci]
        dt, b, c = self._ssm_inputs(u)
        A = -torch.exp(self.A_log.float())
        if scan is None:
            y, final = selective_scan(u.transpose(1, 2), dt.transpose(1, 2), A, b, c, state, self.chunk_size)
        else:
            y, final = scan(u.transpose(1, 2), dt.transpose(1, 2), A, b, c, state)
        return y.transpose(1, 2), u, z, dt, final

    # ------------------------------------------------------------------ entry points

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; one recurrent step from the cached conv inputs and state."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(conv_step(xs[:, 0], self.conv_weight, self.conv_bias, cache["conv"]))[:, None]  # [B, 1, Ci]
        dt, b, c = self._ssm_inputs(u)
        y, state = selective_step(u[:, 0], dt[:, 0], -torch.exp(self.A_log.float()), b[:, 0], c[:, 0],
                                  cache["state"])
        cache["state"].copy_(state)
        return self._out(y[:, None], u, z, x.dtype)

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """prefill's scan, summarised per channel [B, Ci] (contracts.MixerStatistics):
        decay, the mean share exp(dt A) of the state kept per token and state entry; write, the mean dt;
        state_norm, the final state's norm over Ns; output_norm, the mean |y_t|."""
        scratch = self._scratch(x)  # the layer's cache stays as it is
        y, _, _, dt, final = self._prefill_scan(x, scratch["conv"], scratch["state"], scratch)
        A = -torch.exp(self.A_log.float())
        decay = torch.exp(dt[..., None] * A).mean(-1)  # [B, L, Ci]
        return {"decay": decay.mean(1), "write": dt.mean(1), "state_norm": final.norm(dim=-1),
                "output_norm": y.abs().mean(1)}
