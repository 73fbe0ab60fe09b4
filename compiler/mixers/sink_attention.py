"""Sliding-window shared-KV attention with learned attention sinks (DeepSeek-V4's attention for
its sliding-window layers).

    x [B, L, D]
      q:  wq_a -> q_norm -> wq_b -> [B, H, L, Dh] -> unweighted RMSNorm per head -> RoPE on the
          last R channels of each head
      kv: wkv -> kv_norm -> [B, 1, L, Dh] -> RoPE on its last R channels. One KV head, read as the
          keys AND the values of every query head (shared-KV multi-query attention).
      attention: a query at position t sees the keys at t - window + 1 .. t, plus a learned
          per-head sink: one more logit in the softmax, with no value. The sink takes probability
          mass without adding anything, so a head can attend to "nothing".
      o [B, H, L, Dh]: the values carried RoPE (K = V), so the inverse rotation (angle -t, the
          query's position) is applied to the last R channels of the output: what a key
          contributes then depends only on its distance to the query.
      grouped low-rank output: the H heads in G groups; each group's H*Dh/G channels -> o_lora
          (wo_a, one block per group), the G*o_lora results -> D (wo_b).

Rotated channels are the LAST R of each head (DeepSeek-V4 lays heads out as [nope | rope]),
pairs interleaved (2i, 2i+1) as its checkpoints store them (`rope_interleaved`).

Cache: a ring buffer of Sw = min(window, max_seq) slots per sequence, kv [B, 1, Sw, Dh]; position p
lives in slot p % Sw. A token never sees more than `window` keys, so nothing older needs keeping:
the cache is a constant per-sequence state (`grows=False`), not a per-token cost, and its size
does not depend on max_seq (for V4-Flash 128 slots instead of up to 1M).

    prefill: each query gathers the Sw keys of its own window ([B, H, L, Sw] scores, never
             [L, L]); the last Sw keys go to their ring slots.
    decode:  the key goes to slot pos % Sw; attention over the Sw slots (slot s holds a valid key
             iff s <= pos: before the ring wraps, slots above pos are still empty).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
from torch import nn

from .kv_cache import decode_mask, extend_positions, ring_positions, write_decode, write_ring, write_ring_extend
from .scores import head_rows
from ..contracts import AttentionMaps, CacheField, KeepFloat32, KindSpec, Mixer, span
from ..norm.norms import RMSNorm
from ..registry import register
from ..position.rope import apply_rotary, rope_key


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    """RoPE on the last `rot` channels of x [..., Dh]; cos/sin broadcast to [..., rot/2]."""
    return torch.cat((x[..., :-rot], apply_rotary(x[..., -rot:], cos, sin, interleaved)), dim=-1)


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """scores [..., S] (-inf where masked), sink broadcastable to [..., 1] -> probabilities
    [..., S] (float32) of a softmax over [scores | sink] with the sink's column dropped."""
    logits = torch.cat((scores.float(), sink.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return logits.softmax(dim=-1)[..., :-1]


def window_to_tokens(x: torch.Tensor, fill: float) -> torch.Tensor:
    """Per-query window columns [B, h, L, Sw] (column w: key t - Sw + 1 + w, as window_scores lays
    them out) -> per-token columns [B, h, L, L]; `fill` outside each query's window."""
    B, h, L, Sw = x.shape
    t = torch.arange(L, device=x.device)
    col = t[None, :] - t[:, None] + Sw - 1  # key s of query t sits in window column s - t + Sw - 1
    inside = (col >= 0) & (col < Sw)
    return x.gather(-1, col.clamp(0, Sw - 1).expand(B, h, L, L)).masked_fill(~inside, fill)


class AttentionSink(nn.Module, KeepFloat32):
    """weight [H]: one learned logit per head. Kept in float32, as checkpoints store it."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))


@register("mixer", "swa_mqa")
class SinkAttention(Mixer):
    """Parameters: wq_a [Cq, D], q_norm [Cq], wq_b [H*Dh, Cq], wkv [Dh, D], kv_norm [Dh],
    wo_a [G*Go, H*Dh/G] (G blocks of [Go, H*Dh/G]), wo_b [D, G*Go], sink.weight [H] (float32)."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "swa_mqa"
        n_heads: int = "???"  # type: ignore[assignment]
        head_dim: int = "???"  # type: ignore[assignment]
        q_lora_rank: int = "???"  # type: ignore[assignment]  # width of wq_a / q_norm
        rot_dim: int = "???"  # type: ignore[assignment]  # R: the LAST R channels of a head are rotated
        window: int = "???"  # type: ignore[assignment]  # a token sees itself and the window - 1 before it
        o_groups: int = "???"  # type: ignore[assignment]  # G: head groups of the output projection
        o_lora_rank: int = "???"  # type: ignore[assignment]  # Go: per-group width after wo_a
        rope_interleaved: bool = True  # rotary pairs (2i, 2i+1), as DeepSeek-V4 checkpoints store them
        rope_slot: str = "rope"  # which rope schedule: `rope`, or a name in the model's `ropes`
        norm_eps: Optional[float] = None  # eps of q_norm, the per-head query norm, kv_norm; null: the model's
        softmax_scale: Optional[float] = None  # null: head_dim ** -0.5

        def resolve(self, model: dict) -> "SinkAttention.Spec":
            eps = self.norm_eps if self.norm_eps is not None else model["norm"].eps
            return replace(self, norm_eps=eps)

        def check(self, model: dict) -> Optional[str]:
            dims = {k: getattr(self, k) for k in ("n_heads", "head_dim", "q_lora_rank", "window", "o_groups",
                                                  "o_lora_rank")}
            bad = {k: v for k, v in dims.items() if v <= 0}
            if bad:
                return f"{bad} must be positive"
            if self.rot_dim <= 0 or self.rot_dim % 2 or self.rot_dim > self.head_dim:
                return f"rot_dim={self.rot_dim} must be a positive even number <= head_dim={self.head_dim}"
            if self.n_heads % self.o_groups:
                return f"o_groups={self.o_groups} does not divide n_heads={self.n_heads}"
            slots = model.get("rope_slots", ["rope"])
            if self.rope_slot not in slots:
                return f"rope_slot={self.rope_slot!r} is not one of the model's rope slots {list(slots)}"
            return None

    def __init__(self, spec: "SinkAttention.Spec", model):
        super().__init__()
        self.spec = s = spec
        D = model.dim
        self.n_heads, self.head_dim, self.rot, self.window = s.n_heads, s.head_dim, s.rot_dim, s.window
        self.groups, self.o_rank = s.o_groups, s.o_lora_rank
        self.rope_slot = s.rope_slot
        self.rope = rope_key(s.rot_dim, s.rope_slot)
        self.scale = s.softmax_scale or s.head_dim ** -0.5
        self.eps = s.norm_eps
        norm = RMSNorm.Spec(eps=s.norm_eps)
        self.wq_a = nn.Linear(D, s.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(norm, s.q_lora_rank)
        self.wq_b = nn.Linear(s.q_lora_rank, s.n_heads * s.head_dim, bias=False)
        self.wkv = nn.Linear(D, s.head_dim, bias=False)
        self.kv_norm = RMSNorm(norm, s.head_dim)
        self.wo_a = nn.Linear(s.n_heads * s.head_dim // s.o_groups, s.o_groups * s.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(s.o_groups * s.o_lora_rank, D, bias=False)
        self.sink = AttentionSink(s.n_heads)

    def rope_dims(self) -> list[int]:
        return [self.rot]

    def shard(self, plan) -> bool:
        """Query heads split by output group: each rank keeps G / tp groups and their H / G heads
        each (wq_b column-parallel by head, the sinks alike; wo_a's blocks of those groups; wo_b
        row-parallel over their Go columns). Replicated: the one shared K=V head (wkv, kv_norm and
        its cache, which every query head reads), the low-rank query input (wq_a, q_norm), and in
        the compressed kinds the compressor (it pools that one head) and the indexer (its scores
        sum over all index heads before the top-k, as DSA's)."""
        H, Dh, G, Go = self.n_heads, self.head_dim, self.groups, self.o_rank
        g = plan.units(G, "o_groups")
        h = (g[0] * H // G, g[1] * H // G)
        plan.column(self.wq_b, [span(0, h, Dh)])
        plan.param(self.sink, "weight", {0: [h]})
        plan.column(self.wo_a, [span(0, g, Go)])
        plan.row(self.wo_b, [span(0, g, Go)])
        self.n_heads, self.groups = h[1] - h[0], g[1] - g[0]
        return True

    def slots(self, max_seq: int) -> int:
        """Sw: ring slots per sequence (a prompt shorter than the window never wraps)."""
        return min(self.window, max_seq)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {"kv": CacheField((max_batch, 1, self.slots(max_seq), self.head_dim), dtype, grows=False)}

    def attention_flops(self, context):
        """Per token at `context` cached tokens: q.k scores and the weighted sum of the shared K=V,
        over at most `window` keys."""
        return 4 * self.n_heads * self.head_dim * np.minimum(np.asarray(context), self.window)

    # ------------------------------------------------------------------ projections

    def query_residual(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, D] -> q_norm(wq_a(x)) [B, L, Cq] (compressed layers' indexer reads it too)."""
        return self.q_norm(self.wq_a(x))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_resid: Optional[torch.Tensor] = None):
        """x [B, L, D], cos/sin broadcastable to [B, 1, L, R/2] -> q [B, H, L, Dh], kv [B, 1, L, Dh]
        (normalised and rotated: what the cache holds). q_resid: query_residual(x), if at hand."""
        B, L, _ = x.shape
        il = self.spec.rope_interleaved
        q_resid = self.query_residual(x) if q_resid is None else q_resid
        q = self.wq_b(q_resid).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        qf = q.float()  # the per-head query norm has no weight
        q = (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        q = rope_tail(q, cos, sin, self.rot, il)
        kv = rope_tail(self.kv_norm(self.wkv(x))[:, None], cos, sin, self.rot, il)
        return q, kv

    def out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [B, H, L, Dh] -> inverse RoPE at the query positions -> grouped wo_a -> wo_b -> [B, L, D]."""
        B, H, L, Dh = o.shape
        o = rope_tail(o, cos, -sin, self.rot, self.spec.rope_interleaved)
        o = o.transpose(1, 2).reshape(B, L, self.groups, H * Dh // self.groups)
        w = self.wo_a.weight.view(self.groups, self.o_rank, -1)  # [G, Go, H*Dh/G]
        o = torch.einsum("blgi,goi->blgo", o, w).reshape(B, L, self.groups * self.o_rank)
        return self.wo_b(o)

    # ------------------------------------------------------------------ attention

    def attend_window(self, q: torch.Tensor, kv: torch.Tensor, slots: int) -> torch.Tensor:
        """Causal sliding-window attention within a prompt: every query gathers its own window.
        q [B, H, L, Dh], kv [B, 1, L, Dh] at positions 0..L-1, slots = Sw -> [B, H, L, Dh].

        Query t reads keys t - Sw + 1 .. t (gathered [B, L, Sw, Dh]: one KV head, Sw/H times the
        size of q), those before position 0 masked: [B, H, L, Sw] scores, never [L, L].
        Sw = min(window, max_seq) covers the window, or every earlier key when max_seq is shorter.
        """
        keys, scores = self.window_scores(q, kv, slots)
        probs = softmax_with_sink(scores, self.sink.weight.view(1, -1, 1, 1))
        return torch.einsum("bhlw,blwd->bhld", probs.to(keys.dtype), keys)

    def window_scores(self, q: torch.Tensor, kv: torch.Tensor, slots: int):
        """q [B, H, L, Dh], kv [B, 1, L, Dh] -> each query's window keys [B, L, Sw, Dh] and their
        scaled scores [B, H, L, Sw] (-inf before position 0); see attend_window."""
        L = q.shape[2]
        key = torch.arange(L, device=q.device)[:, None] - (slots - 1) + torch.arange(slots, device=q.device)
        keys = kv[:, 0][:, key.clamp(min=0)]  # [B, L, Sw, Dh]
        scores = torch.einsum("bhld,blwd->bhlw", q, keys) * self.scale
        return keys, scores.masked_fill(key < 0, float("-inf"))

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)) -> AttentionMaps:
        """prefill's attention as probabilities (contracts.AttentionProbe): its projection, RoPE,
        window scores and sink softmax, laid out per token [B, h, L, L]; extras "sink" [B, h, L].
        A window of min(window, L) slots sees what prefill's min(window, max_seq) does."""
        cos, sin = ctx["rope"][self.rope]
        q, kv = self.project(x, cos, sin)
        rows = head_rows(heads, self.n_heads)
        sel = slice(rows.start, rows.stop)
        _, scores = self.window_scores(q[:, sel], kv, self.slots(x.shape[1]))
        probs = softmax_with_sink(scores, self.sink.weight[sel].view(1, -1, 1, 1))
        return AttentionMaps(window_to_tokens(probs, 0.0), window_to_tokens(scores.float(), float("-inf")),
                             {"sink": 1 - probs.sum(-1)})

    write_ring = staticmethod(write_ring)  # kv_cache.write_ring (compressed layers pass it on)

    # ------------------------------------------------------------------ entry points

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; the last Sw keys go to the ring."""
        cos, sin = ctx["rope"][self.rope]  # [L, R/2]
        q, kv = self.project(x, cos, sin)
        self.write_ring(cache["kv"], kv)
        return self.out(self.attend_window(q, kv, cache["kv"].shape[2]), cos, sin)

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions start..start+L-1 (ctx["start"] [B]) -> [B, L, D]: the queries
        attend over the ring as it was and the chunk's own keys (masked by position and the Sw
        window), then the chunk's last Sw keys go to the ring."""
        cos, sin = ctx["rope"][self.rope]  # [B, L, R/2]
        cos, sin = cos[:, None], sin[:, None]
        q, kv = self.project(x, cos, sin)
        start, ring = ctx["start"], cache["kv"]
        qpos = extend_positions(start, x.shape[1])  # [B, L]
        kpos = torch.cat((ring_positions(start, ring.shape[2]), qpos), dim=1)  # [B, Sw + L]
        keys = torch.cat((ring.to(q.dtype), kv), dim=2)  # [B, 1, Sw + L, Dh]
        d = qpos[:, :, None] - kpos[:, None, :]
        visible = (d >= 0) & (d < ring.shape[2]) & (kpos[:, None, :] >= 0)  # [B, L, Sw + L]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, H, L, Sw + L]
        probs = softmax_with_sink(scores.masked_fill(~visible[:, None], float("-inf")),
                                  self.sink.weight.view(1, -1, 1, 1))
        o = torch.matmul(probs.to(keys.dtype), keys)
        write_ring_extend(ring, kv, start)
        return self.out(o, cos, sin)

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; writes ring slot pos % Sw."""
        cos, sin = ctx["rope"][self.rope]  # [B, R/2]
        cos, sin = cos[:, None, None], sin[:, None, None]
        q, kv = self.project(x, cos, sin)
        pos, ring = ctx["pos"], cache["kv"]
        write_decode(ring, kv, pos % ring.shape[2])
        keys = ring.to(q.dtype)  # [B, 1, Sw, Dh]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, H, 1, Sw]
        scores = scores.masked_fill(~decode_mask(pos, ring.shape[2]), float("-inf"))
        probs = softmax_with_sink(scores, self.sink.weight.view(1, -1, 1, 1))
        return self.out(torch.matmul(probs.to(keys.dtype), keys), cos, sin)
