"""The two graphs: prefill (many tokens, compute-bound) and decode (one token, memory-bound).

Regional compilation: the repeated block is compiled once per distinct layer kind and reused by
every layer of that kind (parameters are graph inputs, so layers share one graph); the embedding,
final norm and head run eagerly around it. Both entry points compile with fullgraph=True.

Each block gets a context dict: "ids" (token ids [B, L] / [B, 1], for hash routing), "rope"
({rope key: (cos, sin)} rows for the step's positions) and, in decode, "pos" ([B] slot written)
and "one_query_kernel" (whether attention may call zoo's CPU decode kernel).

    prefill: ids [B, L] -> logits [B, L, V]. L is a dynamic dimension (one graph for every
             prompt length 2..max_seq); a 1-token prompt runs the decode graph at position 0.
    decode:  tok [B] -> logits [B, V] at each row's next position. Static shapes: one graph.

Batches are padded to max_batch rows, so shapes never depend on the batch size. On CUDA the
whole decode step (all blocks, head, position update) is captured once as a CUDA graph over
static buffers and replayed.
"""
from __future__ import annotations

import contextlib
import itertools
import time
import types
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from ..errors import InputError
from ..mixers import one_query
from ..model import Decoder
from ..position.rope import rope_key
from .aot import StepPackages, context_tensors
from .cache import plan_caches
from .compiling import GraphCounter, apply_compile_settings, cpu_compile_patches, dynamo_settings, structure
from .mtp import mtp_caches, mtp_prefill


def _block_prefill(block, h, cache, ctx):
    return block.prefill(h, cache, ctx)


def _block_decode(block, h, cache, ctx):
    return block.decode(h, cache, ctx)


def _own_copy(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own: dynamo keeps compiled entries per code object."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _entries(fn: Callable) -> int:
    """Compiled entries dynamo holds for fn's code object."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


_ENGINES = itertools.count()


class Engine:
    """Caches, rope tables and the prefill/decode graphs of one materialized Decoder."""

    def __init__(self, model: Decoder, *, max_batch: int, max_seq: int, cache_dtype: torch.dtype,
                 compile: bool = True, cuda_graph: bool = True, aot: bool = False):
        self.model = model
        self.device = model.embed.weight.device
        self.max_batch, self.max_seq = max_batch, max_seq
        self.vocab_size = model.spec.vocab_size
        self.plan = plan_caches(model, max_batch, max_seq, cache_dtype)
        self.caches = self.plan.allocate(self.device)
        self.mtp_caches = mtp_caches(model, max_batch, max_seq, cache_dtype, self.device)
        self.rope = {rope_key(r, slot): model.rope_impls[slot].table(r, max_seq, self.device)
                     for slot, r in model.rope_slots()}
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # next slot per row
        self.length = 0  # tokens in the cache (all rows advance together)
        self.batch = 0  # rows in use since the last prefill
        # per-row state for continuous batching (prefill_row / decode_rows / release_row): tokens
        # in each row's cache on the host (None: free), and a device mask that sends free rows
        # back to position 0 after each step
        self.row_len: list[int | None] = [None] * max_batch
        self._active = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.compiled = compile
        self._trusted: bool | None = None  # decode may skip guards (None: not decided, see _decode_step)
        # zoo's CPU decode-attention kernel (mixers/one_query.py), built here, outside the graphs
        self.one_query_kernel = self.device.type == "cpu" and one_query.available()
        key = f"zoo-max_seq={max_seq}"
        t0 = time.perf_counter()
        # CPU layers as AOTInductor packages (aot.py), loaded or made at each step's first call;
        # nothing of dynamo or inductor is imported unless a package has to be made
        if aot and not (compile and self.device.type == "cpu"):
            raise ValueError("aot needs compile=True on a CPU")
        self.aot = aot
        self._loaders: dict[str, object] = {}  # package path -> runner, shared by the step packages
        self._packages: dict[tuple, StepPackages] = {}  # ("prefill" | "decode", where) -> its packages
        dynamo = compile and not aot
        if dynamo:
            apply_compile_settings()
        patches = cpu_compile_patches() if dynamo and self.device.type == "cpu" else {}
        self.compile_seconds = {"setup": time.perf_counter() - t0, "prefill": 0.0, "decode": 0.0}
        self.counters = {name: GraphCounter(name, key, patches) for name in ("prefill", "decode")}
        if dynamo:
            self._run_prefill: Callable = torch.compile(_block_prefill, fullgraph=True, dynamic=False,
                                                        backend=self.counters["prefill"])
            # one decode function per distinct layer structure, each with a code object of its own
            # (so one compiled entry each: see _decode_step)
            engine, kinds = next(_ENGINES), {}
            structures = [structure(block, cache) for block, cache in zip(model.layers, self.caches)]
            for st in structures:
                kinds.setdefault(st, _own_copy(_block_decode, f"_block_decode_{engine}_{len(kinds)}"))
            self._decode_kinds = list(kinds.values())
            compiled = {st: torch.compile(f, fullgraph=True, dynamic=False, backend=self.counters["decode"])
                        for st, f in kinds.items()}
            self._run_decode: list[Callable] = [compiled[st] for st in structures]
        else:
            self._run_prefill, self._decode_kinds = _block_prefill, []
            self._run_decode = [_block_decode] * len(model.layers)
        self._settings = dynamo_settings if dynamo else contextlib.nullcontext
        self.use_cuda_graph = cuda_graph and self.device.type == "cuda"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._tok_buf = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._logits_buf: torch.Tensor | None = None

    # ------------------------------------------------------------------ state

    @torch.no_grad()
    def reset(self) -> None:
        """Zero every cache and position in place (addresses stay fixed for CUDA graphs)."""
        for layer in self.caches:
            for t in layer.values():
                t.zero_()
        self.pos.zero_()
        self.length = 0
        self.batch = 0
        self.row_len = [None] * self.max_batch
        self._active.zero_()

    # ------------------------------------------------------------------ checks

    def _check_ids(self, ids: torch.Tensor, what: str, check_range: bool = True) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{what}: token ids must be int64 or int32, got {ids.dtype}")
        if self.device.type == "meta" or not check_range:
            return
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise InputError(f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _pad_batch(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.max_batch:
            return x
        pad = torch.zeros((self.max_batch - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        return torch.cat((x, pad))

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, return_mtp: bool = False, last_only: bool = False):
        """Start a new batch: ids [B, L] (positions 0..L-1) -> logits [B, L, V] float32
        ([B, 1, V], the last position only, with last_only: what generation needs).

        return_mtp: return (logits, mtp) where mtp holds, per multi-token-prediction depth k,
        logits [B, L - k, V] for token t + k + 1 at positions t (see mtp.py).
        """
        if ids.dim() != 2:
            raise InputError(f"prefill: expected ids of shape [batch, seq_len], got {tuple(ids.shape)}")
        B, L = ids.shape
        if B > self.max_batch or B == 0:
            raise InputError(f"prefill: batch {B} must be in 1..max_batch={self.max_batch} "
                             f"(rebuild with runtime.max_batch={B})")
        if L > self.max_seq or L == 0:
            raise InputError(f"prefill: prompt of {L} tokens must be in 1..max_seq={self.max_seq} "
                             f"(rebuild with a larger runtime.max_seq)")
        self._check_ids(ids, "prefill")
        self.reset()
        self.batch = B
        # canonical strides: graphs guard on them, and callers pass views (seq[:, :n])
        ids = self._pad_batch(ids.to(self.device, torch.long)).clone(memory_format=torch.contiguous_format)
        if L == 1 and not return_mtp:
            return self._decode(ids[:, 0])[:B, None]
        h = self._prefill_states(ids)
        logits = self.model.logits(h[:, -1:] if last_only else h)
        self.pos.fill_(L)
        self.length = L
        self._mark_rows(range(B), L)
        if return_mtp:
            return logits[:B], [m[:B] for m in mtp_prefill(self, ids, h)]
        return logits[:B]

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self._prefill_states(ids))

    def _prefill_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] -> the last residual state [B, L, ...D]; fills the caches."""
        model = self.model
        h = model.streams.expand(model.embed(ids))
        return self._prefill_layers("batch", model.layers, self.caches, h, self._prefill_ctx(ids, h))

    def _prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """layers' prefill in order over h [B, L, ...D]; fills their caches. where: what the
        caches are (the whole batch, one row's views, an MTP block): each has its own packages."""
        if self.aot:
            return self._step_packages("prefill", where, layers, caches, h, ctx).run(h, context_tensors(ctx))
        with self._settings():
            for block, cache in zip(layers, caches):
                h = self._run_prefill(block, h, cache, ctx)
        return h

    def _step_packages(self, step: str, where, layers, caches: list[dict], h: torch.Tensor,
                       ctx: dict) -> StepPackages:
        """The packages of `step` for these layers and caches (runtime.aot), loaded (or made) on
        first use from the first call's inputs."""
        steps = self._packages.get((step, where))
        if steps is None:
            if step == "prefill":  # the prompt length: h's dim 1, the ids' dim 1, the rope rows' dim 0
                dims = {"ids": 1, "rope": {k: (0, 0) for k in ctx["rope"]}}
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders, pytree.tree_leaves(dims),
                                     self.max_seq)
            else:
                steps = StepPackages(step, layers, caches, h, ctx, self._loaders)
            self._packages[step, where] = steps
        return steps

    def block_prefill(self, block, h: torch.Tensor, cache: dict, ids: torch.Tensor) -> torch.Tensor:
        """One block (a layer of `model.layers` or `model.mtp`) over positions 0..L-1 through the
        prefill graph: h [max_batch, L, ...D], ids [max_batch, L] (the tokens at those positions)
        -> [max_batch, L, ...D]; fills `cache` (that block's cache dict)."""
        return self._prefill_layers(("block", id(block)), [block], [cache], h, self._prefill_ctx(ids, h))

    def _prefill_ctx(self, ids: torch.Tensor, h: torch.Tensor) -> dict:
        """The block context of a prefill over positions 0..L-1 (L dynamic when compiled)."""
        L = ids.shape[1]
        ids = ids.contiguous()  # blocks may read ids (hash routing): one stride, no recompiles
        ctx = {"ids": ids, "rope": {k: (cos[:L], sin[:L]) for k, (cos, sin) in self.rope.items()}}
        if self.compiled and not self.aot and L >= 2:
            # dynamic, not constrained: when inductor specialises on a size threshold (a CPU
            # reduction over > 4096 positions, int16 indices under 32767 MoE rows) a longer prompt
            # compiles one more graph instead of failing a declared range
            torch._dynamo.maybe_mark_dynamic(h, 1)
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            for cos, sin in ctx["rope"].values():
                torch._dynamo.maybe_mark_dynamic(cos, 0)
                torch._dynamo.maybe_mark_dynamic(sin, 0)
        return ctx

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [B] at each row's next position -> logits [B, V] float32."""
        if self.batch == 0:
            raise InputError("decode: no active batch; call prefill first")
        if tok.dim() != 1 or tok.shape[0] != self.batch:
            raise InputError(f"decode: expected tokens of shape [{self.batch}] (the prefilled batch), "
                             f"got {tuple(tok.shape)}")
        if self.length >= self.max_seq:
            raise InputError(f"decode: the cache is full (max_seq={self.max_seq} tokens); "
                             f"rebuild with a larger runtime.max_seq")
        # no range check of tokens sampled on the device: it would stall the host every step (it
        # could no longer queue the next one); an out-of-range id still fails loudly, in the
        # embedding's device-side bounds check
        self._check_ids(tok, "decode", check_range=tok.device.type == "cpu")
        logits = self._decode(self._pad_batch(tok.to(self.device, torch.long)))[: self.batch]
        self.row_len[: self.batch] = [self.length] * self.batch
        return logits

    def _decode(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [max_batch] -> logits [max_batch, V]; advances every row by one position.

        Tokens always go through one static buffer: the graphs see the same tensor layout every
        step whatever view the caller passed (a strided column would otherwise recompile)."""
        self._tok_buf.copy_(tok)
        if self.use_cuda_graph:
            if self._graph is None:
                raise RuntimeError("CUDA graph not captured; call warmup() after building")
            self._graph.replay()
            logits = self._logits_buf.clone()
        else:
            logits = self._decode_step(self._tok_buf)
        self.length += 1
        return logits

    def _decode_ctx(self, tok: torch.Tensor) -> dict:
        """The block context of a decode step: tok [max_batch] at the rows' positions."""
        pos = self.pos
        return {"ids": tok.contiguous()[:, None], "pos": pos,  # one stride (see _prefill_ctx)
                "rope": {k: (cos[pos], sin[pos]) for k, (cos, sin) in self.rope.items()},
                "one_query_kernel": self.one_query_kernel}

    def _decode_step(self, tok: torch.Tensor) -> torch.Tensor:
        model, pos = self.model, self.pos
        h = model.streams.expand(model.embed(tok[:, None]))
        ctx = self._decode_ctx(tok)
        if self.aot:
            steps = self._step_packages("decode", "batch", model.layers, self.caches, h, ctx)
            h = steps.run(h, context_tensors(ctx))
        else:
            # Once the first step has compiled each layer structure's function exactly once (every
            # layer of a structure passed its one entry's guards), CPU steps skip dynamo's guard
            # checks (torch's skip_guard_eval_unsafe: 50-80 us per layer call at batch 1, a tenth
            # of a SmolLM2 step). Safe because a step's inputs never change: the same modules,
            # caches and buffers, shapes and context keys every step; with one entry per code
            # object there is no choice to get wrong. Any structure with more entries keeps the
            # full guards.
            with self._settings(), (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if self._trusted
                                    else contextlib.nullcontext()):
                for run, block, cache in zip(self._run_decode, model.layers, self.caches):
                    h = run(block, h, cache, ctx)
        if self._trusted is None:
            self._trusted = (self.compiled and self.device.type == "cpu"
                             and all(_entries(f) == 1 for f in self._decode_kinds))
        logits = model.logits(h[:, 0])
        pos.add_(1)
        return logits

    # ------------------------------------------------------------------ rows

    def _mark_rows(self, rows, length: int | None) -> None:
        for r in rows:
            self.row_len[r] = length
        self._active.copy_(torch.tensor([n is not None for n in self.row_len], dtype=torch.long))

    def free_rows(self) -> list[int]:
        """Rows no sequence holds: prefill_row may start one there."""
        return [r for r, n in enumerate(self.row_len) if n is None]

    @torch.no_grad()
    def prefill_row(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """Start a sequence in one free row without touching the others: ids [L] (positions
        0..L-1) -> logits [V] float32 of the last position.

        The prefill graph runs at batch 1 on views of that row of every cache field (whatever
        the mixer keeps: all fields are batch first, contracts.Mixer.cache_fields), so it is one
        graph for every row and length (a second one for 1-token prompts), and nothing is
        copied. The row is zeroed first, as prefill's reset does for a whole batch.
        """
        if not 0 <= row < self.max_batch:
            raise InputError(f"prefill_row: row {row} must be in 0..{self.max_batch - 1} (max_batch={self.max_batch})")
        if self.row_len[row] is not None:
            raise InputError(f"prefill_row: row {row} is in use ({self.row_len[row]} tokens); release_row it first")
        if ids.dim() != 1 or not 1 <= ids.shape[0] <= self.max_seq:
            raise InputError(f"prefill_row: expected ids of shape [seq_len] with seq_len in 1..max_seq="
                             f"{self.max_seq}, got {tuple(ids.shape)}")
        self._check_ids(ids, "prefill_row")
        ids = ids.to(self.device, torch.long).reshape(1, -1).clone(memory_format=torch.contiguous_format)
        model = self.model
        views = [{name: t[row:row + 1] for name, t in layer.items()} for layer in self.caches]
        for layer in views:
            for t in layer.values():
                t.zero_()
        h = model.streams.expand(model.embed(ids))
        h = self._prefill_layers(("row", row), model.layers, views, h, self._prefill_ctx(ids, h))
        self.pos[row] = ids.shape[1]
        self._mark_rows([row], ids.shape[1])
        return model.logits(h[0, -1])

    def release_row(self, row: int) -> None:
        """Free a row at once (its cache is left as is: the next prefill_row there zeroes it)."""
        self._mark_rows([row], None)

    @torch.no_grad()
    def decode_rows(self, tok: torch.Tensor) -> torch.Tensor:
        """One step of every row: tok [max_batch] (any id for free rows) -> logits [max_batch, V].

        The same static decode graph as `decode` (CUDA-graph replay on GPU): free rows compute
        garbage at position 0 of their own row, which nobody reads and the next prefill_row
        there overwrites. Each sequence advances by one position; a full row is refused.
        """
        if tok.dim() != 1 or tok.shape[0] != self.max_batch:
            raise InputError(f"decode_rows: expected tokens of shape [{self.max_batch}] (max_batch), "
                             f"got {tuple(tok.shape)}")
        full = [r for r, n in enumerate(self.row_len) if n is not None and n >= self.max_seq]
        if full:
            raise InputError(f"decode_rows: row {full[0]} holds max_seq={self.max_seq} tokens; release it "
                             f"(or rebuild with a larger runtime.max_seq)")
        self._check_ids(tok, "decode_rows", check_range=tok.device.type == "cpu")
        logits = self._decode(tok.to(self.device, torch.long))
        self.pos.mul_(self._active)
        self.row_len = [None if n is None else n + 1 for n in self.row_len]
        return logits

    # ------------------------------------------------------------------ compile

    @torch.no_grad()
    def warmup(self) -> dict[str, float]:
        """Compile both graphs (and capture the CUDA graph) on dummy tokens, then reset.

        Returns the wall time spent on each graph's first run (compile + one run), and on setting
        up the compiler ("setup": the CPU ISA probe, on the first compile in a cache only). Under
        runtime.aot the packages are loaded (made on a miss) without running them: a dummy pass
        would only cost a forward over every weight (~0.3 s of a SmolLM2 float32 start-up).
        """
        dummy = torch.zeros(self.max_batch, min(2, self.max_seq), dtype=torch.long, device=self.device)
        if self.aot:
            model = self.model
            t0 = time.perf_counter()
            if self.max_seq >= 2:
                h = model.streams.expand(model.embed(dummy))
                self._step_packages("prefill", "batch", model.layers, self.caches, h, self._prefill_ctx(dummy, h))
            self.compile_seconds["prefill"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            h = model.streams.expand(model.embed(self._tok_buf[:, None]))
            self._step_packages("decode", "batch", model.layers, self.caches, h, self._decode_ctx(self._tok_buf))
            self.compile_seconds["decode"] = time.perf_counter() - t0
            return dict(self.compile_seconds)
        if self.max_seq >= 2:
            t0 = time.perf_counter()
            self._prefill(dummy)
            self.compile_seconds["prefill"] = time.perf_counter() - t0
        self.reset()
        t0 = time.perf_counter()
        if self.use_cuda_graph:
            self._capture()
        else:
            self._decode_step(self._tok_buf)
        self.compile_seconds["decode"] = time.perf_counter() - t0
        self.reset()
        return dict(self.compile_seconds)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and settle allocations outside the capture
                self._decode_step(self._tok_buf)
        torch.cuda.current_stream().wait_stream(stream)
        self.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits_buf = self._decode_step(self._tok_buf)
        self._graph = graph

    def graph_counts(self) -> dict[str, int]:
        """Graphs compiled so far by each entry point (recompiles show up here); under runtime.aot
        the packages in use instead ("prefill_packages", "decode_packages": one per layer
        structure and layout of the inputs)."""
        if not self.aot:
            return {name: c.graphs for name, c in self.counters.items()}
        counts = {"prefill_packages": set(), "decode_packages": set()}
        for (step, _), steps in self._packages.items():
            counts[f"{step}_packages"] |= steps.keys
        return {name: len(keys) for name, keys in counts.items()}

    def packages_built(self) -> list[str]:
        """Keys of the packages this engine compiled (runtime.aot; the others came from disk)."""
        return [key for steps in self._packages.values() for key in steps.built]
