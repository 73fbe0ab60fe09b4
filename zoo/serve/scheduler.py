"""Continuous batching: one thread owns the model and steps the rows in use.

Between decode steps the scheduler admits waiting sequences into free rows (Engine.prefill_row
prefills one row without touching the others), then runs one decode step over its n decoding
rows (Engine.decode_active: the smallest decode bucket holding them, one static step each) and
hands each running sequence its next token. A sequence that ends (an end token, a stop string,
max_tokens, a full row) or is cancelled (its client went away) frees its row at once.

Rows stay compact so that a bucket is a prefix of the rows: the decoding sequences hold rows
0..n-1. A new one takes row n (the lowest free); when one ends, the highest moves into its hole
(Engine.move_row, one copy of that row's caches) and the row -> sequence table follows.

Chunked prefill (runtime.step_tokens: a per-step token budget, null: off): a step spends at most
step_tokens tokens, one per decoding row and the rest on prompts. A prompt that does not fit in
what is left is prefilled in chunks, one per step, into a row above the decode bucket (row
bucket(n), where decode steps never reach): the first chunk by prefill_row, the others by
Engine.extend_rows, so the running rows get a token every step while it is admitted, and its
logits equal a whole prefill's. When its last chunk is in, it moves down to row n and decodes
with the others. One prompt is chunked at a time, and nothing is admitted behind it meanwhile
(first come, first served; the decode bucket cannot grow into its row). A prompt is prefilled
whole when no row above the bucket is left (n past the second-largest bucket), or when nothing
decodes (there is nothing to keep streaming). Cancelling it mid-prompt frees its row at once.

Admission starts a row through the prefix cache (compiler/engine/prefix.py) when the engine can
extend rows: the longest cached prefix the prompt shares with earlier prompts and conversations
is copied into the row and only the rest is prefilled; each prompt, and each conversation when
its row is released, is kept in the cache (host memory, bounded by `prefix_cache_bytes`, least
recently used evicted). Its sizes and hits are in /metrics (zoo_prefix_cache_*).

Prompt log-probabilities (SamplingParams.prompt_logprobs: /v1/completions' echo, what
lm-evaluation-harness scores with): such a row is prefilled with every position's logits
(Engine.prefill_row / extend_rows with last_only=False, in pieces of at most step_tokens or
ECHO_POSITIONS positions, so its logits stay bounded); the other rows stay on the last-position
path. It reads nothing from the prefix cache, since a reused prefix has
no logits: its prompt is recomputed (and stored for the requests after). max_tokens 0 ends it
once its prompt is in, with no token sampled.

Each sequence samples with its own settings and its own seeded torch.Generator, so the same seed
and request give the same text whatever else runs beside it. A sequence with a grammar
(SamplingParams.grammar, zoo.constrain) has its logits masked to what the grammar takes before it
samples, beside unconstrained rows in the same step, and ends when the grammar is complete.

Speculative decoding (runtime.speculative, or the `speculative` argument) replaces the decode
step: every row drafts and verifies in one engine call (compiler/engine/speculative.py) and may
get several tokens per step. A constrained row's drafts are cut at the first token its grammar
rejects and its verified positions masked by the grammar (Constraint.draft_masks); its grammar
then follows the tokens it emits, as after a decode step. A sequence that ends inside a step drops
the tokens after its end, and frees its row and its drafter state at once, as a cancelled one does.
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
from ..sampling import probabilities, sample, token_logprobs
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
    prompt_logprobs: Optional[int] = None  # None: off; k >= 0: each prompt token's logprob and the top k
    ignore_eos: bool = False
    grammar: Optional[Grammar] = None  # constrained decoding (zoo.constrain): each choice gets its own state
    keep_special: bool = False  # text with special tokens (tool-call and channel markers are some)


@dataclass
class Event:
    """What a sequence reports to its consumer, from the scheduler thread.

    kind "prompt" (only with SamplingParams.prompt_logprobs, once, before any token): `prompt`,
    per prompt token (the token's log-probability, [(token, logprob)] of the top k), None for
    the first (nothing precedes it). kind "token": one generated token (text: what can be shown
    now; may be "" while a possible stop string is held back). kind "done": the end, with
    finish_reason "stop" | "length" | "cancelled" | "error" and any text released at the end.
    """

    kind: str
    text: str = ""
    token: Optional[int] = None
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    prompt: Optional[list[Optional[tuple[float, list[tuple[int, float]]]]]] = None
    code: Optional[str] = None  # with "error": "invalid_grammar" when the request's own grammar failed


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
    prompt_lps: list = field(default_factory=list)  # the prompt's log-probabilities so far (scheduler thread)

    def __post_init__(self):
        self.text = StopText(self.tokenizer, self.params.stop, keep_special=self.params.keep_special)
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()
        self.constraint = self.params.grammar.constraint() if self.params.grammar is not None else None


PREFIX_CACHE_BYTES = 1 << 30  # host memory for cached prompts (compiler/engine/prefix.py)
ECHO_POSITIONS = 512  # positions of a prompt whose logits one call computes for its log-probabilities


class QueueFull(Exception):
    """The waiting queue holds max_queue sequences: come back later."""


@dataclass
class Chunking:
    """The prompt being prefilled in chunks: its sequence, its row (above the decode bucket) and
    how many of its tokens are in."""

    seq: Sequence
    row: int
    done: int


class Scheduler:
    """Owns model.engine's rows. `start()` runs `step()` on a dedicated thread; tests may call
    `step()` themselves instead (then no thread is started). step_tokens: the per-step token
    budget of chunked prefill (None: the model's runtime.step_tokens; 0: off)."""

    def __init__(self, model, *, max_queue: int = 64, metrics=None, eos_ids=None, step_tokens: Optional[int] = None,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES, speculative=None, draft_tokens=None):
        self.engine = model.engine
        if step_tokens is None:
            step_tokens = getattr(getattr(model, "spec", None), "runtime", None)
            step_tokens = getattr(step_tokens, "step_tokens", None) or 0
        if step_tokens and step_tokens < self.engine.max_batch:
            raise ValueError(f"step_tokens={step_tokens}: a step may hold max_batch - 1 = {self.engine.max_batch - 1} "
                             f"decode rows besides a prompt's chunk; expected step_tokens >= max_batch="
                             f"{self.engine.max_batch} (or 0 / null: no chunked prefill)")
        self.step_tokens = step_tokens
        self._chunk: Optional[Chunking] = None
        # speculative / draft_tokens: None follows runtime.speculative ("off": plain decoding)
        self.spec = model.speculator(speculative, draft_tokens)
        if self.spec is not None and not self.engine.can_extend:
            raise ConfigError(f"runtime.speculative.drafter={self.spec.drafter.name}: speculative serving extends "
                              f"rows, which this engine's {self.engine.runner} runner cannot; "
                              f"serve with runtime.speculative.drafter=null")
        if self.spec is not None and self.spec.drafter.wants_hidden and self.step_tokens:
            raise ConfigError(f"runtime.speculative.drafter={self.spec.drafter.name} with runtime.step_tokens="
                              f"{self.step_tokens}: the drafter starts from a whole prompt's hidden states, which a "
                              f"prompt prefilled in chunks does not keep yet; serve with one of them")
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
        # None: no reuse (0 bytes asked for, or an engine that cannot extend rows: torchrun's leader)
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
        return len(self._rows) + (self._chunk is not None)

    def warmup(self) -> None:
        """Compile the row prefill graphs (a 2-token and a 1-token prompt) before serving, and
        with chunked prefill or the prefix cache the extend graph (a runner that cannot extend
        fails here, at start, under chunked prefill)."""
        e = self.engine
        for n in (min(2, e.max_seq), 1):
            e.prefill_row(0, torch.zeros(n, dtype=torch.long))
            if (self.step_tokens or self.prefix is not None) and n == 2 and e.max_seq >= 5:
                for k in (2, 1):  # two lengths: the extend graph is dynamic in L from the second
                    e.extend_rows([0], torch.zeros(1, k, dtype=torch.long), last_only=True)
            e.release_row(0)

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
                while not self._stopping and not self._waiting and not self._rows and self._chunk is None:
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # a bug must not take the server down: fail what was running
                log.exception("scheduler step failed")
                for row in list(self._rows):
                    self._finish(row, "error", error=f"{type(e).__name__}: {e}")
                if self._chunk is not None:
                    self._drop_chunk("error", error=f"{type(e).__name__}: {e}")
        for row in list(self._rows):
            self._finish(row, "cancelled")
        if self._chunk is not None:
            self._drop_chunk("cancelled")
        with self._cv:
            while self._waiting:
                self._waiting.popleft().sink(Event("done", finish_reason="cancelled"))

    @torch.no_grad()
    def step(self) -> bool:
        """Prompt work (a chunk of the prompt being chunked, or admissions of waiting sequences),
        then one decode step of the decoding rows. False when idle."""
        e = self.engine
        for row, s in list(self._rows.items()):  # rows of cancelled sequences first: admissions reuse them
            if s.cancelled:
                self._finish(row, "cancelled")
        if self._chunk is not None and self._chunk.seq.cancelled:
            self._drop_chunk("cancelled")
        self._compact()
        # the budget left for prompts: one token per decoding row is spent below (None: no limit)
        left = self.step_tokens - len(self._rows) if self.step_tokens else None
        worked = False
        if self._chunk is not None:
            worked = self._next_chunk(left)
        else:
            worked = self._admit(left)
        self._compact()
        n = len(self._rows)
        if not n:
            self._gauges()
            return worked
        if self.spec is not None:  # a speculative step in place of the decode step
            self._speculate()
            self._gauges()
            return True
        logits = e.decode_active(self._tok[:n])
        for row in range(n):
            self._advance(row, logits[row])
        self._gauges()
        return True

    def _admit(self, left: Optional[int]) -> bool:
        """Admit waiting sequences first come, first served, into the lowest free rows: whole
        while their prompts fit in `left` tokens (None: always), then the next one's first chunk
        (module docstring). True when any was taken off the queue."""
        e = self.engine
        admitted = []
        chunk = None
        with self._cv:
            kept = collections.deque(s for s in self._waiting if not s.cancelled)
            for s in self._waiting:
                if s.cancelled:
                    s.sink(Event("done", finish_reason="cancelled"))
            self._waiting = kept
            free = e.free_rows()
            while self._waiting and free:
                s = self._waiting[0]
                if left is not None and len(s.prompt) > left:
                    n = len(self._rows) + len(admitted)
                    row = e.bucket(n) if n else None  # the lowest row no decode step of n rows reaches
                    if row is not None and row < e.max_batch and left > 0:
                        self._waiting.popleft()
                        chunk = Chunking(s, row, 0)
                        s.row = row
                        break
                    if admitted:
                        break  # its turn comes next step, with the whole budget
                    # no row above the bucket, or nothing decoding: the whole prompt now
                self._waiting.popleft()
                s.row = free.pop(0)
                admitted.append(s)
                if left is not None:
                    left -= len(s.prompt)
            self._gauges()
        for s in admitted:
            try:
                logits = self._start(s)
            except Exception as err:
                e.release_row(s.row) if e.row_len[s.row] is not None else None
                s.sink(Event("done", finish_reason="error", error=str(err)))
                continue
            self._rows[s.row] = s
            self._begin(s.row, logits)
        if chunk is not None:
            self._chunk = chunk
            self._next_chunk(left)
        return bool(admitted) or chunk is not None

    def _next_chunk(self, left: int) -> bool:
        """Prefill the next `left` tokens (at least one) of the prompt being chunked; after its
        last one it joins the decoding rows (row n)."""
        e, c = self.engine, self._chunk
        s = c.seq
        echo = s.params.prompt_logprobs is not None  # every chunk's logits, and no reused prefix (_start_echo)
        try:
            if c.done == 0 and self.prefix is not None and not echo:  # the longest stored prefix, copied in
                before = self._prefix_counts()
                c.done = self.prefix.begin(c.row, torch.tensor(s.prompt, dtype=torch.long))
                if self.metrics is not None:
                    self.metrics.prefix_cache(self.prefix, before)
            k = min(max(left, 1), len(s.prompt) - c.done)
            ids = torch.tensor(s.prompt[c.done:c.done + k], dtype=torch.long)
            if c.done == 0:
                logits = e.prefill_row(c.row, ids, last_only=not echo)
            else:
                logits = e.extend_rows([c.row], ids[None], last_only=not echo)[0]
        except Exception as err:
            self._drop_chunk("error", error=str(err))
            return True
        if echo:
            logits = self._prompt_logprobs(s, c.done, logits)
        c.done += k
        if c.done < len(s.prompt):
            return True
        if self.prefix is not None:
            self.prefix.store(c.row, s.prompt, logits)
        self._chunk = None
        row = len(self._rows)  # compact: the decoding rows are 0..row-1
        if row != c.row:
            self.spec.move_row(c.row, row) if self.spec is not None else e.move_row(c.row, row)
        if self.spec is not None:  # (a drafter that needs hidden states is refused with chunking)
            self.spec.started_row(row, torch.tensor(s.prompt, dtype=torch.long))
        s.row = row
        self._rows[row] = s
        self._begin(row, logits)
        return True

    def _drop_chunk(self, reason: str, error: Optional[str] = None) -> None:
        """End the prompt being chunked (cancelled, or its chunk failed): its row is freed."""
        c, self._chunk = self._chunk, None
        if self.engine.row_len[c.row] is not None:
            self.engine.release_row(c.row)
        c.seq.finish_reason = reason
        if self.metrics is not None:
            self.metrics.finished(reason)
        c.seq.sink(Event("done", finish_reason=reason, error=error))

    def _compact(self) -> None:
        """Move the highest decoding rows into the holes below them, until they hold 0..n-1."""
        n = len(self._rows)
        holes = [r for r in range(n) if r not in self._rows]
        high = sorted((r for r in self._rows if r >= n), reverse=True)
        for dst, src in zip(holes, high):
            if self.spec is not None:
                self.spec.move_row(src, dst)  # the drafter's state of the row moves with it
            else:
                self.engine.move_row(src, dst)
            s = self._rows.pop(src)
            s.row = dst
            self._rows[dst] = s
            self._tok[dst] = self._tok[src]

    def _speculate(self) -> None:
        """One speculative step (see the module docstring) in place of the decode step."""
        rows = list(self._rows)
        before = dataclasses.replace(self.spec.stats)
        seqs = [self._rows[r] for r in rows]
        picks = [Pick(None if s.params.temperature == 0 else self._probs(s.params), s.generator, s.constraint)
                 for s in seqs]
        results = self.spec.step(rows, [torch.tensor(s.prompt + s.tokens, dtype=torch.long) for s in seqs], picks)
        if self.metrics is not None:
            self.metrics.speculative(before, self.spec.stats)
        for r, res in zip(rows, results):
            if res.error is not None:  # the grammar reached a dead end: only this row fails
                self._finish(r, "error", error=res.error, code="invalid_grammar")
                continue
            for tok, logits in zip(res.tokens, res.logits):
                if not self._emit(r, tok, logits):
                    break  # the sequence ended: the rest of its tokens are dropped

    @staticmethod
    def _probs(p: SamplingParams):
        return lambda logits: probabilities(logits, p.temperature, p.top_k, p.top_p)

    def _start(self, s: Sequence) -> torch.Tensor:
        """Prefill a sequence's row (through the prefix cache, when there is one) -> logits [V]."""
        ids = torch.tensor(s.prompt, dtype=torch.long)
        if s.params.prompt_logprobs is not None:
            return self._start_echo(s, ids)
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

    def _start_echo(self, s: Sequence, ids: torch.Tensor) -> torch.Tensor:
        """A sequence that wants its prompt's log-probabilities: prefilled with every position's
        logits, in pieces of step_tokens (else ECHO_POSITIONS) positions where the engine can
        extend rows, so the logits held at once stay [piece, V] whatever the prompt's length.
        A reused prefix would have none, so the prefix cache is not read (the prompt is
        recomputed); the prompt is stored in it for the requests after."""
        e = self.engine
        if self.spec is not None and self.spec.drafter.wants_hidden:  # it starts from the whole prompt's states
            last = self._prompt_logprobs(s, 0, self.spec.prefill_row(s.row, ids, last_only=False))
        else:
            piece = (self.step_tokens or ECHO_POSITIONS) if e.can_extend else len(ids)
            for at in range(0, len(ids), piece):
                part = ids[at:at + piece]
                logits = e.prefill_row(s.row, part, last_only=False) if at == 0 else \
                    e.extend_rows([s.row], part[None])[0]
                last = self._prompt_logprobs(s, at, logits)
            if self.spec is not None:
                self.spec.started_row(s.row, ids)
        if self.prefix is not None:
            self.prefix.store(s.row, ids, last)
        return last

    def _prompt_logprobs(self, s: Sequence, start: int, logits: torch.Tensor) -> torch.Tensor:
        """logits [l, V] of prompt positions start..start+l-1 -> the log-probabilities of the
        tokens after them, kept on s; sent (a "prompt" event) once the whole prompt is in.
        Returns the last position's logits [V]."""
        if start == 0:
            s.prompt_lps = [None]  # the first token: nothing precedes it
        after = torch.tensor(s.prompt[start + 1:start + 1 + logits.shape[0]], dtype=torch.long)
        if len(after):
            s.prompt_lps += token_logprobs(logits[:len(after)], after, s.params.prompt_logprobs)
        if len(s.prompt_lps) == len(s.prompt):
            s.sink(Event("prompt", prompt=s.prompt_lps))
        return logits[-1]

    def _begin(self, row: int, logits: torch.Tensor) -> None:
        """A sequence whose prompt is in (logits [V] of its last token): its first token, or its
        end when it asked for none (max_tokens 0: the prompt's log-probabilities only)."""
        if self._rows[row].params.max_tokens == 0:
            self._finish(row, "length")
        else:
            self._advance(row, logits)

    def _prefix_counts(self) -> dict:
        p = self.prefix
        return {"lookups": p.lookups, "hits": p.hits, "tokens_reused": p.tokens_reused, "evictions": p.evictions}

    def _advance(self, row: int, logits: torch.Tensor) -> None:
        """logits [V] of a running sequence -> its next token, events, maybe its end."""
        s, p = self._rows[row], self._rows[row].params
        c = s.constraint
        try:
            allowed = logits if c is None else c.apply(logits)
        except ValueError as err:  # the grammar reached a dead end or a limit: only this row fails
            self._finish(row, "error", error=str(err), code="invalid_grammar")
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
            (lp, top), = token_logprobs(logits[None], torch.tensor([tok]), p.logprobs)
            top = top if p.logprobs > 0 else None
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
            self._finish(row, "error", error=f"the grammar rejected token {tok}: {c.error}", code="invalid_grammar")
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

    def _finish(self, row: int, reason: str, error: Optional[str] = None, code: Optional[str] = None) -> None:
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
        s.sink(Event("done", text=rest, finish_reason=reason, error=error, code=code))

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
