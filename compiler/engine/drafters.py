"""Drafters: what proposes the tokens a speculative step verifies (speculative.py).

    ngram   prompt lookup: the latest earlier occurrence of the history's last n tokens
            (n = ngram_max down to ngram_min) and the tokens that followed it. Any family, no
            weights; deterministic (the rejection rule's q is one-hot).
    mtp     the model's own multi-token-prediction layer (compiler/mtp.py; DeepSeek-V3, GLM-4.5/5,
            Qwen3-Next ship one): see mtp_drafter.py.

A drafter sees each row's history (prompt and every chosen token, the last one not yet in the
target's cache) and proposes up to Kd tokens per row; it may keep per-row state of its own, which
the speculative step tells it about (`verified`, `release`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Optional, Sequence

import torch

from ..errors import InputError


@dataclasses.dataclass
class Pick:
    """How one row chooses its tokens: probs (logits [m, V] -> probabilities [m, V] after the
    row's temperature / top-k / top-p; None: greedy), the row's own random generator, and its
    output constraint (None: free): an object with draft_masks(draft: list[int]) -> allowed
    bool [a + 1, V], the a leading drafts it takes and the tokens it takes at each verified
    position, raising ValueError at a dead end (zoo.constrain.Constraint)."""

    probs: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    generator: Optional[torch.Generator] = None
    constraint: Optional[object] = None


@dataclasses.dataclass
class Draft:
    """tokens [n, Kd] (padding past each row's count), counts [n] (real drafts per row, on the
    host), q [n, Kd, V] the drafter's probabilities (None: deterministic, one-hot at the token)."""

    tokens: torch.Tensor
    counts: list[int]
    q: Optional[torch.Tensor] = None


class Drafter:
    """Proposes draft tokens for a set of the engine's rows (see the module docstring)."""

    name: ClassVar[str]
    wants_hidden: ClassVar[bool] = False  # the verify step hands it the target's final hidden states

    def propose(self, rows: list[int], histories: Sequence[torch.Tensor], kd: int,
                picks: Sequence[Pick]) -> Draft:
        """histories: per row, every token so far [T + 1] (the last one chosen, not yet in the
        cache) -> up to kd draft tokens per row."""
        raise NotImplementedError

    def verified(self, rows: list[int], starts: list[int], tokens: torch.Tensor, kept: list[int],
                 hidden: Optional[torch.Tensor]) -> None:
        """After a verify step: tokens [n, Kd + 1] were appended to each row at position starts[i]
        and the first kept[i] + 1 of them stay; hidden [n, Kd + 1, D] the target's final hidden
        states there (only for drafters that want them)."""

    def prefilled(self, rows: list[int], ids: torch.Tensor, hidden: Optional[torch.Tensor]) -> None:
        """A prefill of ids [n, L] started these rows (hidden [n, L, D]: see `verified`)."""

    def release(self, row: int) -> None:
        """The row's sequence ended."""

    def move(self, src: int, dst: int) -> None:
        """The row's sequence moved from row src to the free row dst (Engine.move_row)."""

    def reset(self) -> None:
        """The engine was reset: every row is free."""


class NgramDrafter(Drafter):
    """Prompt lookup (see the module docstring): input-grounded generation (summarise, edit,
    answer from a given text) copies spans of its input, which the lookup finds."""

    name = "ngram"

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise InputError(f"runtime.speculative: ngram_min={ngram_min}, ngram_max={ngram_max}; expected "
                             f"1 <= ngram_min <= ngram_max")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def lookup(self, history: torch.Tensor, kd: int) -> list[int]:
        """history [T] -> up to kd tokens that followed an earlier occurrence of its longest
        matching suffix (ngram_max .. ngram_min tokens); [] when none occurs."""
        T = history.shape[0]
        for n in range(min(self.ngram_max, T - 1), self.ngram_min - 1, -1):
            # windows starting at 0..T-n-1: every occurrence that ends before the suffix itself
            windows = history[:-1].unfold(0, n, 1)
            hits = (windows == history[T - n:]).all(dim=1).nonzero()
            if hits.numel():
                # the latest occurrence followed by kd tokens (a recent repeat runs into the end
                # of the history), else the earliest: the longest continuation
                ends = hits[:, 0] + n
                full = ends[ends + kd <= T]
                start = int(full[-1]) if full.numel() else int(ends[0])
                return history[start:start + kd].tolist()
        return []

    def propose(self, rows, histories, kd, picks) -> Draft:
        found = [self.lookup(h.cpu(), kd) for h in histories]
        tokens = torch.zeros(len(rows), kd, dtype=torch.long)
        for i, f in enumerate(found):
            tokens[i, :len(f)] = torch.tensor(f, dtype=torch.long)
        return Draft(tokens, [len(f) for f in found])
