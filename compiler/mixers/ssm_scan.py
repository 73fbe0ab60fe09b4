"""The entry points the selective-scan mixers share (Mamba, Mamba2): one chunked scan over a
prompt from a given conv history and state serves prefill (zeros), extend (the cached ones) and
the naive reference (the token loop, from zeros, on scratch caches).

A subclass defines `_prefill_scan(x, conv_history, state, cache, scan=None) -> (y, u, z, dt,
final state)` (the conv inputs left in cache["conv"]), `_out(y, u, z, dtype)` and `naive_scan`,
the token loop its chunked scan is held to.
"""
from __future__ import annotations

from typing import Callable, ClassVar

import torch

from ..contracts import Mixer


class ScanMixer(Mixer):
    """prefill / extend / reference of a selective-scan mixer over its `_prefill_scan`."""

    naive_scan: ClassVar[Callable]

    def prefill_from(self, x: torch.Tensor, conv_history: torch.Tensor, state: torch.Tensor,
                     cache: dict) -> torch.Tensor:
        """x [B, L, D] continuing a sequence whose conv inputs and SSM state are given -> [B, L, D];
        leaves the new conv inputs and state in the cache."""
        y, u, z, _, final = self._prefill_scan(x, conv_history, state, cache)
        cache["state"].copy_(final)
        return self._out(y, u, z, x.dtype)

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] (new sequences: zero conv history and state) -> [B, L, D]."""
        return self.prefill_from(x, torch.zeros_like(cache["conv"]), torch.zeros_like(cache["state"]), cache)

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] after the rows' cached tokens -> [B, L, D]: the chunked form from the cached
        conv inputs and state, leaving both updated (chunked prefill, prefix reuse, verification)."""
        return self.prefill_from(x, cache["conv"].clone(), cache["state"], cache)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The naive token-loop form from zero history and state: x [B, L, D] -> [B, L, D]."""
        scratch = self._scratch(x)
        y, u, z, _, _ = self._prefill_scan(x, scratch["conv"], scratch["state"], scratch, type(self).naive_scan)
        return self._out(y, u, z, x.dtype)

    def _scratch(self, x: torch.Tensor) -> dict:
        """Zeroed caches for x's batch and length (the layer's own cache stays as it is)."""
        return {name: torch.zeros(f.shape, dtype=f.dtype, device=x.device)
                for name, f in self.cache_fields(x.shape[0], x.shape[1], x.dtype).items()}
