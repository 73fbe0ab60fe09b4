"""Compressed attention (DeepSeek-V4's long-range layers): sliding-window shared-KV attention with
sinks (sink_attention.py, reused as the base class) whose softmax also covers compressed KV
entries, one per block of m tokens.

    compressor (per layer; width Wc = Dc, or 2 Dc with overlap):
      token t:  row_t = [wkv(x_t) | wgate(x_t) + ape[t % m]]                       [2Wc]
      entry w (block w = tokens w*m .. w*m + m - 1):
        no overlap (HCA, m = 128):  softmax over the block's m tokens, per channel, of the gates;
                                    the gate-weighted sum of the kv rows
        overlap (CSA, m = 4):       2m slots: the first Dc channels ("Ca") of block w-1's tokens,
                                    then the last Dc channels ("Cb") of block w's; block -1's
                                    slots do not exist (weight 0)
        -> norm (RMSNorm, Dc) -> RoPE on the last R channels at position w*m (the block's start)
      Entry w exists once its block is complete: query t sees entries w < (t + 1) // m.

    hca_mqa: query t attends to its window keys + every visible entry (+ the sink), one softmax.
    csa_mqa: a lightning indexer picks, per query, the top-k visible entries:
        iq = indexer.wq_b(q_resid) [Hi, Di] (RoPE on the last R channels, at the query position)
        ik = the indexer's own overlapping compressor (width Di) over the same blocks
        score[t, w] = sum_h weights_proj(x_t)[h] * Hi^-0.5 * relu(iq[t, h] . ik[w]) * Di^-0.5
      and query t attends to its window keys + the chosen entries (+ the sink).

Every RoPE in these layers (queries, window keys, entries, indexer) uses the mixer's rope slot
(DeepSeek-V4: `compress`, theta 160000 + YaRN).

Caches per layer (prefill starts at position 0; decode writes position pos):
    kv       [B, 1, Sw, Dh]       sliding-window ring (as swa_mqa)                       state
    block    [B, 1, (1+o)m, 4Wc']  ring of the last (1+o)*m token rows [kv | gate]: the    state
                                  partial block (and, with overlap, the previous block)
    start    [B, R] float32       cos|sin at the current block's start position         state
    entries  [B, 1, Ne, Dh]        compressed entries, Ne = max_seq // m                  grows 1/m
    index_block, index_keys       the same two for the indexer (csa_mqa)                 state / grows 1/m
A decode step that completes a block (pos % m == m - 1) pools the ring into entry pos // m.

extend (L tokens after cached ones): the contract's default, one decode step per token (exact;
the window ring, the block ring and the entries advance as in decode). swa_mqa's one-pass extend
is not inherited: the entries and the block ring need decode's per-position updates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import decode_mask, write_decode, write_prefill
from ..norm.norms import RMSNorm
from ..registry import register
from .scores import head_rows
from .sink_attention import SinkAttention, rope_tail, softmax_with_sink, window_to_tokens
from ..contracts import AttentionMaps, CacheField, KeepFloat32, Mixer


class PositionBias(nn.Module, KeepFloat32):
    """weight [m, Wc]: a learned gate bias per position within a block (`ape`), float32 as stored."""

    def __init__(self, ratio: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ratio, width))

    def active_parameters(self, matmul_only: bool = False) -> int:
        """(analysis.py) A token reads the row of its position, added, never multiplied."""
        return 0 if matmul_only else self.weight.shape[1]


class Compressor(nn.Module):
    """Parameters: wkv, wgate [Wc, D] (Wc = (1+overlap) * Dc), ape.weight [m, Wc], norm [Dc]."""

    def __init__(self, dim: int, out_dim: int, ratio: int, overlap: bool, rot: int, interleaved: bool, eps: float):
        super().__init__()
        self.out_dim, self.ratio, self.overlap, self.rot, self.interleaved = out_dim, ratio, overlap, rot, interleaved
        self.width = (2 if overlap else 1) * out_dim
        self.span = (2 if overlap else 1) * ratio  # tokens one entry reads
        self.wkv = nn.Linear(dim, self.width, bias=False)
        self.wgate = nn.Linear(dim, self.width, bias=False)
        self.ape = PositionBias(ratio, self.width)
        self.norm = RMSNorm(RMSNorm.Spec(eps=eps), out_dim)

    def token_flops(self) -> int:
        """(analysis.py) The gate-weighted pooling, per token: an entry sums span rows of Dc
        channels once per m tokens, i.e. Wc multiply-adds per token."""
        return 2 * self.span * self.out_dim // self.ratio

    def rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, L, D] at positions pos ([L] or [B, 1]) -> token rows [B, L, 2Wc]: [kv | gate + ape]."""
        gate = self.wgate(x) + self.ape.weight[pos % self.ratio].to(x.dtype)
        return torch.cat((self.wkv(x), gate), dim=-1)

    def pool(self, rows: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rows [..., span, 2Wc] of one entry's tokens in order, valid [..., span] (False: before
        position 0), cos/sin broadcastable to [..., R/2] at the block start -> entry [..., Dc]."""
        kv, gate = rows.split(self.width, dim=-1)
        if self.overlap:  # Ca of the previous block's tokens, then Cb of this block's
            m, d = self.ratio, self.out_dim
            kv = torch.cat((kv[..., :m, :d], kv[..., m:, d:]), dim=-2)
            gate = torch.cat((gate[..., :m, :d], gate[..., m:, d:]), dim=-2)
        probs = gate.float().masked_fill(~valid[..., None], float("-inf")).softmax(dim=-2)
        entry = self.norm((kv * probs.to(kv.dtype)).sum(dim=-2))
        return rope_tail(entry, cos, sin, self.rot, self.interleaved)

    def prefill(self, x: torch.Tensor, ring: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_ring,
                slots: int):
        """x [B, L, D] at positions 0..L-1, cos/sin [L, R/2] -> entries [B, Ne, Dc] for the blocks
        0..Ne-1 (Ne = `slots`, static: the prompt is zero-padded to Ne*m tokens, so that no shape
        depends on L // m; entries of incomplete blocks are never visible to the prompt's queries
        and are rewritten by decode when their block completes); the last `span` token rows go to
        `ring` [B, 1, span, 2Wc]."""
        B, L, _ = x.shape
        m, N = self.ratio, slots
        rows = self.rows(x, torch.arange(L, device=x.device))
        write_ring(ring, rows[:, None])
        cur = F.pad(rows, (0, 0, 0, N * m - L)).view(B, N, m, rows.shape[-1])
        valid = torch.ones(N, m, dtype=torch.bool, device=x.device)
        if self.overlap:  # block w-1's rows before block w's; block -1 is padding
            prev = torch.cat((cur.new_zeros(B, 1, m, cur.shape[-1]), cur[:, :-1]), dim=1)
            cur = torch.cat((prev, cur), dim=2)
            first = torch.arange(N, device=x.device)[:, None] > 0
            valid = torch.cat((first.expand(N, m), valid), dim=1)
        cos = F.pad(cos, (0, 0, 0, N * m - L))[::m]
        sin = F.pad(sin, (0, 0, 0, N * m - L))[::m]
        return self.pool(cur, valid, cos, sin)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """x [B, 1, D] at positions pos [B]; writes its row to ring slot pos % span and returns the
        entry of the block that pos ends [B, Dc] (meaningful only when pos % m == m - 1).
        cos/sin [B, R/2]: the block's start position."""
        span = self.span
        write_decode(ring, self.rows(x, pos[:, None])[:, None], pos % span)
        k = torch.arange(span, device=pos.device)
        slot = (pos[:, None] + 1 + k) % span  # oldest first
        rows = ring[:, 0].gather(1, slot[..., None].expand(-1, -1, ring.shape[-1])).to(x.dtype)
        valid = pos[:, None] + 1 - span + k >= 0
        return self.pool(rows, valid, cos, sin)


def visible_entries(query_pos: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """query_pos [...] -> [..., n] bool: entry w is complete for a query at t iff (w + 1) * m <= t + 1."""
    return torch.arange(n, device=query_pos.device) < torch.div(query_pos + 1, ratio, rounding_mode="floor")[..., None]


@register("mixer", "hca_mqa")
class CompressedAttention(SinkAttention):
    """swa_mqa's parameters plus compressor.{wkv, wgate [Wc, D], ape.weight [m, Wc], norm [Dh]}."""

    @dataclass
    class Spec(SinkAttention.Spec):
        kind: str = "hca_mqa"
        compress_ratio: int = "???"  # type: ignore[assignment]  # m: tokens per compressed entry
        compress_overlap: bool = False  # entries also read the previous block (Ca/Cb halves)

        def check(self, model: dict) -> Optional[str]:
            err = SinkAttention.Spec.check(self, model)
            if err:
                return err
            if self.compress_ratio <= 0:
                return f"compress_ratio={self.compress_ratio} must be positive"
            return None

    def __init__(self, spec: "CompressedAttention.Spec", model):
        super().__init__(spec, model)
        self.ratio = spec.compress_ratio
        self.compressor = Compressor(model.dim, spec.head_dim, spec.compress_ratio, spec.compress_overlap,
                                     spec.rot_dim, spec.rope_interleaved, spec.norm_eps)

    def n_entries(self, max_seq: int) -> int:
        """Ne: entry slots per sequence (at least one, so that every tensor has a shape)."""
        return max(1, max_seq // self.ratio)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        c, N = self.compressor, self.n_entries(max_seq)
        return {**super().cache_fields(max_batch, max_seq, dtype),
                "block": CacheField((max_batch, 1, c.span, 2 * c.width), dtype, grows=False),
                "start": CacheField((max_batch, self.rot), torch.float32, grows=False),
                "entries": CacheField((max_batch, 1, N, self.head_dim), dtype, grows=True)}

    def attention_flops(self, context):
        """Per token: the window (swa_mqa) plus q.k and the weighted sum over the visible entries."""
        n = np.asarray(context) // self.ratio
        return super().attention_flops(context) + 4 * self.n_heads * self.head_dim * self.chosen(n)

    def chosen(self, n):
        """Entries a query attends to when n are visible: all of them (no indexer)."""
        return n

    def decode_cache_bytes(self, context: int, dtype: torch.dtype) -> int:
        """(analysis.py) Cache bytes one decode step reads per sequence at `context` tokens: every
        field, but of the entries only those chosen."""
        fields = self.cache_fields(1, context, dtype)
        entries = fields["entries"]
        per_entry = entries.nbytes // entries.shape[2]
        return sum(f.nbytes for f in fields.values()) - entries.nbytes + \
            per_entry * int(self.chosen(context // self.ratio))

    # ------------------------------------------------------------------ entry selection

    def select_prefill(self, x, q_resid, cache, cos, sin, visible) -> torch.Tensor:
        """-> [B, L, n] bool: the visible entries each query attends to (all, here)."""
        return visible.expand(x.shape[0], -1, -1)

    def select_decode(self, x, q_resid, cache, cos, sin, visible):
        """-> entry slots [B, K] and their mask [B, K] (every slot, here)."""
        slots = torch.arange(visible.shape[-1], device=x.device).expand(x.shape[0], -1)
        return slots, visible

    # ------------------------------------------------------------------ entry points

    def _start(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat((cos, sin), dim=-1).float()

    def prefill_attention(self, x: torch.Tensor, cache: dict, cos: torch.Tensor, sin: torch.Tensor):
        """prefill up to its softmax (shared with attention_probe): x [B, L, D] at positions
        0..L-1, cos/sin [L, R/2]; fills the window ring, the block ring, the entries of the complete
        blocks and the start of the last (partial) block. -> window keys [B, L, Sw, Dh], entries
        [B, N, Dh], logits [B, H, L, Sw + N] (window then entries, -inf where not attended) and
        their probabilities (float32; the sink holds the rest)."""
        L, m = x.shape[1], self.ratio
        q_resid = self.query_residual(x)
        q, kv = self.project(x, cos, sin, q_resid)
        self.write_ring(cache["kv"], kv)
        N = cache["entries"].shape[2]
        entries = self.compressor.prefill(x, cache["block"], cos, sin, self.write_ring, N)  # [B, N, Dh]
        write_prefill(cache["entries"], entries[:, None])
        # the start of the block holding the last token (if that block is complete, decode's
        # next position opens a new one and overwrites this)
        last = torch.arange(L, device=x.device)[-1:]  # [1]: L - 1, as a tensor (no shape guard)
        start = self._start(cos, sin).index_select(0, last - last % m)  # [1, R]
        cache["start"].copy_(start.expand_as(cache["start"]))
        visible = visible_entries(torch.arange(L, device=x.device), entries.shape[1], m)  # [L, n]
        chosen = self.select_prefill(x, q_resid, cache, cos, sin, visible)  # [B, L, n]
        keys, scores = self.window_scores(q, kv, cache["kv"].shape[2])
        ce = torch.einsum("bhld,bnd->bhln", q, entries) * self.scale
        logits = torch.cat((scores, ce.masked_fill(~chosen[:, None], float("-inf"))), dim=-1)
        return keys, entries, logits, softmax_with_sink(logits, self.sink.weight.view(1, -1, 1, 1))

    extend = Mixer.extend  # one decode step per token (see the module docstring), not swa_mqa's

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (positions 0..L-1) -> [B, L, D]; fills the caches (see prefill_attention)."""
        cos, sin = ctx["rope"][self.rope]  # [L, R/2]
        keys, entries, _, probs = self.prefill_attention(x, cache, cos, sin)
        pw, pc = probs.to(keys.dtype).split([keys.shape[2], entries.shape[1]], dim=-1)
        o = torch.einsum("bhlw,blwd->bhld", pw, keys) + torch.einsum("bhln,bnd->bhld", pc, entries)
        return self.out(o, cos, sin)

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)) -> AttentionMaps:
        """prefill's attention as probabilities (contracts.AttentionProbe), run on a scratch cache
        sized for the prompt (entries past L // m are never visible to it): the window part per
        token [B, h, L, L]; extras "sink" [B, h, L] and "entries" [B, h, L, Ne] (the chosen
        compressed entries' shares)."""
        cos, sin = ctx["rope"][self.rope]
        B, L, _ = x.shape
        scratch = {name: torch.zeros(f.shape, dtype=f.dtype, device=x.device)
                   for name, f in self.cache_fields(B, L, x.dtype).items()}
        keys, _, logits, probs = self.prefill_attention(x, scratch, cos, sin)
        rows = head_rows(heads, self.n_heads)
        probs, logits, Sw = probs[:, rows.start:rows.stop], logits[:, rows.start:rows.stop].float(), keys.shape[2]
        return AttentionMaps(window_to_tokens(probs[..., :Sw], 0.0), window_to_tokens(logits[..., :Sw], float("-inf")),
                             {"sink": 1 - probs.sum(-1), "entries": probs[..., Sw:]})

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx['pos'] [B] -> [B, 1, D]; writes the window ring slot, the
        block ring slot, and, when pos completes a block, entry pos // m."""
        cos, sin = ctx["rope"][self.rope]  # [B, R/2]
        pos, m = ctx["pos"], self.ratio
        q_resid = self.query_residual(x)
        q, kv = self.project(x, cos[:, None, None], sin[:, None, None], q_resid)
        ring = cache["kv"]
        write_decode(ring, kv, pos % ring.shape[2])
        opens = (pos % m == 0)[:, None]
        cache["start"].copy_(torch.where(opens, self._start(cos, sin), cache["start"]))
        complete = pos % m == m - 1
        self.complete_block(x, pos, complete, cache, "block", "entries", self.compressor)
        visible = visible_entries(pos, cache["entries"].shape[2], m)  # [B, N]
        slots, mask = self.select_decode(x, q_resid, cache, cos, sin, visible)  # [B, K]
        keys = ring.to(q.dtype)  # [B, 1, Sw, Dh]
        ents = cache["entries"][:, 0].gather(1, slots[..., None].expand(-1, -1, self.head_dim)).to(q.dtype)
        sw = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, H, 1, Sw]
        sw = sw.masked_fill(~decode_mask(pos, ring.shape[2]), float("-inf"))
        se = torch.einsum("bhqd,bkd->bhqk", q, ents) * self.scale
        se = se.masked_fill(~mask[:, None, None], float("-inf"))
        probs = softmax_with_sink(torch.cat((sw, se), dim=-1), self.sink.weight.view(1, -1, 1, 1))
        pw, pe = probs.to(q.dtype).split([keys.shape[2], ents.shape[1]], dim=-1)
        o = torch.matmul(pw, keys) + torch.einsum("bhqk,bkd->bhqd", pe, ents)
        return self.out(o, cos[:, None, None], sin[:, None, None])

    def complete_block(self, x, pos, complete, cache, ring_name: str, entries_name: str, compressor) -> None:
        """Decode: the compressor's row for pos into its ring; entry pos // m written iff complete."""
        start = cache["start"]
        half = self.rot // 2
        entry = compressor.decode(x, pos, cache[ring_name], start[:, :half], start[:, half:])  # [B, Dc]
        entries = cache[entries_name]  # [B, 1, N, Dc]
        rows = torch.arange(entries.shape[0], device=pos.device)
        w = torch.div(pos, self.ratio, rounding_mode="floor").clamp(max=entries.shape[2] - 1)
        entries[rows, 0, w] = torch.where(complete[:, None], entry.to(entries.dtype), entries[rows, 0, w])


class IndexerWeights(nn.Module):
    """Parameters of the lightning indexer: wq_b [Hi*Di, Cq], weights_proj [Hi, D], compressor."""

    def __init__(self, dim: int, q_lora_rank: int, heads: int, head_dim: int, compressor: Compressor):
        super().__init__()
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, heads, bias=False)
        self.compressor = compressor


@register("mixer", "csa_mqa")
class SparseCompressedAttention(CompressedAttention):
    """hca_mqa plus indexer.{wq_b, weights_proj, compressor.*}: each query attends to the
    index_topk visible entries of highest indexer score."""

    @dataclass
    class Spec(CompressedAttention.Spec):
        kind: str = "csa_mqa"
        compress_overlap: bool = True
        index_n_heads: int = "???"  # type: ignore[assignment]
        index_head_dim: int = "???"  # type: ignore[assignment]
        index_topk: int = "???"  # type: ignore[assignment]

        def check(self, model: dict) -> Optional[str]:
            err = CompressedAttention.Spec.check(self, model)
            if err:
                return err
            bad = {k: getattr(self, k) for k in ("index_n_heads", "index_head_dim", "index_topk")
                   if getattr(self, k) <= 0}
            if bad:
                return f"{bad} must be positive"
            if self.rot_dim > self.index_head_dim:
                return f"rot_dim={self.rot_dim} exceeds index_head_dim={self.index_head_dim}"
            return None

    def __init__(self, spec: "SparseCompressedAttention.Spec", model):
        super().__init__(spec, model)
        s = spec
        self.index_heads, self.index_dim, self.topk = s.index_n_heads, s.index_head_dim, s.index_topk
        comp = Compressor(model.dim, s.index_head_dim, s.compress_ratio, s.compress_overlap, s.rot_dim,
                          s.rope_interleaved, s.norm_eps)
        self.indexer = IndexerWeights(model.dim, s.q_lora_rank, s.index_n_heads, s.index_head_dim, comp)

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        c, N = self.indexer.compressor, self.n_entries(max_seq)
        return {**super().cache_fields(max_batch, max_seq, dtype),
                "index_block": CacheField((max_batch, 1, c.span, 2 * c.width), dtype, grows=False),
                "index_keys": CacheField((max_batch, 1, N, self.index_dim), dtype, grows=True)}

    def chosen(self, n):
        return np.minimum(n, self.topk)

    def attention_flops(self, context):
        """Plus the indexer: Hi dot products of Di and the head-weighted sum, per visible entry."""
        n = np.asarray(context) // self.ratio
        return super().attention_flops(context) + 2 * self.index_heads * (self.index_dim + 1) * n

    def index_scores(self, x, q_resid, keys, cos, sin) -> torch.Tensor:
        """x [B, L, D], q_resid [B, L, Cq], keys [B, n, Di], cos/sin broadcastable to [B, L, 1, R/2]
        -> scores [B, L, n] float32."""
        B, L, _ = x.shape
        iq = self.indexer.wq_b(q_resid).view(B, L, self.index_heads, self.index_dim)
        iq = rope_tail(iq, cos, sin, self.rot, self.spec.rope_interleaved)
        dots = torch.einsum("blhd,bnd->blhn", iq.float(), keys.float()).relu() * self.index_dim ** -0.5
        w = self.indexer.weights_proj(x).float() * self.index_heads ** -0.5  # [B, L, Hi]
        return torch.einsum("blhn,blh->bln", dots, w)

    def top(self, scores: torch.Tensor, visible: torch.Tensor):
        """scores, visible [B, L, n] -> the top min(k, n) visible entries: indices [B, L, K] and
        whether each is visible (fewer than K visible: the rest are padding)."""
        scores = scores.masked_fill(~visible, float("-inf"))
        idx = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return idx, visible.gather(-1, idx)

    def select_prefill(self, x, q_resid, cache, cos, sin, visible) -> torch.Tensor:
        keys = self.indexer.compressor.prefill(x, cache["index_block"], cos, sin, self.write_ring,
                                               cache["index_keys"].shape[2])  # [B, N, Di]
        write_prefill(cache["index_keys"], keys[:, None])
        scores = self.index_scores(x, q_resid, keys, cos[:, None], sin[:, None])
        visible = visible.expand(x.shape[0], -1, -1)
        idx, ok = self.top(scores, visible)
        return torch.zeros_like(visible).scatter_(-1, idx, ok)

    def select_decode(self, x, q_resid, cache, cos, sin, visible):
        keys = cache["index_keys"][:, 0].to(x.dtype)  # [B, N, Di]
        scores = self.index_scores(x, q_resid, keys, cos[:, None, None], sin[:, None, None])  # [B, 1, N]
        idx, ok = self.top(scores, visible[:, None])
        return idx[:, 0], ok[:, 0]

    def complete_block(self, x, pos, complete, cache, ring_name, entries_name, compressor) -> None:
        super().complete_block(x, pos, complete, cache, ring_name, entries_name, compressor)
        if compressor is self.compressor:  # the indexer's keys complete with the same blocks
            super().complete_block(x, pos, complete, cache, "index_block", "index_keys", self.indexer.compressor)
