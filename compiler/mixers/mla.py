"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5): keys and values come from one small
per-token latent, which is all the cache keeps.

    x [B, L, D]
      q:  wq_a -> q_norm -> wq_b           (or wq when q_lora_rank is null) -> [B, L, H, Dn + R]
            per head [q_nope Dn | q_rope R]; RoPE on q_rope
      kv: wkv_a -> [latent C | k_rope R];  latent -> kv_norm;  RoPE on k_rope (one, shared by heads)
      cache: [latent | k_rope]  (C + R values per token, e.g. 512 + 64 = 576 for DeepSeek-V3)

    prefill (expanded, compute-bound): wkv_b turns the latent into per-head k_nope [H, Dn] and
      v [H, Dv]; k = [k_nope | k_rope]; causal attention; wo.
    decode (absorbed, memory-bound): wkv_b = [W_UK | W_UV] per head is folded in instead of
      expanded, so every step reads only the latent cache:
        q_lat  = q_nope @ W_UK            [B, H, C]
        score  = q_lat . latent + q_rope . k_rope           (an MQA over C + R channels)
        o_lat  = softmax(score * scale) @ latent            [B, H, C]
        o      = o_lat @ W_UV^T                             [B, H, Dv] -> wo
      which equals the expanded form: q_nope . (W_UK latent) = (q_nope W_UK) . latent.

RoPE pairs are interleaved (2i, 2i+1) in DeepSeek checkpoints (`rope_interleaved`). With
`rope: false` (Kimi Linear's MLA layers) the R "rope" channels are kept, q_rope and the shared
k_rope still score against each other, but nothing is rotated: position enters only through the
causal mask (and the linear layers around it). The softmax
scale is (Dn + R)^-0.5 times the rope's softmax_scale_factor (YaRN mscale^2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import decode_mask, extend_positions, write_decode, write_extend, write_prefill
from .scores import causal_mask, dot_scores, head_rows, masked_softmax
from ..contracts import AttentionMaps, CacheField, FloatLinears, KindSpec, Mixer, span
from ..norm.norms import RMSNorm
from ..registry import register
from ..position.rope import apply_rotary, rope_key


def _split_wkv_b(wkv_b: torch.Tensor, n_heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wkv_b [H * (Dn + Dv), C] (rows per head [k_nope | v]) -> W_UK [H, Dn, C], W_UV [H, Dv, C]."""
    w = wkv_b.view(n_heads, -1, wkv_b.shape[1])
    return w[:, :nope], w[:, nope:]


def expanded_qkv(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, wkv_b: torch.Tensor):
    """Per-head K/V expanded from the latent: q_nope [B, H, L, Dn], q_rope [B, H, L, R], kv
    [B, 1, S, C + R], wkv_b [H * (Dn + Dv), C] -> q, k [B, H, *, Dn + R], v [B, H, S, Dv]."""
    B, H, L, nope = q_nope.shape
    C = wkv_b.shape[1]
    latent, k_rope = kv.split([C, kv.shape[-1] - C], dim=-1)
    k_nope, v = F.linear(latent[:, 0], wkv_b).view(B, -1, H, wkv_b.shape[0] // H).transpose(1, 2) \
        .split([nope, wkv_b.shape[0] // H - nope], dim=-1)
    k = torch.cat((k_nope, k_rope.expand(-1, H, -1, -1)), dim=-1)
    return torch.cat((q_nope, q_rope), dim=-1), k, v


def expanded_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, wkv_b: torch.Tensor,
                       scale: float, mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
    """Per-head K/V expanded from the latent (the prefill form). q_nope [B, H, L, Dn], q_rope
    [B, H, L, R], kv [B, 1, S, C + R], wkv_b [H * (Dn + Dv), C] -> [B, L, H * Dv]."""
    B, H, L, _ = q_nope.shape
    q, k, v = expanded_qkv(q_nope, q_rope, kv, wkv_b)
    v_dim = v.shape[-1]
    if v_dim < k.shape[-1]:
        # zero-padded to the q/k width: the fused (flash) kernels need one head width; with
        # two, the compiler falls back to a materialised-scores softmax (10x slower on CPU)
        v = F.pad(v, (0, k.shape[-1] - v_dim))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return o[..., :v_dim].transpose(1, 2).reshape(B, L, H * v_dim)


def absorb_query(q_nope: torch.Tensor, q_rope: torch.Tensor, wkv_b: torch.Tensor) -> torch.Tensor:
    """W_UK folded into the query: q_nope [B, H, L, Dn], q_rope [B, H, L, R] -> [B, H, L, C + R],
    to be scored against the latent cache entries [C | k_rope] directly (the decode form)."""
    w_uk, _ = _split_wkv_b(wkv_b, q_nope.shape[1], q_nope.shape[-1])
    return torch.cat((torch.einsum("bhln,hnc->bhlc", q_nope, w_uk), q_rope), dim=-1)


def expand_values(o_lat: torch.Tensor, wkv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """W_UV after attending over latents: o_lat [B, H, L, C] -> [B, L, H * Dv]."""
    B, H, L, _ = o_lat.shape
    _, w_uv = _split_wkv_b(wkv_b, H, nope)
    return torch.einsum("bhlc,hvc->blhv", o_lat, w_uv).reshape(B, L, -1)


@register("mixer", "mla")
class MLA(Mixer, FloatLinears):
    # the absorbed paths read wkv_b's weight (contracts.FloatLinears): it stays float when quantized
    float_linears = {"wkv_b": "read as a matrix by the absorbed attention (not applied as a linear)"}

    @dataclass
    class Spec(KindSpec):
        kind: str = "mla"
        n_heads: int = "???"  # type: ignore[assignment]
        q_lora_rank: Optional[int] = None  # null: a full-rank query projection wq
        kv_lora_rank: int = "???"  # type: ignore[assignment]  # C: latent width cached per token
        qk_nope_dim: int = "???"  # type: ignore[assignment]  # Dn: query/key channels without RoPE
        qk_rope_dim: int = "???"  # type: ignore[assignment]  # R: rotated channels (k_rope is shared)
        v_head_dim: int = "???"  # type: ignore[assignment]  # Dv
        rope_interleaved: bool = True  # rotary pairs (2i, 2i+1), as DeepSeek checkpoints store them
        rope: bool = True  # false: the R channels are not rotated (NoPE MLA, Kimi Linear)
        bias: bool = False  # biases on wq_a, wkv_a and wo (never on wq, wq_b, wkv_b)
        latent_norm_eps: float = 1e-6  # eps of q_norm and kv_norm
        softmax_scale: Optional[float] = None  # null: (qk_nope_dim + qk_rope_dim) ** -0.5

        def check(self, model: dict) -> Optional[str]:
            dims = {k: getattr(self, k) for k in ("n_heads", "kv_lora_rank", "qk_nope_dim", "v_head_dim")}
            bad = {k: v for k, v in dims.items() if v <= 0}
            if bad:
                return f"{bad} must be positive"
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                return f"q_lora_rank={self.q_lora_rank} must be positive (or null for a full-rank query)"
            if self.rope and (self.qk_rope_dim <= 0 or self.qk_rope_dim % 2):
                return f"qk_rope_dim={self.qk_rope_dim} must be a positive even number"
            if self.qk_rope_dim < 0:
                return f"qk_rope_dim={self.qk_rope_dim} must be >= 0"
            return None

    def __init__(self, spec: "MLA.Spec", model):
        super().__init__()
        self.spec = s = spec
        D = model.dim
        self.n_heads, self.rank = s.n_heads, s.kv_lora_rank
        self.nope, self.rot, self.v_dim = s.qk_nope_dim, s.qk_rope_dim, s.v_head_dim
        self.rope = rope_key(s.qk_rope_dim)
        self.scale = (s.softmax_scale or (s.qk_nope_dim + s.qk_rope_dim) ** -0.5) * \
            model.rope_impl.softmax_scale_factor()
        q_out = s.n_heads * (s.qk_nope_dim + s.qk_rope_dim)
        norm = RMSNorm.Spec(eps=s.latent_norm_eps)
        if s.q_lora_rank is None:
            self.wq = nn.Linear(D, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(D, s.q_lora_rank, bias=s.bias)
            self.q_norm = RMSNorm(norm, s.q_lora_rank)
            self.wq_b = nn.Linear(s.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(D, s.kv_lora_rank + s.qk_rope_dim, bias=s.bias)
        self.kv_norm = RMSNorm(norm, s.kv_lora_rank)
        self.wkv_b = nn.Linear(s.kv_lora_rank, s.n_heads * (s.qk_nope_dim + s.v_head_dim), bias=False)
        self.wo = nn.Linear(s.n_heads * s.v_head_dim, D, bias=s.bias)

    def rope_dims(self) -> list[int]:
        return [self.rot] if self.spec.rope else []

    def _cos_sin(self, ctx: dict):
        """The rope tables this layer reads from ctx, or (None, None) without rope."""
        return ctx["rope"][self.rope] if self.spec.rope else (None, None)

    def shard(self, plan) -> bool:
        """Heads split over the ranks: the query up-projection (wq_b, or wq) and wkv_b by head,
        wo row-parallel. The latent projections (wq_a, q_norm, wkv_a, kv_norm) are replicated, and
        so is the latent cache: every head reads all of it, so each rank keeps the whole cache
        (C + R per token) and computes it redundantly. DSA's indexer stays replicated too (dsa.py)."""
        h = plan.units(self.n_heads, "n_heads")
        plan.column(self.wq if self.spec.q_lora_rank is None else self.wq_b, [span(0, h, self.nope + self.rot)])
        plan.column(self.wkv_b, [span(0, h, self.nope + self.v_dim)])
        plan.row(self.wo, [span(0, h, self.v_dim)])
        self.n_heads = h[1] - h[0]
        return True

    def attention_flops(self, context):
        """Per token at `context` cached tokens, absorbed (decode) form: per head, scores over the
        C + R latent channels and the weighted sum of the C latent values."""
        return 2 * self.n_heads * (2 * self.rank + self.rot) * np.asarray(context)

    def prefill_attention_flops(self, context):
        """Per token at `context` visible tokens, expanded (prefill) form: per head, q.k over
        Dn + R channels and the weighted sum of Dv-wide values (wkv_b's expansion of each token's
        latent is a per-token matmul, counted with the parameters)."""
        return 2 * self.n_heads * (self.nope + self.rot + self.v_dim) * np.asarray(context)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        """One field, [normalized latent C | roped k_rope R] per token: [B, 1, S, C + R] (a
        single KV head, so attention reads it in place)."""
        return {"kv": CacheField((max_batch, 1, max_seq, self.rank + self.rot), dtype, grows=True, token_axis=2)}

    def expanded_cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        """What a per-head K/V cache of the expanded form would hold (for reports, never allocated):
        k [B, H, S, Dn + R], v [B, H, S, Dv]."""
        H = self.n_heads
        return {"k": CacheField((max_batch, H, max_seq, self.nope + self.rot), dtype, grows=True),
                "v": CacheField((max_batch, H, max_seq, self.v_dim), dtype, grows=True)}

    # ------------------------------------------------------------------ projections

    def query_residual(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x [B, L, D] -> q_norm(wq_a(x)) [B, L, Cq], the low-rank query (None without q_lora_rank)."""
        return None if self.spec.q_lora_rank is None else self.q_norm(self.wq_a(x))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_resid: Optional[torch.Tensor] = None):
        """x [B, L, D], cos/sin broadcastable to [B, 1, L, R/2] (None: no rotation) ->
        q_nope [B, H, L, Dn], q_rope [B, H, L, R], kv [B, 1, L, C + R] (what the cache holds).
        q_resid: query_residual(x) when the caller has it already (DSA's indexer reads it too)."""
        B, L, _ = x.shape
        if q_resid is None:
            q_resid = self.query_residual(x)
        q = self.wq(x) if q_resid is None else self.wq_b(q_resid)
        q = q.view(B, L, self.n_heads, self.nope + self.rot).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rot], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rot], dim=-1)
        k_rope = k_rope[:, None]  # [B, 1, L, R]
        if cos is not None:
            il = self.spec.rope_interleaved
            q_rope, k_rope = apply_rotary(q_rope, cos, sin, il), apply_rotary(k_rope, cos, sin, il)
        kv = torch.cat((self.kv_norm(latent)[:, None], k_rope), dim=-1)
        return q_nope, q_rope, kv

    def attend_expanded(self, q_nope, q_rope, kv, mask=None, causal=False) -> torch.Tensor:
        """Per-head K/V from the latent. q_* [B, H, L, *], kv [B, 1, S, C + R] -> [B, L, H * Dv]."""
        return expanded_attention(q_nope, q_rope, kv, self.wkv_b.weight, self.scale, mask, causal)

    def attend_absorbed(self, q_nope, q_rope, kv, mask=None, causal=False) -> torch.Tensor:
        """W_UK folded into the query, W_UV applied after attending over the latent.
        q_* [B, H, L, *], kv [B, 1, S, C + R] -> [B, L, H * Dv]."""
        q = absorb_query(q_nope, q_rope, self.wkv_b.weight)  # [B, H, L, C + R]
        o_lat = F.scaled_dot_product_attention(q, kv, kv[..., : self.rank], attn_mask=mask, is_causal=causal,
                                               scale=self.scale, enable_gqa=True)  # [B, H, L, C]
        return expand_values(o_lat, self.wkv_b.weight, self.nope)

    def probe_logits(self, q_nope, q_rope, kv, heads: slice, absorbed: bool) -> torch.Tensor:
        """Scaled q.k [B, h, L, S] of query heads `heads` (q_* [B, H, L, *]) over the latents kv
        [B, 1, S, C + R], in the expanded form (what prefill's kernel gets) or the absorbed one
        (decode's); the two agree up to rounding."""
        rows = head_rows(heads, self.n_heads)
        sel = slice(rows.start, rows.stop)
        wkv_b = self.wkv_b.weight.view(self.n_heads, -1, self.rank)[sel].reshape(-1, self.rank)
        q_nope, q_rope = q_nope[:, sel], q_rope[:, sel]
        if absorbed:
            return dot_scores(absorb_query(q_nope, q_rope, wkv_b), kv, self.scale)
        q, k, _ = expanded_qkv(q_nope, q_rope, kv, wkv_b)
        return dot_scores(q, k, self.scale)

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None),
                        absorbed: bool = False) -> AttentionMaps:
        """prefill's attention as probabilities (contracts.AttentionProbe): its projection, RoPE,
        scale and causal mask, scored in the expanded form or (absorbed) the decode form."""
        cos, sin = self._cos_sin(ctx)  # (None, None) for a NoPE MLA (rope: false)
        q_nope, q_rope, kv = self.project(x, cos, sin)
        logits = self.probe_logits(q_nope, q_rope, kv, heads, absorbed)
        logits, probs = masked_softmax(logits, causal_mask(x.shape[1], x.device))
        return AttentionMaps(probs, logits)

    # ------------------------------------------------------------------ entry points

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; fills cache slots 0..L-1. Expanded form."""
        cos, sin = self._cos_sin(ctx)  # [L, R/2]
        q_nope, q_rope, kv = self.project(x, cos, sin)
        write_prefill(cache["kv"], kv)
        return self.wo(self.attend_expanded(q_nope, q_rope, kv, causal=True))

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; one cache slot per row. Absorbed form."""
        cos, sin = self._cos_sin(ctx)  # [B, R/2]
        if cos is not None:
            cos, sin = cos[:, None, None], sin[:, None, None]
        q_nope, q_rope, kv = self.project(x, cos, sin)
        pos = ctx["pos"]
        write_decode(cache["kv"], kv, pos)
        cached = cache["kv"].to(q_nope.dtype)
        return self.wo(self.attend_absorbed(q_nope, q_rope, cached, mask=decode_mask(pos, cached.shape[2])))

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions start..start+L-1 (ctx["start"] [B]) -> [B, L, D]; the chunk's
        latents go to their slots, then query t attends over slots <= t. Absorbed form (the
        decode's: it reads the latent cache in place)."""
        cos, sin = self._cos_sin(ctx)  # [B, L, R/2]
        if cos is not None:
            cos, sin = cos[:, None], sin[:, None]
        q_nope, q_rope, kv = self.project(x, cos, sin)
        qpos = extend_positions(ctx["start"], x.shape[1])
        write_extend(cache["kv"], kv, qpos)
        cached = cache["kv"].to(q_nope.dtype)
        visible = torch.arange(cached.shape[2], device=x.device) <= qpos[..., None]  # [B, L, S]
        return self.wo(self.attend_absorbed(q_nope, q_rope, cached, mask=visible[:, None]))
