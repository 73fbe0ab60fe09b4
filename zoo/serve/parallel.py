"""`zoo serve` under torchrun (runtime.parallel): rank 0 serves HTTP, every rank runs the model.

Each step of the model holds collectives that need every rank, in the same order with the same
shapes. So the scheduler (scheduler.py), with its prefix cache, chunked prefill and speculative
decoding, runs on rank 0 only, against a `LeaderEngine`: every engine call it makes that runs or
changes rows is first broadcast to the other ranks, which `follow` it on their own engines.
What the scheduler reads (free_rows, row_len, max_seq, ...) stays equal on every rank because
the same calls ran everywhere. Sampling, drafting by n-gram lookup and acceptance happen on rank 0
(its logits are every rank's: the head all-gathers them); what they chose reaches the other ranks
as the next call's input (decode tokens, the drafts of a verify step). An MTP drafter's steps run
the model's sharded MTP layer, so they are engine calls too (Engine.mtp_extend), replayed with
the hidden states they read.

The calls:
    prefill_row(row, ids, return_hidden, last_only)   release_row(row)   move_row(src, dst)
    decode_rows(tok)    decode_active(tok)    reset()               truncate_row(row, length)
    extend_rows(rows, ids, last_only, return_hidden)
    save_state(rows) -> handle                restore_state(rows, handle)
    export_row(row, logits) -> snapshot       import_row(row, snapshot, length)
    mtp_extend(depth, rows, prev, ids, start)
What a call returns to be handed back later (a save_state handle, an export_row snapshot of the
prefix cache) stays on each rank, under one key: rank 0 gets its own object wrapped in `Shared`
(the key beside it), each follower keeps its own under that key. Rank 0's prefix cache decides
hits and evictions; import_row names the key, and when rank 0 drops its object (an evicted
entry, a handle no longer needed) the followers drop theirs with the next call (FORGET).

The commands go over their own gloo group (on CPU even when the model's group is NCCL): a header
[op, flags, n_ints, n_floats], then n_ints int64 values (rows, tokens, keys) and n_floats
float32 values (an MTP step's hidden states, which every float dtype here holds exactly; flags
name the dtype); no pickles. The group's timeout is long: an idle server sends nothing, and the
followers wait for its next request.

After each call every rank reports over that group whether its call raised (one all-reduce of a
flag; the error texts only when some rank failed). A call that failed on every rank (the same
call on the same state: bad input) leaves the ranks alike: rank 0 raises it to the scheduler,
which fails that request, and the followers go on. A call that failed on some ranks only leaves
their states different, and the next step's collectives would mix them: every rank raises
`RankFailed` naming the ranks and their errors, the followers return from `follow` with it, and
rank 0's engine refuses every later call and asks its server to stop (`on_failure`).
"""
from __future__ import annotations

import collections
import datetime
import itertools
import logging
import signal
import threading
import weakref

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..compiler.errors import ZooError

log = logging.getLogger("zoo.serve")

(PREFILL, RELEASE, DECODE, RESET, STOP, DECODE_ACTIVE, MOVE, EXTEND, TRUNCATE, SAVE, RESTORE, EXPORT, IMPORT,
 MTP, FORGET) = range(15)
OP_NAMES = {PREFILL: "prefill_row", RELEASE: "release_row", DECODE: "decode_rows", RESET: "reset",
            DECODE_ACTIVE: "decode_active", MOVE: "move_row", EXTEND: "extend_rows", TRUNCATE: "truncate_row",
            SAVE: "save_state", RESTORE: "restore_state", EXPORT: "export_row", IMPORT: "import_row",
            MTP: "mtp_extend"}
ROW_OPS = (PREFILL, RELEASE, MOVE, TRUNCATE, EXPORT, IMPORT)  # ints[0] is the row (named in errors)
LAST_ONLY, HIDDEN, ALL_POSITIONS = 1, 2, 4  # flags of prefill_row / extend_rows (prefill_row: last_only=False)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # an MTP step's hidden states: flags index
IDLE_TIMEOUT = datetime.timedelta(days=365)
MESSAGE_BYTES = 1000  # of each failed rank's error text, sent to every rank


class RankFailed(ZooError):
    """An engine call failed on some ranks and not on the others: their states differ, so the
    whole group stops."""


class Shared:
    """What an engine call returned on rank 0 (`local`: a save_state handle, an export_row
    RowCache) and the key its followers keep theirs under; reads its attributes through (a
    prefix cache reads a snapshot's length, nbytes and logits)."""

    def __init__(self, key: int, local):
        self.key, self.local = key, local

    def __getattr__(self, name):
        if name == "local":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)


def _exchange_outcome(group, error: Optional[BaseException]) -> Optional[list[Optional[str]]]:
    """Every rank's outcome of the call it just made, as rank-ordered error texts (None: it
    succeeded), or None when every rank succeeded (the common case: one all-reduce of a flag)."""
    failed = torch.tensor([0 if error is None else 1], dtype=torch.long)
    dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)
    if int(failed) == 0:
        return None
    text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
    mine = torch.zeros(MESSAGE_BYTES + 2, dtype=torch.long)  # [failed, length, bytes...]
    mine[0], mine[1] = int(error is not None), len(text)
    mine[2:2 + len(text)] = torch.tensor(list(text), dtype=torch.long)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [bytes(t[2:2 + int(t[1])].tolist()).decode(errors="replace") if int(t[0]) else None for t in every]


def _settle(group, op: int, row: int, error: Optional[BaseException]) -> None:
    """Raise RankFailed on every rank when the call failed on some ranks only; return when it
    succeeded everywhere or failed everywhere (the caller then raises its own error, if any)."""
    outcome = _exchange_outcome(group, error)
    if outcome is None or all(text is not None for text in outcome):
        return
    failed = {r: text for r, text in enumerate(outcome) if text is not None}
    ok = [r for r, text in enumerate(outcome) if text is None]
    what = f"{OP_NAMES.get(op, op)}" + (f" (row {row})" if op in ROW_OPS else "")
    raise RankFailed(f"engine call {what} failed on rank(s) {sorted(failed)} and not on rank(s) {ok}: "
                     + "; ".join(f"rank {r}: {text}" for r, text in failed.items())
                     + ". The ranks' states now differ, so every rank stops.") from error


def control_group():
    """The command channel's group (every rank calls this, together)."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _ints(*parts) -> torch.Tensor:
    """int64 [n] of ints, lists and tensors, flattened in order."""
    return torch.cat([p.to("cpu", torch.long).reshape(-1) if isinstance(p, torch.Tensor) else
                      torch.tensor(p if isinstance(p, (list, tuple)) else [p], dtype=torch.long) for p in parts])


class LeaderEngine:
    """Rank 0's engine: each call that runs or changes rows is sent to the followers first, and
    its outcome compared with theirs after (see the module docstring). on_failure(error) is
    called once when the ranks' states part (serve: stop the server)."""

    def __init__(self, engine, group, on_failure: Optional[Callable[[RankFailed], None]] = None):
        self._engine, self._group, self._on_failure = engine, group, on_failure
        self.failed: Optional[RankFailed] = None
        self._keys = itertools.count()
        self._dead: collections.deque[int] = collections.deque()  # keys rank 0 dropped (weakref.finalize)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def can_extend(self) -> bool:
        """The engine's own: every call that extends rows is replayed."""
        return self._engine.can_extend

    def _send(self, op: int, flags: int = 0, ints: torch.Tensor | None = None, floats: torch.Tensor | None = None):
        ni = 0 if ints is None else int(ints.numel())
        nf = 0 if floats is None else int(floats.numel())
        dist.broadcast(torch.tensor([op, flags, ni, nf], dtype=torch.long), src=0, group=self._group)
        if ni:
            dist.broadcast(ints.contiguous(), src=0, group=self._group)
        if nf:
            dist.broadcast(floats.to("cpu", torch.float32).reshape(-1).contiguous(), src=0, group=self._group)

    def _call(self, op: int, run: Callable, ints: torch.Tensor | None = None, flags: int = 0,
              floats: torch.Tensor | None = None):
        if self.failed is not None:  # the followers are gone: nothing may run
            raise RankFailed(f"the group stopped after an earlier failure: {self.failed}")
        if self._dead:  # what rank 0 let go of since the last call: the followers let go too
            dead = []
            while self._dead:
                dead.append(self._dead.popleft())
            self._send(FORGET, ints=_ints(dead))
        self._send(op, flags, ints, floats)
        row = int(ints[0]) if op in ROW_OPS else 0
        try:
            out = run()
        except Exception as e:
            self._settle(op, row, e)
            raise  # failed on every rank alike: this request's error
        self._settle(op, row, None)
        return out

    def _settle(self, op: int, row: int, error: Optional[BaseException]) -> None:
        try:
            _settle(self._group, op, row, error)
        except RankFailed as e:
            self.failed = e
            log.error("%s", e)
            if self._on_failure is not None:
                self._on_failure(e)
            raise

    def _shared(self, key: int, local) -> Shared:
        out = Shared(key, local)
        weakref.finalize(out, self._dead.append, key)
        return out

    def prefill_row(self, row: int, ids: torch.Tensor, return_hidden: bool = False, last_only: bool = True):
        return self._call(PREFILL, lambda: self._engine.prefill_row(row, ids, return_hidden=return_hidden,
                                                                    last_only=last_only),
                          _ints(row, ids), HIDDEN * return_hidden + ALL_POSITIONS * (not last_only))

    def release_row(self, row: int):
        return self._call(RELEASE, lambda: self._engine.release_row(row), _ints(row))

    def decode_rows(self, tok: torch.Tensor):
        return self._call(DECODE, lambda: self._engine.decode_rows(tok), _ints(tok))

    def decode_active(self, tok: torch.Tensor):
        return self._call(DECODE_ACTIVE, lambda: self._engine.decode_active(tok), _ints(tok))

    def move_row(self, src: int, dst: int):
        return self._call(MOVE, lambda: self._engine.move_row(src, dst), _ints(src, dst))

    def extend_rows(self, rows, ids: torch.Tensor, last_only: bool = False, return_hidden: bool = False):
        rows = [int(r) for r in rows]
        return self._call(EXTEND, lambda: self._engine.extend_rows(rows, ids, last_only=last_only,
                                                                   return_hidden=return_hidden),
                          _ints(len(rows), rows, ids), LAST_ONLY * last_only + HIDDEN * return_hidden)

    def truncate_row(self, row: int, length: int):
        return self._call(TRUNCATE, lambda: self._engine.truncate_row(row, length), _ints(row, length))

    def save_state(self, rows) -> Shared:
        rows, key = [int(r) for r in rows], next(self._keys)
        return self._shared(key, self._call(SAVE, lambda: self._engine.save_state(rows), _ints(key, rows)))

    def restore_state(self, rows, handle: Shared):
        rows = [int(r) for r in rows]
        return self._call(RESTORE, lambda: self._engine.restore_state(rows, handle.local), _ints(handle.key, rows))

    def export_row(self, row: int, logits: torch.Tensor | None = None) -> Shared:
        key = next(self._keys)  # the followers keep no logits: only rank 0 reads them
        return self._shared(key, self._call(EXPORT, lambda: self._engine.export_row(row, logits), _ints(row, key)))

    def import_row(self, row: int, snap: Shared, length: int):
        return self._call(IMPORT, lambda: self._engine.import_row(row, snap.local, length),
                          _ints(row, snap.key, length))

    def mtp_extend(self, depth: int, rows, prev: torch.Tensor, ids: torch.Tensor, start: torch.Tensor):
        rows = [int(r) for r in rows]
        return self._call(MTP, lambda: self._engine.mtp_extend(depth, rows, prev, ids, start),
                          _ints(depth, len(rows), ids.shape[1], rows, ids, start), FLOAT_DTYPES.index(prev.dtype),
                          prev)

    def reset(self):
        return self._call(RESET, lambda: self._engine.reset())

    def stop(self) -> None:
        """The followers return from `follow` (a follower already gone is only logged; after a
        RankFailed they have returned already, and nothing is sent)."""
        if self.failed is not None:
            return
        try:
            self._send(STOP)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("could not tell the other ranks to stop: %s", e)


def _run(engine, op: int, flags: int, ints: torch.Tensor, floats: Optional[torch.Tensor], shared: dict) -> None:
    """A follower's replay of one of rank 0's calls (the layouts LeaderEngine sends)."""
    last_only, hidden = bool(flags & LAST_ONLY), bool(flags & HIDDEN)
    if op == PREFILL:
        engine.prefill_row(int(ints[0]), ints[1:], return_hidden=hidden, last_only=not flags & ALL_POSITIONS)
    elif op == RELEASE:
        engine.release_row(int(ints[0]))
    elif op == DECODE:
        engine.decode_rows(ints)
    elif op == DECODE_ACTIVE:
        engine.decode_active(ints)
    elif op == RESET:
        engine.reset()
    elif op == MOVE:
        engine.move_row(int(ints[0]), int(ints[1]))
    elif op == EXTEND:  # [n, rows..., tokens...]
        n = int(ints[0])
        engine.extend_rows(ints[1:1 + n].tolist(), ints[1 + n:].reshape(n, -1), last_only=last_only,
                           return_hidden=hidden)
    elif op == TRUNCATE:
        engine.truncate_row(int(ints[0]), int(ints[1]))
    elif op == SAVE:  # [key, rows...]
        shared[int(ints[0])] = engine.save_state(ints[1:].tolist())
    elif op == RESTORE:  # [key, rows...]
        engine.restore_state(ints[1:].tolist(), shared[int(ints[0])])
    elif op == EXPORT:  # [row, key]
        shared[int(ints[1])] = engine.export_row(int(ints[0]))
    elif op == IMPORT:  # [row, key, length]
        engine.import_row(int(ints[0]), shared[int(ints[1])], int(ints[2]))
    elif op == MTP:  # [depth, n, L, rows..., ids [n, L]..., start [n]...]; floats: prev [n, L, D]
        depth, n, L = (int(v) for v in ints[:3])
        rows, ids, start = ints[3:3 + n].tolist(), ints[3 + n:3 + n + n * L].reshape(n, L), ints[3 + n + n * L:]
        prev = floats.to(FLOAT_DTYPES[flags]).reshape(n, L, -1)
        engine.mtp_extend(depth, rows, prev, ids, start)
    else:
        raise ValueError(f"unknown engine call {op} from rank 0")


@torch.no_grad()
def follow(engine, group) -> None:
    """A rank other than 0: run rank 0's engine calls until it stops. A call that fails here and
    on every other rank (bad input) is only logged: rank 0's scheduler reports it. One that fails
    on some ranks only raises RankFailed here, as on every rank. Ctrl-C (SIGINT to the whole
    process group) is left to rank 0: its server shuts down and then sends STOP."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = torch.zeros(4, dtype=torch.long)
    shared: dict = {}  # key -> this rank's save_state handle or export_row snapshot (see Shared)
    while True:
        dist.broadcast(header, src=0, group=group)
        op, flags, ni, nf = (int(v) for v in header)
        ints = torch.zeros(ni, dtype=torch.long)
        floats = None
        if ni:
            dist.broadcast(ints, src=0, group=group)
        if nf:
            floats = torch.zeros(nf, dtype=torch.float32)
            dist.broadcast(floats, src=0, group=group)
        if op == STOP:
            return
        if op == FORGET:  # no outcome to compare: dropping a key cannot fail
            for key in ints.tolist():
                shared.pop(key, None)
            continue
        error = None
        try:
            _run(engine, op, flags, ints, floats, shared)
        except Exception as e:  # noqa: BLE001 - compared with the other ranks' outcome below
            error = e
        try:
            _settle(group, op, int(ints[0]) if op in ROW_OPS and ni else 0, error)
        except RankFailed as e:
            log.error("rank %d: %s", dist.get_rank(), e)
            raise
        if error is not None:
            log.warning("rank %d: engine call %s failed on every rank: %s", dist.get_rank(),
                        OP_NAMES.get(op, op), error)
