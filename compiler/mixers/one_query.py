"""One-query attention over a KV cache on the CPU (a decode step): zoo's kernel and its reference.

    decode_attention(q [B, H, Dh], k, v [B, Hkv, S, Dh], n [B] int64, scale) -> o [B, H, Dh]
        float32; row b attends to cache slots 0..n[b]-1; query head h reads KV head h // (H / Hkv)
    prefix_attention / window_attention: L queries per row, each computed as that decode step
        (a full cache's slots 0..pos; a sliding window's keys in position order, read through an index)

The kernel (cpu_attention.cpp, built on first use by compiler/native.py) reads each visible
slot of k and v once and skips the rest of the static cache; `reference` is the same thing in
torch ops, for the tests (tests/test_one_query.py holds one to the other). Where the kernel did
not build, Attention.decode keeps its own torch-op path (ctx "one_query_kernel" is False).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .. import native

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel computes, in torch ops."""
    B, H, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = H // Hkv
    logits = torch.einsum("bkgd,bksd->bkgs", q.view(B, Hkv, g, Dh), k) * scale  # [B, Hkv, g, S]
    visible = torch.arange(S, device=q.device)[None, :] < n[:, None]  # [B, S]
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bkgs,bksd->bkgd", probs, v).reshape(B, H, Dh)


@functools.cache
def _load() -> str | None:
    why = native.load(SOURCE)
    if why is None:
        torch.library.register_fake("zoo_attn::decode_attention")(lambda q, k, v, n, scale: torch.empty_like(q))
        torch.library.register_fake("zoo_attn::prefix_attention")(lambda q, k, v, start, scale: q.new_empty(q.shape))
        torch.library.register_fake("zoo_attn::window_attention")(
            lambda q, k, v, slots, first, n, scale: q.new_empty(q.shape))
    return why


def available() -> bool:
    """Whether the kernel built and loaded (else callers use their torch-op path)."""
    return _load() is None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.ops.zoo_attn.decode_attention(q, k, v, n, scale)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, Dh] at positions start[b] + t over k, v [B, Hkv, S, Dh] -> o [B, H, L, Dh]: query t
    of row b sees slots 0..start[b] + t, each computed as decode_attention computes its step (the
    same bits: a prompt prefilled whole, in chunks, after a reused prefix or decoded gives each
    position the same attention output, issue #46)."""
    return torch.ops.zoo_attn.prefix_attention(q, k, v, start, scale)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, first: torch.Tensor,
                     n: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, Dh] over k, v [B, Hkv, T, Dh] -> o [B, H, L, Dh]: query t of row b sees the n[b, t]
    keys at rows slots[b, first[b, t] + u], u < n[b, t] (slots [B, P], first / n [B, L] int64): a
    sliding window's keys in position order, wherever the cache keeps them. Each query computed as
    decode_attention computes one over those keys copied to slots 0..n-1: a window gives a position
    the same bits whole, in chunks, after a reused prefix or decoded (issue #46)."""
    return torch.ops.zoo_attn.window_attention(q, k, v, slots, first, n, scale)


def window_reference(q, k, v, slots, first, n, scale) -> torch.Tensor:
    """What window_attention computes, in torch ops (each query over its keys gathered)."""
    B, H, L, Dh = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        for t in range(L):
            rows = slots[b, first[b, t]:first[b, t] + n[b, t]]
            kk, vv = k[b:b + 1, :, rows], v[b:b + 1, :, rows]
            out[b, :, t] = reference(q[b:b + 1, :, t], kk, vv, n[b, t].view(1), scale)[0]
    return out
