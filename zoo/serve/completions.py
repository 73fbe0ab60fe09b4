"""/v1/completions' own fields and answer, in OpenAI's legacy completions shape: `logprobs` (the
top k per token), `echo` (the prompt comes back before the completion, with its tokens'
log-probabilities when logprobs is set: what lm-evaluation-harness' local-completions scores
multiple-choice tasks with) and `max_tokens` 0 (echo only, nothing generated).

    logprobs: {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
               "text_offset": [int]}

With echo the lists start with the prompt's tokens; the first prompt token has null
token_logprobs and top_logprobs (nothing precedes it). text_offset is each token's offset in the
choice's text (the echoed prompt, then the completion). A token's string is its own decode
(special tokens kept), so the offsets count those strings; top_logprobs is keyed by those
strings, and tokens that read alike keep the most likely one's value.

The prompt's log-probabilities come from the scheduler (SamplingParams.prompt_logprobs: every
prompt position's logits, computed for that row only; scheduler.py).
"""
from __future__ import annotations

from typing import Optional

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (OpenAI's own limit is 5)


def options(body: dict, field, range_check) -> tuple[Optional[int], Optional[int], bool]:
    """-> (logprobs k per generated token, prompt log-probabilities k, echo) of a completions
    request; None: not asked for. field / range_check: api._field / api._range (400s naming the key)."""
    logprobs = field(body, "logprobs", int, None)
    if logprobs is not None:
        range_check("logprobs", logprobs, 0 <= logprobs <= MAX_LOGPROBS, f"an integer in 0..{MAX_LOGPROBS}")
    echo = field(body, "echo", bool, False)
    return logprobs, (logprobs if echo else None), echo


def _offsets(texts: list[str], start: int) -> list[int]:
    out = []
    for t in texts:
        out.append(start)
        start += len(t)
    return out


def prompt_text(server, prompt: list[int]) -> str:
    """The echoed prompt: its tokens decoded, special tokens kept (the ids are what was scored)."""
    tok = server.tokenizer
    return tok.decode(prompt, skip_special_tokens=False) if tok is not None else ""


def choice(server, index: int, prompt: list[int], c, echo: bool, want_logprobs: bool) -> dict:
    """One non-streamed choice: c is api.Choice (text, generated tokens' events, and with echo
    and logprobs the prompt's log-probabilities, c.prompt)."""
    head = prompt_text(server, prompt) if echo else ""
    return {"index": index, "text": head + c.text, "finish_reason": c.finish,
            "logprobs": logprobs(server, prompt if echo else [], c.prompt, c.lps) if want_logprobs else None}


def top_dict(name, top) -> dict:
    """[(token, logprob)], most likely first -> {token text: logprob}; tokens whose texts are equal
    (partial UTF-8 bytes all read U+FFFD) keep the most likely one's, so the dict's max is the top."""
    out: dict = {}
    for t, v in top:
        out.setdefault(name(t), v)
    return out


def logprobs(server, prompt: list[int], prompt_lps: Optional[list], generated: list) -> dict:
    """The logprobs object of prompt tokens (with their log-probabilities prompt_lps: None for
    the first) followed by the generated tokens' events (scheduler.Event: token, logprob, top)."""
    name = server.token_text
    texts = [name(t) for t in prompt] + [name(ev.token) for ev in generated]
    lps, tops = [], []
    for entry in (prompt_lps or [None] * len(prompt)):
        lps.append(None if entry is None else entry[0])
        tops.append(None if entry is None else top_dict(name, entry[1]))
    for ev in generated:
        lps.append(ev.logprob)
        tops.append(top_dict(name, ev.top or []))
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": _offsets(texts, 0)}


def echo_chunk(server, index: int, prompt: list[int], prompt_lps: Optional[list], want_logprobs: bool) -> dict:
    """A streamed choice's first chunk under echo: the prompt's text (and its logprobs)."""
    return {"index": index, "text": prompt_text(server, prompt), "finish_reason": None,
            "logprobs": logprobs(server, prompt, prompt_lps, []) if want_logprobs else None}
