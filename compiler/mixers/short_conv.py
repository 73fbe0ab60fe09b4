"""The short gated causal convolution (LFM2's `conv` layers), and the causal depthwise conv with
a cached history that the SSM mixers (mamba.py, mamba2.py) share.

    x [B, L, D] -> in_proj -> b, c, x' [B, L, D] each
    u = b * x' -> causal depthwise conv over L (width W, no activation) -> c * conv -> out_proj

No attention weights and no recurrent state: `zoo patterns` has no map to draw for it; it reports
the gates instead (`mixer_statistics`, the whole layer as one head).

Forms: prefill runs the conv over the whole prompt at once (F.conv1d, after the cached history:
`prefill_from` takes that history, zeros for new sequences); decode runs one step from the last
W-1 inputs. `reference` is the naive per-token loop the tests hold both to.

Cache per layer, constant per sequence (grows=False):
  conv  [B, D, W-1]  the last W-1 conv inputs u (cache dtype)

Parameters: in_proj [3D, D] (rows b | c | x'), conv_weight [D, 1, W], conv_bias [D] (optional,
with the projections' biases: `bias`), out_proj [D, D].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import CacheField, KindSpec, Mixer
from ..registry import register


# ---------------------------------------------------------------------------- the causal conv

def conv_from_history(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv continuing after `history`, no activation.

    x [B, Cc, L], weight [Cc, 1, W], bias [Cc] or None, history [B, Cc, W-1] (the W-1 inputs
    before x; zeros for a new sequence) -> (y [B, Cc, L], the new history [B, Cc, W-1]).
    """
    W = weight.shape[-1]
    full = torch.cat((history.to(x.dtype), x), dim=-1)  # [B, Cc, W-1+L]
    y = F.conv1d(full, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), groups=x.shape[1])
    return y, full[:, :, full.shape[2] - (W - 1):]


def conv_step(new: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              history: torch.Tensor) -> torch.Tensor:
    """One token of the same conv: new [B, Cc] -> y [B, Cc]; shifts history [B, Cc, W-1] in place."""
    window = torch.cat((history.to(new.dtype), new[:, :, None]), dim=-1)  # [B, Cc, W]
    history.copy_(window[:, :, 1:])
    y = (window * weight[:, 0].to(window.dtype)).sum(-1)
    return y if bias is None else y + bias.to(y.dtype)


def check_conv(spec) -> Optional[str]:
    """The conv width check every conv-carrying Spec shares."""
    return None if spec.conv_kernel >= 2 else f"conv_kernel={spec.conv_kernel} must be >= 2"


# ---------------------------------------------------------------------------- the mixer

@register("mixer", "short_conv")
class ShortConv(Mixer):
    """LFM2's gated short convolution; no attention weights (see the module docstring)."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "short_conv"
        conv_kernel: int = 3  # W (LFM2's conv_L_cache)
        bias: bool = False  # in_proj, conv and out_proj biases (LFM2's conv_bias)

        def check(self, model: dict) -> Optional[str]:
            return check_conv(self)

    def __init__(self, spec: "ShortConv.Spec", model):
        super().__init__()
        self.spec, D = spec, model.dim
        self.kernel = spec.conv_kernel
        self.in_proj = nn.Linear(D, 3 * D, bias=spec.bias)
        self.conv_weight = nn.Parameter(torch.empty(D, 1, spec.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(D)) if spec.bias else None
        self.out_proj = nn.Linear(D, D, bias=spec.bias)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random-build values: a unit-sum causal conv."""
        nn.init.constant_(self.conv_weight, 1.0 / self.kernel)
        if self.conv_bias is not None:
            nn.init.zeros_(self.conv_bias)

    def rope_dims(self) -> list[int]:
        return []

    def attention_flops(self, context):
        """Per token, whatever the context: the conv's W multiply-adds per channel."""
        return 0 * context + 2 * self.conv_weight.shape[0] * self.kernel

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {"conv": CacheField((max_batch, self.conv_weight.shape[0], self.kernel - 1), dtype, grows=False)}

    def _gates(self, x: torch.Tensor):
        """x [B, L, D] -> u = b * x' [B, D, L], c [B, L, D]."""
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        return (b * xx).transpose(1, 2), c

    def prefill_from(self, x: torch.Tensor, history: torch.Tensor, cache: dict) -> torch.Tensor:
        """x [B, L, D] continuing after the conv inputs `history` [B, D, W-1] -> [B, L, D]; leaves
        the last W-1 inputs in cache["conv"]."""
        u, c = self._gates(x)
        y, new_history = conv_from_history(u, self.conv_weight, self.conv_bias, history)
        cache["conv"].copy_(new_history)
        return self.out_proj(c * y.transpose(1, 2))

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (new sequences: a zero history) -> [B, L, D]."""
        return self.prefill_from(x, torch.zeros_like(cache["conv"]), cache)

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] after the rows' cached tokens -> [B, L, D]: the conv over L tokens after the
        cached inputs, leaving the last W-1 in the cache."""
        return self.prefill_from(x, cache["conv"].clone(), cache)

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; one conv step from the cached inputs."""
        u, c = self._gates(x)
        y = conv_step(u[:, :, 0], self.conv_weight, self.conv_bias, cache["conv"])
        return self.out_proj(c * y[:, None, :])

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """The gates over a prompt, the layer as one head [B, 1] (contracts.MixerStatistics):
        input_gate, the mean |b|; output_gate, the mean |c|; output_norm, the mean |c * conv| per token."""
        u, c = self._gates(x)
        history = torch.zeros(x.shape[0], u.shape[1], self.kernel - 1, dtype=u.dtype, device=x.device)
        y, _ = conv_from_history(u, self.conv_weight, self.conv_bias, history)
        b = self.in_proj(x).chunk(3, dim=-1)[0]
        out = (c * y.transpose(1, 2)).float()
        return {"input_gate": b.float().abs().mean((1, 2))[:, None], "output_gate": c.float().abs().mean((1, 2))[:, None],
                "output_norm": out.norm(dim=-1).mean(-1)[:, None]}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The naive form, token by token from a zero history: x [B, L, D] -> [B, L, D]."""
        u, c = self._gates(x)
        W = self.kernel
        u = F.pad(u, (W - 1, 0))
        w = self.conv_weight[:, 0]
        ys = []
        for t in range(x.shape[1]):
            y = (u[:, :, t:t + W] * w).sum(-1)
            ys.append(y if self.conv_bias is None else y + self.conv_bias)
        return self.out_proj(c * torch.stack(ys, dim=1))
