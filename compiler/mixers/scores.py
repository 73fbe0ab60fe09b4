"""Explicit attention scores, for the attention probes (contracts.AttentionProbe) of the softmax
mixers: the same q, k (from each kind's own projection and RoPE) and scale its fused kernel gets,
scored and normalised in float32 without the kernel.
"""
from __future__ import annotations

import torch


def causal_mask(L: int, device) -> torch.Tensor:
    """[L, L] bool: query t sees key s iff s <= t (what SDPA's is_causal applies)."""
    t = torch.arange(L, device=device)
    return t[None, :] <= t[:, None]


def dot_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, h, L, X], k [B, 1 or h, S, X] -> scale * q.k [B, h, L, S] float32."""
    return torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., L, S], mask broadcastable (True: attended) -> (logits with -inf where masked,
    probabilities [..., L, S] float32)."""
    logits = logits.float().masked_fill(~mask, float("-inf"))
    return logits, torch.softmax(logits, dim=-1)


def head_rows(heads: slice, n_heads: int) -> range:
    """The query heads a probe slice selects, as a range (checked: a probe of no head is a bug)."""
    rows = range(n_heads)[heads]
    if not len(rows) or rows.step != 1:
        raise ValueError(f"heads={heads}: expected a contiguous, non-empty slice of {n_heads} heads")
    return rows
