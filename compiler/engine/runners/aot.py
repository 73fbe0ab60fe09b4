"""AOTInductor packages: CPU layers exported and compiled ahead of time, run by torch's C++
runner (runtime.aot; the packages themselves, their keys and cache are ../aot.py).

Loaded (made on a miss) at each step's first call, per cache layout (`where`): the batch, a row's
views, an MTP block, each decode bucket (its rows' views: one package per layer structure and
bucket), an extend of n rows (chunked prefill, prefix reuse, speculative verification of k+1
tokens: any length in [2, max_seq] through one package, 1-token extends through another).
Nothing of dynamo or inductor is imported unless a package has to be made.
"""
from __future__ import annotations

import time

import torch
from torch.utils import _pytree as pytree

from ...contracts import extends_by_decode
from ..aot import StepPackages, context_tensors
from .base import Runner, RunnerOptions, register


def _length_dims(ctx: dict, rope_dim: int) -> list:
    """Per context tensor (context_tensors' order), its token-length dimension or None: the ids'
    and the per-layer inputs' dim 1 and the rope rows' `rope_dim` (0 in prefill: [L, d]; 1 in an extend: [n, L, d]); the
    rest ("start", the mixers' flags) have none."""
    leaves, _ = pytree.tree_flatten_with_path(ctx)
    dims = {"ids": 1, "rope": rope_dim, "per_layer": 1}  # per_layer [n, L, Nl, Dp]
    return [dims.get(path[0].key) for path, x in leaves if isinstance(x, torch.Tensor)]


@register("aot", priority=30)
class AOTRunner(Runner):
    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        if options.aot and not (options.compile and options.device.type == "cpu"):
            raise ValueError("aot needs compile=True on a CPU")
        return options.aot

    def __init__(self, engine, options: RunnerOptions):
        super().__init__(engine, options)
        self._loaders: dict[str, object] = {}  # package path -> runner, shared by the step packages
        # (step, where[, ...]) -> its packages; step: "prefill" | "decode" | "extend"
        self._packages: dict[tuple, StepPackages] = {}

    def _steps(self, step: str, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> StepPackages:
        """The packages of `step` for these layers and caches, loaded (or made) on first use from
        the first call's inputs. A prefill's and an extend's length (h's dim 1) is dynamic: one
        package for every length in [2, max_seq]; a 1-token extend has packages of its own
        (export makes a dimension of size 1 a constant)."""
        key = (step, where) if step != "extend" else (step, where, h.shape[1] == 1)
        steps = self._packages.get(key)
        if steps is None:
            if step == "decode" or h.shape[1] == 1:
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders)
            else:
                dims = _length_dims(ctx, 0 if step == "prefill" else 1)
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders, dims, self.engine.max_seq)
            self._packages[key] = steps
        return steps

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self._steps("prefill", where, layers, caches, h, ctx).run(h, context_tensors(ctx))

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        engine, b = self.engine, h.shape[0]
        steps = self._steps("decode", ("bucket", b), engine.model.layers, engine.decode_caches(b), h, ctx)
        return steps.run(h, context_tensors(ctx))

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Runs of consecutive layers as packages (per `where`: the rows' count, an MTP block),
        made from the first call and fed each call's caches (views of a run of rows or gathered
        copies: one layout); a layer whose extend is one decode step per token (a loop over L,
        contracts.extends_by_decode) runs it eagerly, as the compiled runner does."""
        tensors = context_tensors(ctx)
        layers, caches = list(layers), list(caches)
        i = 0
        while i < len(layers):
            if extends_by_decode(layers[i].mixer):
                h = layers[i].extend(h, caches[i], ctx)
                i += 1
                continue
            j = i
            while j < len(layers) and not extends_by_decode(layers[j].mixer):
                j += 1
            steps = self._steps("extend", (where, i), layers[i:j], caches[i:j], h, ctx)
            h = steps.run(h, tensors, caches[i:j])
            i = j
        return h

    def warmup(self) -> dict[str, float]:
        """Load the packages (made on a miss) without running them."""
        # a dummy pass would only cost a forward over every weight (~0.3 s of a SmolLM2 float32 start-up)
        engine, seconds = self.engine, {}
        model = engine.model
        t0 = time.perf_counter()
        if engine.max_seq >= 2:
            ids = torch.zeros(engine.max_batch, 2, dtype=torch.long, device=engine.device)
            self._steps("prefill", "batch", model.layers, engine.caches, engine.embed(ids), engine.prefill_ctx(ids))
        seconds["prefill"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in engine.buckets:
            tok = engine.token_buffer[:b, None]
            self._steps("decode", ("bucket", b), model.layers, engine.decode_caches(b), engine.embed(tok),
                        engine.decode_ctx(b))
        seconds["decode"] = time.perf_counter() - t0
        return seconds

    def graph_counts(self) -> dict[str, int]:
        """The packages in use ("prefill_packages", "decode_packages", "extend_packages": one per
        layer structure and layout of the inputs, so one per decode bucket; an extend's per rows'
        count, and its 1-token extends' apart)."""
        counts = {"prefill_packages": set(), "decode_packages": set(), "extend_packages": set()}
        for (step, *_), steps in self._packages.items():
            counts[f"{step}_packages"] |= steps.keys
        # extend once an extend has run (most engines never extend)
        return {name: len(keys) for name, keys in counts.items() if name != "extend_packages" or keys}

    def packages_built(self) -> list[str]:
        return [key for steps in self._packages.values() for key in steps.built]
