"""Constrained decoding: a grammar (a JSON schema, a regex, a Lark / GBNF grammar, a choice list)
turned into a per-row token mask by llguidance (the engine chosen in scripts/bench_grammar.py).

    grammars = Grammars(tokenizer, vocab_size=V, eos_ids=...)   one per tokenizer (~1 s to build)
    g = grammars.get("json_schema", schema, field="response_format")   compiled once, cached
    c = g.constraint()                                          one per row (a copy of the matcher)
    c.apply(logits [V]) -> logits [V] with the tokens the grammar rejects at -inf
    c.accept(token); c.done (the grammar is complete and can take nothing more)
    c.draft_masks(draft [k]) -> bool [m + 1, V]   speculative verification: the leading m drafts
                                                  it takes and the mask after each; state unchanged

A grammar that cannot be compiled, or that admits no token at its start, raises GrammarError
naming the request field it came from.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any, Optional

import torch

KINDS = ("json_schema", "regex", "grammar", "choice", "lark")  # lark: zoo's own grammars (tool calls)
# compact JSON with the separators models are trained on; flexible whitespace lets a weak model
# emit whitespace until max_tokens. A schema's own "x-guidance" options win over these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar from a request that cannot be used; `field` names where it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _lark(kind: str, value: Any, field: str) -> str:
    """The llguidance grammar text of one request's constraint."""
    import jsonschema
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_schema":
        if not isinstance(value, dict):
            raise GrammarError(field, f"a JSON schema must be an object, got {json.dumps(value)[:80]}")
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as e:
            raise GrammarError(field, f"invalid JSON schema: {e.message} (at {'/'.join(map(str, e.path)) or 'the root'})")
        return LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_DEFAULTS)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise GrammarError(field, f"a regex must be a non-empty string, got {json.dumps(value)[:80]}")
        return LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise GrammarError(field, f"a grammar must be a non-empty string (Lark or GBNF), got {json.dumps(value)[:80]}")
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as e:  # the GBNF converter raises plain exceptions on bad syntax
            raise GrammarError(field, f"cannot read the grammar as Lark or GBNF: {e}")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError(field, f"a choice must be a non-empty list of non-empty strings, got "
                                      f"{json.dumps(value)[:80]}")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "lark":
        return LLMatcher.grammar_from_lark(value)
    raise GrammarError(field, f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")


def _after(prefix: tuple[str, str], inner: str) -> str:
    """The grammar `prefix` then `inner`: prefix = (what `start` begins with, its rules), e.g.
    a reasoning block the constraint leaves free ("think?", "think: <[id]> /(?s:.*)/ <[id]>")."""
    grammar = json.loads(inner)["grammars"][0] if inner.lstrip().startswith("{") else {"lark_grammar": inner}
    head, rules = prefix
    return json.dumps({"grammars": [{"name": "outer", "lark_grammar": f"start: {head} @inner\n{rules}"},
                                    {**grammar, "name": "inner"}]})


class Grammar:
    """One compiled grammar: a matcher at its start state, copied for each row that uses it.
    ends: the end tokens its tokenizer was given (the grammar admits them where it may end)."""

    def __init__(self, matcher, vocab: int, ends: frozenset[int] = frozenset()):
        self._proto, self.vocab, self.ends = matcher, vocab, ends

    def constraint(self) -> Constraint:
        return Constraint(self._proto.deep_copy(), self.vocab, self.ends)


_SHIFT = torch.arange(32, dtype=torch.int32)


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's bitmask int32 [..., W] (bit b of word w: token 32 w + b) -> bool [..., V]."""
    return ((bits[..., None] >> _SHIFT) & 1).bool().flatten(-2)[..., :vocab]


class Constraint:
    """One row's grammar state: masks its logits, follows its tokens."""

    def __init__(self, matcher, vocab: int, ends: frozenset[int] = frozenset()):
        self._m, self.vocab, self.ends = matcher, vocab, ends
        self._words = (vocab + 31) // 32
        self._bits = torch.zeros(self._words, dtype=torch.int32)

    def _fill(self, bits: torch.Tensor) -> None:
        """The mask of the current state into bits int32 [W] (contiguous)."""
        self._m.unsafe_compute_mask_ptr(bits.data_ptr(), self._words * 4)

    def allowed(self) -> torch.Tensor:
        """-> bool [V]: the tokens the grammar takes next (end tokens where it may end)."""
        self._fill(self._bits)
        return _unpack(self._bits, self.vocab)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> a copy with every token the grammar rejects at -inf."""
        allowed = self.allowed().to(logits.device)
        if self._m.is_error() or not bool(allowed.any()):
            raise GrammarError("grammar", f"no token can continue the output here ({self.error or 'dead end'})")
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False (and an error state) when the grammar rejects it."""
        return self._m.consume_token(token)

    def accept_draft(self, tokens: list[int]) -> int:
        """Of draft tokens (speculative decoding), how many lead the grammar can take (none are
        consumed: accept the verified ones one by one)."""
        return self._m.validate_tokens(tokens)

    def draft_masks(self, draft: list[int]) -> torch.Tensor:
        """Speculative verification of draft tokens [k] -> allowed bool [m + 1, V]: the grammar
        takes the leading m <= k drafts (it rejects draft[m]) and row j is what it takes after
        draft[:j], i.e. the mask of verified position j. The matcher is advanced along the lead
        for the masks and rolled back: its state is unchanged (the caller accepts the tokens it
        keeps). A lead stops after an end token (the row ends there; the mask after it repeats
        the one before, the token chosen there is dropped) and before a token after which nothing
        can follow. GrammarError when nothing can continue the output now."""
        m = self._m
        lead = list(draft[:m.validate_tokens(draft)]) if draft else []
        end = next((j for j, t in enumerate(lead) if t in self.ends), None)
        if end is not None:  # llguidance does not count a consumed end token in rollback
            lead = lead[:end + 1]
        walk = lead[:end] if end is not None else lead
        bits = torch.zeros(len(lead) + 1, self._words, dtype=torch.int32)
        self._fill(bits[0])
        for j, t in enumerate(walk):
            if not m.consume_token(t):  # validate_tokens took it: a failure is llguidance's bug
                raise GrammarError("grammar", f"the grammar engine took draft token {t} and then refused it: "
                                              f"{self.error}")
            self._fill(bits[j + 1])
        if walk and not m.rollback(len(walk)):
            raise GrammarError("grammar", f"the grammar engine cannot roll back {len(walk)} tokens: {self.error}")
        if end is not None:
            bits[-1] = bits[-2]
        allowed = _unpack(bits, self.vocab)
        some = allowed.any(dim=1)
        if m.is_error() or not bool(some[0]):
            raise GrammarError("grammar", f"no token can continue the output here ({self.error or 'dead end'})")
        if not bool(some.all()):  # a draft token into a dead end: the lead stops before it
            allowed = allowed[:int((~some).nonzero()[0, 0])]
        return allowed

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token: the row ends here."""
        return self._m.is_stopped()

    @property
    def error(self) -> Optional[str]:
        # the first line: llguidance appends its parser's whole state
        return self._m.get_error().splitlines()[0] if self._m.is_error() else None


class Grammars:
    """The grammar engine bound to one tokenizer: compiles request grammars once each and caches
    them (least recently used out past CACHE_SIZE). Thread-safe: the API compiles, the scheduler
    thread only uses constraints."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, limits: Optional[dict] = None):
        """limits: llguidance.LLParserLimits fields (the server's, zoo/serve/limits.py); None:
        llguidance's defaults."""
        import llguidance

        # vocab_size is the model's (its logits may be padded past the tokenizer's ids)
        self._tok = llguidance.LLTokenizer(tokenizer._backend.to_str(), n_vocab=vocab_size,
                                           eos_token=sorted(eos_ids))
        self.vocab = vocab_size
        self._ends = frozenset(int(e) for e in eos_ids)
        # llguidance reads every added token as a special token: a grammar names them by id
        self._added = {t.content: i for i, t in tokenizer._backend.get_added_tokens_decoder().items()}
        self._limits = llguidance.LLParserLimits(**limits) if limits else None
        self._cache: collections.OrderedDict[tuple, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, value: Any, field: str, prefix: Optional[tuple[str, str]] = None) -> Grammar:
        """The compiled grammar of `value` (kind: one of KINDS), after `prefix` (Lark: what the
        output starts with before it, see _after) if given; GrammarError naming `field`."""
        key = (kind, json.dumps(value, sort_keys=True), prefix)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._compile(kind, value, field, prefix)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def literal(self, text: str) -> str:
        """Lark for the fixed string `text`: its added tokens (<tool_call>, [TOOL_CALLS], ...)
        as token references <[id]>, the rest as string literals."""
        out, plain, i = [], "", 0
        names = sorted(self._added, key=len, reverse=True)
        while i < len(text):
            hit = next((n for n in names if n and text.startswith(n, i)), None)
            if hit is None:
                plain, i = plain + text[i], i + 1
                continue
            if plain:
                out.append(json.dumps(plain, ensure_ascii=False))
            out.append(f"<[{self._added[hit]}]>")
            plain, i = "", i + len(hit)
        if plain or not out:
            out.append(json.dumps(plain, ensure_ascii=False))
        return " ".join(out)

    def _compile(self, kind: str, value: Any, field: str, prefix=None) -> Grammar:
        from llguidance import LLMatcher

        text = _lark(kind, value, field)
        if prefix is not None:
            text = _after(prefix, text)
        try:
            m = LLMatcher(self._tok, text, log_level=0, limits=self._limits)
        except Exception as e:  # the constructor raises on some invalid grammars, flags others
            raise GrammarError(field, f"the grammar engine rejects it: {e}")
        if m.is_error():
            raise GrammarError(field, f"the grammar engine rejects it: {m.get_error().splitlines()[0]}")
        c = Constraint(m, self.vocab)
        if not bool(c.allowed().any()) or m.is_error():  # a mask that leads nowhere is an error state
            raise GrammarError(field, f"no output of this model's tokens can match it ({c.error or 'empty mask'})")
        return Grammar(m, self.vocab, self._ends)
