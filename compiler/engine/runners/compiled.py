"""Compiled regions: each layer's prefill and decode through torch.compile (dynamo + inductor).

Regional compilation: the repeated block is compiled once per distinct layer kind and reused by
every layer of that kind (parameters are graph inputs, so layers share one graph); the embedding,
final norm and head run eagerly around it. Both entry points compile with fullgraph=True.

    prefill: L is a dynamic dimension (one graph for every prompt length 2..max_seq).
    extend:  L dynamic too, and the rows' positions are data: one graph per (rows n, layer kind).
             A layer whose mixer extends by the contract's decode-step loop
             (contracts.extends_by_decode) runs eagerly: a graph of the loop would specialise on L.
    decode:  static shapes: one graph per layer structure and decode bucket (each bucket's
             functions have code objects of their own); after a bucket's first step, its CPU
             steps skip dynamo's guard checks where that is proven safe (see decode_layers).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import types
from typing import Callable

import torch

from ...contracts import extends_by_decode
from ..compiling import GraphCounter, apply_compile_settings, kernel_sources_digest, cpu_compile_patches, dynamo_settings, structure
from .base import Runner, RunnerOptions, register


def _block_prefill(block, h, cache, ctx):
    return block.prefill(h, cache, ctx)


def _block_extend(block, h, cache, ctx):
    return block.extend(h, cache, ctx)


def _block_decode(block, h, cache, ctx):
    return block.decode(h, cache, ctx)


def _own_copy(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own: dynamo keeps compiled entries per code object."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _entries(fn: Callable) -> int:
    """Compiled entries dynamo holds for fn's code object."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


_ENGINES = itertools.count()


@register("compiled", priority=10)
class CompiledRunner(Runner):
    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        return options.compile

    def __init__(self, engine, options: RunnerOptions):
        super().__init__(engine, options)
        model = engine.model
        apply_compile_settings()
        patches = cpu_compile_patches() if engine.device.type == "cpu" else {}
        key = f"zoo-max_seq={engine.max_seq}-kernels={kernel_sources_digest()}"  # see kernel_sources_digest
        self.counters = {name: GraphCounter(name, key, patches) for name in ("prefill", "decode", "extend")}
        self._prefill = torch.compile(_block_prefill, fullgraph=True, dynamic=False, backend=self.counters["prefill"])
        self._extend = torch.compile(_block_extend, fullgraph=True, dynamic=False, backend=self.counters["extend"])
        # one decode function per distinct layer structure and bucket, each with a code object of
        # its own (so one compiled entry each: see decode_layers); a bucket's caches are views of
        # its rows, so the structure (shapes) tells the buckets apart
        n = next(_ENGINES)
        self._decode: dict[int, list[Callable]] = {}  # bucket -> each layer's compiled decode
        self._decode_kinds: dict[int, list[Callable]] = {}  # bucket -> its distinct functions
        for b in engine.buckets:
            kinds = {}
            structures = [structure(block, cache) for block, cache in zip(model.layers, engine.decode_caches(b))]
            for st in structures:
                kinds.setdefault(st, _own_copy(_block_decode, f"_block_decode_{n}_b{b}_{len(kinds)}"))
            self._decode_kinds[b] = list(kinds.values())
            compiled = {st: torch.compile(f, fullgraph=True, dynamic=False, backend=self.counters["decode"])
                        for st, f in kinds.items()}
            self._decode[b] = [compiled[st] for st in structures]
        # per bucket, whether its decode steps may skip guards (None: not decided, see decode_layers)
        self._trust: dict[int, bool | None] = {b: None for b in engine.buckets}
        self._state = None  # the global state (grad mode, autocast, ...) the trusted entries were checked in

    @property
    def trusted(self) -> bool | None:
        """Whether the decode steps skip dynamo's guards: None before any bucket decided, False
        once any bucket keeps its guards, else True."""
        decided = [t for t in self._trust.values() if t is not None]
        return None if not decided else all(decided)

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        if h.shape[1] >= 2:
            # dynamic, not constrained: when inductor specialises on a size threshold (a CPU
            # reduction over > 4096 positions, int16 indices under 32767 MoE rows) a longer prompt
            # compiles one more graph instead of failing a declared range
            torch._dynamo.maybe_mark_dynamic(h, 1)
            torch._dynamo.maybe_mark_dynamic(ctx["ids"], 1)
            if "per_layer" in ctx:
                torch._dynamo.maybe_mark_dynamic(ctx["per_layer"], 1)
            for cos, sin in ctx["rope"].values():
                torch._dynamo.maybe_mark_dynamic(cos, 0)
                torch._dynamo.maybe_mark_dynamic(sin, 0)
        with dynamo_settings():
            for block, cache in zip(layers, caches):
                h = self._prefill(block, h, cache, ctx)
        return h

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        # as prefill: L dynamic (1-token extends, speculative verification of k+1 tokens and long
        # chunks share the graph once a second length has been seen)
        torch._dynamo.maybe_mark_dynamic(h, 1)
        torch._dynamo.maybe_mark_dynamic(ctx["ids"], 1)
        if "per_layer" in ctx:
            torch._dynamo.maybe_mark_dynamic(ctx["per_layer"], 1)
        for cos, sin in ctx["rope"].values():
            torch._dynamo.maybe_mark_dynamic(cos, 1)
            torch._dynamo.maybe_mark_dynamic(sin, 1)
        with dynamo_settings():
            for block, cache in zip(layers, caches):
                run = block.extend if extends_by_decode(block.mixer) else functools.partial(self._extend, block)
                h = run(h, cache, ctx)
        return h

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        engine, b = self.engine, h.shape[0]
        # Once the first step has compiled each layer structure's function exactly once (every
        # layer of a structure passed its one entry's guards), CPU steps skip dynamo's guard
        # checks (torch's skip_guard_eval_unsafe: 50-80 us per layer call at batch 1, a tenth of
        # a SmolLM2 step). Safe because a step's inputs never change: the same modules, caches
        # and buffers, shapes and context keys every step, made by the engine in one autograd
        # mode whatever the caller's (core.py); with one entry per code object there is no
        # choice to get wrong. The global state dynamo guards on (grad mode, autocast, ...) is
        # still compared with the first step's, cheaply: a step in another state runs with the
        # full guards (and may compile another entry, which ends the trust). Any structure with
        # more entries keeps the full guards. Each bucket decides for its own functions.
        trust = self._trust[b]
        skip = bool(trust) and self._state.check()
        with dynamo_settings(), (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if skip
                                 else contextlib.nullcontext()):
            for run, block, cache in zip(self._decode[b], engine.model.layers, engine.decode_caches(b)):
                h = run(block, h, cache, ctx)
        if self._state is None:
            self._state = torch._C._dynamo.guards.GlobalStateGuard()
        if trust is None or (trust and not skip):
            self._trust[b] = engine.device.type == "cpu" and all(_entries(f) == 1 for f in self._decode_kinds[b])
        return h

    def graph_counts(self) -> dict[str, int]:
        """prefill and decode; extend once an extend has compiled (most engines never extend)."""
        return {name: c.graphs for name, c in self.counters.items() if name != "extend" or c.graphs}
