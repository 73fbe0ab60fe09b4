"""Writers and masks of per-token caches laid out [B, Hc, S, X] (one slot per position), shared
by every mixer that keeps such a cache (GQA, MLA, DSA, sink and compressed attention).

Sliding-window layers keep a ring of Sw slots instead (GQA with `window`, sink and compressed
attention): position p lives in slot p % Sw, so the cache holds the last Sw keys whatever the
context. `write_ring` fills it after a prefill, `write_decode(cache, new, pos % Sw)` per step, and
`decode_mask(pos, Sw)` is still the visibility mask (before the ring wraps, slots above pos are
empty; after, every slot holds one of the last Sw positions).

Extend (L tokens appended at each row's own start): `write_extend` puts them in their slots of a
per-position cache; a ring is read first (`ring_positions`: which position each slot holds
before the chunk) and attended together with the chunk's own keys, then `write_ring_extend`
keeps the chunk's last Sw positions. Any chunk length is exact with Sw slots.
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


def extend_positions(start: torch.Tensor, L: int) -> torch.Tensor:
    """start [B] -> [B, L]: the positions start[b]..start[b]+L-1 of an extend chunk."""
    return start[:, None] + torch.arange(L, device=start.device)


def write_extend(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> None:
    """cache [B, Hc, S, X] <- new [B, Hc, L, X] at slots pos [B, L] of each row."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache[rows, :, pos] = new.transpose(1, 2).to(cache.dtype)  # indexed as [B, L, Hc, X]


def ring_positions(start: torch.Tensor, Sw: int) -> torch.Tensor:
    """start [B] -> [B, Sw]: the position ring slot s holds before an extend at start (the latest
    p < start with p % Sw == s); negative where no position reached the slot."""
    last = start[:, None] - 1
    return last - torch.remainder(last - torch.arange(Sw, device=start.device), Sw)


def window_span(qpos: torch.Tensor, p0: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qpos [B, L] query positions, p0 [B] the position of a row's first indexed key, window W ->
    (first, n) [B, L]: query t sees the keys of positions max(0, qpos - W + 1)..qpos, n of them,
    the first at index first of its row's slots (one_query.window_attention)."""
    lo = torch.clamp(qpos - (window - 1), min=0)
    return lo - p0[:, None], qpos - lo + 1


def write_ring_extend(cache: torch.Tensor, new: torch.Tensor, start: torch.Tensor) -> None:
    """cache [B, Hc, Sw, X] <- the chunk new [B, Hc, L, X] at positions start[b]..start[b]+L-1:
    slot s gets the chunk's latest position p with p % Sw == s; the other slots keep theirs."""
    B, Hc, Sw, X = cache.shape
    end = start[:, None] + new.shape[2] - 1
    p = end - torch.remainder(end - torch.arange(Sw, device=start.device), Sw)  # [B, Sw]
    valid = p >= start[:, None]
    j = torch.where(valid, p - start[:, None], 0)
    picked = new.gather(2, j[:, None, :, None].expand(B, Hc, Sw, X)).to(cache.dtype)
    cache.copy_(torch.where(valid[:, None, :, None], picked, cache))
