"""Optional analysis hooks (compiler/patterns.py, `zoo patterns`): a kind without them is
reported as such. Shape letters are the glossary's (glossary.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class AttentionMaps:
    """What a softmax mixer attends to over a prompt at positions 0..L-1, for heads h (a slice of
    its H query heads), float32:

    probs   [B, h, L, L]  weight of query t on prompt token s (0 where t does not attend to s)
    logits  [B, h, L, L]  the scaled q.k score of (t, s) wherever the kind computes one (its
                          causal / window mask), -inf elsewhere; a sparse kind (DSA) gives the
                          dense scores, before its selection
    extras  per-kind views with the same leading [B, h, L] (or [B, L] for per-query picks):
            "sink" [B, h, L] the learned sink's share; "entries" [B, h, L, Ne] the share of
            compressed entries; "picks" [B, L, Ks] the indexer's chosen keys (-1: none);
            "captured" [B, h, L] the share of the dense softmax mass that the picks hold.
    For every query, probs.sum(-1) + sink + entries.sum(-1) == 1.
    """

    probs: torch.Tensor
    logits: torch.Tensor
    extras: dict = field(default_factory=dict)


@runtime_checkable
class AttentionProbe(Protocol):
    """A softmax mixer that can show its attention. The probe must run the mixer's own code
    (projections, RoPE, scale, masks, sinks, selection) on the prefill's inputs; only the fused
    kernel (SDPA) is replaced by an explicit softmax. Adding it to a new kind: factor the kind's
    score computation into a helper its prefill calls, and call that helper here too."""

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)) -> AttentionMaps:
        """x [B, L, D] and ctx exactly as `prefill` gets them (positions 0..L-1) -> the maps of
        query heads `heads`; touches no cache."""


@runtime_checkable
class MixerStatistics(Protocol):
    """A mixer without attention probabilities (linear / recurrent) that reports its gates and state."""

    def mixer_statistics(self, x: torch.Tensor, ctx: dict) -> dict[str, torch.Tensor]:
        """x [B, L, D], ctx as `prefill` gets them -> name -> [B, heads] float32 per-head statistics."""


@runtime_checkable
class StreamMixing(Protocol):
    """A residual connection that mixes N streams (mHC)."""

    def mixing(self, h: torch.Tensor) -> torch.Tensor:
        """residual state h [..., N, D] -> the stream-mixing matrix it applies [..., N, N] (float32)."""
