"""What one request may ask of the server, and what the server may ask of the machine: every
bound in one place. A request past a bound is refused (`Refused`, answered by the API layer as a
4xx in the OpenAI error shape) before it is tokenized, compiled or queued, so a hostile request
costs the server no more than reading a capped body; `check_kv_budget` refuses, at start, a
`max_batch x max_seq` whose caches the machine cannot hold.

The bounds (OpenAI's own where it publishes one: 128 tools, 20 top_logprobs, 4 stop strings --
zoo allows 16):

    body         MAX_BODY_BYTES, read in pieces and cut off there (413), Content-Length first
    JSON         MAX_JSON_DEPTH levels of nesting (json's recursion would otherwise end in a
                 RecursionError deep inside the parser, or the schema checker's)
    tools        MAX_TOOLS
    stop         MAX_STOP strings of at most MAX_STOP_CHARS characters each
    logprobs     MAX_TOP_LOGPROBS
    seed         a signed 64-bit integer (torch.Generator's range)
    grammars     MAX_GRAMMAR_CHARS of regex / Lark / GBNF text, MAX_CHOICES strings in a choice,
                 and llguidance's resource limits GRAMMAR_LIMITS: the lexer's fuel bounds the work
                 of one mask (a regex such as ((a{100}){100}){100} otherwise takes the scheduler
                 thread for seconds to minutes on its first token); a grammar that runs out is
                 an error of that request alone (400 invalid_grammar)
"""
from __future__ import annotations

import json
from typing import Optional

from .errors import APIError

MAX_BODY_BYTES = 8 << 20  # 8 MiB: any prompt a context of 10^6 tokens holds, as JSON
MAX_JSON_DEPTH = 64
MAX_TOOLS = 128
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 64 << 10
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
# llguidance.LLParserLimits: a tenth of its default lexer fuel (its defaults let one mask take
# minutes on an adversarial regex); its item / state / grammar-size limits stay as shipped
GRAMMAR_LIMITS = {"initial_lexer_fuel": 100_000, "step_lexer_fuel": 20_000}


class Refused(APIError):
    """A request past one of the bounds: status, message, the field and an OpenAI error code (an
    APIError, so each API answers it in its own shape)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: str = "invalid_value"):
        super().__init__(status, message, param=param, code=code)


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (413) past `limit` bytes: by its Content-Length before
    reading, else as soon as the pieces read pass it (a chunked body has no length)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the request body has {int(declared)} bytes; this server takes at most {limit}",
                      code="request_too_large")
    parts, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise Refused(413, f"the request body passes {limit} bytes, the most this server takes",
                          code="request_too_large")
        parts.append(piece)
    return b"".join(parts)


def parse_json(raw: bytes):
    """raw -> the JSON value; Refused (400 invalid_json) for bytes that are not UTF-8 JSON or
    that nest deeper than MAX_JSON_DEPTH (json's C parser refuses past the recursion limit with
    a RecursionError; what it takes is measured without recursion)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise Refused(400, f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels are taken",
                      code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise Refused(400, f"the request body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are taken",
                      code="invalid_json")
    return value


def json_depth(value) -> int:
    """Levels of list / object nesting of a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


def check_tools(tools) -> None:
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise Refused(400, f"'tools' has {len(tools)} entries; at most {MAX_TOOLS} are taken", param="tools")


def check_stop(stop: list) -> None:
    if len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise Refused(400, f"'stop' must be a string or a list of at most {MAX_STOP} strings", param="stop")
    long = [s for s in stop if len(s) > MAX_STOP_CHARS]
    if long:
        raise Refused(400, f"'stop' strings may have at most {MAX_STOP_CHARS} characters, got one of {len(long[0])}",
                      param="stop")


def check_seed(seed: Optional[int], n: int) -> None:
    """seed + i for each of n choices must fit torch.Generator's signed 64 bits."""
    lo, hi = SEED_RANGE
    if seed is not None and not lo <= seed <= hi - (n - 1):
        raise Refused(400, f"'seed' must be an integer in [{lo}, {hi - (n - 1)}], got {seed}", param="seed")


def check_grammar(kind: str, value, field: str) -> None:
    """A regex / grammar / choice constraint's size, before it is compiled."""
    if kind in ("regex", "grammar") and isinstance(value, str) and len(value) > MAX_GRAMMAR_CHARS:
        raise Refused(400, f"{field}: {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are taken",
                      param=field, code="invalid_grammar")
    if kind == "choice" and isinstance(value, list):
        if len(value) > MAX_CHOICES:
            raise Refused(400, f"{field}: {len(value)} choices; at most {MAX_CHOICES} are taken", param=field,
                          code="invalid_grammar")
        size = sum(len(c) for c in value if isinstance(c, str))
        if size > MAX_GRAMMAR_CHARS:
            raise Refused(400, f"{field}: {size} characters in all; at most {MAX_GRAMMAR_CHARS} are taken",
                          param=field, code="invalid_grammar")


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any vocabulary entry is written with (byte-level BPE's mapped
    characters and SentencePiece's \u2581 are at least as long as the text they stand for): a
    text of b bytes is at least b / this many tokens."""
    backend = tokenizer._backend
    return max(len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)) or 1


# how far a normalizer may shrink text (NFKC folds some sequences) before tokens are counted
NORMALIZER_SLACK = 4


def check_prompt_text(text: str, max_seq: int, max_token_bytes: int, param: str) -> None:
    """A prompt text so long that its tokens cannot fit max_seq, refused before it is tokenized
    (tokenizing megabytes holds a core for seconds)."""
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > NORMALIZER_SLACK * max_seq * max_token_bytes:
        raise Refused(400, f"this model's maximum context length is {max_seq} tokens; the prompt has {n} bytes, "
                           f"at least {n // (NORMALIZER_SLACK * max_token_bytes)} tokens",
                      param=param, code="context_length_exceeded")


# ---------------------------------------------------------------------------- the machine

def kv_budget(info, max_batch: int, max_seq: int, prefix_cache_bytes: int) -> dict:
    """The host memory a server of this build holds besides its weights, from the build's cache
    plan (compiler/build.py's cache stage: info.cache_bytes_per_token, state bytes per sequence):
    every row's cache at max_seq, and the prefix store's cap."""
    per_token, state = int(info.cache_bytes_per_token), int(info.state_bytes_per_sequence)
    kv = per_token * max_batch * max_seq + state * max_batch
    return {"bytes_per_token": per_token, "state_bytes_per_sequence": state, "max_batch": max_batch,
            "max_seq": max_seq, "kv_bytes": kv, "prefix_cache_bytes": int(prefix_cache_bytes),
            "param_bytes": int(info.param_bytes), "needed_bytes": int(info.param_bytes) + kv + int(prefix_cache_bytes)}


def check_kv_budget(info, max_batch: int, max_seq: int, prefix_cache_bytes: int, available: int,
                    where: str = "", available_from: str = "") -> dict:
    """ZooError (a named refusal with the sizes) when the weights, the caches of max_batch rows
    of max_seq tokens and the prefix cache need more than `available` bytes; else the budget.
    available_from: where that figure came from (compiler/memory.py), named in the refusal."""
    from ..compiler.errors import ConfigError

    b = kv_budget(info, max_batch, max_seq, prefix_cache_bytes)
    if b["needed_bytes"] > available:
        raise ConfigError(
            f"{where or 'zoo serve'}: the KV cache of max_batch={max_batch} x max_seq={max_seq} is "
            f"{b['bytes_per_token']:,} bytes per token x {max_batch} x {max_seq}"
            + (f" + {b['state_bytes_per_sequence']:,} state bytes x {max_batch}" if b["state_bytes_per_sequence"] else "")
            + f" = {_size(b['kv_bytes'])}; with {_size(b['param_bytes'])} of weights and the prefix cache's "
            f"{_size(prefix_cache_bytes)} the server needs {_size(b['needed_bytes'])}, but {_size(available)} "
            f"are available" + (f" ({available_from})" if available_from else "")
            + "; give a smaller max_batch= or max_seq= (or prefix_cache_mib=), or force_load=true to start anyway")
    return b


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
