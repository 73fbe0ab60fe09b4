"""AOTInductor packages: CPU layers exported and compiled ahead of time, run by torch's C++
runner (runtime.aot; the packages themselves, their keys and cache are ../aot.py).

Loaded (made on a miss) at each step's first call, per cache layout (`where`): the batch, a row's
views, an MTP block. Nothing of dynamo or inductor is imported unless a package has to be made.
"""
from __future__ import annotations

import time

import torch

from ...errors import ConfigError
from torch.utils import _pytree as pytree

from ..aot import StepPackages, context_tensors
from .base import Runner, RunnerOptions, register


@register("aot", priority=30)
class AOTRunner(Runner):
    extends = False
    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        if options.aot and not (options.compile and options.device.type == "cpu"):
            raise ValueError("aot needs compile=True on a CPU")
        return options.aot

    def __init__(self, engine, options: RunnerOptions):
        super().__init__(engine, options)
        self._loaders: dict[str, object] = {}  # package path -> runner, shared by the step packages
        self._packages: dict[tuple, StepPackages] = {}  # ("prefill" | "decode", where) -> its packages

    def _steps(self, step: str, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> StepPackages:
        """The packages of `step` for these layers and caches, loaded (or made) on first use from
        the first call's inputs."""
        steps = self._packages.get((step, where))
        if steps is None:
            if step == "prefill":  # the prompt length: h's dim 1, the ids' dim 1, the rope rows' dim 0
                dims = {"ids": 1, "rope": {k: (0, 0) for k in ctx["rope"]}}
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders, pytree.tree_leaves(dims),
                                     self.engine.max_seq)
            else:
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders)
            self._packages[step, where] = steps
        return steps

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self._steps("prefill", where, layers, caches, h, ctx).run(h, context_tensors(ctx))

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        engine = self.engine
        return self._steps("decode", "batch", engine.model.layers, engine.caches, h, ctx).run(h, context_tensors(ctx))

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        raise ConfigError("runtime.aot: extend_rows (chunked prefill, prefix reuse, speculative "
                                  "decoding) has no AOTInductor packages; build with compile=true and aot=false")

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
        tok = engine.token_buffer[:, None]
        self._steps("decode", "batch", model.layers, engine.caches, engine.embed(tok), engine.decode_ctx())
        seconds["decode"] = time.perf_counter() - t0
        return seconds

    def graph_counts(self) -> dict[str, int]:
        """The packages in use ("prefill_packages", "decode_packages": one per layer structure and
        layout of the inputs)."""
        counts = {"prefill_packages": set(), "decode_packages": set()}
        for (step, _), steps in self._packages.items():
            counts[f"{step}_packages"] |= steps.keys
        return {name: len(keys) for name, keys in counts.items()}

    def packages_built(self) -> list[str]:
        return [key for steps in self._packages.values() for key in steps.built]
