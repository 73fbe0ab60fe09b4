"""`zoo serve` under torchrun (runtime.parallel): rank 0 serves HTTP, every rank runs the model.

Each step of the model holds collectives that need every rank, in the same order with the same
shapes. So the scheduler (scheduler.py) runs on rank 0 only, against a `LeaderEngine`: every call
that runs or changes the engine's rows (prefill_row, release_row, decode_rows, reset) is first
broadcast to the other ranks, which `follow` it on their own engines. What the scheduler reads
(free_rows, row_len, max_seq, ...) stays equal on every rank because the same calls ran
everywhere. Sampling happens on rank 0 (its logits are every rank's: the head all-gathers them);
the sampled tokens reach the other ranks as the next decode_rows call's input.

The commands go over their own gloo group (on CPU even when the model's group is NCCL), as int64
tensors: a header [op, row, n] and n token ids; no pickles. The group's timeout is long: an idle
server sends nothing, and the followers wait for its next request.

After each call every rank reports over that group whether its call raised (one all-reduce of a
flag; the error texts only when some rank failed). A call that failed on every rank (the same
call on the same state: bad input) leaves the ranks alike: rank 0 raises it to the scheduler,
which fails that request, and the followers go on. A call that failed on some ranks only leaves
their states different, and the next step's collectives would mix them: every rank raises
`RankFailed` naming the ranks and their errors, the followers return from `follow` with it, and
rank 0's engine refuses every later call and asks its server to stop (`on_failure`).
"""
from __future__ import annotations

import datetime
import logging
import signal
import threading

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..compiler.errors import ZooError

log = logging.getLogger("zoo.serve")

PREFILL, RELEASE, DECODE, RESET, STOP = range(5)
OP_NAMES = {PREFILL: "prefill_row", RELEASE: "release_row", DECODE: "decode_rows", RESET: "reset"}
IDLE_TIMEOUT = datetime.timedelta(days=365)
MESSAGE_BYTES = 1000  # of each failed rank's error text, sent to every rank


class RankFailed(ZooError):
    """An engine call failed on some ranks and not on the others: their states differ, so the
    whole group stops."""


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
    what = f"{OP_NAMES.get(op, op)}" + (f" (row {row})" if op in (PREFILL, RELEASE) else "")
    raise RankFailed(f"engine call {what} failed on rank(s) {sorted(failed)} and not on rank(s) {ok}: "
                     + "; ".join(f"rank {r}: {text}" for r, text in failed.items())
                     + ". The ranks' states now differ, so every rank stops.") from error


def control_group():
    """The command channel's group (every rank calls this, together)."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class LeaderEngine:
    """Rank 0's engine: each call that runs the model is sent to the followers first, and its
    outcome compared with theirs after (see the module docstring). on_failure(error) is called
    once when the ranks' states part (serve: stop the server)."""

    # extend_rows / import_row are not sent to the followers (yet): the scheduler keeps no prefix
    # cache under torchrun, so that every call that runs the model runs on every rank
    can_extend = False

    def __init__(self, engine, group, on_failure: Optional[Callable[[RankFailed], None]] = None):
        self._engine, self._group, self._on_failure = engine, group, on_failure
        self.failed: Optional[RankFailed] = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _send(self, op: int, row: int = 0, ids: torch.Tensor | None = None) -> None:
        n = 0 if ids is None else int(ids.numel())
        dist.broadcast(torch.tensor([op, row, n], dtype=torch.long), src=0, group=self._group)
        if n:
            dist.broadcast(ids.to("cpu", torch.long).reshape(-1).contiguous(), src=0, group=self._group)

    def _call(self, op: int, row: int, ids: torch.Tensor | None, run: Callable):
        if self.failed is not None:  # the followers are gone: nothing may run
            raise RankFailed(f"the group stopped after an earlier failure: {self.failed}")
        self._send(op, row, ids)
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

    def prefill_row(self, row: int, ids: torch.Tensor):
        return self._call(PREFILL, row, ids, lambda: self._engine.prefill_row(row, ids))

    def release_row(self, row: int):
        return self._call(RELEASE, row, None, lambda: self._engine.release_row(row))

    def decode_rows(self, tok: torch.Tensor):
        return self._call(DECODE, 0, tok, lambda: self._engine.decode_rows(tok))

    def reset(self):
        return self._call(RESET, 0, None, lambda: self._engine.reset())

    def stop(self) -> None:
        """The followers return from `follow` (a follower already gone is only logged; after a
        RankFailed they have returned already, and nothing is sent)."""
        if self.failed is not None:
            return
        try:
            self._send(STOP)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("could not tell the other ranks to stop: %s", e)


@torch.no_grad()
def follow(engine, group) -> None:
    """A rank other than 0: run rank 0's engine calls until it stops. A call that fails here and
    on every other rank (bad input) is only logged: rank 0's scheduler reports it. One that fails
    on some ranks only raises RankFailed here, as on every rank. Ctrl-C (SIGINT to the whole
    process group) is left to rank 0: its server shuts down and then sends STOP."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = torch.zeros(3, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0, group=group)
        op, row, n = (int(v) for v in header)
        ids = None
        if n:
            ids = torch.zeros(n, dtype=torch.long)
            dist.broadcast(ids, src=0, group=group)
        if op == STOP:
            return
        error = None
        try:
            if op == PREFILL:
                engine.prefill_row(row, ids)
            elif op == RELEASE:
                engine.release_row(row)
            elif op == DECODE:
                engine.decode_rows(ids)
            elif op == RESET:
                engine.reset()
            else:
                raise ValueError(f"unknown engine call {op} from rank 0")
        except Exception as e:  # noqa: BLE001 - compared with the other ranks' outcome below
            error = e
        try:
            _settle(group, op, row, error)
        except RankFailed as e:
            log.error("rank %d: %s", dist.get_rank(), e)
            raise
        if error is not None:
            log.warning("rank %d: engine call %s failed on every rank: %s", dist.get_rank(),
                        OP_NAMES.get(op, op), error)
