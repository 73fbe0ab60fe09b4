"""Grouped-query attention (MHA when n_kv_heads == n_heads, MQA when 1) with a static KV cache.

    x [B, L, D] -> wqkv -> q [B, H, L, Dh], k/v [B, Hkv, L, Dh] -> RoPE on the first R channels
      prefill: causal SDPA within the prompt; k/v written to cache[:, :, :L]
      decode:  k/v written at each sequence's position; SDPA over the cache with a position mask
    -> wo -> [B, L, D]

Cache per layer: k, v [max_batch, Hkv, max_seq, Dh] (gpt-fast's static layout: SDPA reads it
without a copy; one slot per position).

Options:
  output_gate  the q rows of wqkv hold [query Dh | gate Dh] per head (the checkpoint's q_proj
               layout, split by a view); the attention output is multiplied by sigmoid(gate)
               before wo: wqkv [(2H + 2Hkv) * Dh, D] (Qwen3-Next)
  qk_norm      q and k normalised by the model's norm kind (zero-centred when the model's norm
               is; without a weight when qk_norm_affine is false: Llama 4's L2 norm): per head over Dh (qk_norm_over: head; q_norm, k_norm [Dh]; Qwen3, Gemma 3) or
               over the whole projection (projection; q_norm [H*Dh], k_norm [Hkv*Dh]; OLMo 2),
               before RoPE (qk_norm_at: before_rope) or after it (after_rope)
  clip_qkv     q, k and v clamped to [-clip_qkv, clip_qkv] right after the projection (OLMo 1.7)
  alibi        ALiBi: no rotary; each head adds slope_h * (key position) to its logits, the slopes
               Bloom's geometric series over H (alibi_slopes); with a window it is refused
  window       sliding window W: a token sees itself and the W - 1 before it (Mistral, Gemma,
               gpt-oss local layers). The cache is then a ring of Sw = min(W, max_seq) slots
               (kv_cache.py): O(W) per layer whatever the context, and a decode step reads Sw slots
  chunk        chunked attention C: a token at position p sees the keys k <= p of its own chunk,
               k // C == p // C (Llama 4's RoPE layers; block-diagonal causal). The cache is the
               window's ring of Sw = min(C, max_seq) slots: a chunk starts at slot 0, so the keys a
               decode step sees are slots 0..p % C; older slots (the previous chunk) are masked
  softcap      attention logits squashed to softcap * tanh(logits / softcap) (Gemma 2)
  sinks        one learned logit per head joins each softmax, with no value (gpt-oss; the softmax
               of sink_attention.py): sink.weight [H], float32
  rope_slot    which rope schedule the layer reads (Gemma 3: local layers their own theta)
  scale_dim    softmax scale scale_dim ** -0.5 instead of head_dim ** -0.5 (Gemma's
               query_pre_attn_scalar); softmax_scale, when given, wins
  temperature_beta, temperature_period, temperature_offset
               attention temperature by position: the query at position p (after RoPE) times
               1 + beta * log(1 + floor((p + offset) / period)), so that long contexts sharpen
               the softmax (Llama 4's attn_temperature_tuning, Ministral 3's llama_4_scaling_beta)

  rope_reversed
               RoPE rotates by the negative angle (NanoChat's rotate_half is (x2, -x1)): sin negated
  v_norm       v normalised per head over Dh by the model's norm kind without a weight (Gemma 4)

KV shared across layers (the model's kv_shared_layers, spec.ModelSpec.kv_sources; Gemma 3n / 4):
a consumer layer computes queries only (wqkv holds the q rows) and attends over its producer's
cache, which its own cache fields alias (CacheField.alias_of): the producer writes, then the
consumer reads, in the same step. A producer keeps one slot per position even with a window
(no ring): a consumer's prefill and extend queries need the keys a ring would have dropped; the
window is then a mask over the slots.

rotary_fraction 0 is a NoPE layer (SmolLM3): no rotary at all, and no cos/sin table asked for.

Without softcap or sinks both entry points call SDPA (a window is a boolean mask); with either,
`scores` -> `probabilities` -> `mix` spell the same attention out (one place a probe can read the
probabilities from). Prefill attends within the prompt ([L, L] scores, the window masked), then
keeps the last Sw keys; prompts longer than the window are fine. On the CPU (zoo's attention kernel
built, float32, no softcap / sinks / ALiBi) prefill, extend and decode instead compute each query
as a decode step does, so that a row gets the same bits on every path (issue #46): over a full
cache one_query.prefix_attention / decode_attention, over a window one_query.window_attention
(its keys in position order: the prompt's, the ring's, the ring's then the chunk's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import AttentionMaps, CacheField, KindSpec, Mixer, span
from ..errors import ConfigError
from . import one_query
from .kv_cache import (decode_mask, extend_positions, ring_positions, window_span, write_decode, write_extend,
                       write_prefill, write_ring, write_ring_extend)
from .scores import dot_scores, head_rows
from .sink_attention import AttentionSink, softmax_with_sink
from ..norm.norms import make_norm, weightless
from ..registry import register
from ..position.rope import apply_rotary, rope_key

QK_NORM_OVER = ("head", "projection")
QK_NORM_AT = ("before_rope", "after_rope")


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's per-head slopes [H] as Bloom computes them (float32): a geometric series over the
    largest power of two <= H, then every other term of the series for twice that many."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32, device="cpu")
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, device="cpu"))
    if closest != n_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, device="cpu")
        rest = min(closest, n_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * rest, 2, dtype=torch.int32,
                                                                     device="cpu"))])
    return slopes.tolist()


@register("mixer", "gqa")
class Attention(Mixer):
    @dataclass
    class Spec(KindSpec):
        kind: str = "gqa"
        n_heads: int = "???"  # type: ignore[assignment]
        n_kv_heads: Optional[int] = None  # None: n_heads (MHA)
        head_dim: Optional[int] = None  # None: dim // n_heads
        rotary_fraction: float = 1.0  # share of head_dim that RoPE rotates (partial rotary; 0: NoPE)
        rope_interleaved: bool = False  # channel pairs (2i, 2i+1) instead of rotate-half
        rope_reversed: bool = False  # rotate by -angle (sin negated: NanoChat's rotate_half)
        qkv_bias: bool = False
        out_bias: bool = False
        softmax_scale: Optional[float] = None  # None: head_dim ** -0.5
        output_gate: bool = False  # q rows hold [query | gate] per head; output * sigmoid(gate)
        qk_norm: bool = False  # norm (the model's norm kind) on q and k before RoPE
        qk_norm_over: str = "head"  # head: over Dh per head | projection: over all H*Dh (Hkv*Dh) channels
        qk_norm_at: str = "before_rope"  # before_rope | after_rope
        alibi: bool = False  # ALiBi biases instead of rotary (set rotary_fraction: 0)
        clip_qkv: Optional[float] = None  # clamp q, k, v to [-clip_qkv, clip_qkv] after the projection
        window: Optional[int] = None  # sliding window W (itself + W - 1 before); None: full causal
        chunk: Optional[int] = None  # chunked attention C: keys k <= p with k // C == p // C; None: off
        qk_norm_affine: bool = True  # false: the q/k norms carry no weight (Llama 4's L2 norm)
        softcap: Optional[float] = None  # attention logits -> softcap * tanh(logits / softcap)
        sinks: bool = False  # a learned per-head logit in every softmax (sink.weight [H])
        rope_slot: str = "rope"  # which rope schedule: `rope`, or a name in the model's `ropes`
        scale_dim: Optional[float] = None  # softmax scale scale_dim ** -0.5; None: head_dim
        temperature_beta: Optional[float] = None  # q * (1 + beta log(1 + floor((p + offset) / period)))
        temperature_period: Optional[float] = None
        temperature_offset: int = 0
        v_norm: bool = False  # v normalised per head (the model's norm kind, no weight)

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
            if self.qk_norm_over not in QK_NORM_OVER:
                return f"qk_norm_over={self.qk_norm_over!r}: expected one of {list(QK_NORM_OVER)}"
            if self.qk_norm_at not in QK_NORM_AT:
                return f"qk_norm_at={self.qk_norm_at!r}: expected one of {list(QK_NORM_AT)}"
            if self.alibi and (self.rotary_fraction or self.window is not None):
                return (f"alibi=true takes no rotary and no window (got rotary_fraction={self.rotary_fraction}, "
                        f"window={self.window}); ALiBi is the position signal")
            if self.clip_qkv is not None and self.clip_qkv <= 0:
                return f"clip_qkv must be positive (or null), got {self.clip_qkv}"
            if self.window is not None and self.window <= 0:
                return f"window must be a positive number of tokens (or null), got {self.window}"
            if self.chunk is not None and (self.chunk <= 0 or self.window is not None or self.alibi):
                return (f"chunk={self.chunk}: expected a positive number of tokens (or null), and no window "
                        f"(window={self.window}) or alibi beside it: a layer attends within its chunk or its window")
            if self.softcap is not None and self.softcap <= 0:
                return f"softcap must be positive (or null), got {self.softcap}"
            if self.scale_dim is not None and self.scale_dim <= 0:
                return f"scale_dim must be positive (or null), got {self.scale_dim}"
            if (self.temperature_beta is None) != (self.temperature_period is None):
                return (f"temperature_beta={self.temperature_beta} and temperature_period={self.temperature_period}: "
                        f"give both (the position temperature) or neither")
            if self.temperature_period is not None and self.temperature_period <= 0:
                return f"temperature_period must be positive (or null), got {self.temperature_period}"
            slots = model.get("rope_slots", ["rope"])
            if self.rope_slot not in slots:
                return f"rope_slot={self.rope_slot!r} is not one of the model's rope slots {list(slots)}"
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
        self.rope_slot, self.window, self.chunk = s.rope_slot, s.window, s.chunk
        # KV shared across layers: the layer whose cache this one reads (None: its own), and
        # whether a later layer reads this one's
        layer = getattr(model, "layer", None)
        sources = getattr(model.spec, "kv_sources", None) or {}
        self.kv_source = sources.get(layer)
        shared = self.kv_source is not None or layer in sources.values()
        if shared and s.chunk is not None:
            raise ConfigError(f"layer {layer}: kv_shared_layers with chunked attention (chunk={s.chunk}) is not "
                              f"supported: a chunk's ring cache drops the keys a sharing layer reads")
        # a ring cache of this many slots (at most); None: one per position (and always when shared)
        self.ring = None if shared else (s.window or s.chunk)
        self.rope = rope_key(self.rot_dim, s.rope_slot)
        # no rope softmax_scale_factor (YaRN's mscale^2): that is MLA's (DeepSeek); every GQA
        # attention in transformers keeps head_dim ** -0.5 under YaRN (Ministral 3, gpt-oss)
        self.scale = s.softmax_scale or (s.scale_dim or s.head_dim) ** -0.5
        self.explicit = s.softcap is not None or s.sinks or s.alibi  # SDPA's causal path has none of them
        self.slopes = alibi_slopes(s.n_heads) if s.alibi else None  # a list: no buffer to load
        q_rows = (2 if s.output_gate else 1) * s.n_heads
        kv_rows = 0 if self.kv_source is not None else 2 * s.n_kv_heads  # a consumer reads its keys
        qkv_out = (q_rows + kv_rows) * s.head_dim
        self.wqkv = nn.Linear(model.dim, qkv_out, bias=s.qkv_bias)
        self.wo = nn.Linear(s.n_heads * s.head_dim, model.dim, bias=s.out_bias)
        if s.qk_norm:
            whole = s.qk_norm_over == "projection"
            norm = model.spec.norm if s.qk_norm_affine else weightless(model.spec.norm)
            self.q_norm = make_norm(norm, s.head_dim * (s.n_heads if whole else 1))
            if self.kv_source is None:
                self.k_norm = make_norm(norm, s.head_dim * (s.n_kv_heads if whole else 1))
        self.v_norm = make_norm(weightless(model.spec.norm), s.head_dim) if s.v_norm else None
        if s.sinks:
            self.sink = AttentionSink(s.n_heads)

    def rope_dims(self) -> list[int]:
        return [self.rot_dim] if self.rot_dim else []

    def shard(self, plan) -> bool:
        """Heads split over the ranks: wqkv column-parallel by head (its q, k, v parts each
        sliced), wo row-parallel. With fewer kv heads than ranks each rank keeps the one kv head
        its query heads read (replicated over tp / Hkv ranks); the cache holds local heads only."""
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.kv_source is not None:
            raise ConfigError(f"runtime.parallel: a layer reading layer {self.kv_source}'s KV cache "
                              f"(kv_shared_layers) has no sharding plan yet")
        qh = plan.units(H, "n_heads")
        kvh = plan.units(Hkv, "n_kv_heads", replicate=True)
        qw = (2 if self.spec.output_gate else 1) * Dh  # q rows per head ([query | gate] when gated)
        rows = [span(0, qh, qw), span(H * qw, kvh, Dh), span(H * qw + Hkv * Dh, kvh, Dh)]
        if self.spec.qk_norm and self.spec.qk_norm_over == "projection":
            raise ConfigError("runtime.parallel: q/k norm over the whole projection (qk_norm_over: projection) "
                              "normalises across heads, which tensor parallelism splits; it has no sharding plan yet")
        plan.column(self.wqkv, rows)
        plan.row(self.wo, [span(0, qh, Dh)])
        if self.spec.sinks:
            plan.param(self.sink, "weight", {0: [qh]})
        if self.slopes is not None:
            self.slopes = self.slopes[qh[0]:qh[1]]
        self.n_heads, self.n_kv_heads = qh[1] - qh[0], kvh[1] - kvh[0]
        return True

    def attention_flops(self, context):
        """Per token at `context` cached tokens: q.k scores and the weighted sum of v (over at
        most `window` keys, or those of its own chunk)."""
        context = np.asarray(context)
        seen = context if self.window is None else np.minimum(context, self.window)
        seen = seen if self.chunk is None else np.remainder(seen, self.chunk)
        return 4 * self.n_heads * self.head_dim * seen

    def slots(self, max_seq: int) -> int:
        """Cache slots per sequence: max_seq, or the ring's Sw = min(window or chunk, max_seq)."""
        return max_seq if self.ring is None else min(self.ring, max_seq)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        """k, v [B, Hkv, S, Dh]: one slot per position (grows), or a ring of Sw slots: a constant
        per-sequence state, the last Sw keys."""
        shape = (max_batch, self.n_kv_heads, self.slots(max_seq), self.head_dim)
        grows = self.ring is None
        axis = 2 if grows else None  # slot p holds position p (a ring has no such axis)
        # a consumer's fields are its producer's (the plan allocates them once, there)
        return {"k": CacheField(shape, dtype, grows=grows, token_axis=axis, alias_of=self.kv_source),
                "v": CacheField(shape, dtype, grows=grows, token_axis=axis, alias_of=self.kv_source)}

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, L, D], cos/sin broadcastable to [B, 1, L, R/2] -> q [B,H,L,Dh], k, v [B,Hkv,L,Dh],
        gate [B, L, H*Dh] (None without output_gate)."""
        B, L, _ = x.shape
        H, Hkv, Dh, R = self.n_heads, self.n_kv_heads, self.head_dim, self.rot_dim
        gated = self.spec.output_gate
        qkv = self.wqkv(x)
        if self.spec.clip_qkv is not None:
            qkv = qkv.clamp(-self.spec.clip_qkv, self.spec.clip_qkv)
        if self.kv_source is not None:  # queries only: the keys are the producer's
            return self._project_q(qkv, cos, sin)
        q, k, v = qkv.split([(2 if gated else 1) * H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        gate = None
        if gated:
            qg = q.view(B, L, H, 2 * Dh)
            q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, L, H * Dh)
        norm_at = self.spec.qk_norm_at if self.spec.qk_norm else None
        if norm_at == "before_rope":
            q, k = self._qk_norm(q, k)
        q = q.reshape(B, L, H, Dh).transpose(1, 2)
        k = k.reshape(B, L, Hkv, Dh).transpose(1, 2)
        v = v.view(B, L, Hkv, Dh)
        v = (v if self.v_norm is None else self.v_norm(v)).transpose(1, 2)
        il = self.spec.rope_interleaved
        if R and self.spec.rope_reversed:
            sin = -sin
        if R == 0:  # NoPE
            pass
        elif R == Dh:
            q, k = apply_rotary(q, cos, sin, il), apply_rotary(k, cos, sin, il)
        else:
            q = torch.cat((apply_rotary(q[..., :R], cos, sin, il), q[..., R:]), dim=-1)
            k = torch.cat((apply_rotary(k[..., :R], cos, sin, il), k[..., R:]), dim=-1)
        if norm_at == "after_rope":
            q, k = self._qk_norm(q.transpose(1, 2), k.transpose(1, 2))
            q, k = q.reshape(B, L, H, Dh).transpose(1, 2), k.reshape(B, L, Hkv, Dh).transpose(1, 2)
        return q, k, v, gate

    def _project_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A consumer's projection q rows [B, L, (2)H*Dh] -> (q [B, H, L, Dh], None, None, gate):
        the same norm and RoPE as a producer's queries."""
        B, L, _ = q.shape
        H, Dh, R, il = self.n_heads, self.head_dim, self.rot_dim, self.spec.rope_interleaved
        gate = None
        if self.spec.output_gate:
            qg = q.view(B, L, H, 2 * Dh)
            q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, L, H * Dh)
        norm_at = self.spec.qk_norm_at if self.spec.qk_norm else None
        whole = self.spec.qk_norm_over == "projection"

        def q_norm(q):  # [B, L, H, Dh] -> the same, normalised per head or over the projection
            return self.q_norm(q.reshape(B, L, H * Dh) if whole else q).view(B, L, H, Dh)

        q = q.reshape(B, L, H, Dh)
        if norm_at == "before_rope":
            q = q_norm(q)
        q = q.transpose(1, 2)
        if R and self.spec.rope_reversed:
            sin = -sin
        if R == Dh:
            q = apply_rotary(q, cos, sin, il)
        elif R:
            q = torch.cat((apply_rotary(q[..., :R], cos, sin, il), q[..., R:]), dim=-1)
        if norm_at == "after_rope":
            q = q_norm(q.transpose(1, 2)).transpose(1, 2)
        return q, None, None, gate

    def _temper(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, Dh] at positions pos ([L], or [B, L]) -> q times its position temperature
        1 + beta * log(1 + floor((pos + offset) / period)) (unchanged without temperature_beta)."""
        s = self.spec
        if s.temperature_beta is None:
            return q
        p = torch.floor((pos.float() + s.temperature_offset) / s.temperature_period)
        t = 1 + s.temperature_beta * torch.log1p(p)
        return q * (t[:, None, :, None] if t.dim() == 2 else t[:, None]).to(q.dtype)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        """q [B, L, H*Dh or H, Dh], k [B, L, Hkv*Dh or Hkv, Dh] -> q [B, L, H, Dh], k [B, L, Hkv, Dh]
        normalised per head or over the whole projection (qk_norm_over)."""
        B, L = q.shape[:2]
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.spec.qk_norm_over == "projection":
            return (self.q_norm(q.reshape(B, L, H * Dh)).view(B, L, H, Dh),
                    self.k_norm(k.reshape(B, L, Hkv * Dh)).view(B, L, Hkv, Dh))
        return self.q_norm(q.reshape(B, L, H, Dh)), self.k_norm(k.reshape(B, L, Hkv, Dh))

    def _out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        B, H, L, Dh = o.shape
        o = o.transpose(1, 2).reshape(B, L, H * Dh)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.wo(o)

    # ------------------------------------------------------------------ attention

    @staticmethod
    def one_query(q: torch.Tensor) -> bool:
        """A decode step on the CPU. There the compiled flash kernel is the slow way to attend
        with one query per row (it tiles for many; SmolLM2's shapes at 512 positions: 1.95 ms
        for 16 rows, 320 us for one, one thread for one row): the scores as products summed over
        Dh, which inductor fuses into one loop over the cache, then a matmul with v, took 0.86 ms
        and 170 us."""
        return q.shape[2] == 1 and q.device.type == "cpu"

    def scores(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, Dh], k [B, Hkv, T, Dh], visible (bool, broadcastable to [B, H, L, T]) ->
        scaled (and soft-capped) logits [B, H, L, T] float32, -inf where not visible."""
        B, H, L, Dh = q.shape
        g = H // self.n_kv_heads  # the query heads of one KV head side by side
        if self.one_query(q):  # no transposed copy of the cache (see one_query)
            logits = (q.reshape(B, self.n_kv_heads, g, 1, Dh) * k[:, :, None]).sum(-1)
        else:
            logits = torch.matmul(q.reshape(B, self.n_kv_heads, g * L, Dh), k.transpose(-1, -2))
        logits = logits.view(B, H, L, -1).float() * self.scale
        if self.spec.softcap is not None:
            logits = torch.tanh(logits / self.spec.softcap) * self.spec.softcap
        if self.slopes is not None:
            logits = logits + self.alibi(logits.shape[-1], logits.device)
        return logits.masked_fill(~visible, float("-inf"))

    def alibi(self, T: int, device) -> torch.Tensor:
        """[1, H, 1, T] float32: slope_h * t for keys t = 0..T-1 (a key's cache slot is its
        position: ALiBi has no window)."""
        slopes = torch.tensor(self.slopes, dtype=torch.float32, device=device)
        return (slopes[:, None] * torch.arange(T, device=device, dtype=torch.float32))[None, :, None]

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [B, H, L, T] -> the softmax over the keys (and the sink, when learned), float32."""
        if self.spec.sinks:
            return softmax_with_sink(scores, self.sink.weight.view(1, -1, 1, 1))
        return scores.softmax(dim=-1)

    def mix(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """probs [B, H, L, T], v [B, Hkv, T, Dh] -> o [B, H, L, Dh] in v's dtype."""
        B, H, L, T = probs.shape
        g = H // self.n_kv_heads
        o = torch.matmul(probs.to(v.dtype).reshape(B, self.n_kv_heads, g * L, T), v)
        return o.view(B, H, L, -1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, Dh] over k, v [B, Hkv, T, Dh] where `visible` [.., L, T] -> [B, H, L, Dh]."""
        if self.explicit or self.one_query(q):
            return self.mix(self.probabilities(self.scores(q, k, visible)), v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale,
                                              enable_gqa=self.n_heads != self.n_kv_heads)

    def prompt_mask(self, L: int, device) -> torch.Tensor:
        """[L, L] bool: query t sees key s iff s <= t (and t - s < window, or s // C == t // C)."""
        t = torch.arange(L, device=device)
        return self.visible(t[:, None], t[None, :])

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Query positions and key positions (broadcast against each other) -> bool: causal, within
        the window or within the query's chunk."""
        diff = qpos - kpos
        visible = diff >= 0
        if self.window is not None:
            visible = visible & (diff < self.window)
        if self.chunk is not None:
            visible = visible & (torch.div(qpos, self.chunk, rounding_mode="floor")
                                 == torch.div(kpos, self.chunk, rounding_mode="floor"))
        return visible

    # ------------------------------------------------------------------ entry points

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; fills cache slots 0..L-1 (a ring: the
        last Sw positions)."""
        cos, sin = ctx["rope"][self.rope] if self.rot_dim else (None, None)  # [L, R/2]
        q, k, v, gate = self._project(x, cos, sin)
        q = self._temper(q, torch.arange(x.shape[1], device=x.device))
        if self.kv_source is None:
            write = write_prefill if self.ring is None else write_ring
            write(cache["k"], k)
            write(cache["v"], v)
        else:  # the producer wrote slots 0..L-1 of these fields earlier in this step
            # index_select, not a slice: a slice of symbolic length L specialises on L == S (write_prefill)
            slots = torch.arange(x.shape[1], device=x.device)
            k, v = (cache[n].index_select(2, slots).to(q.dtype) for n in ("k", "v"))
        if self.ring is None and self.prefix_kernel(ctx, q, cache["k"]):
            # each query as its decode step computes it, over the cache as decode reads it: the same
            # bits whole, in chunks, after a reused prefix or decoded (one_query.prefix_attention)
            start = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            o = one_query.prefix_attention(q, cache["k"].to(q.dtype), cache["v"].to(q.dtype), start, self.scale)
        elif self.window_kernel(ctx, q, k):  # the same for a sliding window: its keys in position order
            B, L = x.shape[:2]
            qpos = torch.arange(L, device=x.device).expand(B, L)
            first, n = window_span(qpos, torch.zeros(B, dtype=torch.long, device=x.device), self.window)
            o = one_query.window_attention(q, k, v, qpos, first, n, self.scale)
        elif self.ring is None and not self.explicit and self.window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            o = self.attend(q, k, v, self.prompt_mask(x.shape[1], x.device))
        return self._out(o, gate)

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)) -> AttentionMaps:
        """prefill's attention as probabilities (contracts.AttentionProbe): its projection, norms,
        RoPE, scale, soft-cap, causal/window mask and sinks. x [B, L, D] -> maps [B, h, L, L]
        (extras "sink" [B, h, L] with learned sinks); query head j reads KV head j // (H / Hkv)."""
        if self.kv_source is not None:
            raise ConfigError(f"attention probe: this layer reads layer {self.kv_source}'s keys "
                              f"(kv_shared_layers); it has no probe of its own yet")
        cos, sin = ctx["rope"][self.rope] if self.rot_dim else (None, None)
        q, k, _, _ = self._project(x, cos, sin)
        q = self._temper(q, torch.arange(x.shape[1], device=x.device))
        rows = head_rows(heads, self.n_heads)
        kv = torch.arange(rows.start, rows.stop, device=x.device) // (self.n_heads // self.n_kv_heads)
        logits = dot_scores(q[:, rows.start:rows.stop], k[:, kv], self.scale)
        if self.spec.softcap is not None:
            logits = torch.tanh(logits / self.spec.softcap) * self.spec.softcap
        if self.slopes is not None:
            logits = logits + self.alibi(x.shape[1], x.device)[:, rows.start:rows.stop]
        logits = logits.masked_fill(~self.prompt_mask(x.shape[1], x.device), float("-inf"))
        if not self.spec.sinks:
            return AttentionMaps(torch.softmax(logits, dim=-1), logits)
        probs = softmax_with_sink(logits, self.sink.weight[rows.start:rows.stop].view(1, -1, 1, 1))
        return AttentionMaps(probs, logits, {"sink": 1.0 - probs.sum(-1)})

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; writes one cache slot per row
        (pos, or pos % Sw in a ring). A chunked layer sees slots 0..pos % C (its chunk so far)."""
        if self.rot_dim:
            cos, sin = ctx["rope"][self.rope]  # [B, R/2]
            cos, sin = cos[:, None, None], sin[:, None, None]
        else:
            cos = sin = None
        q, k, v, gate = self._project(x, cos, sin)
        pos = ctx["pos"]
        q = self._temper(q, pos[:, None])
        S = cache["k"].shape[2]
        slot = pos if self.ring is None else pos % S
        if self.kv_source is None:  # a consumer reads the slot its producer wrote this step
            write_decode(cache["k"], k, slot)
            write_decode(cache["v"], v, slot)
        kc, vc = cache["k"].to(q.dtype), cache["v"].to(q.dtype)
        last = pos if self.chunk is None else pos % self.chunk  # the last visible slot
        if self.one_query_kernel(ctx, q, kc):
            o = one_query.decode_attention(q[:, :, 0], kc, vc, last + 1, self.scale)[:, :, None]
        elif self.window_kernel(ctx, q, kc):
            if self.ring is None:  # one slot per position (a window over a shared KV cache): slot p holds p
                p0 = torch.zeros_like(pos)
                slots = torch.arange(S, device=x.device).repeat(pos.shape[0], 1)
            else:  # the ring after this write: slot p % S holds position p
                p0 = pos - (S - 1)
                slots = torch.remainder(p0[:, None] + torch.arange(S, device=x.device), S)
            first, n = window_span(pos[:, None], p0, self.window)
            o = one_query.window_attention(q, kc, vc, slots, first, n, self.scale)
        else:
            visible = decode_mask(last, S)
            if self.ring is None and self.window is not None:  # a window over one slot per position
                visible = visible & (torch.arange(S, device=pos.device) > (pos - self.window)[:, None])[:, None, None]
            o = self.attend(q, kc, vc, visible)
        return self._out(o, gate)

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions start..start+L-1 (ctx["start"] [B]) -> [B, L, D]. Full cache:
        the chunk's keys go to their slots, then query t attends over slots <= t. Ring: the
        queries attend over the ring as it was (the last Sw positions before start) and the chunk's
        own keys, masked by position and window; then the chunk's last Sw keys go to the ring."""
        if self.rot_dim:
            cos, sin = ctx["rope"][self.rope]  # [B, L, R/2]
            cos, sin = cos[:, None], sin[:, None]
        else:
            cos = sin = None
        q, k, v, gate = self._project(x, cos, sin)
        start = ctx["start"]
        qpos = extend_positions(start, x.shape[1])  # [B, L]
        q = self._temper(q, qpos)
        if self.ring is None:
            if self.kv_source is None:  # a consumer reads the slots its producer wrote this step
                write_extend(cache["k"], k, qpos)
                write_extend(cache["v"], v, qpos)
            kc, vc = cache["k"].to(q.dtype), cache["v"].to(q.dtype)
            if self.prefix_kernel(ctx, q, kc):  # as prefill: each query as its decode step
                return self._out(one_query.prefix_attention(q, kc, vc, start, self.scale), gate)
            if self.window_kernel(ctx, q, kc):  # a window over one slot per position: slot p holds p
                slots = torch.arange(kc.shape[2], device=x.device).repeat(x.shape[0], 1)
                first, n = window_span(qpos, torch.zeros_like(start), self.window)
                return self._out(one_query.window_attention(q, kc, vc, slots, first, n, self.scale), gate)
            visible = self.visible(qpos[..., None], torch.arange(kc.shape[2], device=x.device))  # [B, L, S]
            return self._out(self.attend(q, kc, vc, visible[:, None]), gate)
        kpos = torch.cat((ring_positions(start, cache["k"].shape[2]), qpos), dim=1)  # [B, Sw + L]
        keys = torch.cat((cache["k"].to(q.dtype), k), dim=2)
        values = torch.cat((cache["v"].to(q.dtype), v), dim=2)
        if self.window_kernel(ctx, q, keys):  # keys by position: p0..start-1 in the ring, then the chunk's
            Sw = cache["k"].shape[2]
            p0 = start - Sw
            j = p0[:, None] + torch.arange(Sw + x.shape[1], device=x.device)  # [B, Sw + L]
            slots = torch.where(j >= start[:, None], Sw + j - start[:, None], torch.remainder(j, Sw))
            first, n = window_span(qpos, p0, self.window)
            o = one_query.window_attention(q, keys, values, slots, first, n, self.scale)
        else:
            visible = self.visible(qpos[:, :, None], kpos[:, None, :]) & (kpos[:, None, :] >= 0)  # [B, L, Sw + L]
            o = self.attend(q, keys, values, visible[:, None])
        write_ring_extend(cache["k"], k, start)
        write_ring_extend(cache["v"], v, start)
        return self._out(o, gate)

    def decode_context(self, device: torch.device) -> dict:
        """ctx "one_query_kernel": whether zoo's CPU decode-attention kernel (one_query.py) is
        built, building it here on a CPU (contracts.Mixer.decode_context: outside the graphs)."""
        return {"one_query_kernel": device.type == "cpu" and one_query.available()}

    def prefix_kernel(self, ctx: dict, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a prefill or an extend attends through zoo's CPU kernel, each query as a decode
        step (one_query.prefix_attention): where decode does (one_query_kernel's conditions, for any
        number of queries) over a cache whose slot is the position (no chunks)."""
        H, Dh, Hkv = q.shape[1], q.shape[3], k.shape[1]
        return (bool(ctx.get("one_query_kernel")) and q.dtype == torch.float32 and not self.explicit
                and self.window is None and self.chunk is None and H % Hkv == 0 and H // Hkv <= 64
                and Dh % 8 == 0 and Dh <= 512)

    def window_kernel(self, ctx: dict, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a sliding window's prefill, extend and decode step all attend through zoo's CPU
        kernel (one_query.window_attention: each query over its window's keys in position order, the
        same bits on every path): built, float32, a plain softmax (no soft-cap, sink or chunk)."""
        H, Dh, Hkv = q.shape[1], q.shape[3], k.shape[1]
        return (bool(ctx.get("one_query_kernel")) and q.dtype == torch.float32 and k.dtype == torch.float32
                and not self.explicit and self.window is not None and self.chunk is None and H % Hkv == 0
                and H // Hkv <= 64 and Dh % 8 == 0 and Dh <= 512)

    def one_query_kernel(self, ctx: dict, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a decode step attends through zoo's CPU kernel (one_query.py): it is built
        (ctx "one_query_kernel", see decode_context), float32, plain softmax over slots 0..pos (or
        0..pos % C: a chunk starts at slot 0; no window, soft-cap or sink), shapes it takes."""
        H, Dh, Hkv = q.shape[1], q.shape[3], k.shape[1]
        return (bool(ctx.get("one_query_kernel")) and self.one_query(q) and q.dtype == torch.float32
                and not self.explicit and self.window is None and H % Hkv == 0 and H // Hkv <= 64
                and Dh % 8 == 0 and Dh <= 512)
