"""CPU layers as AOTInductor packages run by torch's C++ runner (runtime.aot).

    StepPackages(step, layers, caches, h, ctx, loaders, length_dims=None, max_length=None)
    .run(h, ctx_tensors, caches=None) -> h   every layer's `step` (prefill | decode | extend), in
                                             order, on the caches it was made with or `caches`

Why: a layer compiled by torch.compile is entered through a dynamo frame, a compiled-entry lookup
and inductor's Python wrapper (one Python call and size assert per op) on every layer of every
step; at batch 1 on a CPU that is a third of a small model's decode step. A package is one C++
call per layer. And a process that only loads packages imports neither dynamo nor inductor
(seconds of torch's Python) and traces nothing. Measurements: scripts/results/design-measurements.md
(warm start, packages against compiled layers) and scripts/results/quant_smollm2_aot.json.

What a package is: the layer's `prefill(h, cache, ctx)`, `decode(h, cache, ctx)` or
`extend(h, cache, ctx)` (rows that hold tokens take L more, each at its own ctx["start"]) exported
(torch.export, non-strict) with everything it reads as *inputs*: the layer's parameters and
buffers, its cache fields, h and the tensors of the step context. So all layers of one structure
(compiling.structure) share a package, weights changed in place are seen, and the caches are
written in place by the package itself (the exported index_put_ / copy_ on its inputs). The
context's non-tensor values (flags) are fixed at export and part of the key. A prefill or an
extend package takes every length in [2, max_length] (a 1-token extend is a package of its own): h's position dimension and the context tensors'
`length_dims` are one exported dimension (a layer that specialises on the length is refused at
export, never served a wrong length).

Packages live in the zoo compile cache, `aot/<key>.pt2`, key = sha256 of: the step, the
structure, the inputs' layout (shapes, dtypes, strides; the length dimension as a range) and the
context's non-tensor values, the CPU's instruction set (torch's get_cpu_capability), torch's
version and the source of every module of zoo's compiler package (any change to zoo's code misses
and rebuilds), and that of the code from outside zoo the layer runs (a plugin's kinds:
compiling.outside_source_digest). A hit loads with torch._C._aoti's runner; a miss exports,
compiles (inductor: seconds a package) and writes the package atomically.

Not for: CUDA (the decode step is a CUDA graph there), tensor parallel (collectives), layers
whose step reads tensors that are neither parameters, buffers, cache fields nor context
(export would bake them in as constants: refused with the layer named).
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from .compiling import (apply_compile_settings, compile_cache_dir, cpu_compile_patches, outside_source_digest,
                        structure)

FORMAT = 2  # bump when what a package takes or returns changes


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
    """block.<step>(h, cache, ctx) with the block's state as inputs. The block is held outside
    the module tree, so export lifts none of its tensors as constants of its own."""

    def __init__(self, step: str, block: torch.nn.Module, names: list[str], cache_keys: list[str], ctx_spec,
                 ctx_consts):
        super().__init__()
        object.__setattr__(self, "block", block)
        self.step, self.names, self.cache_keys = step, names, cache_keys
        self.ctx_spec, self.ctx_consts = ctx_spec, ctx_consts

    def forward(self, state: list[torch.Tensor], h: torch.Tensor, cache: list[torch.Tensor],
                ctx_tensors: list[torch.Tensor]) -> torch.Tensor:
        from torch.nn.utils.stateless import _reparametrize_module

        it = iter(ctx_tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.ctx_consts]
        ctx = pytree.tree_unflatten(leaves, self.ctx_spec)
        with _reparametrize_module(self.block, dict(zip(self.names, state))):
            return getattr(self.block, self.step)(h, dict(zip(self.cache_keys, cache)), ctx)


_TENSOR = object()  # a context leaf that is a tensor input (the others are fixed at export)


def context_tensors(ctx: dict) -> list[torch.Tensor]:
    """The tensors of a step's context, in the order a package takes them."""
    return [x for x in pytree.tree_leaves(ctx) if isinstance(x, torch.Tensor)]


def _ctx_layout(ctx: dict) -> tuple[Any, list]:
    """The context's tree and its leaves with each tensor replaced by _TENSOR (the values a
    package has fixed; the tensors come as inputs, in context_tensors' order)."""
    leaves, spec = pytree.tree_flatten(ctx)
    return spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]


def _layout(t: torch.Tensor, dim: Optional[int]) -> tuple:
    """What a package fixes of an input: shape, dtype and strides; with a length dimension, its
    place instead of its size (and whether the tensor is contiguous: its strides follow)."""
    if dim is None:
        return tuple(t.shape), str(t.dtype), t.stride()
    return tuple(-1 if d == dim else n for d, n in enumerate(t.shape)), str(t.dtype), t.is_contiguous()


def _length_range(ep, at: int, dim: int) -> Optional[tuple]:
    """The prompt lengths an exported prefill takes: the range of h's length dimension (h is user
    input `at`), or None when export made it a constant."""
    h = [n for n in ep.graph.nodes if n.op == "placeholder"][len(ep.graph_signature.input_specs)
                                                                  - len(ep.graph_signature.user_inputs) + at]
    size = h.meta["val"].shape[dim]
    if not isinstance(size, torch.SymInt):
        return None
    r = ep.range_constraints[size.node.expr]
    return int(r.lower), int(r.upper)


class StepPackages:
    """See the module docstring. step: "prefill", "decode" or "extend"; layers / caches: blocks
    and their cache dicts (views are fine: their strides are part of the key; an extend's run
    gets each call's rows, of the same layout, as `caches`); h: the residual state the first
    layer gets, [B, L, ...D] ([B, 1, ...D] in decode); ctx: one call's context (its layout
    and flags are those of every call); loaders: package path -> loaded runner, shared by the
    engine's StepPackages; length_dims: per context tensor (context_tensors order), its
    length dimension or None; max_length: the longest prompt or extend (dynamic lengths only)."""

    def __init__(self, step: str, layers, caches: list[dict], h: torch.Tensor, ctx: dict, loaders: dict,
                 length_dims: Optional[list[Optional[int]]] = None, max_length: Optional[int] = None):
        ctx_tensors, (spec, consts) = context_tensors(ctx), _ctx_layout(ctx)
        dynamic = length_dims is not None
        if dynamic and len(length_dims) != len(ctx_tensors):  # zip below would drop the rest silently
            raise ValueError(f"length_dims gives {len(length_dims)} dimensions for {len(ctx_tensors)} context tensors")
        dims = [1 if dynamic else None, *(length_dims or [None] * len(ctx_tensors))]
        layout = (step, repr(spec), repr([c if c is not _TENSOR else "tensor" for c in consts]),
                  [_layout(t, d) for t, d in zip([h, *ctx_tensors], dims)], (2, max_length) if dynamic else None,
                  # machine code for this CPU's instruction set (a shared cache dir may be read by another machine)
                  torch.backends.cpu.get_cpu_capability())
        self.step = step
        self.built: list[str] = []  # packages compiled here (the rest were on disk)
        self.keys: set[str] = set()
        # per layer: its loaded package, its state, its cache's field names and the cache it was made with
        self._layers: list[tuple[Any, list[torch.Tensor], list[str], list[torch.Tensor]]] = []
        for block, cache in zip(layers, caches):
            names, state = _state(block)
            keys = sorted(cache)
            key = hashlib.sha256(repr((FORMAT, structure(block, cache), layout, torch.__version__,
                                       _zoo_source_digest(), outside_source_digest(block))).encode()).hexdigest()[:40]
            path = str(compile_cache_dir() / "aot" / f"{key}.pt2")
            if path not in loaders:
                if not os.path.exists(path):
                    self._build(Path(path), _Step(step, block, names, keys, spec, consts),
                                (state, h, [cache[k] for k in keys], ctx_tensors), dims, max_length,
                                type(block).__qualname__)
                    self.built.append(key)
                loaders[path] = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
            self.keys.add(key)
            self._layers.append((loaders[path], state, keys, [cache[k] for k in keys]))

    def _build(self, path: Path, step: _Step, args: tuple, dims: list, max_length: Optional[int], what: str) -> None:
        # the compilers are imported on a miss only: a process whose packages are all on disk
        # imports neither dynamo nor inductor
        import torch._inductor

        apply_compile_settings()
        state, h, cache, ctx_tensors = args
        shapes = None
        if max_length is not None:
            # DYNAMIC, not a named Dim: a guard export cannot prove over the range (size
            # arithmetic such as min(L, 2*L*L) == L in a sliding window's mask) becomes a runtime
            # check instead of an error; a length the layer really specialises on is refused below
            length = torch.export.Dim.DYNAMIC(min=2, max=max_length)
            shapes = ([None] * len(state), {dims[0]: length}, [None] * len(cache),
                      [None if d is None else {d: length} for d in dims[1:]])
        with torch.no_grad():  # non-strict export traces with fake tensors: the caches are not written
            ep = torch.export.export(step, args, dynamic_shapes=shapes, strict=False)
        if max_length is not None:
            got = _length_range(ep, len(state), dims[0])
            if got != (2, max_length):
                raise ConfigError(f"runtime.aot: the {self.step} of layer kind {what} cannot take every prompt length "
                                  f"in [2, {max_length}] as one package (export kept {got}); set runtime.aot=false")
        if ep.constants:
            raise ConfigError(f"runtime.aot: the {self.step} of layer kind {what} reads tensors that are not "
                              f"parameters, buffers, cache fields or context ({sorted(ep.constants)[:3]}); "
                              f"register them as buffers, or set runtime.aot=false")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        try:
            # not in the key: the one CPU patch (cpp.vec_isa_ok) skips inductor's ISA probe once
            # it has passed, the code is the same
            with warnings.catch_warnings():  # torch's own deprecation when it copies the program's pytree specs
                warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
                torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                         inductor_configs=cpu_compile_patches())
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    def run(self, h: torch.Tensor, ctx_tensors: list[torch.Tensor], caches: Optional[list[dict]] = None) -> torch.Tensor:
        """Every layer's step in order: h [B, L, ...D] -> the same shape; writes the caches (those
        it was made with, or `caches`: other tensors of the same layout, one dict per layer, as an
        extend's rows' views or copies)."""
        if caches is None:
            for runner, state, _, cache in self._layers:
                h = runner.run([*state, h, *cache, *ctx_tensors])[0]
            return h
        for (runner, state, keys, made), cache in zip(self._layers, caches, strict=True):
            fields = [cache[k] for k in keys]
            for k, t, m in zip(keys, fields, made):  # a package reads its inputs with the strides it was made for
                if t.shape != m.shape or t.stride() != m.stride() or t.dtype != m.dtype:
                    raise ValueError(f"{self.step} packages made for cache field {k!r} of shape {tuple(m.shape)}, "
                                     f"strides {m.stride()}, {m.dtype}; got {tuple(t.shape)}, {t.stride()}, {t.dtype}")
            h = runner.run([*state, h, *fields, *ctx_tensors])[0]
        return h
