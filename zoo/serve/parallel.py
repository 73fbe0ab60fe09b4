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
"""
from __future__ import annotations

import datetime
import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("zoo.serve")

PREFILL, RELEASE, DECODE, RESET, STOP = range(5)
IDLE_TIMEOUT = datetime.timedelta(days=365)


def control_group():
    """The command channel's group (every rank calls this, together)."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class LeaderEngine:
    """Rank 0's engine: each call that runs the model is sent to the followers first."""

    def __init__(self, engine, group):
        self._engine, self._group = engine, group

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _send(self, op: int, row: int = 0, ids: torch.Tensor | None = None) -> None:
        n = 0 if ids is None else int(ids.numel())
        dist.broadcast(torch.tensor([op, row, n], dtype=torch.long), src=0, group=self._group)
        if n:
            dist.broadcast(ids.to("cpu", torch.long).reshape(-1).contiguous(), src=0, group=self._group)

    def prefill_row(self, row: int, ids: torch.Tensor):
        self._send(PREFILL, row, ids)
        return self._engine.prefill_row(row, ids)

    def release_row(self, row: int):
        self._send(RELEASE, row)
        return self._engine.release_row(row)

    def decode_rows(self, tok: torch.Tensor):
        self._send(DECODE, 0, tok)
        return self._engine.decode_rows(tok)

    def reset(self):
        self._send(RESET)
        return self._engine.reset()

    def stop(self) -> None:
        """The followers return from `follow` (a follower already gone is only logged)."""
        try:
            self._send(STOP)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("could not tell the other ranks to stop: %s", e)


@torch.no_grad()
def follow(engine, group) -> None:
    """A rank other than 0: run rank 0's engine calls until it stops. A call that fails here
    failed on rank 0 too (the same call on the same state), where the scheduler reports it.
    Ctrl-C (SIGINT to the whole process group) is left to rank 0: its server shuts down and
    then sends STOP."""
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
        try:
            if op == PREFILL:
                engine.prefill_row(row, ids)
            elif op == RELEASE:
                engine.release_row(row)
            elif op == DECODE:
                engine.decode_rows(ids)
            elif op == RESET:
                engine.reset()
        except Exception:
            log.exception("rank %d: engine call %d failed (as on rank 0)", dist.get_rank(), op)
