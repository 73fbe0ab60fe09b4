"""The engine core: one materialized Decoder's caches, rope tables and per-row state, the row
operations, and the batch API written on top of them. How a step executes is a runner
(runners/: eager, compiled regions, AOTInductor packages, CUDA-graph replay), chosen once here.

Per-row state, one scheme for every API: each of the max_batch rows has a next position (`pos`,
on the device), a token count on the host (`row_len`, None: free) and an active flag (a device
mask that sends free rows back to position 0 after each step).

    prefill_rows(start, ids [n, L]) -> logits [n, V]   start sequences in free rows start..start+n-1
    prefill_row(row, ids [L]) -> logits [V]            the same for one row (a server's admission;
                                                       [L, V], every position, with last_only=False)
    decode_rows(tok [max_batch]) -> logits [max_batch, V]   one step of every row (free: garbage)
    decode_active(tok [n]) -> logits [n, V]            one step of rows 0..n-1 (rows past them: free,
                                                       or in use past the bucket, left as they are)
    move_row(src, dst)                                 a sequence's state to a free row (compaction)
    release_row(row)                                   free a row
    extend_rows(rows, ids [n, L]) -> logits [n, L, V]  append L tokens to rows in use, each at its
                                                       own position ([n, V] with last_only)
    truncate_row(row, length)                          roll a row back to `length` tokens (caches
                                                       whose every field grows with tokens)
    export_row(row) -> RowCache, import_row(row, snap, n)   a row's cache out to RAM and into a
                                                       free row at its first n tokens (prefix.py)
    mtp_extend(depth, rows, prev, ids, start)          an MTP layer's step over rows' own MTP
                                                       caches (the MTP drafter's, mtp.py)
    save_state(rows) -> handle, restore_state(rows, handle)   copy the constant-state fields
                                                       (recurrent, conv, ring) and lengths of rows
                                                       out and back: the rollback of any family
    prefill(ids [B, L]) -> logits [B, L, V]            reset, then rows 0..B-1
    decode(tok [B]) -> logits [B, V]                   one step of those rows

Decode batch buckets (buckets.py, runtime.decode_buckets): every decode step runs the smallest
bucket b of a few static sizes (1, 2, 4, ..., max_batch) that holds the rows it must compute, over
rows 0..b-1 (cache views caches[:b]); each bucket is its own static step (graph, package or
capture), all made by warmup, so no step recompiles. decode_rows runs the bucket that holds the
highest row in use; decode_active(tok [n]) the one that holds n rows, for a caller that keeps its
sequences in rows 0..n-1. A server keeps them there by compaction (zoo/serve/scheduler.py): a
new sequence takes the lowest free row, and when a row frees, the highest row in use moves into
the hole (move_row). Compaction rather than an index map because a move copies one row of every
cache field once per finished sequence, while a map costs every step: either a gather of b whole
cache rows per layer (a step's cache traffic times two or more) or an indirection inside every
mixer kind's cache reads and writes.

The batch API runs the bucket of its batch B: a prefill over rows 0..b-1 (one prefill graph per
bucket, compiled on first use except max_batch's, which warmup makes; a row's prefill is the
1-row bucket's), padded rows free. A 1-token batch prompt runs the decode step at position 0.
A prefill graph takes every prompt length 2..max_seq.

Rollback: a row's grow-with-token fields (KV caches) need no copy to roll back: positions past
the row's length are never visible (masks compare slots with positions) and the next write
overwrites them, so truncate_row only moves the length. Constant-state fields (a recurrent
state, a conv window, a sliding-window ring, a compressor's partial block) hold no per-position
history, so a family with any refuses truncate_row (naming the kinds): save_state before the
tokens that may be rolled back, restore_state after (it also restores the lengths), then
extend_rows the tokens kept. Rings keep exactly Sw = min(window, max_seq) slots: extend reads
the ring before writing it (any chunk length is exact), and rollback goes through the saved
state rather than through spare ring slots (which every decode step would have to read).

Each block gets a context dict: "ids" (token ids [B, L] / [B, 1], for hash routing), "rope"
({rope key: (cos, sin)} rows for the step's positions), "per_layer" ([B, L, Nl, Dp], a model with
per-layer input embeddings: Decoder.per_layer) and, in decode, "pos" ([B] slot written) and the
fixed entries the layers' mixers asked for (contracts.Mixer.decode_context).

Every step runs with autograd off and outside inference mode, whatever mode the caller is in
(`torch.no_grad()`, `torch.inference_mode()` or neither): compiled graphs guard on the mode and
on the tensors it makes (an inference tensor is another kind of input), a captured CUDA graph
and the packages were made in one mode, so the caller's mode must not reach them.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Sequence

import torch

from ..contracts import CachePlan
from ..errors import InputError
from ..model import Decoder
from ..position.rope import rope_key
from .buckets import bucket_for, check_buckets
from .cache import plan_caches
from .mtp import mtp_caches, mtp_prefill
from .runners import RunnerOptions, choose


class RowCache:
    """One row's cache in host memory (Engine.export_row): `length` tokens, per layer
    {field: tensor without the batch axis}, the logits [V] of its last token (or None)."""

    def __init__(self, length: int, fields: list[dict], logits: torch.Tensor | None):
        self.length, self.fields, self.logits = length, fields, logits
        self.nbytes = sum(t.numel() * t.element_size() for layer in fields for t in layer.values()) + \
            (0 if logits is None else logits.numel() * 4)


def _engine_mode(fn: Callable) -> Callable:
    """Run fn with autograd off and inference mode off (see the module docstring). The order
    matters: leaving inference mode turns grad mode on, so no_grad comes inside it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def decode_context(model: Decoder, device: torch.device) -> dict:
    """The fixed decode-context entries every layer's mixer asks for (Mixer.decode_context),
    merged; two layers giving one key different values, or a key the engine sets itself, are
    refused."""
    out: dict = {}
    for i, block in enumerate(model.layers):
        for key, value in block.mixer.decode_context(device).items():
            if key in ("ids", "pos", "rope"):
                raise ValueError(f"layers.{i}.mixer ({type(block.mixer).__qualname__}).decode_context: key {key!r} "
                                 f"is the engine's own; expected another name")
            if key in out and out[key] != value:
                raise ValueError(f"layers.{i}.mixer ({type(block.mixer).__qualname__}).decode_context: {key}={value!r} "
                                 f"but an earlier layer gave {out[key]!r}; expected one value per engine")
            out[key] = value
    return out


class Engine:
    """Caches, rope tables, per-row state and the runner of one materialized Decoder."""

    def __init__(self, model: Decoder, *, max_batch: int, max_seq: int, cache_dtype: torch.dtype,
                 compile: bool = True, cuda_graph: bool = True, aot: bool = False,
                 plan: CachePlan | None = None, decode_buckets: Sequence[int] | None = None):
        self.model = model
        self.device = model.device
        self.max_batch, self.max_seq = max_batch, max_seq
        self.vocab_size = model.spec.vocab_size
        # the build's cache stage hands its plan in (compiler/build.py); made here otherwise
        if plan is not None and (plan.max_batch, plan.max_seq) != (max_batch, max_seq):
            raise ValueError(f"cache plan for max_batch={plan.max_batch}, max_seq={plan.max_seq} given to an "
                             f"engine of max_batch={max_batch}, max_seq={max_seq}")
        self.plan = plan if plan is not None else plan_caches(model, max_batch, max_seq, cache_dtype)
        self.caches = self.plan.allocate(self.device)
        self.buckets = check_buckets(decode_buckets, max_batch)
        # each bucket's decode caches: views of its rows, made once (the same tensors every step)
        self._bucket_caches = {b: self.caches if b == max_batch else
                               [{name: t[:b] for name, t in layer.items()} for layer in self.caches]
                               for b in self.buckets}
        self.mtp_caches = mtp_caches(model, max_batch, max_seq, cache_dtype, self.device)
        self.rope = {rope_key(r, slot): model.rope_impls[slot].table(r, max_seq, self.device)
                     for slot, r in model.rope_slots()}
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # next slot per row
        self.row_len: list[int | None] = [None] * max_batch  # tokens in each row's cache (None: free)
        self._active = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.batch = 0  # rows the batch API holds (rows 0..batch-1) since its last prefill
        # the decode step's tokens go through one static buffer: the graphs see the same tensor
        # layout every step whatever view the caller passed (a strided column would recompile)
        self.token_buffer = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        # built here, outside the graphs (a native kernel is compiled on first use)
        self.context_flags = decode_context(model, self.device)
        self.compiled, self.aot = compile, aot
        t0 = time.perf_counter()
        self._runner = choose(self, RunnerOptions(self.device, compile, cuda_graph, aot))
        self.runner = self._runner.name  # for reports: eager, compiled, aot, cuda_graph+...
        self.runner_kind = self._runner.kind  # the registered runner: eager, compiled, aot, cuda_graph
        self.compile_seconds = {"setup": time.perf_counter() - t0, "prefill": 0.0, "decode": 0.0}

    @property
    def use_cuda_graph(self) -> bool:
        """Whether the decode step replays a captured CUDA graph."""
        return self._runner.kind == "cuda_graph"

    @property
    def _graph(self):
        """The captured CUDA graph (None before warmup, or without one)."""
        return self._runner.graph

    @property
    def _trusted(self):
        """Whether compiled decode steps skip dynamo's guards (None: not decided or not compiled)."""
        return self._runner.trusted

    @property
    def length(self) -> int:
        """Tokens in the cache of the batch API's rows (they advance together)."""
        return max((n for n in self.row_len[: self.batch] if n is not None), default=0)

    # ------------------------------------------------------------------ state

    @_engine_mode
    def reset(self) -> None:
        """Zero every cache and position and free every row, in place (addresses stay fixed for
        CUDA graphs)."""
        for layer in self.caches:
            for t in layer.values():
                t.zero_()
        self.pos.zero_()
        self.batch = 0
        self.row_len = [None] * self.max_batch
        self._active.zero_()

    def _mark_rows(self, rows, length: int | None) -> None:
        for r in rows:
            self.row_len[r] = length
        self._active.copy_(torch.tensor([n is not None for n in self.row_len], dtype=torch.long))

    def free_rows(self) -> list[int]:
        """Rows no sequence holds: prefill_row may start one there."""
        return [r for r, n in enumerate(self.row_len) if n is None]

    # ------------------------------------------------------------------ checks

    def _check_ids(self, ids: torch.Tensor, what: str, check_range: bool = True) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{what}: token ids must be int64 or int32, got {ids.dtype}")
        if self.device.type == "meta" or not check_range:
            return
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise InputError(f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _pad_batch(self, x: torch.Tensor, b: int | None = None) -> torch.Tensor:
        """x [B, ...] padded with zero rows to [b, ...] (b: max_batch unless given)."""
        b = self.max_batch if b is None else b
        if x.shape[0] == b:
            return x
        pad = torch.zeros((b - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        return torch.cat((x, pad))

    # ------------------------------------------------------------------ steps (runners call these)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] -> the first residual state [B, L, ...D]."""
        return self.model.streams.expand(self.model.embed(ids))

    def prefill_ctx(self, ids: torch.Tensor) -> dict:
        """The block context of a prefill over positions 0..L-1."""
        L = ids.shape[1]
        ids = ids.contiguous()  # blocks may read ids (hash routing): one stride, no recompiles
        return {"ids": ids, "rope": {k: (cos[:L], sin[:L]) for k, (cos, sin) in self.rope.items()},
                **self.model.per_layer(ids), **self.context_flags}

    def decode_caches(self, b: int) -> list[dict]:
        """The caches of decode bucket b: views of rows 0..b-1 of every field (the engine's own at
        max_batch)."""
        return self._bucket_caches[b]

    def bucket(self, n: int) -> int:
        """The smallest decode bucket holding n rows."""
        return bucket_for(self.buckets, n)

    def decode_ctx(self, b: int) -> dict:
        """The block context of a decode step of bucket b: rows 0..b-1 of the token buffer at
        their positions."""
        pos = self.pos if b == self.max_batch else self.pos[:b]
        ids = self.token_buffer[:b, None]
        return {"ids": ids, "pos": pos, "rope": {k: (cos[pos], sin[pos]) for k, (cos, sin) in self.rope.items()},
                **self.model.per_layer(ids), **self.context_flags}

    def extend_ctx(self, ids: torch.Tensor, start: torch.Tensor) -> dict:
        """The block context of an extend: ids [n, L] at positions start[b]..start[b]+L-1 of each
        row (start [n] long, on the device)."""
        pos = start[:, None] + torch.arange(ids.shape[1], device=start.device)  # [n, L]
        ids = ids.contiguous()
        return {"ids": ids, "start": start, "rope": {k: (cos[pos], sin[pos]) for k, (cos, sin) in self.rope.items()},
                **self.model.per_layer(ids), **self.context_flags}

    def decode_step(self, layers: Callable[[torch.Tensor, dict], torch.Tensor], b: int) -> torch.Tensor:
        """One decode step of bucket b (rows 0..b-1 of the token buffer) around `layers(h, ctx) ->
        h` (a runner's; h [b, 1, ...D], the caches are decode_caches(b)) -> logits [b, V];
        advances those rows' positions by one."""
        h = self.embed(self.token_buffer[:b, None])
        logits = self.model.logits(layers(h, self.decode_ctx(b))[:, 0])
        self.pos[:b].add_(1)
        return logits

    def _prefill_rows(self, rows: slice, ids: torch.Tensor) -> torch.Tensor:
        """ids [n, L] (on the device, canonical strides) at positions 0..L-1 of rows `rows` (n of
        them, caches zeroed) -> the last residual state [n, L, ...D]; sets those rows' positions.

        The whole batch writes the caches themselves; fewer rows write views of those rows of
        every cache field (whatever the mixer keeps: all fields are batch first,
        contracts.Mixer.cache_fields), so nothing is copied."""
        if rows == slice(0, self.max_batch):
            where, caches = "batch", self.caches
        elif rows.start == 0 and rows.stop in self._bucket_caches:
            where, caches = ("rows", 0, rows.stop), self._bucket_caches[rows.stop]
        else:
            where = ("rows", rows.start, rows.stop)
            caches = [{name: t[rows] for name, t in layer.items()} for layer in self.caches]
        h = self.embed(ids)
        h = self._runner.prefill_layers(where, self.model.layers, caches, h, self.prefill_ctx(ids))
        self.pos[rows] = ids.shape[1]
        return h

    def _step(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [n] (n <= max_batch; rows n..b-1 free) -> logits [n, V]: one decode step of the
        smallest bucket b holding rows 0..n-1 (its rows past n compute garbage from the buffer's
        old tokens); its rows in use advance by one position, free rows go back to position 0,
        rows from b on are not touched."""
        n = tok.shape[0]
        b = self.bucket(n)
        self.token_buffer[:n].copy_(tok)
        logits = self._runner.decode(b)
        self.pos.mul_(self._active)
        self.row_len = [r if r is None or i >= b else r + 1 for i, r in enumerate(self.row_len)]
        return logits[:n]

    # ------------------------------------------------------------------ rows

    @_engine_mode
    def prefill_rows(self, start: int, ids: torch.Tensor, return_hidden: bool = False):
        """Start sequences in free rows start..start+n-1 without touching the others: ids [n, L]
        (positions 0..L-1) -> logits [n, V] float32 of the last position. The rows are zeroed
        first, as prefill's reset does for a whole batch. One prefill graph per n (compiled:
        another for 1-token prompts), for every start and length. return_hidden: (logits, the
        final-normed states [n, L, D] the head reads; what an MTP drafter starts from)."""
        rows = self._free_slice("prefill_rows", start, ids.shape[0] if ids.dim() == 2 else 1)
        if ids.dim() != 2 or not 1 <= ids.shape[1] <= self.max_seq:
            raise InputError(f"prefill_rows: expected ids of shape [rows, seq_len] with seq_len in 1..max_seq="
                             f"{self.max_seq}, got {tuple(ids.shape)}")
        self._check_ids(ids, "prefill_rows")
        h = self._start_rows(rows, ids)
        if return_hidden:
            return self.model.logits(h[:, -1]), self.model.final_hidden(h)
        return self.model.logits(h[:, -1])

    @_engine_mode
    def prefill_row(self, row: int, ids: torch.Tensor, return_hidden: bool = False, last_only: bool = True):
        """Start a sequence in one free row without touching the others: ids [L] (positions
        0..L-1) -> logits [V] float32 of the last position (prefill_rows at n = 1); with
        return_hidden also the final-normed states [L, D]. last_only=False: the logits of every
        position [L, V] (a server's prompt log-probabilities; the head runs over L rows)."""
        rows = self._free_slice("prefill_row", row, 1)
        if ids.dim() != 1 or not 1 <= ids.shape[0] <= self.max_seq:
            raise InputError(f"prefill_row: expected ids of shape [seq_len] with seq_len in 1..max_seq="
                             f"{self.max_seq}, got {tuple(ids.shape)}")
        self._check_ids(ids, "prefill_row")
        h = self._start_rows(rows, ids.reshape(1, -1))
        logits = self.model.logits(h[0, -1] if last_only else h[0])
        if return_hidden:
            return logits, self.model.final_hidden(h[0])
        return logits

    def _free_slice(self, what: str, start: int, n: int) -> slice:
        if n < 1 or not 0 <= start <= self.max_batch - n:
            which = f"row {start}" if n == 1 else f"rows {start}..{start + n - 1}"
            raise InputError(f"{what}: {which} must be in 0..{self.max_batch - 1} (max_batch={self.max_batch})")
        for r in range(start, start + n):
            if self.row_len[r] is not None:
                raise InputError(f"{what}: row {r} is in use ({self.row_len[r]} tokens); release_row it first")
        return slice(start, start + n)

    def _start_rows(self, rows: slice, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device, torch.long).clone(memory_format=torch.contiguous_format)
        for layer in self.caches:
            for t in layer.values():
                t[rows].zero_()
        h = self._prefill_rows(rows, ids)
        self._mark_rows(range(rows.start, rows.stop), ids.shape[1])
        return h

    def _rows_in_use(self, what: str, rows) -> list[int]:
        rows = [int(r) for r in rows]
        if not rows:
            raise InputError(f"{what}: expected at least one row, got none")
        if len(set(rows)) != len(rows):
            raise InputError(f"{what}: rows {rows} name a row twice")
        for r in rows:
            if not 0 <= r < self.max_batch:
                raise InputError(f"{what}: row {r} must be in 0..{self.max_batch - 1} (max_batch={self.max_batch})")
            if self.row_len[r] is None:
                raise InputError(f"{what}: row {r} is free; start a sequence there first (prefill_row)")
        return rows

    def _row_caches(self, rows: list[int]):
        """(caches of `rows`, write-back) for a step over some rows: views of a contiguous run
        of rows (nothing to write back), else gathered copies written back by the returned
        function."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            sl = slice(rows[0], rows[0] + len(rows))
            return [{name: t[sl] for name, t in layer.items()} for layer in self.caches], lambda: None
        idx = torch.tensor(rows, device=self.device)
        # one copy per tensor: a field another layer aliases (KV shared across layers,
        # contracts.CacheField.alias_of) stays one tensor there, so its readers see this step's writes
        copies: dict[int, torch.Tensor] = {}
        caches = []
        for layer in self.caches:
            for t in layer.values():
                if id(t) not in copies:
                    copies[id(t)] = t.index_select(0, idx)
            caches.append({name: copies[id(t)] for name, t in layer.items()})

        def write_back():
            for i, (layer, part) in enumerate(zip(self.caches, caches)):
                for name in self.plan.own_fields(i):
                    layer[name].index_copy_(0, idx, part[name])

        return caches, write_back

    @_engine_mode
    def extend_rows(self, rows, ids: torch.Tensor, last_only: bool = False, return_hidden: bool = False):
        """Append ids [n, L] to rows in use (n of them, in that order), each at its own next
        position -> logits [n, L, V] float32 ([n, V], the last position only, with last_only).

        Whatever a row already holds (a prompt prefilled whole or in chunks, decoded tokens, a
        reused prefix) is what the new tokens see: a prompt extended in chunks equals its whole
        prefill. Compiled: one graph per (n, layer kind) for every L and position. return_hidden:
        (logits, the final-normed states [n, L, D] the head reads; speculative.py's MTP drafter)."""
        rows = self._rows_in_use("extend_rows", rows)
        if ids.dim() != 2 or ids.shape[0] != len(rows) or ids.shape[1] < 1:
            raise InputError(f"extend_rows: expected ids of shape [{len(rows)}, L] (one row of tokens per row "
                             f"in {rows}, L >= 1), got {tuple(ids.shape)}")
        L = ids.shape[1]
        over = [r for r in rows if self.row_len[r] + L > self.max_seq]
        if over:
            raise InputError(f"extend_rows: row {over[0]} holds {self.row_len[over[0]]} tokens; {L} more exceed "
                             f"max_seq={self.max_seq} (release it, or rebuild with a larger runtime.max_seq)")
        self._check_ids(ids, "extend_rows")
        ids = ids.to(self.device, torch.long).clone(memory_format=torch.contiguous_format)
        start = torch.tensor([self.row_len[r] for r in rows], dtype=torch.long, device=self.device)
        caches, write_back = self._row_caches(rows)
        h = self.embed(ids)
        h = self._runner.extend_layers(("extend", len(rows)), self.model.layers, caches, h,
                                       self.extend_ctx(ids, start))
        write_back()
        idx = torch.tensor(rows, device=self.device)
        self.pos.index_add_(0, idx, torch.full_like(idx, L))
        for r in rows:
            self.row_len[r] += L
        if return_hidden:
            return self.model.logits(h[:, -1] if last_only else h), self.model.final_hidden(h)
        return self.model.logits(h[:, -1] if last_only else h)

    @_engine_mode
    def mtp_extend(self, depth: int, rows, prev: torch.Tensor, ids: torch.Tensor, start: torch.Tensor):
        """MTP layer `depth` (model.mtp[depth]) over prev [n, L, D] (hidden states) and ids [n, L]
        (the tokens one ahead) at positions start [n].. of rows' own MTP caches -> (its hidden
        [n, D], logits [n, V] float32) at the last position: the MTP drafter's step (mtp.py)."""
        rows = [int(r) for r in rows]
        layer, own = self.model.mtp[depth], self.mtp_caches[depth]
        prev, ids = prev.to(self.device), ids.to(self.device, torch.long)
        idx = torch.tensor(rows, device=self.device)
        cache = {name: t.index_select(0, idx) for name, t in own.items()}
        x = layer.step_in(self.model, prev, ids)
        x = self.block_extend(layer, x, cache, ids, start.to(self.device, torch.long))
        for name, t in own.items():
            t.index_copy_(0, idx, cache[name])
        hidden, logits = layer.step_out(self.model, x[:, -1:])
        return hidden[:, 0], logits[:, 0]

    def constant_state_kinds(self) -> list[str]:
        """"layers.i (kind): fields" of every layer whose cache has constant-state fields
        (grows=False): what truncate_row cannot roll back."""
        out = []
        for i, (block, layer) in enumerate(zip(self.model.layers, self.plan.layers)):
            names = [name for name, f in layer.items() if not f.grows]
            if names:
                out.append(f"layers.{i} ({block.mixer.kind}): {', '.join(names)}")
        return out

    @_engine_mode
    def truncate_row(self, row: int, length: int) -> None:
        """Roll a row in use back to its first `length` tokens (the next token goes to position
        `length`). Only the length moves: slots past it are invisible and overwritten (see the
        module docstring); a family with constant-state fields is refused, naming them."""
        (row,) = self._rows_in_use("truncate_row", [row])
        if not 0 <= length <= self.row_len[row]:
            raise InputError(f"truncate_row: row {row} holds {self.row_len[row]} tokens; length {length} must be "
                             f"in 0..{self.row_len[row]}")
        if length == self.row_len[row]:
            return
        state = self.constant_state_kinds()
        if state:
            raise InputError(f"truncate_row: this model keeps constant-state cache fields, which hold no "
                             f"per-position history to roll back ({'; '.join(state)}); save_state(rows) before "
                             f"the tokens to drop, restore_state(rows, handle) after, then extend_rows the kept ones")
        self.row_len[row] = length
        self.pos[row] = length

    def _state_fields(self):
        """(caches, name) of every constant-state field, main layers and MTP blocks."""
        for layer, fields in zip(self.caches, self.plan.layers):
            for name, f in fields.items():
                if not f.grows:
                    yield layer, name
        for layer, block in zip(self.mtp_caches, self.model.mtp):
            fields = block.mixer.cache_fields(self.max_batch, self.max_seq, torch.float32)
            for name, f in fields.items():
                if not f.grows:
                    yield layer, name

    @_engine_mode
    def save_state(self, rows) -> dict:
        """A copy (on the device) of rows' constant-state fields and lengths, for restore_state."""
        rows = self._rows_in_use("save_state", rows)
        idx = torch.tensor(rows, device=self.device)
        return {"rows": rows, "lengths": [self.row_len[r] for r in rows],
                "fields": [layer[name].index_select(0, idx) for layer, name in self._state_fields()]}

    @_engine_mode
    def restore_state(self, rows, handle: dict) -> None:
        """Put rows back as save_state found them: their constant-state fields and lengths (KV
        slots written since are past the restored length, so invisible). rows: the saved rows or
        as many others in use (the state then moves with them)."""
        rows = self._rows_in_use("restore_state", rows)
        if len(rows) != len(handle["rows"]):
            raise InputError(f"restore_state: the handle holds {len(handle['rows'])} rows {handle['rows']}, "
                             f"got {len(rows)} rows {rows}")
        idx = torch.tensor(rows, device=self.device)
        for (layer, name), saved in zip(self._state_fields(), handle["fields"]):
            layer[name].index_copy_(0, idx, saved)
        for r, n in zip(rows, handle["lengths"]):
            self.row_len[r] = n
            self.pos[r] = n

    @property
    def can_extend(self) -> bool:
        """Whether this engine's runner extends rows (every runner here does; Runner.extends)."""
        return self._runner.extends

    @_engine_mode
    def export_row(self, row: int, logits: torch.Tensor | None = None) -> RowCache:
        """A copy in host memory of what row `row` (in use) holds: of each field with a token
        axis only its first row_len slots, of the others all (contracts.CacheField.token_axis);
        logits [V], when given, those of its last token (an exact match needs no step)."""
        (row,) = self._rows_in_use("export_row", [row])
        n = self.row_len[row]
        fields = []
        for i, layer in enumerate(self.caches):
            out = {}
            for name, f in self.plan.own_fields(i).items():  # an alias is its source layer's field
                t = layer[name][row]
                if f.token_axis is not None:
                    t = t.narrow(f.token_axis - 1, 0, n)
                out[name] = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # dense, in host memory
            fields.append(out)
        return RowCache(n, fields, None if logits is None else logits.detach().to("cpu", torch.float32, copy=True))

    @_engine_mode
    def import_row(self, row: int, snap: RowCache, length: int) -> None:
        """Start a sequence in free row `row` from a RowCache at its first `length` tokens (the
        next token goes to position `length`). Fewer tokens than the snapshot holds need every
        field to grow with tokens (as truncate_row)."""
        row = self._free_slice("import_row", row, 1).start
        if not 1 <= length <= snap.length:
            raise InputError(f"import_row: length {length} must be in 1..{snap.length} (the snapshot's tokens)")
        if length < snap.length and self.constant_state_kinds():
            raise InputError(f"import_row: a snapshot of {snap.length} tokens cannot be cut to {length}: this model "
                             f"keeps constant-state cache fields ({'; '.join(self.constant_state_kinds())})")
        for i, (layer, saved) in enumerate(zip(self.caches, snap.fields)):
            for name, f in self.plan.own_fields(i).items():
                t = layer[name][row]
                src = saved[name]
                if f.token_axis is not None:
                    t = t.narrow(f.token_axis - 1, 0, length)
                    src = src.narrow(f.token_axis - 1, 0, length)
                t.copy_(src)
        self._mark_rows([row], length)
        self.pos[row] = length

    @_engine_mode
    def release_row(self, row: int) -> None:
        """Free a row at once (its cache is left as is: the next prefill there zeroes it)."""
        self._mark_rows([row], None)

    @_engine_mode
    def move_row(self, src: int, dst: int) -> None:
        """Move the sequence in row src to the free row dst: every cache field's row (the MTP
        blocks' too), its position and token count; src is free after. What compaction does
        (module docstring): a whole row of every field is copied, whatever the field holds (KV
        slots, ring buffers, recurrent state), since fields say nothing of their layout past the
        batch dimension."""
        for r, what in ((src, "src"), (dst, "dst")):
            if not 0 <= r < self.max_batch:
                raise InputError(f"move_row: {what} row {r} must be in 0..{self.max_batch - 1} "
                                 f"(max_batch={self.max_batch})")
        if self.row_len[src] is None:
            raise InputError(f"move_row: row {src} holds no sequence; expected a row in use as src")
        if self.row_len[dst] is not None:
            raise InputError(f"move_row: row {dst} is in use ({self.row_len[dst]} tokens); expected a free row "
                             f"as dst")
        for layer in (*self.caches, *self.mtp_caches):
            for t in layer.values():
                t[dst].copy_(t[src])
        self.pos[dst] = self.pos[src]
        self.pos[src] = 0
        length = self.row_len[src]
        self.row_len[src] = None
        self._mark_rows([dst], length)


    @_engine_mode
    def decode_rows(self, tok: torch.Tensor) -> torch.Tensor:
        """One step of every row: tok [max_batch] (any id for free rows) -> logits [max_batch, V].

        The same static decode step as `decode`: free rows compute garbage at position 0 of their
        own row, which nobody reads and the next prefill there overwrites. Each sequence advances
        by one position; a full row is refused.
        """
        if tok.dim() != 1 or tok.shape[0] != self.max_batch:
            raise InputError(f"decode_rows: expected tokens of shape [{self.max_batch}] (max_batch), "
                             f"got {tuple(tok.shape)}")
        full = [r for r, n in enumerate(self.row_len) if n is not None and n >= self.max_seq]
        if full:
            raise InputError(f"decode_rows: row {full[0]} holds max_seq={self.max_seq} tokens; release it "
                             f"(or rebuild with a larger runtime.max_seq)")
        self._check_ids(tok, "decode_rows", check_range=tok.device.type == "cpu")
        # the bucket that holds the highest row in use; the rows past it are free: zero logits
        n = max((r + 1 for r, used in enumerate(self.row_len) if used is not None), default=1)
        logits = self._step(tok[:n].to(self.device, torch.long))
        if n == self.max_batch:
            return logits
        return torch.cat((logits, logits.new_zeros(self.max_batch - n, logits.shape[1])))

    @_engine_mode
    def decode_active(self, tok: torch.Tensor) -> torch.Tensor:
        """One step of rows 0..n-1: tok [n] (any id for free rows among them) -> logits [n, V],
        through the smallest decode bucket b holding n rows. Rows n..b-1 must be free (they
        compute garbage); rows from b on are left as they are, in use or not (a compacting caller
        keeps its n decoding sequences in rows 0..n-1, see the module docstring, and may keep a
        prompt being prefilled in chunks above the bucket)."""
        if tok.dim() != 1 or not 1 <= tok.shape[0] <= self.max_batch:
            raise InputError(f"decode_active: expected tokens of shape [n] with n in 1..max_batch={self.max_batch}, "
                             f"got {tuple(tok.shape)}")
        n = tok.shape[0]
        b = self.bucket(n)
        inside = [r for r in range(n, b) if self.row_len[r] is not None]
        if inside:
            raise InputError(f"decode_active: row {inside[0]} is in use but inside the decode bucket of {b} rows "
                             f"past the n={n} rows given; expected rows {n}..{b - 1} free (move_row compacts "
                             f"the rows in use into 0..n-1)")
        full = [r for r in range(n) if self.row_len[r] is not None and self.row_len[r] >= self.max_seq]
        if full:
            raise InputError(f"decode_active: row {full[0]} holds max_seq={self.max_seq} tokens; release it "
                             f"(or rebuild with a larger runtime.max_seq)")
        self._check_ids(tok, "decode_active", check_range=tok.device.type == "cpu")
        return self._step(tok.to(self.device, torch.long))

    # ------------------------------------------------------------------ batch API

    @_engine_mode
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
        ids = self._pad_batch(ids.to(self.device, torch.long), self.bucket(B)).clone(
            memory_format=torch.contiguous_format)
        if L == 1 and not return_mtp:
            self._mark_rows(range(B), 0)
            return self._step(ids[:B, 0])[:, None]
        h = self._prefill_rows(slice(0, ids.shape[0]), ids)
        logits = self.model.logits(h[:, -1:] if last_only else h)
        self._mark_rows(range(B), L)
        if return_mtp:
            return logits[:B], [m[:B] for m in mtp_prefill(self, ids, h)]
        return logits[:B]

    @_engine_mode
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
        return self._step(tok.to(self.device, torch.long))

    def block_prefill(self, block, h: torch.Tensor, cache: dict, ids: torch.Tensor) -> torch.Tensor:
        """One block (a layer of `model.layers` or `model.mtp`) over positions 0..L-1 through the
        runner's prefill: h [b, L, ...D], ids [b, L] (the tokens at those positions) -> [b, L, ...D]
        (b: a bucket's rows); fills `cache` (that block's cache dict, or views of its first b rows)."""
        where = ("block", id(block), h.shape[0])
        return self._runner.prefill_layers(where, [block], [cache], h, self.prefill_ctx(ids))

    def block_extend(self, block, h: torch.Tensor, cache: dict, ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One block (an MTP layer) appending h [n, L, ...D] to rows that hold start [n] positions
        of its own cache through the runner's extend: ids [n, L] the tokens there, cache that
        block's cache dict for those n rows -> [n, L, ...D]."""
        return self._runner.extend_layers(("block_extend", id(block), h.shape[0]), [block], [cache], h,
                                          self.extend_ctx(ids, start))

    # ------------------------------------------------------------------ runner

    def warm_prefill(self) -> None:
        """A batch prefill of dummy tokens through the runner (its graphs compile); the caller resets."""
        ids = torch.zeros(self.max_batch, min(2, self.max_seq), dtype=torch.long, device=self.device)
        self.model.logits(self._prefill_rows(slice(0, self.max_batch), ids))

    @_engine_mode
    def warmup(self) -> dict[str, float]:
        """Make what both steps need (compile the graphs, capture the CUDA graphs, load or make the
        packages) on dummy tokens, then reset: the batch prefill at max_batch and the decode step
        of every bucket (each bucket compiles, captures or loads its own, so warmup's decode part
        grows with the number of buckets).

        Returns the wall time spent on each step's first run (compile + one run; packages are
        loaded without running; decode: every bucket's), and on setting up the compiler ("setup":
        the CPU ISA probe, on the first compile in a cache only).
        """
        self.compile_seconds.update(self._runner.warmup())
        return dict(self.compile_seconds)

    def graph_counts(self) -> dict[str, int]:
        """Graphs compiled so far by each entry point (recompiles show up here); under runtime.aot
        the packages in use instead ("prefill_packages", "decode_packages": one per layer
        structure and layout of the inputs)."""
        return self._runner.graph_counts()

    def packages_built(self) -> list[str]:
        """Keys of the packages this engine compiled (runtime.aot; the others came from disk)."""
        return self._runner.packages_built()
