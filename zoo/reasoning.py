"""Reasoning text: models that think write it between markers before the answer. The markers are
data (REASONING); a model's pair is the first whose end marker its chat template contains (the
template strips earlier turns' reasoning at that marker). gpt-oss's harmony channels carry their
own reasoning (zoo.tools.harmony).

    r = detect(tokenizer.chat_template)                       # None: the model does not think
    opened = r.opened(prompt_text)                            # the prompt already opened the block
    reasoning, rest = r.split(text, opened, final)            # the text so far, split
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .tools.base import held_back, until


@dataclass(frozen=True)
class Reasoning:
    start: str
    end: str

    def opened(self, prompt: str) -> Optional[bool]:
        """True: the prompt ends inside an open block (the reply starts with reasoning); False:
        it may open one; None: the prompt closed an empty block (thinking switched off)."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return None
        return tail.endswith(self.start)

    def split(self, text: str, opened: bool, final: bool) -> tuple[str, str]:
        """-> (the reasoning so far, the text after the block). While the block is open all of
        it is reasoning; a reply that does not open one is all answer."""
        if not opened:
            body = text.lstrip()
            if not final and held_back(body, (self.start,)) == len(body):
                return "", ""  # may still open the block
            if not body.startswith(self.start):
                return "", text
            text = body[len(self.start):]
        reasoning, closed, after = until(text, (self.end,), final)
        return reasoning, text[after:] if closed else ""


REASONING = (Reasoning("<think>", "</think>"),)


def detect(template: Optional[str]) -> Optional[Reasoning]:
    if not template:
        return None
    for r in REASONING:
        if r.end in template:
            return r
    return None
