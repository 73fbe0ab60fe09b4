"""The OpenAI-compatible HTTP layer (FastAPI). Requests are parsed and checked here, turned into
scheduler Sequences (one per choice) and answered from the events the scheduler thread sends.
Completions' own fields and answer shape (echo, prompt log-probabilities) are in completions.py,
/tokenize, /detokenize and /tokenizer_info in tokenize.py.

Every error is an OpenAI-style object {"error": {"message", "type", "param", "code"}}: 400 for
bad input (malformed JSON, missing or mistyped fields, out-of-range values, a prompt plus
max_tokens over max_seq: code context_length_exceeded), 401 for a wrong or missing key, 404 for an
unknown model or route, 429 with Retry-After when the waiting queue is full. An output constraint
(response_format, or extra_body regex / grammar / choice: zoo.constrain) that cannot be compiled
is a 400 naming its field (code invalid_grammar), before anything is queued. /v1/messages and
/v1/responses (serve/anthropic.py, serve/responses.py) run as chat turns (serve/turn.py) and
answer, errors included, in their own APIs' shapes.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..compiler.errors import ZooError
from ..constrain import Grammar, GrammarError, Grammars
from ..tools import ToolError, by_name
from . import completions as completions_api
from . import limits
from .chat import ChatOutput, ChatPlan
from .errors import APIError
from .limits import MAX_STOP, MAX_TOP_LOGPROBS  # noqa: F401 - every bound lives in limits.py
from .metrics import Metrics
from .scheduler import PREFIX_CACHE_BYTES, Event, QueueFull, SamplingParams, Scheduler, Sequence
from .web import add_routes as add_web_routes
from .tokenize import add_routes as add_token_routes


# ---------------------------------------------------------------------------- field checks

_MISSING = object()


def _field(body: dict, key: str, types, default=_MISSING, what: str = ""):
    """body[key] checked against `types` (bool is never an int here); default when absent/null."""
    value = body.get(key, None)
    if value is None:
        if default is _MISSING:
            raise APIError(400, f"missing required field {key!r}", param=key, code="missing_field")
        return default
    types = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(t.__name__ for t in types)
        raise APIError(400, f"{key!r} must be {what or names}, got {json.dumps(value)[:80]}", param=key,
                       code="invalid_type")
    return value


def _range(key: str, value, ok: bool, expected: str):
    if not ok:
        raise APIError(400, f"{key!r} must be {expected}, got {value}", param=key, code="invalid_value")
    return value


class Server:
    """What the endpoints share: the model, its scheduler and metrics, the served name."""

    def __init__(self, model, model_name: str, api_key: Optional[str] = None, max_queue: int = 64,
                 tool_format: Optional[str] = None, prefix_cache_bytes: int = PREFIX_CACHE_BYTES):
        self.model, self.name, self.api_key = model, model_name, api_key
        self.tool_format = by_name(tool_format).name if tool_format else None  # else the template's (zoo.tools)
        self.tokenizer = model.tokenizer
        self.max_seq, self.vocab = model.engine.max_seq, model.engine.vocab_size
        self.max_batch = model.engine.max_batch
        self.metrics = Metrics()
        self.scheduler = Scheduler(model, max_queue=max_queue, metrics=self.metrics,
                                   prefix_cache_bytes=prefix_cache_bytes)
        self.created = int(time.time())
        # the grammar engine reads the tokenizer once (~1 s for a 50k vocabulary), here and not
        # in the first constrained request
        self.grammars, self.grammars_error = None, None
        self.token_bytes = limits.longest_token_bytes(self.tokenizer) if self.tokenizer is not None else 1
        if self.tokenizer is not None:
            try:
                self.grammars = Grammars(self.tokenizer, self.vocab, self.scheduler.eos,
                                         limits=limits.GRAMMAR_LIMITS)
            except Exception as e:  # a tokenizer the engine cannot read: only constrained requests fail
                self.grammars_error = f"{type(e).__name__}: {e}"

    # ---------------------------------------------------------------- request -> sequences

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        # x-api-key: how Anthropic's clients send it (serve/anthropic.py)
        if header != f"Bearer {self.api_key}" and request.headers.get("x-api-key") != self.api_key:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key> or x-api-key)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(self, request: Request, need_model: bool = True) -> dict:
        """The request's JSON object, after the key check, naming a model this server serves
        (`need_model=False`: /tokenize and friends, where `model` may be left out)."""
        self.check_auth(request)
        body = limits.parse_json(await limits.read_body(request))  # size- and depth-bounded
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        if need_model or body.get("model") is not None:
            self.check_model(body)
        return body

    def check_model(self, body: dict) -> None:
        name = _field(body, "model", str)
        if name != self.name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer and this model has none: send token ids to "
                                f"/v1/completions", code="no_tokenizer")
        return self.tokenizer

    def chat_plan(self, body: dict) -> ChatPlan:
        """tools / tool_choice / reasoning of a chat request (serve/chat.py); 400 naming the field."""
        limits.check_tools(body.get("tools"))
        try:
            return ChatPlan.of(self.tokenizer, body, self.tool_format)
        except ToolError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from e

    def chat_prompt(self, body: dict, plan: Optional[ChatPlan] = None) -> tuple[list[int], str]:
        """-> the prompt's token ids and its text."""
        plan = plan or ChatPlan()
        messages = _field(body, "messages", list)
        if not messages:
            raise APIError(400, "'messages' must not be empty", param="messages", code="invalid_value")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages",
                               code="invalid_type")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text can be served
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages", code="invalid_value")
                content = "".join(p["text"] for p in content)
            if content is not None and not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param="messages", code="invalid_type")
            clean.append({**m, "content": content or ""})
        tok = self.need_tokenizer("/v1/chat/completions")
        try:
            clean = plan.messages(clean)
            text = tok.apply_chat_template(clean, add_generation_prompt=True, tools=plan.raw_tools,
                                           **plan.template_args)
        except ToolError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from e
        except ZooError as e:
            raise APIError(400, str(e), param="messages") from e
        limits.check_prompt_text(text, self.max_seq, self.token_bytes, "messages")
        return tok.encode(text, add_special_tokens=False), text  # the template writes its own BOS

    def completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                         for p in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of those",
                           param="prompt", code="invalid_type" if prompt is not None else "missing_field")
        out = []
        for p in prompts:
            if isinstance(p, str):
                tok = self.need_tokenizer("a text prompt")
                limits.check_prompt_text(p, self.max_seq, self.token_bytes, "prompt")
                out.append(tok.encode(p))
                continue
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise APIError(400, "a token-id prompt must be a non-empty list of integers", param="prompt",
                               code="invalid_type")
            bad = [t for t in p if not 0 <= t < self.vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})",
                               param="prompt", code="invalid_value")
            out.append(list(p))
        return out

    def sampling(self, body: dict, prompt_len: int, chat: bool, plan: Optional[ChatPlan] = None,
                 prompt_text: str = "") -> tuple[list[SamplingParams], int]:
        """-> one SamplingParams per choice (n of them), and n."""
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, key, int, None)
        least = 1 if chat or max_tokens is None else 0  # completions' 0 (asked for): echo scores the prompt only
        if max_tokens is None:
            if prompt_len >= self.max_seq:  # nothing left to generate into: say so, not "max_tokens -N"
                raise APIError(400, f"this model's maximum context length is {self.max_seq} tokens; the request has "
                                    f"{prompt_len} prompt tokens and leaves none to generate",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            max_tokens = self.max_seq - prompt_len
        _range(key, max_tokens, max_tokens >= least, f"an integer >= {least}")
        if prompt_len + max_tokens > self.max_seq:
            raise APIError(400, f"this model's maximum context length is {self.max_seq} tokens; the request has "
                                f"{prompt_len} prompt tokens and asks for {max_tokens} more",
                           param=key, code="context_length_exceeded")
        temperature = float(_field(body, "temperature", float, 1.0))
        _range("temperature", temperature, 0 <= temperature <= 2, "a number in [0, 2]")
        top_p = float(_field(body, "top_p", float, 1.0))
        _range("top_p", top_p, 0 < top_p <= 1, "a number in (0, 1]")
        top_k = _field(body, "top_k", int, -1)
        _range("top_k", top_k, top_k >= -1, "an integer >= 1 (or 0 / -1 for none)")
        seed = _field(body, "seed", int, None)
        n = _field(body, "n", int, 1)
        _range("n", n, 1 <= n <= self.max_batch, f"an integer in 1..{self.max_batch} (max_batch)")
        limits.check_seed(seed, n)
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        limits.check_stop(stop)
        if stop:
            self.need_tokenizer("'stop'")
        if chat:
            want = _field(body, "logprobs", bool, False)
            k = _field(body, "top_logprobs", int, 0)
            _range("top_logprobs", k, 0 <= k <= MAX_TOP_LOGPROBS, f"an integer in 0..{MAX_TOP_LOGPROBS}")
            logprobs, prompt_logprobs = (k if want else None), None
        else:
            logprobs, prompt_logprobs, _ = completions_api.options(body, _field, _range)
        ignore_eos = _field(body, "ignore_eos", bool, False)
        grammar = self.grammar(body, plan, prompt_text)
        keep = plan is not None and plan.active
        params = [SamplingParams(grammar=grammar, keep_special=keep, max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p,
                                 top_k=top_k if top_k > 0 else None,
                                 seed=None if seed is None else seed + i, stop=tuple(stop), logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos) for i in range(n)]
        return params, n

    def grammar(self, body: dict, plan: Optional[ChatPlan] = None, prompt_text: str = "") -> Optional[Grammar]:
        """The request's output constraint, compiled: response_format json_object / json_schema,
        or (extra_body) one of regex, grammar (Lark or GBNF), choice (a list of strings), or the
        call tool_choice required / a named function forces (its format's grammar). For a model
        that reasons, the constraint starts after the reasoning (serve/chat.py)."""
        found, prefix = [], None
        if plan is not None and plan.active:
            if self.grammars is None and plan.forces_call:
                raise APIError(400, f"'tool_choice': the grammar engine cannot read this model's tokenizer "
                                    f"({self.grammars_error})", param="tool_choice", code="unsupported")
            if self.grammars is not None:
                tool, prefix = plan.constraint(self.grammars.literal, prompt_text)
                found += [tool] if tool is not None else []
        fmt = _field(body, "response_format", dict, None)
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(("json_schema", {"type": "object"}, "response_format"))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(400, "'response_format' of type json_schema needs json_schema.schema, a JSON "
                                        f"schema object; got {json.dumps(spec)[:80]}",
                                   param="response_format.json_schema.schema", code="invalid_value")
                found.append(("json_schema", spec["schema"], "response_format.json_schema.schema"))
            elif kind != "text":
                raise APIError(400, f"'response_format.type' must be text, json_object or json_schema, got "
                                    f"{json.dumps(kind)}", param="response_format.type", code="invalid_value")
        found += [(k, body[k], k) for k in ("regex", "grammar", "choice") if body.get(k) is not None]
        found = [(*f, prefix) if len(f) == 3 else f for f in found]
        if len(found) > 1:
            raise APIError(400, f"at most one output constraint per request, got {', '.join(f[2] for f in found)}",
                           param=found[1][2], code="invalid_value")
        if not found:
            return None
        kind, value, where, prefix = found[0]
        limits.check_grammar(kind, value, where)
        self.need_tokenizer(f"'{where}'")
        if self.grammars is None:
            raise APIError(400, f"'{where}': the grammar engine cannot read this model's tokenizer "
                                f"({self.grammars_error})", param=where, code="unsupported")
        try:
            return self.grammars.get(kind, value, where, prefix=prefix)
        except GrammarError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_grammar") from e

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False) if self.tokenizer else str(tok)


# ---------------------------------------------------------------------------- running requests

class Run:
    """The choices of one request in flight: one event queue fed by the scheduler thread."""

    def __init__(self, server: Server, prompts: list[list[int]], params: list[SamplingParams]):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.seqs = []
        for i, (prompt, p) in enumerate((pr, p) for pr in prompts for p in params):
            self.seqs.append(Sequence(prompt, p, self._sink(i), tokenizer=server.tokenizer))

    def _sink(self, i: int):
        def sink(ev: Event) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
        return sink

    def submit(self) -> None:
        try:
            self.server.scheduler.submit(self.seqs)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from e
        self.server.metrics.prompt_tokens.inc(self.prompt_tokens)

    def cancel(self) -> None:
        for s in self.seqs:
            if s.finish_reason is None:
                self.server.scheduler.cancel(s)

    def usage(self) -> dict:
        out = sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out,
                "total_tokens": self.prompt_tokens + out}

    async def events(self, request: Request):
        """(choice, event) until every choice is done; cancels everything if the client leaves."""
        left = len(self.seqs)
        try:
            while left:
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev.kind == "done":
                    left -= 1
                    if ev.finish_reason == "error" and ev.code == "invalid_grammar":  # the request's own
                        raise APIError(400, f"the output constraint failed while generating: {ev.error}",
                                       code="invalid_grammar")
                    if ev.finish_reason in ("error", "cancelled"):
                        raise APIError(500 if ev.finish_reason == "error" else 503,
                                       f"generation failed: {ev.error or 'the server is shutting down'}",
                                       type="server_error", code=ev.finish_reason)
                yield i, ev
        finally:
            self.cancel()  # no-op for finished choices


def _chat_logprob(server: Server, ev: Event) -> dict:
    def entry(tok, lp):
        s = server.token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {**entry(ev.token, ev.logprob), "top_logprobs": [entry(t, lp) for t, lp in (ev.top or [])]}


class Choice:
    """What a non-streamed choice accumulates."""

    def __init__(self):
        self.text, self.tokens, self.lps, self.finish = "", [], [], None
        self.prompt = None  # the prompt's log-probabilities (a "prompt" event: completions' echo)


async def _collect(server: Server, run: Run, request: Request) -> list[Choice]:
    choices = [Choice() for _ in run.seqs]
    async for i, ev in run.events(request):
        c = choices[i]
        if ev.kind == "prompt":
            c.prompt = ev.prompt
            continue
        c.text += ev.text
        if ev.kind == "token":
            c.tokens.append(ev.token)
            if ev.logprob is not None:
                c.lps.append(ev)
        else:
            c.finish = ev.finish_reason
    return choices


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------- the app

def create_app(model, model_name: str, api_key: Optional[str] = None, max_queue: int = 64,
               tool_format: Optional[str] = None, prefix_cache_bytes: int = PREFIX_CACHE_BYTES) -> FastAPI:
    server = Server(model, model_name, api_key=api_key, max_queue=max_queue, tool_format=tool_format,
                    prefix_cache_bytes=prefix_cache_bytes)
    server.scheduler.warmup()

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        yield
        server.scheduler.stop()

    app = FastAPI(title="zoo serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        server.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    body_of = server.read_body

    add_web_routes(app, server)  # the page at / and GET /v1/zoo/card (serve/web.py)

    add_token_routes(app, server, body_of, _field, APIError)  # /tokenize, /detokenize, /tokenizer_info

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": server.scheduler.running, "waiting": server.scheduler.queue_depth}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "zoo",
                "max_model_len": server.max_seq}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str, request: Request):
        server.check_auth(request)
        if name != server.name:
            raise APIError(404, f"model {name!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)

        def prepare():
            plan = server.chat_plan(body)
            prompt, text = server.chat_prompt(body, plan)
            params, _ = server.sampling(body, len(prompt), chat=True, plan=plan, prompt_text=text)
            return prompt, params, [plan.output(text) for _ in params] if plan.active else None

        # templates, tokenizing and grammar compiles off the event loop: one large request
        # never holds up the others' streams
        prompt, params, outputs = await asyncio.to_thread(prepare)
        return await respond(request, body, [prompt], params, chat=True, outputs=outputs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)

        def prepare():
            prompts = server.completion_prompts(body)
            return prompts, server.sampling(body, max(len(p) for p in prompts), chat=False)[0]

        prompts, params = await asyncio.to_thread(prepare)  # as in chat(): off the event loop
        for p in prompts:
            if not p:
                raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return await respond(request, body, prompts, params, chat=False)

    from . import anthropic, responses  # /v1/messages, /v1/responses: chat turns in their own shapes

    anthropic.register(app, server)
    responses.register(app, server)

    async def respond(request: Request, body: dict, prompts, params, chat: bool,
                      outputs: Optional[list[ChatOutput]] = None):
        """outputs: per choice, the parser of a chat reply with tools or reasoning (serve/chat.py)."""
        stream = _field(body, "stream", bool, False)
        opts = _field(body, "stream_options", dict, {})
        include_usage = bool(opts.get("include_usage", False)) and stream
        want_ids = _field(body, "return_token_ids", bool, server.tokenizer is None)
        echo = not chat and _field(body, "echo", bool, False)
        run = Run(server, prompts, params)
        run.submit()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": server.name}
        if not stream:
            choices = await _collect(server, run, request)
            out = []
            for i, c in enumerate(choices):
                if chat and outputs is not None:
                    outputs[i].feed(c.text)
                    message, finish = outputs[i].message(c.finish)
                    item = {"index": i, "message": message,
                            "logprobs": {"content": [_chat_logprob(server, ev) for ev in c.lps]} if c.lps else None,
                            "finish_reason": finish}
                elif chat:
                    item = {"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": {"content": [_chat_logprob(server, ev) for ev in c.lps]} if c.lps else None,
                            "finish_reason": c.finish}
                else:
                    item = completions_api.choice(server, i, run.seqs[i].prompt, c, echo,
                                                  run.seqs[i].params.logprobs is not None)
                if want_ids:
                    item["token_ids"] = c.tokens
                out.append(item)
            return {**head, "choices": out, "usage": run.usage()}

        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(i: int, text: Optional[str], ev: Optional[Event] = None, finish=None, role=False,
                  delta: Optional[dict] = None) -> str:
            if chat:
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": i, "delta": delta,
                          "logprobs": {"content": [_chat_logprob(server, ev)]} if ev is not None and
                          ev.logprob is not None else None, "finish_reason": finish}
            else:
                lp = None
                if ev is not None and ev.logprob is not None:
                    t = server.token_text(ev.token)
                    lp = {"tokens": [t], "token_logprobs": [ev.logprob],
                          "top_logprobs": [completions_api.top_dict(server.token_text, ev.top or [])]}
                choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if want_ids and ev is not None and ev.token is not None:
                choice["token_ids"] = [ev.token]
            return _sse({**head, "choices": [choice], **extra})

        async def sse():
            try:
                for i, s in enumerate(run.seqs):
                    if chat:
                        yield chunk(i, None, role=True)
                    elif echo and s.params.prompt_logprobs is None:  # else with its "prompt" event
                        yield _sse({**head, "choices": [completions_api.echo_chunk(server, i, s.prompt, None, False)],
                                    **extra})
                async for i, ev in run.events(request):
                    if ev.kind == "prompt":  # completions' echo with logprobs
                        yield _sse({**head, "choices": [completions_api.echo_chunk(server, i, run.seqs[i].prompt,
                                                                                  ev.prompt, True)], **extra})
                    elif outputs is not None:  # the reply parsed: content / reasoning / tool-call deltas
                        deltas = outputs[i].feed(ev.text)
                        finish = None
                        if ev.kind == "done":
                            more, finish = outputs[i].finish(ev.finish_reason)
                            deltas += more
                        tok_ev = ev if ev.kind == "token" else None
                        if tok_ev is not None and not deltas and (ev.logprob is not None or want_ids):
                            deltas = [{}]
                        for k, d in enumerate(deltas):
                            yield chunk(i, None, tok_ev if k == 0 else None, delta=d)
                        if ev.kind == "done":
                            yield chunk(i, None, finish=finish)
                    elif ev.kind == "token":
                        if ev.text or ev.logprob is not None or want_ids:
                            yield chunk(i, ev.text, ev)
                    else:
                        if ev.text:
                            yield chunk(i, ev.text)
                        yield chunk(i, None, finish=ev.finish_reason)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": run.usage()})
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
                yield "data: [DONE]\n\n"
            finally:
                run.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def serve(model, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          max_queue: int = 64, log_level: str = "info", tool_format: Optional[str] = None,
          prefix_cache_bytes: int = PREFIX_CACHE_BYTES) -> None:
    """Build the app and run it with uvicorn until interrupted (SIGINT/SIGTERM). Under torchrun
    (runtime.parallel) rank 0 serves and the other ranks follow its engine calls (parallel.py)."""
    import uvicorn

    leader = None
    if model.info.parallel:
        from .parallel import LeaderEngine, control_group, follow

        group = control_group()
        if model.info.parallel["rank"] != 0:
            return follow(model.engine, group)
        # ranks whose states parted (an engine call failed on some only): shut down as on Ctrl-C
        leader = model.engine = LeaderEngine(model.engine, group,
                                             on_failure=lambda e: signal.raise_signal(signal.SIGINT))
    try:
        app = create_app(model, model_name, api_key=api_key, max_queue=max_queue, tool_format=tool_format,
                         prefix_cache_bytes=prefix_cache_bytes)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        if leader is not None:
            leader.stop()
    if leader is not None and leader.failed is not None:
        raise leader.failed
