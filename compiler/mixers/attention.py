"""Grouped-query attention (MHA when n_kv_heads == n_heads, MQA when 1) with a static KV cache.

    x [B, L, D] -> wqkv -> q [B, H, L, Dh], k/v [B, Hkv, L, Dh] -> RoPE on the first R channels
      prefill: causal SDPA within the prompt; k/v written to cache[:, :, :L]
      decode:  k/v written at each sequence's position; SDPA over the cache with a position mask
    -> wo -> [B, L, D]

Cache per layer: k, v [max_batch, Hkv, max_seq, Dh] (gpt-fast's static layout: SDPA reads it
without a copy; one slot per position).

Options (Qwen3-Next gated attention):
  output_gate  the q rows of wqkv hold [query Dh | gate Dh] per head (the checkpoint's q_proj
               layout, split by a view); the attention output is multiplied by sigmoid(gate)
               before wo: wqkv [(2H + 2Hkv) * Dh, D]
  qk_norm      q and k normalised per head over Dh (before RoPE) by the model's norm kind
               (q_norm, k_norm [Dh]; zero-centred when the model's norm is)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import AttentionMaps, Mixer
from ..engine.cache import CacheField
from .kv_cache import decode_mask, write_decode, write_prefill
from .scores import causal_mask, dot_scores, head_rows, masked_softmax
from ..norm.norms import make_norm
from ..registry import register
from ..position.rope import apply_rotary, rope_key


@register("mixer", "gqa")
class Attention(Mixer):
    @dataclass
    class Spec:
        kind: str = "gqa"
        n_heads: int = "???"  # type: ignore[assignment]
        n_kv_heads: Optional[int] = None  # None: n_heads (MHA)
        head_dim: Optional[int] = None  # None: dim // n_heads
        rotary_fraction: float = 1.0  # share of head_dim that RoPE rotates (partial rotary)
        rope_interleaved: bool = False  # channel pairs (2i, 2i+1) instead of rotate-half
        qkv_bias: bool = False
        out_bias: bool = False
        softmax_scale: Optional[float] = None  # None: head_dim ** -0.5
        output_gate: bool = False  # q rows hold [query | gate] per head; output * sigmoid(gate)
        qk_norm: bool = False  # per-head norm (the model's norm kind) on q and k before RoPE

        def resolve(self, model: dict) -> "Attention.Spec":
            head_dim = self.head_dim
            if head_dim is None and self.n_heads > 0 and model["dim"] % self.n_heads == 0:
                head_dim = model["dim"] // self.n_heads
            return replace(self, n_kv_heads=self.n_kv_heads or self.n_heads, head_dim=head_dim)

        def check(self, model: dict) -> Optional[str]:
            if self.n_heads <= 0 or self.n_kv_heads <= 0:
                return f"n_heads={self.n_heads} and n_kv_heads={self.n_kv_heads} must be positive"
            if self.head_dim is None:
                return (f"n_heads={self.n_heads} does not divide dim={model['dim']} "
                        f"(give head_dim explicitly if that is intended)")
            if self.n_heads % self.n_kv_heads:
                return f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}"
            rot = self.head_dim * self.rotary_fraction
            if rot != int(rot) or int(rot) % 2:
                return (f"rotary_fraction={self.rotary_fraction} of head_dim={self.head_dim} "
                        f"gives {rot} rotated channels; expected an even integer")
            return None

        @property
        def rot_dim(self) -> int:
            return int(self.head_dim * self.rotary_fraction)

    def __init__(self, spec: "Attention.Spec", model):
        super().__init__()
        self.spec = spec
        s = spec
        self.n_heads, self.n_kv_heads, self.head_dim, self.rot_dim = s.n_heads, s.n_kv_heads, s.head_dim, s.rot_dim
        self.rope = rope_key(self.rot_dim)
        self.scale = (s.softmax_scale or s.head_dim ** -0.5) * model.rope_impl.softmax_scale_factor()
        q_rows = (2 if s.output_gate else 1) * s.n_heads
        qkv_out = (q_rows + 2 * s.n_kv_heads) * s.head_dim
        self.wqkv = nn.Linear(model.dim, qkv_out, bias=s.qkv_bias)
        self.wo = nn.Linear(s.n_heads * s.head_dim, model.dim, bias=s.out_bias)
        if s.qk_norm:
            self.q_norm = make_norm(model.spec.norm, s.head_dim)
            self.k_norm = make_norm(model.spec.norm, s.head_dim)

    def rope_dims(self) -> list[int]:
        return [self.rot_dim]

    def attention_flops(self, context):
        """Per token at `context` cached tokens: q.k scores and the weighted sum of v."""
        return 4 * self.n_heads * self.head_dim * np.asarray(context)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        shape = (max_batch, self.n_kv_heads, max_seq, self.head_dim)
        return {"k": CacheField(shape, dtype, grows=True), "v": CacheField(shape, dtype, grows=True)}

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, L, D], cos/sin broadcastable to [B, 1, L, R/2] -> q [B,H,L,Dh], k, v [B,Hkv,L,Dh],
        gate [B, L, H*Dh] (None without output_gate)."""
        B, L, _ = x.shape
        H, Hkv, Dh, R = self.n_heads, self.n_kv_heads, self.head_dim, self.rot_dim
        gated = self.spec.output_gate
        q, k, v = self.wqkv(x).split([(2 if gated else 1) * H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        gate = None
        if gated:
            qg = q.view(B, L, H, 2 * Dh)
            q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, L, H * Dh)
        q = q.reshape(B, L, H, Dh)
        k = k.view(B, L, Hkv, Dh)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.view(B, L, Hkv, Dh).transpose(1, 2)
        il = self.spec.rope_interleaved
        if R == Dh:
            q, k = apply_rotary(q, cos, sin, il), apply_rotary(k, cos, sin, il)
        else:
            q = torch.cat((apply_rotary(q[..., :R], cos, sin, il), q[..., R:]), dim=-1)
            k = torch.cat((apply_rotary(k[..., :R], cos, sin, il), k[..., R:]), dim=-1)
        return q, k, v, gate

    def _out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        B, H, L, Dh = o.shape
        o = o.transpose(1, 2).reshape(B, L, H * Dh)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.wo(o)

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; fills cache slots 0..L-1."""
        cos, sin = ctx["rope"][self.rope]  # [L, R/2]
        q, k, v, gate = self._project(x, cos, sin)
        write_prefill(cache["k"], k)
        write_prefill(cache["v"], v)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self._out(o, gate)

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)) -> AttentionMaps:
        """prefill's attention as probabilities (contracts.AttentionProbe): its projection, norms,
        RoPE and scale, its causal mask. x [B, L, D] -> maps [B, h, L, L]; query head j reads KV
        head j // (H / Hkv)."""
        cos, sin = ctx["rope"][self.rope]
        q, k, _, _ = self._project(x, cos, sin)
        rows = head_rows(heads, self.n_heads)
        kv = torch.arange(rows.start, rows.stop, device=x.device) // (self.n_heads // self.n_kv_heads)
        logits = dot_scores(q[:, rows.start:rows.stop], k[:, kv], self.scale)
        logits, probs = masked_softmax(logits, causal_mask(x.shape[1], x.device))
        return AttentionMaps(probs, logits)

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; writes one cache slot per row."""
        cos, sin = ctx["rope"][self.rope]  # [B, R/2]
        q, k, v, gate = self._project(x, cos[:, None, None], sin[:, None, None])
        pos = ctx["pos"]
        write_decode(cache["k"], k, pos)
        write_decode(cache["v"], v, pos)
        kc, vc = cache["k"].to(q.dtype), cache["v"].to(q.dtype)
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=decode_mask(pos, kc.shape[2]),
                                           scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads)
        return self._out(o, gate)
