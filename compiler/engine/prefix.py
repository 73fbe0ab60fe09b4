"""Prefix reuse: a store in host memory of the caches of prompts seen before, so that a prompt
sharing a prefix with one of them copies that prefix's cache into its row and extends only the
rest (llama.cpp's prompt cache, vLLM's and SGLang's prefix caching).

    PrefixCache(engine, max_bytes, block=16)
      start(row, ids [L]) -> logits [V]   start a sequence in free row `row`: the longest usable
                                          stored prefix goes in (Engine.import_row), the rest is
                                          extended (Engine.extend_rows); none: Engine.prefill_row.
                                          The prompt's cache is then stored (a reuse point).
      store(row, tokens)                  store what a row holds (tokens: its ids), e.g. a whole
                                          conversation before its row is released

Index: each stored entry's ids are cut into blocks of `block` tokens; a chain hash of blocks
0..i (hash of the previous chain hash and block i) maps to the entries holding them. A lookup
walks the new prompt's chain as deep as it is stored, then compares the candidates' ids with
the prompt's token by token (hashes only narrow the search; a collision costs a comparison).

What can be reused depends on the cache kinds (Engine.constant_state_kinds):
  every field grows with tokens (KV caches, latents): any shared prefix, cut to its length (a
    row's slots past its length are invisible), at most L - 1 tokens unless the whole prompt
    is stored with its logits;
  some field is constant state (a recurrent or conv state, a sliding-window ring, a compressor's
    partial block): that state exists only for the exact token counts it was saved at, so only
    a stored entry whose ids are all a prefix of the prompt is reused. The reuse points are the
    end of each prompt (a shared system prompt sent alone, a chat's previous turns) and each
    stored conversation; `mode` says which of the two applies.

Memory: entries hold only the first `length` slots of fields with a token axis (the rest whole),
in host memory; the total is kept <= max_bytes by evicting the least recently used entries.
A full store evicts; it never fails a request (an entry larger than the whole store is not kept).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass
class _Entry:
    key: int
    ids: torch.Tensor  # [n] long, on the host
    snap: object  # core.RowCache
    chain: list[int]


class PrefixCache:
    """See the module docstring. Counters: lookups, hits, tokens_reused, evictions; bytes held."""

    def __init__(self, engine, max_bytes: int, block: int = 16):
        if max_bytes < 0:
            raise InputError(f"prefix cache: max_bytes={max_bytes} must be >= 0 (0: nothing is stored)")
        if block < 1:
            raise InputError(f"prefix cache: block={block} must be a positive number of tokens")
        self.engine, self.max_bytes, self.block = engine, max_bytes, block
        state = engine.constant_state_kinds()
        self.any_prefix = not state
        self.mode = ("any shared prefix: every cache field grows with tokens" if self.any_prefix else
                     "stored prompts only (the end of each prompt, each stored conversation): "
                     f"{'; '.join(state)} keep constant state, which exists only at the token counts it "
                     f"was saved at")
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # oldest first
        self._index: dict[int, set[int]] = {}
        self._keys = itertools.count()
        self.bytes = self.lookups = self.hits = self.tokens_reused = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ index

    def _chain(self, ids: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(len(ids) // self.block):
            h = hash((h, tuple(ids[i * self.block:(i + 1) * self.block])))
            out.append(h)
        return out

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        n = min(len(a), len(b))
        diff = (a[:n] != b[:n]).nonzero()
        return int(diff[0, 0]) if len(diff) else n

    def _usable(self, entry: _Entry, shared: int, L: int) -> int:
        """Tokens of `entry` a prompt of L tokens sharing `shared` with it can start from."""
        n = len(entry.ids)
        if shared == n == L and entry.snap.logits is not None:
            return L  # the whole prompt, with its logits: no step at all
        if self.any_prefix:
            return min(shared, L - 1)
        return n if shared >= n and n < L else 0

    def match(self, ids: torch.Tensor) -> tuple[_Entry | None, int]:
        """ids [L] -> (the entry to start from, its tokens to reuse) or (None, 0)."""
        ids = ids.to("cpu", torch.long)
        cands: set[int] = set()
        for h in self._chain(ids.tolist()):
            found = self._index.get(h)
            if not found:
                break
            # the deepest match shares the most with any prefix; snapshots may sit at any depth
            cands = set(found) if self.any_prefix else cands | found
        best, best_n = None, 0
        for key in cands:
            entry = self._entries[key]
            n = self._usable(entry, self._common(entry.ids, ids), len(ids))
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    # ------------------------------------------------------------------ rows

    def start(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """Start a sequence of ids [L] in free row `row` from the longest usable stored prefix
        -> logits [V] float32 of its last token (equal to a cold prefill's); stores the prompt."""
        e = self.engine
        self.lookups += 1
        entry, n = self.match(ids)
        if entry is None:
            logits = e.prefill_row(row, ids)
        else:
            self._entries.move_to_end(entry.key)
            e.import_row(row, entry.snap, n)
            try:
                if n < len(ids):
                    logits = e.extend_rows([row], ids[None, n:], last_only=True)[0]
                else:
                    logits = entry.snap.logits.to(e.device)
            except Exception:
                e.release_row(row)
                raise
            self.hits += 1
            self.tokens_reused += n
        self.store(row, ids, logits)
        return logits

    def store(self, row: int, ids, logits: torch.Tensor | None = None) -> None:
        """Keep what row `row` holds: ids (its tokens, as many as the row holds), logits [V] of
        the last one if known. Prompts shorter than one block are not kept (nothing indexes them)."""
        ids = torch.as_tensor(ids).to("cpu", torch.long)
        if self.max_bytes == 0 or len(ids) < self.block:
            return
        if len(ids) != self.engine.row_len[row]:
            raise InputError(f"prefix cache: row {row} holds {self.engine.row_len[row]} tokens, "
                             f"got {len(ids)} ids to store it under")
        for entry in list(self._entries.values()):
            if len(entry.ids) == len(ids) and torch.equal(entry.ids, ids):
                self._entries.move_to_end(entry.key)  # already kept
                return
        snap = self.engine.export_row(row, logits)
        if snap.nbytes > self.max_bytes:
            return
        if self.any_prefix:  # an entry that is a prefix of this one is of no more use
            for entry in list(self._entries.values()):
                if len(entry.ids) < len(ids) and torch.equal(entry.ids, ids[:len(entry.ids)]):
                    self._drop(entry)
        entry = _Entry(next(self._keys), ids, snap, self._chain(ids.tolist()))
        self._entries[entry.key] = entry
        for h in entry.chain:
            self._index.setdefault(h, set()).add(entry.key)
        self.bytes += snap.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries.values())))
            self.evictions += 1

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        for h in entry.chain:
            keys = self._index[h]
            keys.discard(entry.key)
            if not keys:
                del self._index[h]
        self.bytes -= entry.snap.nbytes

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._drop(entry)
