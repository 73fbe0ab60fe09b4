"""Streaming text of one sequence: incremental detokenization plus stop strings.

Text that could still be the start of a stop string is held back until the next tokens show it is
not (then it is released) or it completes a stop string (then the sequence ends before it).
"""
from __future__ import annotations

from typing import Sequence


class StopText:
    """feed(token id) -> (text safe to emit now, stopped); finish() -> the held-back rest."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), keep_special: bool = False):
        self._stream = None if tokenizer is None else \
            tokenizer.stream(skip_special_tokens=False) if keep_special else tokenizer.stream()
        self._stop = [s for s in stop if s]
        self._held = ""
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.hit = None  # the stop string that ended the text

    def feed(self, token_id: int) -> tuple[str, bool]:
        if self._stream is None or self.stopped:
            return "", self.stopped
        self._held += self._stream.feed(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of the sequence (length or end token): whatever is still held back."""
        if self._stream is None or self.stopped:
            return ""
        self._held += self._stream.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [(self._held.find(s), s) for s in self._stop if s in self._held]
        if hits:
            at, self.hit = min(hits)
            out, self._held, self.stopped = self._held[:at], "", True
        elif final:
            out, self._held = self._held, ""
        else:
            keep = max((k for s in self._stop for k in range(min(len(s) - 1, len(self._held)), 0, -1)
                        if self._held.endswith(s[:k])), default=0)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self.text += out
        return out, self.stopped
