"""Speculative decoding over the engine core's rows: draft Kd tokens per row, verify every row in
one target step over Kd + 1 positions, keep what the acceptance rule keeps, roll the rest back.

    a round over rows r (each holds T_r tokens in its cache and one chosen token x_r not yet in it):
      drafter.propose      -> d_r [Kd] (up to Kd real ones per row; drafters.py)
      engine.extend_rows   [x_r, d_r] at positions T_r..T_r + Kd -> logits [n, Kd + 1, V]
      a constrained row    -> its drafts cut at the first one its grammar rejects, and its
                           logits at each verified position masked with the grammar state after
                           the drafts before it (Pick.constraint.draft_masks)
      acceptance rule      -> a_r kept drafts and the next token (acceptance.py) from the
                           (masked) logits: a_r + 1 tokens
      roll back            caches that grow with tokens: truncate_row(r, T_r + 1 + a_r);
                           constant state (recurrent, conv): restored from before the verify,
                           then [x_r, d_r[:a_r]] extended again (one call per distinct a_r)

The rows verify together whatever each one accepts; Kd is cut for the round so that no row
passes max_seq (Kd = 0 is a plain decode step through extend_rows). Greedy rounds emit exactly
the tokens plain greedy decoding does; sampled rounds keep the target's distribution (the
rejection rule); for a constrained row that is plain constrained decoding's: argmax of, or the
distribution renormalised over, what the grammar takes. The round leaves each grammar's state
as it found it: the caller accepts the tokens it emits. Used by Model.generate (zoo/runtime.py)
and the server's scheduler (zoo/serve/scheduler.py); `stats` counts drafted, grammar-cut and
accepted tokens for reports and /metrics.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..errors import InputError
from .acceptance import accept_greedy, accept_sampled
from .drafters import Drafter, NgramDrafter, Pick
from .mtp import MtpDrafter


@dataclasses.dataclass
class SpecStats:
    """Totals since the speculator was made: rounds (verify steps, one per row), drafted (real
    draft tokens proposed), cut (of those, rejected by a row's grammar before verification),
    accepted (of those, kept), emitted (tokens chosen)."""

    rounds: int = 0
    drafted: int = 0
    cut: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclasses.dataclass
class RowResult:
    """What one row got from a round: tokens (a + 1 chosen ones, the last not yet in the cache)
    and logits [a + 1, V], the target's logits each token was chosen from (before any grammar
    mask); error: the row's grammar reached a dead end (no tokens; the row must end)."""

    tokens: list[int]
    logits: torch.Tensor
    error: Optional[str] = None


class Speculator:
    """Speculative rounds over an engine's rows with one drafter and Kd draft tokens."""

    def __init__(self, engine, drafter: Drafter, draft_tokens: int):
        if draft_tokens < 1:
            raise InputError(f"runtime.speculative.draft_tokens={draft_tokens}: expected >= 1")
        if not engine.can_extend:
            raise InputError(f"speculative decoding verifies drafts by extending rows, which the {engine.runner} "
                             f"runner cannot; build with another runner (runtime.compile / runtime.aot)")
        self.engine, self.drafter, self.kd = engine, drafter, draft_tokens
        # constant-state fields (recurrent and conv states, sliding-window rings) cannot be
        # truncated: a rollback restores them and re-extends the kept tokens
        self.recurrent = bool(engine.constant_state_kinds())
        self.stats = SpecStats()

    def prefill_row(self, row: int, ids: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """Engine.prefill_row (ids [L] -> logits [V], or [L, V] with last_only=False) that also
        starts the drafter's row."""
        if not self.drafter.wants_hidden:
            logits = self.engine.prefill_row(row, ids, last_only=last_only)
            self.drafter.prefilled([row], ids[None], None)
            return logits
        logits, hidden = self.engine.prefill_row(row, ids, return_hidden=True, last_only=last_only)
        self.drafter.prefilled([row], ids[None], hidden[None])
        return logits

    def prefill_rows(self, start: int, ids: torch.Tensor) -> torch.Tensor:
        """Engine.prefill_rows (ids [n, L] into free rows start.. -> logits [n, V]) that also
        starts the drafter's rows."""
        rows = list(range(start, start + ids.shape[0]))
        if not self.drafter.wants_hidden:
            logits = self.engine.prefill_rows(start, ids)
            self.drafter.prefilled(rows, ids, None)
            return logits
        logits, hidden = self.engine.prefill_rows(start, ids, return_hidden=True)
        self.drafter.prefilled(rows, ids, hidden)
        return logits

    def started_row(self, row: int, ids: torch.Tensor) -> None:
        """A row started by other means (the server's prefix reuse) with ids [L]; drafters that
        need the prompt's hidden states start through prefill_row instead."""
        if self.drafter.wants_hidden:
            raise InputError(f"the {self.drafter.name} drafter starts from the prompt's hidden states: start "
                             f"row {row} with Speculator.prefill_row")
        self.drafter.prefilled([row], ids[None], None)

    def reset(self) -> None:
        """Engine.reset (every row free), and the drafter forgets every row."""
        self.engine.reset()
        self.drafter.reset()

    def release_row(self, row: int) -> None:
        """Engine.release_row, and the drafter forgets the row."""
        self.engine.release_row(row)
        self.drafter.release(row)

    def move_row(self, src: int, dst: int) -> None:
        """Engine.move_row (a compacting scheduler), and the drafter's state of the row moves too."""
        self.engine.move_row(src, dst)
        self.drafter.move(src, dst)

    def step(self, rows: list[int], histories: Sequence[torch.Tensor], picks: Sequence[Pick]) -> list[RowResult]:
        """One round over `rows` (in use): histories[i] every token of row i so far [T_i + 1],
        the last one chosen but not yet in the cache; picks[i] how the row chooses (drafters.Pick,
        with its grammar if constrained). -> per row the tokens it emits (see RowResult)."""
        e = self.engine
        starts = [e.row_len[r] for r in rows]
        for r, t, h in zip(rows, starts, histories):
            if t is None or h.shape[0] != t + 1:
                raise InputError(f"speculative step: row {r} holds {t} tokens; its history must hold those and "
                                 f"the next chosen one ({h.shape[0]} given)")
        room = e.max_seq - max(starts) - 1  # tokens beyond x that fit in the fullest row
        if room < 0:
            raise InputError(f"speculative step: a row holds max_seq={e.max_seq} tokens; release it")
        kd = min(self.kd, room)
        last = torch.stack([h[-1] for h in histories]).to(torch.long)
        if kd:
            draft = self.drafter.propose(rows, histories, kd, picks)
            ids = torch.cat((last[:, None], draft.tokens.to(last.device)), dim=1)
        else:
            draft, ids = None, last[:, None]
        # per row, so that rows which kept every draft are left as the verify made them
        state = [e.save_state([r]) for r in rows] if self.recurrent and kd else None
        logits, hidden = self._extend(rows, ids)
        counts = list(draft.counts) if draft is not None else [0] * len(rows)
        # grammar masks on the host, before anything reads the logits (an accelerator may still
        # be running the verify)
        masked, errors = self._constrain(logits, ids, counts, picks)
        kept, nxt = self._accept(logits, masked, ids, counts, None if draft is None else draft.q, picks)
        self._roll_back(rows, starts, ids, kept, state)
        self.drafter.verified(rows, starts, ids, kept, hidden)
        out = []
        for i, a in enumerate(kept):
            if i in errors:
                out.append(RowResult([], logits[i, :0], errors[i]))
                continue
            out.append(RowResult(ids[i, 1:a + 1].tolist() + [nxt[i]], logits[i, :a + 1]))
        self.stats.rounds += len(rows)
        self.stats.drafted += sum(draft.counts) if draft is not None else 0
        self.stats.cut += sum(draft.counts) - sum(counts) if draft is not None else 0
        self.stats.accepted += sum(kept)
        self.stats.emitted += sum(a + 1 for a in kept)
        return out

    def _extend(self, rows: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The verify step -> logits [n, Kd + 1, V] and, for a drafter that wants them, the target's
        final hidden states [n, Kd + 1, D]."""
        if self.drafter.wants_hidden:
            return self.engine.extend_rows(rows, ids, return_hidden=True)
        return self.engine.extend_rows(rows, ids), None

    @staticmethod
    def _constrain(logits: torch.Tensor, ids: torch.Tensor, counts: list[int], picks
                   ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Constrained rows (Pick.constraint): counts[i] cut to the drafts the grammar takes ->
        masked {i: row i's logits [Kd + 1, V] with its first counts[i] + 1 positions masked (what
        the grammar rejects there at -inf)}, errors {i: message} for rows at a dead end (counts 0)."""
        masked, errors = {}, {}
        for i, p in enumerate(picks):
            if p.constraint is None:
                continue
            try:
                allowed = p.constraint.draft_masks(ids[i, 1:1 + counts[i]].tolist())
            except ValueError as err:
                errors[i], counts[i] = str(err), 0
                continue
            counts[i] = allowed.shape[0] - 1
            full = torch.ones(logits.shape[1:], dtype=torch.bool)
            full[:allowed.shape[0]] = allowed
            masked[i] = logits[i].masked_fill(~full.to(logits.device), float("-inf"))
        return masked, errors

    def _accept(self, logits: torch.Tensor, masked: dict[int, torch.Tensor], ids: torch.Tensor, counts: list[int],
                q, picks) -> tuple[list[int], list[int]]:
        """logits [n, Kd + 1, V], masked {i: [Kd + 1, V]} what constrained rows choose from in
        their place, counts [n] real drafts, q the drafter's probabilities [n, Kd, V] or None ->
        kept drafts and the next token per row."""
        n, counts = len(counts), torch.tensor(counts, device=logits.device)
        greedy = [i for i, p in enumerate(picks) if p.probs is None]
        kept, nxt = [0] * n, [0] * n
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            target = logits[g].argmax(dim=-1)
            for j, i in enumerate(greedy):
                if i in masked:
                    target[j] = masked[i].argmax(dim=-1)
            a = accept_greedy(target, ids[g, 1:].to(logits.device), counts[g])
            next_tok = target.gather(1, a[:, None])[:, 0]
            for j, i in enumerate(greedy):
                kept[i], nxt[i] = int(a[j]), int(next_tok[j])
        for i, p in enumerate(picks):
            if p.probs is None:
                continue
            kept[i], nxt[i] = accept_sampled(p.probs(masked.get(i, logits[i])), ids[i, 1:], int(counts[i]),
                                            None if q is None else q[i], p.generator)
        return kept, nxt

    def _roll_back(self, rows: list[int], starts: list[int], ids: torch.Tensor, kept: list[int], state) -> None:
        e, kd = self.engine, ids.shape[1] - 1
        short = [i for i, a in enumerate(kept) if a < kd]
        if not short:
            return
        if not self.recurrent:
            for i in short:
                e.truncate_row(rows[i], starts[i] + 1 + kept[i])
            return
        # constant state: back to before the verify (lengths too), then the kept tokens again
        for i in short:
            e.restore_state([rows[i]], state[i])
        by_len: dict[int, list[int]] = {}
        for i in short:
            by_len.setdefault(kept[i] + 1, []).append(i)
        for length, group in sorted(by_len.items()):
            e.extend_rows([rows[i] for i in group], ids[group, :length], last_only=True)


def make_speculator(engine, drafter: str, draft_tokens: int, ngram_max: int = 3, ngram_min: int = 1) -> Speculator:
    """A Speculator with the named drafter (runtime.speculative: ngram | mtp) over `engine`."""
    if drafter == "ngram":
        return Speculator(engine, NgramDrafter(ngram_max, ngram_min), draft_tokens)
    if drafter == "mtp":
        return Speculator(engine, MtpDrafter(engine), draft_tokens)
    raise InputError(f"runtime.speculative.drafter: expected ngram or mtp, got {drafter!r}")
