"""Writers and masks of per-token caches laid out [B, Hc, S, X] (one slot per position), shared
by every mixer that keeps such a cache (GQA, MLA, DSA, sink and compressed attention).

Sliding-window layers keep a ring of Sw slots instead (GQA with `window`, sink and compressed
attention): position p lives in slot p % Sw, so the cache holds the last Sw keys whatever the
context. `write_ring` fills it after a prefill, `write_decode(cache, new, pos % Sw)` per step, and
`decode_mask(pos, Sw)` is still the visibility mask (before the ring wraps, slots above pos are
empty; after, every slot holds one of the last Sw positions).
"""
from __future__ import annotations

import torch


def decode_mask(pos: torch.Tensor, max_seq: int) -> torch.Tensor:
    """[B, 1, 1, S] bool: slot s is visible to the token at pos[b] iff s <= pos[b]."""
    slots = torch.arange(max_seq, device=pos.device)
    return (slots[None, :] <= pos[:, None])[:, None, None, :]


def write_prefill(cache: torch.Tensor, new: torch.Tensor) -> None:
    """cache [B, Hc, S, X] <- new [B, Hc, L, X] at slots 0..L-1."""
    # index_copy_ rather than a slice: a slice of symbolic length L would make the compiler
    # specialise on L == S
    slots = torch.arange(new.shape[2], device=cache.device)
    cache.index_copy_(2, slots, new.to(cache.dtype))


def write_decode(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> None:
    """cache [B, Hc, S, X] <- new [B, Hc, 1, X] at slot pos[b] of each row b."""
    rows = torch.arange(cache.shape[0], device=cache.device)
    cache[rows, :, pos] = new[:, :, 0].to(cache.dtype)


def write_ring(cache: torch.Tensor, new: torch.Tensor) -> None:
    """cache [B, Hc, Sw, X] <- the last Sw of new [B, Hc, L, X] (positions 0..L-1): slot s gets
    the latest position p < L with p % Sw == s; slots no position reached are left as they are."""
    Sw, L = cache.shape[2], new.shape[2]
    s = torch.arange(Sw, device=new.device)
    valid = s < L
    p = torch.where(valid, s + Sw * torch.div(L - 1 - s, Sw, rounding_mode="floor"), 0)
    cache.copy_(torch.where(valid[:, None], new.index_select(2, p).to(cache.dtype), cache))
