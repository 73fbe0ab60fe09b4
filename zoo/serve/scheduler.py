"""Continuous batching: one thread owns the model and steps every row of the static batch.

Between decode steps the scheduler admits waiting sequences into free rows (Engine.prefill_row
prefills one row without touching the others), then runs one decode step over all max_batch rows
(Engine.decode_rows: one static graph; free rows compute garbage nobody reads) and hands each
running sequence its next token. A sequence that ends (an end token, a stop string, max_tokens, a
full row) or is cancelled (its client went away) frees its row at once.

Admission starts a row through the prefix cache (compiler/engine/prefix.py) when the engine can
extend rows: the longest cached prefix the prompt shares with earlier prompts and conversations
is copied into the row and only the rest is prefilled; each prompt, and each conversation when
its row is released, is kept in the cache (host memory, bounded by `prefix_cache_bytes`, least
recently used evicted). Its sizes and hits are in /metrics (zoo_prefix_cache_*).

Each sequence samples with its own settings and its own seeded torch.Generator, so the same seed
and request give the same text whatever else runs beside it. A sequence with a grammar
(SamplingParams.grammar, zoo.constrain) has its logits masked to what the grammar takes before it
samples, beside unconstrained rows in the same step, and ends when the grammar is complete.

Speculative decoding (runtime.speculative, or the `speculative` argument) replaces the decode
step: every unconstrained row drafts and verifies in one engine call (compiler/engine/
speculative.py) and may get several tokens per step; constrained rows take one token per step
beside them (Engine.extend_rows). A sequence that ends inside a step drops the tokens after its
end, and frees its row and its drafter state at once, as a cancelled one does.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..compiler.engine.drafters import Pick
from ..compiler.engine.prefix import PrefixCache
from ..compiler.errors import ConfigError
from ..constrain import Grammar
from ..sampling import probabilities, sample
from .text import StopText

log = logging.getLogger("zoo.serve")


@dataclass(frozen=True)
class SamplingParams:
    """What one choice is generated with (validated by the API layer)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None  # None: off; k >= 0: the chosen token's logprob and the top k
    ignore_eos: bool = False
    grammar: Optional[Grammar] = None  # constrained decoding (zoo.constrain): each choice gets its own state


@dataclass
class Event:
    """What a sequence reports to its consumer, from the scheduler thread.

    kind "token": one generated token (text: what can be shown now; may be "" while a possible
    stop string is held back). kind "done": the end, with finish_reason "stop" | "length" |
    "cancelled" | "error" and any text released at the end.
    """

    kind: str
    text: str = ""
    token: Optional[int] = None
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Sequence:
    """One choice of one request: prompt ids, sampling settings, where its events go."""

    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    tokenizer: object = None
    tokens: list[int] = field(default_factory=list)
    row: Optional[int] = None
    cancelled: bool = False
    finish_reason: Optional[str] = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    last_token: Optional[float] = None

    def __post_init__(self):
        self.text = StopText(self.tokenizer, self.params.stop)
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()
        self.constraint = self.params.grammar.constraint() if self.params.grammar is not None else None


PREFIX_CACHE_BYTES = 1 << 30  # host memory for cached prompts (compiler/engine/prefix.py)


class QueueFull(Exception):
    """The waiting queue holds max_queue sequences: come back later."""


class Scheduler:
    """Owns model.engine's rows. `start()` runs `step()` on a dedicated thread; tests may call
    `step()` themselves instead (then no thread is started)."""

    def __init__(self, model, *, max_queue: int = 64, metrics=None, eos_ids=None,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES, speculative=None, draft_tokens=None):
        self.engine = model.engine
        # speculative / draft_tokens: None follows runtime.speculative ("off": plain decoding)
        self.spec = model.speculator(speculative, draft_tokens)
        if self.spec is not None and not self.engine.can_extend:
            # under torchrun rank 0's LeaderEngine sends only prefill_row / release_row /
            # decode_rows / reset to the other ranks; the packages of runtime.aot cannot extend
            raise ConfigError(f"runtime.speculative.drafter={self.spec.drafter.name}: speculative serving extends "
                              f"rows, which this engine cannot ({type(self.engine).__name__}: under torchrun the "
                              f"other ranks do not follow extend_rows yet; runtime.aot packages do not extend); "
                              f"serve with runtime.speculative.drafter=null")
        tok = model.tokenizer  # a zoo Model (runtime.Model): None when the checkpoint has none
        self.eos = set(model.eos_ids if eos_ids is None else eos_ids) | (set(tok.eos_ids) if tok else set())
        self.max_queue = max_queue
        self.metrics = metrics
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._rows: dict[int, Sequence] = {}
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._tok = torch.zeros(self.engine.max_batch, dtype=torch.long)
        self.engine.reset() if self.spec is None else self.spec.reset()
        # None: no reuse (0 bytes asked for, or a runner that cannot extend rows: runtime.aot)
        self.prefix = PrefixCache(self.engine, prefix_cache_bytes) \
            if prefix_cache_bytes > 0 and self.engine.can_extend else None

    # ------------------------------------------------------------------ from any thread

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the choices of one request together (all or none)."""
        with self._cv:
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} sequences are waiting (max_queue={self.max_queue})")
            self._waiting.extend(seqs)
            self._gauges()
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: the sequence ends (and frees its row) at the next step."""
        with self._cv:
            seq.cancelled = True
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows)

    def warmup(self) -> None:
        """Compile the row prefill graphs (a 2-token and a 1-token prompt) before serving."""
        for n in (min(2, self.engine.max_seq), 1):
            self.engine.prefill_row(0, torch.zeros(n, dtype=torch.long))
            if self.prefix is not None and self.engine.max_seq >= 4:  # the extend graphs: 2 tokens and 1
                self.engine.extend_rows([0], torch.zeros(1, n, dtype=torch.long))
            self.engine.release_row(0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zoo-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the model thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._rows:
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # a bug must not take the server down: fail what was running
                log.exception("scheduler step failed")
                for row in list(self._rows):
                    self._finish(row, "error", error=f"{type(e).__name__}: {e}")
        for row in list(self._rows):
            self._finish(row, "cancelled")
        with self._cv:
            while self._waiting:
                self._waiting.popleft().sink(Event("done", finish_reason="cancelled"))

    @torch.no_grad()
    def step(self) -> bool:
        """Admit waiting sequences into free rows, then one decode step. False when idle."""
        e = self.engine
        for row, s in list(self._rows.items()):  # rows of cancelled sequences first: admissions reuse them
            if s.cancelled:
                self._finish(row, "cancelled")
        admitted = []
        with self._cv:
            kept = collections.deque(s for s in self._waiting if not s.cancelled)
            for s in self._waiting:
                if s.cancelled:
                    s.sink(Event("done", finish_reason="cancelled"))
            self._waiting = kept
            free = e.free_rows()
            while self._waiting and free:
                s = self._waiting.popleft()
                s.row = free.pop(0)
                admitted.append(s)
            self._gauges()
        for s in admitted:
            try:
                logits = self._start(s)
            except Exception as err:
                e.release_row(s.row) if e.row_len[s.row] is not None else None
                s.sink(Event("done", finish_reason="error", error=str(err)))
                continue
            self._rows[s.row] = s
            self._advance(s.row, logits)
        if not self._rows:
            self._gauges()
            return bool(admitted)
        if self.spec is not None:
            self._speculate()
            self._gauges()
            return True
        logits = e.decode_rows(self._tok)
        for row in list(self._rows):
            self._advance(row, logits[row])
        self._gauges()
        return True

    def _speculate(self) -> None:
        """One speculative step (see the module docstring) in place of the decode step."""
        rows = [r for r, s in self._rows.items() if s.constraint is None]
        plain = [r for r, s in self._rows.items() if s.constraint is not None]
        if rows:
            before = dataclasses.replace(self.spec.stats)
            seqs = [self._rows[r] for r in rows]
            picks = [Pick(None if s.params.temperature == 0 else self._probs(s.params), s.generator) for s in seqs]
            results = self.spec.step(rows, [torch.tensor(s.prompt + s.tokens, dtype=torch.long) for s in seqs], picks)
            if self.metrics is not None:
                self.metrics.speculative(before, self.spec.stats)
            for r, res in zip(rows, results):
                for tok, logits in zip(res.tokens, res.logits):
                    if not self._emit(r, tok, logits):
                        break  # the sequence ended: the rest of its tokens are dropped
        if plain:
            logits = self.engine.extend_rows(plain, self._tok[plain][:, None], last_only=True)
            for r, lg in zip(plain, logits):
                self._advance(r, lg)

    @staticmethod
    def _probs(p: SamplingParams):
        return lambda logits: probabilities(logits, p.temperature, p.top_k, p.top_p)

    def _start(self, s: Sequence) -> torch.Tensor:
        """Prefill a sequence's row (through the prefix cache, when there is one) -> logits [V]."""
        ids = torch.tensor(s.prompt, dtype=torch.long)
        if self.spec is not None and (self.prefix is None or self.spec.drafter.wants_hidden):
            # the MTP drafter starts from the prompt's hidden states, which a reused prefix lacks
            return self.spec.prefill_row(s.row, ids)
        if self.prefix is None:
            return self.engine.prefill_row(s.row, ids)
        before = self._prefix_counts()
        logits = self.prefix.start(s.row, ids)
        if self.spec is not None:
            self.spec.started_row(s.row, ids)
        if self.metrics is not None:
            self.metrics.prefix_cache(self.prefix, before)
        return logits

    def _prefix_counts(self) -> dict:
        p = self.prefix
        return {"lookups": p.lookups, "hits": p.hits, "tokens_reused": p.tokens_reused, "evictions": p.evictions}

    def _advance(self, row: int, logits: torch.Tensor) -> None:
        """logits [V] of a running sequence -> its next token, events, maybe its end."""
        s, p = self._rows[row], self._rows[row].params
        c = s.constraint
        try:
            allowed = logits if c is None else c.apply(logits)
        except ValueError as err:  # the grammar reached a dead end: only this row fails
            self._finish(row, "error", error=str(err))
            return
        tok = int(sample(allowed[None], p.temperature, p.top_k, p.top_p, s.generator)[0])
        self._emit(row, tok, logits)

    def _emit(self, row: int, tok: int, logits: torch.Tensor) -> bool:
        """The running sequence's next token tok, chosen from logits [V] -> events, maybe its
        end; whether it still runs."""
        s, p = self._rows[row], self._rows[row].params
        c = s.constraint
        lp = top = None
        if p.logprobs is not None:
            logp = logits.float().log_softmax(-1)
            lp = float(logp[tok])
            if p.logprobs > 0:
                v, i = logp.topk(min(p.logprobs, logp.shape[-1]))
                top = list(zip(i.tolist(), v.tolist()))
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.token(now - (s.last_token or s.submitted), first=s.first_token is None)
        s.first_token = s.first_token or now
        s.last_token = now
        s.tokens.append(tok)
        self._tok[row] = tok
        # under a grammar an end token is only sampled where the grammar may end: it always ends
        end = tok in self.eos and (not p.ignore_eos or c is not None)
        if c is not None and not end and not c.accept(tok):
            self._finish(row, "error", error=f"the grammar rejected token {tok}: {c.error}")
            return False
        text, stopped = ("", False) if end else s.text.feed(tok)
        s.sink(Event("token", text=text, token=tok, logprob=lp, top=top))
        # under speculation tokens may run ahead of the cache: the row holds the prompt and
        # every token but this one once it is fed back
        held = len(s.prompt) + len(s.tokens) - 1
        if end or stopped or (c is not None and c.done):
            self._finish(row, "stop")
        elif len(s.tokens) >= p.max_tokens or held >= self.engine.max_seq:
            self._finish(row, "length")
        else:
            return True
        return False

    def _finish(self, row: int, reason: str, error: Optional[str] = None) -> None:
        s = self._rows.pop(row)
        if self.prefix is not None and reason in ("stop", "length") and self._held_matches(row, s):
            held = self.engine.row_len[row]  # the conversation, for its next turn
            before = self._prefix_counts()
            self.prefix.store(row, (s.prompt + s.tokens)[:held])
            if self.metrics is not None:
                self.metrics.prefix_cache(self.prefix, before)
        if self.spec is not None:
            self.spec.release_row(row)  # the drafter's state of the row too
        else:
            self.engine.release_row(row)
        s.finish_reason = reason
        rest = s.text.finish() if reason in ("stop", "length") else ""
        if self.metrics is not None:
            self.metrics.finished(reason)
        s.sink(Event("done", text=rest, finish_reason=reason, error=error))

    def _held_matches(self, row: int, s: Sequence) -> bool:
        """Whether the row holds only the sequence's tokens: a speculative step that ran past the
        sequence's end kept drafts it dropped; rolled back where the caches allow (else the row
        is not stored)."""
        n = len(s.prompt) + len(s.tokens)
        if self.engine.row_len[row] <= n:
            return True
        if self.engine.constant_state_kinds():
            return False
        self.engine.truncate_row(row, n)
        return True

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.gauges(len(self._waiting), len(self._rows), self.engine.max_batch)
