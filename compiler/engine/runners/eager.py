"""Eager: every layer's Python as written (compile=False; the reference the others are held to)."""
from __future__ import annotations

import torch

from .base import Runner, RunnerOptions, register


@register("eager", priority=0)
class EagerRunner(Runner):
    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        return True

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        for block, cache in zip(layers, caches):
            h = block.prefill(h, cache, ctx)
        return h

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        for block, cache in zip(layers, caches):
            h = block.extend(h, cache, ctx)
        return h

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        for block, cache in zip(self.engine.model.layers, self.engine.caches):
            h = block.decode(h, cache, ctx)
        return h
