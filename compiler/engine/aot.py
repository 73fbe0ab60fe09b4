"""CPU decode layers as AOTInductor packages run by torch's C++ runner (runtime.aot_decode).

    DecodePackages(layers, caches, structures, h, ctx, patches)   one package per layer structure
    .run(i, h, ctx) -> h                            layer i's decode step, h [B, 1, ...D]

Why: a decode layer compiled by torch.compile is entered through a dynamo frame, a compiled-entry
lookup and inductor's Python wrapper (one Python call and size assert per op) on every layer of
every step; at batch 1 on a CPU that is a third of a small model's step. A package is one C++
call per layer. Measured in one process on the same weights and caches (SmolLM2-135M int4, 2
threads, AMD EPYC): 66.6 tok/s through packages against 40.6 through the compiled layers, equal
logits (max difference 0.0).

What a package is: the layer's `decode(h, cache, ctx)` exported (torch.export, non-strict) with
everything it reads as *inputs*: the layer's parameters and buffers, its cache fields, h and the
tensors of the step context. So all layers of one structure (graphs._structure) share a package,
weights changed in place are seen, and the caches are written in place by the package itself
(the exported index_put_ / copy_ on its inputs). The context's non-tensor values (flags) are
fixed at export and part of the key.

Packages live in the zoo compile cache, `aot/<key>.pt2`, key = sha256 of: the structure, the
context's layout and non-tensor values, the CPU's instruction set (torch's
get_cpu_capability), torch's version, inductor's config patches, and the
source of every module of zoo's compiler package (any change to zoo's code misses and rebuilds).
A hit loads with torch._C._aoti's runner: neither dynamo nor inductor is imported for decode.
A miss compiles (inductor, ~20 s a structure) and writes the package atomically.

Not for: CUDA (the decode step is a CUDA graph there), tensor parallel (collectives), layers
whose decode reads tensors that are neither parameters, buffers, cache fields nor context
(export would bake them in as constants: refused with the layer named).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from .compiling import compile_cache_dir

FORMAT = 1  # bump when what a package takes or returns changes


@functools.cache
def _zoo_source_digest() -> str:
    """sha256 over the source of every module of zoo's compiler package (and its C++ ops)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cpp") and p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _state(block: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The layer's parameters then buffers, by name (export inputs, in this order)."""
    named = list(block.named_parameters()) + list(block.named_buffers())
    return [n for n, _ in named], [t for _, t in named]


class _Step(torch.nn.Module):
    """decode(h, cache, ctx) of a layer with its state as inputs. The layer is held outside the
    module tree, so export lifts none of its tensors as constants of its own."""

    def __init__(self, block: torch.nn.Module, names: list[str], cache_keys: list[str], ctx_spec, ctx_consts):
        super().__init__()
        object.__setattr__(self, "block", block)
        self.names, self.cache_keys = names, cache_keys
        self.ctx_spec, self.ctx_consts = ctx_spec, ctx_consts

    def forward(self, state: list[torch.Tensor], h: torch.Tensor, cache: list[torch.Tensor],
                ctx_tensors: list[torch.Tensor]) -> torch.Tensor:
        from torch.nn.utils.stateless import _reparametrize_module

        it = iter(ctx_tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.ctx_consts]
        ctx = pytree.tree_unflatten(leaves, self.ctx_spec)
        with _reparametrize_module(self.block, dict(zip(self.names, state))):
            return self.block.decode(h, dict(zip(self.cache_keys, cache)), ctx)


_TENSOR = object()  # a context leaf that is a tensor input (the others are fixed at export)


def context_tensors(ctx: dict) -> list[torch.Tensor]:
    """The tensors of a step's context, in the order a package takes them."""
    return [x for x in pytree.tree_leaves(ctx) if isinstance(x, torch.Tensor)]


def _ctx_layout(ctx: dict) -> tuple[Any, list]:
    """The context's tree and its leaves with each tensor replaced by _TENSOR (the values a
    package has fixed; the tensors come as inputs, in context_tensors' order)."""
    leaves, spec = pytree.tree_flatten(ctx)
    return spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]


class DecodePackages:
    """See the module docstring. layers / caches: the engine's blocks and their cache dicts;
    structures: graphs._structure of each layer; h: a residual state as decode sees it [B, 1, ...D];
    ctx: one step's context (its layout and flags are those of every step); patches: inductor
    config patches of the engine's graphs."""

    def __init__(self, layers, caches: list[dict], structures: list[tuple], h: torch.Tensor, ctx: dict,
                 patches: dict):
        ctx_tensors, (spec, consts) = context_tensors(ctx), _ctx_layout(ctx)
        # the packages' machine code is built for this CPU's instruction set (a shared cache dir
        # may be read by another machine)
        layout = (repr(spec), repr([c if c is not _TENSOR else "tensor" for c in consts]),
                  [(tuple(t.shape), str(t.dtype), t.stride()) for t in [h, *ctx_tensors]],
                  torch.backends.cpu.get_cpu_capability())
        self._inputs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._runners: list[Any] = []
        self.built: list[str] = []  # keys compiled by this engine (the rest were cache hits)
        runners: dict[tuple, Any] = {}
        for block, cache, st in zip(layers, caches, structures):
            names, state = _state(block)
            keys = sorted(cache)
            if st not in runners:
                key = hashlib.sha256(repr((FORMAT, st, layout, torch.__version__, sorted(patches.items(), key=str),
                                           _zoo_source_digest())).encode()).hexdigest()[:40]
                path = compile_cache_dir() / "aot" / f"{key}.pt2"
                if not path.exists():
                    self._build(path, _Step(block, names, keys, spec, consts),
                                (state, h, [cache[k] for k in keys], ctx_tensors),
                                patches, type(block).__qualname__)
                    self.built.append(key)
                runners[st] = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            self._runners.append(runners[st])
            self._inputs.append((state, [cache[k] for k in keys]))
        self.packages = len(runners)

    @staticmethod
    def _build(path: Path, step: _Step, args: tuple, patches: dict, what: str) -> None:
        import torch._inductor

        with torch.no_grad():  # non-strict export traces with fake tensors: the caches are not written
            ep = torch.export.export(step, args, strict=False)
        if ep.constants:
            raise ConfigError(f"runtime.aot_decode: the decode step of layer kind {what} reads tensors that are "
                              f"not parameters, buffers, cache fields or context ({sorted(ep.constants)[:3]}); "
                              f"register them as buffers, or set runtime.aot_decode=false")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=dict(patches))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    def run(self, i: int, h: torch.Tensor, ctx_tensors: list[torch.Tensor]) -> torch.Tensor:
        """Layer i's decode step: h [B, 1, ...D] -> the same shape; writes layer i's caches."""
        state, cache = self._inputs[i]
        return self._runners[i].run([*state, h, *cache, *ctx_tensors])[0]

