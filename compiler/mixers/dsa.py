"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries attend only to the Ks
cached tokens that a lightning indexer picks for each of them.

    x [B, L, D] -> wq_a -> q_norm = q_resid [B, L, Cq] -> wq_b -> MLA queries     (mla.py)
                                        |
    lightning indexer                   '-> indexer.wq_b -> iq [B, L, Hi, Di]
                x -> indexer.wk -> k_norm (LayerNorm) -> ik [B, L, Di]   one key per token
                x -> indexer.weights_proj -> w [B, L, Hi] * Hi^-0.5      (float32 weights)
        RoPE on the FIRST R channels of iq and ik (interleaved pairs in GLM-5, rotate-half in
        DeepSeek-V3.2: `index_rope_interleaved`); the other Di - R channels pass through.
        score[t, s] = sum_h w[t, h] * relu(iq[t, h] . ik[s] * Di^-0.5)       for s <= t
        chosen(t)   = the Ks keys of highest score (every s <= t while t < Ks)
    MLA attention of query t over exactly the latent cache entries chosen(t).

    prefill: the indexer scores the prompt a chunk of query rows at a time and keeps each
             query's top Ks slots [B, L, Ks] (`zoo::index_topk`). Long prompts (past
             `gather_from`, where it costs fewer FLOPs) attend over each query's own Ks gathered
             latents in MLA's absorbed form (`zoo::selected_attention`): O(L * Ks), no [L, L]
             matrix. Shorter ones apply the choice as a mask on the fused expanded kernel.
    decode:  the new query's scores against the indexer key cache [B, S] (Hi * Di per key, far
             cheaper than MLA's H * (2C + R)); the top Ks slots are gathered from the latent cache
             [B, 1, Ks, C + R] and MLA's absorbed attention runs over those only, so the attention
             itself costs O(Ks) whatever the context.

Caches per layer (both grow per token): MLA's latent `kv` [B, 1, S, C + R] and the indexer keys
`index_k` [B, S, Di].

The indexer's top-k breaks ties (equal scores, e.g. several keys whose ReLUs are all zero)
however torch.topk does; a reference may break them otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import extend_positions, write_decode, write_extend, write_prefill
from .mla import MLA, absorb_query, expand_values, expanded_attention
from .scores import causal_mask, masked_softmax
from ..contracts import AttentionMaps, CacheField, Float32Linear, FloatLinears
from ..norm.norms import LayerNorm
from ..registry import register
from ..position.rope import apply_rotary


# query rows scored at a time in prefill: the per-head scores of a chunk are
# [B, chunk, Hi, L] float32 (a 32k prompt with Hi = 32: 1 GiB per 256 rows, not 128 GiB at once)
PREFILL_CHUNK = 256


@torch.library.custom_op("zoo::index_topk", mutates_args=())
def index_topk(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float, k: int,
               chunk: int) -> torch.Tensor:
    """Prompt positions 0..L-1, float32: q [B, L, Hi, Di], keys [B, L, Di], w [B, L, Hi] ->
    idx [B, L, k] int64, the top k of score[t, s] = sum_h w[t, h] relu(q[t, h] . keys[s] * scale)
    over s <= t, best first. Rows t < k - 1 have fewer keys than k: their extra picks point at
    masked keys or at columns >= L (callers drop both). Query rows are scored `chunk` at a time,
    so memory is O(B * chunk * Hi * L), not O(B * L * Hi * L); a custom op, so the loop runs
    as it is whatever the compiler does with L."""
    B, L, Hi, _ = q.shape
    out = torch.empty(B, L, k, dtype=torch.int64, device=q.device)
    cols = torch.arange(L, device=q.device)
    kt = keys.transpose(1, 2).unsqueeze(1)  # [B, 1, Di, L]
    for start in range(0, L, chunk):
        rows = slice(start, min(start + chunk, L))
        per_head = F.relu(torch.matmul(q[:, rows], kt) * scale)  # [B, c, Hi, L]
        scores = torch.matmul(w[:, rows].unsqueeze(-2), per_head).squeeze(-2)  # [B, c, L]
        scores = scores.masked_fill(cols[None, None, :] > cols[rows, None], float("-inf"))
        # k columns of -inf on the right: k picks exist even while fewer keys are visible
        out[:, rows] = F.pad(scores, (0, k), value=float("-inf")).topk(k, dim=-1).indices
    return out


@index_topk.register_fake
def _index_topk_fake(q, keys, w, scale, k, chunk):
    return q.new_empty(q.shape[0], q.shape[1], k, dtype=torch.int64)


def choice_mask(slots: torch.Tensor) -> torch.Tensor:
    """slots [B, L, k] (prompt queries' chosen keys) -> [B, L, L] bool (query t, key s); picks
    among padding columns (>= L) or masked keys (> t) are dropped."""
    B, L, k = slots.shape
    t = torch.arange(L, device=slots.device)
    chosen = torch.zeros(B, L, L + k, dtype=torch.bool, device=slots.device).scatter_(-1, slots, True)
    return chosen[..., :L] & (t[None, :] <= t[:, None])


# query rows attended at a time by the gathered prefill: the gathered latents of a chunk are
# [B, chunk, Ks, C + R] (GLM-5, bf16: 150 MiB per 64 rows)
ATTENTION_CHUNK = 64


@torch.library.custom_op("zoo::selected_attention", mutates_args=())
def selected_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, wkv_b: torch.Tensor,
                       slots: torch.Tensor, scale: float, gather_from: int, chunk: int) -> torch.Tensor:
    """Prompt positions 0..L-1, each query attending over the latents it chose only:
    q_nope [B, H, L, Dn], q_rope [B, H, L, R], kv [B, L, C + R] (one latent head shared by all),
    wkv_b [H * (Dn + Dv), C], slots [B, L, k] (each query's chosen keys; slots > t, masked or
    padding picks, are ignored) -> [B, L, H * Dv].

    Past `gather_from` tokens: the latents of `chunk` query rows at a time are gathered and
    attended in the absorbed form (softmax in float32): O(L * k) work, O(chunk * k) memory.
    Below it: the choice as an [L, L] mask on the fused expanded kernel, cheaper there. A
    custom op, so that one compiled graph serves every prompt length on either side."""
    B, H, L, nope = q_nope.shape
    if L <= gather_from:
        # contiguous, as the fake says: with one head per rank the kernel's output is a strided view
        return expanded_attention(q_nope, q_rope, kv[:, None], wkv_b, scale,
                                  mask=choice_mask(slots)[:, None]).contiguous()
    t = torch.arange(L, device=q_nope.device)
    q = absorb_query(q_nope, q_rope, wkv_b)  # [B, H, L, C + R]
    C = wkv_b.shape[1]
    o_lat = q.new_empty(B, H, L, C)
    batch = torch.arange(B, device=q.device)[:, None, None]
    for start in range(0, L, chunk):
        rows = slice(start, min(start + chunk, L))
        picked = slots[:, rows]  # [B, c, k]
        valid = picked <= t[rows, None]
        keys = kv[batch, picked.clamp(max=L - 1)]  # [B, c, k, C + R]
        scores = torch.einsum("bhcd,bckd->bhck", q[:, :, rows].float(), keys.float()) * scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        o_lat[:, :, rows] = torch.einsum("bhck,bckd->bhcd", probs, keys[..., :C].float()).to(o_lat.dtype)
    return expand_values(o_lat, wkv_b, nope).contiguous()


@selected_attention.register_fake
def _selected_attention_fake(q_nope, q_rope, kv, wkv_b, slots, scale, gather_from, chunk):
    B, H, L, nope = q_nope.shape
    return q_nope.new_empty(B, L, wkv_b.shape[0] - H * nope)


class LightningIndexer(nn.Module, FloatLinears):
    """Scores every cached token for every query and picks the top Ks (see the module docstring).

    Shapes: iq [B, L, Hi, Di], ik [B, T, Di], w [B, L, Hi], scores [B, L, T] (float32)."""

    float_linears = {"weights_proj": "its weight's dtype sets the indexer's compute dtype"}

    def __init__(self, spec: "DSA.Spec", dim: int):
        super().__init__()
        s = spec
        self.n_heads, self.head_dim, self.rot, self.topk = s.index_n_heads, s.index_head_dim, s.qk_rope_dim, s.index_topk
        self.interleaved = s.index_rope_interleaved
        self.scale = s.index_head_dim ** -0.5
        self.wq_b = nn.Linear(s.q_lora_rank, s.index_n_heads * s.index_head_dim, bias=False)
        self.wk = nn.Linear(dim, s.index_head_dim, bias=False)
        self.k_norm = LayerNorm(LayerNorm.Spec(eps=s.index_norm_eps), s.index_head_dim)
        self.weights_proj = Float32Linear(dim, s.index_n_heads, bias=False)  # float32, as the references keep it

    def flops_per_key(self) -> int:
        """Per query and cached key: Hi dot products of Di channels and the Hi-weighted sum."""
        return 2 * self.n_heads * (self.head_dim + 1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        R = self.rot
        return torch.cat((apply_rotary(x[..., :R], cos, sin, self.interleaved), x[..., R:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], cos/sin broadcastable to [B, L, R/2] -> ik [B, L, Di] (what the cache holds)."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D], q_resid [B, L, Cq], cos/sin broadcastable to [B, L, R/2] -> iq [B, L, Hi, Di]
        and the head weights w [B, L, Hi] (Hi^-0.5 folded in), both float32."""
        B, L, _ = x.shape
        q = self.wq_b(q_resid).view(B, L, self.n_heads, self.head_dim)
        q = self._rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q.float(), w

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], q_resid [B, L, Cq], keys [B, T, Di], cos/sin broadcastable to [B, L, R/2]
        -> index scores [B, L, T] float32 (not yet masked)."""
        q, w = self.queries(x, q_resid, cos, sin)
        per_head = F.relu(torch.matmul(q, keys.float().transpose(1, 2).unsqueeze(1)) * self.scale)  # [B, L, Hi, T]
        return torch.matmul(w.unsqueeze(-2), per_head).squeeze(-2)

    def select_prefill_slots(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Prompt positions 0..L-1: x [B, L, D], q_resid [B, L, Cq], keys [B, L, Di], cos/sin
        [L, R/2] -> slots [B, L, Ks], each query's top Ks keys s <= t, best first; while t < Ks - 1
        the extra slots are > t (masked keys or padding), to be ignored."""
        q, w = self.queries(x, q_resid, cos, sin)
        # Ks stays a constant whatever L is (one compiled graph for every prompt length)
        return index_topk(q, keys.float(), w, self.scale, self.topk, PREFILL_CHUNK)

    def select_decode(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One query per row at pos [B]: x [B, 1, D], q_resid [B, 1, Cq], keys [B, S, Di] (the
        cache, slots <= pos filled), cos/sin [B, R/2] -> slots [B, min(Ks, S)], best first; while
        pos < Ks some are empty slots (> pos), which the caller masks."""
        S = keys.shape[1]
        scores = self.scores(x, q_resid, keys, cos[:, None], sin[:, None])[:, 0]  # [B, S]
        slots = torch.arange(S, device=x.device)
        scores = scores.masked_fill(slots[None, :] > pos[:, None], float("-inf"))
        return scores.topk(min(self.topk, S), dim=-1).indices


@register("mixer", "dsa")
class DSA(MLA):
    """MLA (all of mla.py: projections, latent cache, expanded/absorbed attention) plus a
    LightningIndexer that restricts each query to Ks cached tokens."""

    @dataclass
    class Spec(MLA.Spec):
        kind: str = "dsa"
        index_n_heads: int = "???"  # type: ignore[assignment]  # Hi
        index_head_dim: int = "???"  # type: ignore[assignment]  # Di: also the indexer key cached per token
        index_topk: int = "???"  # type: ignore[assignment]  # Ks: tokens each query attends to
        index_rope_interleaved: bool = True  # indexer RoPE pairs (2i, 2i+1) (GLM-5); false: rotate-half (V3.2)
        index_norm_eps: float = 1e-6  # eps of the indexer's k_norm (LayerNorm)

        def check(self, model: dict) -> Optional[str]:
            problem = MLA.Spec.check(self, model)
            if problem:
                return problem
            if self.q_lora_rank is None:
                return ("q_lora_rank=null: the dsa indexer's queries come from the low-rank query "
                        "q_norm(wq_a(x)); give q_lora_rank")
            dims = {k: getattr(self, k) for k in ("index_n_heads", "index_head_dim", "index_topk")}
            bad = {k: v for k, v in dims.items() if v <= 0}
            if bad:
                return f"{bad} must be positive"
            if self.index_head_dim < self.qk_rope_dim:
                return (f"index_head_dim={self.index_head_dim} must be >= qk_rope_dim={self.qk_rope_dim} "
                        f"(the indexer rotates the first qk_rope_dim channels of each head)")
            return None

    def __init__(self, spec: "DSA.Spec", model):
        super().__init__(spec, model)
        self.indexer = LightningIndexer(spec, model.dim)
        # prompts longer than this attend over gathered latents: per query Ks keys of the absorbed
        # form (2C + R each) against, masked and dense, t keys of the expanded one (Dn + R + Dv,
        # t / 2 on average); GLM-5: 8704 tokens. Shorter prompts take the fused dense kernel.
        self.gather_from = -(-2 * self.spec.index_topk * (2 * self.rank + self.rot) //
                             (self.nope + self.rot + self.v_dim))

    def shard(self, plan) -> bool:
        """MLA's split (heads of wq_b, wkv_b, wo); the indexer is replicated: its score sums over
        all Hi heads before the top-k, so splitting heads would put a second all-reduce (of [B, L, T]
        scores, inside the chunked prefill op) in the sub-layer, and only identical scores on every
        rank give every rank, and the single process, the same choice of keys. It is small (GLM-5:
        Hi * Di * Cq + Di * D + Hi * D = 9.4M of the layer's 174M attention parameters)."""
        return super().shard(plan)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        """MLA's latent kv [B, 1, S, C + R] and the indexer keys index_k [B, S, Di]."""
        return {**super().cache_fields(max_batch, max_seq, dtype),
                "index_k": CacheField((max_batch, max_seq, self.spec.index_head_dim), dtype, grows=True,
                                          token_axis=1)}

    def attention_flops(self, context):
        """Per token at `context` cached tokens: the indexer over the whole context, MLA's
        attention over at most Ks of them."""
        context = np.asarray(context)
        return super().attention_flops(np.minimum(context, self.spec.index_topk)) + \
            self.indexer.flops_per_key() * context

    def prefill_attention_flops(self, context):
        """The same for a prompt token, at the sparse cost: the Ks gathered latents in the absorbed
        form, what prompts past `gather_from` run (shorter ones run a masked dense kernel, which
        costs fewer FLOPs there); W_UK / W_UV are per-token matmuls, counted with the parameters."""
        return self.attention_flops(context)

    def decode_cache_bytes(self, context: int, dtype: torch.dtype) -> int:
        """Cache bytes one decode step reads per sequence at `context` tokens: every indexer key,
        but only the Ks latent entries chosen."""
        return self.cache_fields(1, context, dtype)["index_k"].nbytes + \
            super().cache_fields(1, min(context, self.spec.index_topk), dtype)["kv"].nbytes

    # ------------------------------------------------------------------ entry points

    def prefill_selection(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, L, D] (positions 0..L-1), cos/sin [L, R/2] -> MLA's q_nope, q_rope, kv (mla.py),
        the indexer keys [B, L, Di] and each query's chosen slots [B, L, Ks] (prefill and probe)."""
        q_resid = self.query_residual(x)
        q_nope, q_rope, kv = self.project(x, cos, sin, q_resid=q_resid)
        keys = self.indexer.keys(x, cos, sin)
        slots = self.indexer.select_prefill_slots(x, q_resid, keys, cos, sin)  # [B, L, Ks]
        return q_nope, q_rope, kv, keys, slots

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; fills slots 0..L-1 of both caches. Each
        query attends over the Ks latents the indexer chose for it (see selected_attention)."""
        cos, sin = ctx["rope"][self.rope]  # [L, R/2]
        q_nope, q_rope, kv, keys, slots = self.prefill_selection(x, cos, sin)
        write_prefill(cache["kv"], kv)
        write_prefill(cache["index_k"][:, None], keys[:, None])  # [B, S, Di] viewed as one head
        return self.wo(selected_attention(q_nope, q_rope, kv[:, 0], self.wkv_b.weight, slots, self.scale,
                                          self.gather_from, ATTENTION_CHUNK))

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None),
                        absorbed: bool = False) -> AttentionMaps:
        """prefill's sparse attention as probabilities (contracts.AttentionProbe): the indexer's
        picks and MLA's scores (mla.MLA.probe_logits), softmax over the picked keys only. logits
        are the dense causal scores; extras "picks" [B, L, Ks] (-1 where fewer than Ks keys are
        visible) and "captured" [B, h, L], the share of the dense causal softmax the picks hold."""
        cos, sin = ctx["rope"][self.rope]
        q_nope, q_rope, kv, _, slots = self.prefill_selection(x, cos, sin)
        t = torch.arange(x.shape[1], device=x.device)
        logits, dense = masked_softmax(self.probe_logits(q_nope, q_rope, kv, heads, absorbed),
                                       causal_mask(x.shape[1], x.device))
        chosen = choice_mask(slots)[:, None]  # [B, 1, L, L]
        probs = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1)
        picks = torch.where(slots <= t[:, None], slots, -1)
        return AttentionMaps(probs, logits, {"picks": picks, "captured": (dense * chosen).sum(-1)})

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; one slot per row in both caches.
        MLA's absorbed attention over the Ks gathered latent entries only."""
        cos, sin = ctx["rope"][self.rope]  # [B, R/2]
        pos = ctx["pos"]
        q_resid = self.query_residual(x)
        q_nope, q_rope, kv = self.project(x, cos[:, None, None], sin[:, None, None], q_resid=q_resid)
        write_decode(cache["kv"], kv, pos)
        index_k = cache["index_k"]
        write_decode(index_k[:, None], self.indexer.keys(x, cos[:, None], sin[:, None])[:, None], pos)
        slots = self.indexer.select_decode(x, q_resid, index_k, pos, cos, sin)  # [B, Ks]
        latent = cache["kv"]
        picked = latent.gather(2, slots[:, None, :, None].expand(-1, 1, -1, latent.shape[-1]))
        valid = (slots <= pos[:, None])[:, None, None, :]  # [B, 1, 1, Ks]: empty slots early on
        return self.wo(self.attend_absorbed(q_nope, q_rope, picked.to(q_nope.dtype), mask=valid))

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions start..start+L-1 (ctx["start"] [B]) -> [B, L, D]; the chunk
        goes to both caches, then each query, as in decode, scores every indexer key at or before
        it, gathers its top Ks latents [B, L, Ks, C + R] and attends over them in the absorbed form."""
        cos, sin = ctx["rope"][self.rope]  # [B, L, R/2]
        B, L, _ = x.shape
        qpos = extend_positions(ctx["start"], L)
        q_resid = self.query_residual(x)
        q_nope, q_rope, kv = self.project(x, cos[:, None], sin[:, None], q_resid=q_resid)
        write_extend(cache["kv"], kv, qpos)
        index_k = cache["index_k"]
        write_extend(index_k[:, None], self.indexer.keys(x, cos, sin)[:, None], qpos)
        S = index_k.shape[1]
        scores = self.indexer.scores(x, q_resid, index_k, cos, sin)  # [B, L, S]
        scores = scores.masked_fill(torch.arange(S, device=x.device) > qpos[..., None], float("-inf"))
        slots = scores.topk(min(self.spec.index_topk, S), dim=-1).indices  # [B, L, Ks]
        latent = cache["kv"][:, 0]  # [B, S, C + R]
        Ks = slots.shape[-1]
        picked = latent.gather(1, slots.reshape(B, L * Ks, 1).expand(-1, -1, latent.shape[-1]))
        picked = picked.view(B, L, Ks, -1).to(q_nope.dtype)
        q = absorb_query(q_nope, q_rope, self.wkv_b.weight)  # [B, H, L, C + R]
        logits = torch.einsum("bhlc,blkc->bhlk", q.float(), picked.float()) * self.scale
        valid = (slots <= qpos[..., None])[:, None]  # [B, 1, L, Ks]: empty slots early on
        probs = logits.masked_fill(~valid, float("-inf")).softmax(dim=-1)
        o_lat = torch.einsum("bhlk,blkc->bhlc", probs, picked[..., :self.rank].float()).to(q_nope.dtype)
        return self.wo(expand_values(o_lat, self.wkv_b.weight, self.nope))
