"""The Anthropic Messages API: POST /v1/messages (whole or streamed) and
/v1/messages/count_tokens, translated into a chat turn (serve/turn.py) and written back as
Anthropic content blocks (thinking, text, tool_use) and its stream events.

    request   system (a string or text blocks), messages (user / assistant; content a string or
              blocks: text, tool_use, tool_result; thinking blocks of earlier turns are dropped
              as the chat templates drop earlier reasoning), max_tokens (required),
              stop_sequences, temperature / top_p / top_k (and zoo's extra ignore_eos), tools [{name, description,
              input_schema}], tool_choice auto / any / tool / none (+ disable_parallel_tool_use),
              thinking enabled / disabled (the template's enable_thinking; adaptive: its default),
              output_config.format json_schema (the grammar engine holds the text to it), stream
    response  {"type": "message", "content": [blocks], "stop_reason": end_turn | max_tokens |
              stop_sequence | tool_use, "stop_sequence", "usage": {input_tokens, output_tokens}}
    stream    message_start, ping, (content_block_start, content_block_delta {text_delta |
              thinking_delta | input_json_delta}..., content_block_stop)..., message_delta
              {stop_reason, stop_sequence, usage}, message_stop; a failure mid-stream: error
    errors    {"type": "error", "error": {"type": "invalid_request_error" | ..., "message"}}

Image and document blocks are refused by name (the served models read text); so is a final
assistant message (a prefill: the chat template opens a new turn after it). `tool_choice` any /
tool on a model whose template knows no tool format is the forced JSON call (zoo/tools/forced.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .api import APIError, Server, _field
from .turn import Piece, Turn, check_tools_as, renamed

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
# the chat request's fields, as this API calls them (in error messages)
FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format", "tool_choice.function": "tool_choice"}


def error_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where.split(".")[0].split("[")[0])


def _text_of(blocks, where: str) -> str:
    """A string, or a list of text blocks -> their text."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, f"must be a string or a list of text blocks, got {json.dumps(blocks)[:80]}")
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in ("image", "document"):
            raise _bad(f"{where}[{j}]", f"{kind} blocks are not supported (this server's model reads text)")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}[{j}]", f'must be {{"type": "text", "text": ...}}, got {json.dumps(b)[:80]}')
        out.append(b["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    """system + messages -> chat messages (tool_result blocks -> role tool, tool_use -> tool_calls)."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = _field(body, "messages", list)
    if not messages:
        raise _bad("messages", "must not be empty")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(where, f'must be {{"role": "user" | "assistant", "content": ...}}, got {json.dumps(m)[:80]}')
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise _bad(f"{where}.content", f"must be a string or a list of content blocks, got "
                                           f"{json.dumps(content)[:80]}")
        text, calls, results = [], [], []
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind in ("image", "document"):
                raise _bad(at, f"{kind} blocks are not supported (this server's model reads text)")
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier reasoning: the templates drop it too
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                        not isinstance(b.get("input", {}), dict):
                    raise _bad(at, f'a tool_use block needs "id", "name" and an object "input", got '
                                   f'{json.dumps(b)[:80]}')
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(at, f'a tool_result block needs "tool_use_id", got {json.dumps(b)[:80]}')
                result = _text_of(b.get("content", ""), f"{at}.content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": ("Error: " + result) if b.get("is_error") else result})
            else:
                raise _bad(at, f"unsupported {m['role']} content block {json.dumps(b)[:80]} (expected text, "
                               + ("thinking or tool_use)" if m["role"] == "assistant" else "or tool_result)"))
        out += results
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})})
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    if messages[-1].get("role") == "assistant":
        raise _bad(f"messages[{len(messages) - 1}]", "a final assistant message (a prefill) is not supported: end "
                                                     "with a user message")
    return out


def _tools(body: dict) -> dict:
    """tools / tool_choice -> the chat request's tools, tool_choice, parallel_tool_calls."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    out = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"must be a list of tools, got {json.dumps(tools)[:80]}")
        chat = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
                raise _bad(f"tools[{i}]", f'must be a client tool {{"name", "description", "input_schema"}} '
                                          f'(server tools are not supported), got {json.dumps(t)[:80]}')
            if not isinstance(t.get("input_schema"), dict):
                raise _bad(f"tools[{i}].input_schema", f"must be a JSON schema object, got "
                                                       f"{json.dumps(t.get('input_schema'))[:80]}")
            chat.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t["input_schema"]}})
        if chat:
            check_tools_as(chat, lambda f: f.replace(".function.parameters", ".input_schema").replace(".function", ""))
        out["tools"] = chat or None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice", f'must be {{"type": "auto" | "any" | "tool" | "none"}}, got '
                                      f'{json.dumps(choice)[:80]}')
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise _bad("tool_choice.name", "a tool_choice of type tool names the tool")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            out["tool_choice"] = {"any": "required"}.get(kind, kind)
        parallel = choice.get("disable_parallel_tool_use", False)
        if not isinstance(parallel, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", f"must be a boolean, got {json.dumps(parallel)}")
        out["parallel_tool_calls"] = not parallel
    return out


def chat_body(body: dict, count: bool = False) -> dict:
    """A Messages request -> the chat-completions request it is run as (APIError naming the field).
    count: for count_tokens (no max_tokens)."""
    out = {"model": body.get("model"), "messages": _messages(body), **_tools(body)}
    if not count:
        out["max_tokens"] = _field(body, "max_tokens", int)
        for k in ("temperature", "top_p", "top_k", "ignore_eos"):  # ignore_eos: zoo's extra, as on chat
            if body.get(k) is not None:
                out[k] = body[k]
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list):
                raise _bad("stop_sequences", f"must be a list of strings, got {json.dumps(stop)[:80]}")
            out["stop"] = stop
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking", f'must be {{"type": "enabled" | "disabled" | "adaptive"}}, got '
                                   f'{json.dumps(thinking)[:80]}')
        if kind != "adaptive":  # adaptive: as the template does by default
            out["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    config = _field(body, "output_config", dict, {})
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format", f'must be {{"type": "json_schema", "schema": {{...}}}}, got '
                                               f'{json.dumps(fmt)[:80]}')
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return out


class Blocks:
    """Pieces -> content blocks: the stream's block events as they come, and the whole content."""

    def __init__(self):
        self.content: list[dict] = []
        self.args: dict[int, str] = {}  # block index -> a tool_use's JSON so far
        self.calls: dict[int, int] = {}  # call index -> block index
        self.open: Optional[int] = None

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        return [("content_block_stop", {"type": "content_block_stop", "index": i})]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.open = len(self.content)
        self.content.append(dict(block))
        return out + [("content_block_start", {"type": "content_block_start", "index": self.open,
                                               "content_block": block})]

    def feed(self, p: Piece) -> list[tuple[str, dict]]:
        out = []
        if p.kind in ("reasoning", "content"):
            kind, key, delta = ("thinking", "thinking", "thinking_delta") if p.kind == "reasoning" else \
                ("text", "text", "text_delta")
            if self.open is None or self.content[self.open]["type"] != kind:
                out += self._start({"type": kind, key: "", **({"signature": ""} if kind == "thinking" else {})})
            self.content[self.open][key] += p.text
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.open,
                                                "delta": {"type": delta, key: p.text}}))
        elif p.kind == "call":
            out += self._start({"type": "tool_use", "id": "toolu_" + p.id.removeprefix("call_"), "name": p.name,
                                "input": {}})
            self.calls[p.index] = self.open
            self.args[self.open] = ""
        elif p.kind == "args":
            i = self.calls[p.index]
            self.args[i] += p.text
            out.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                "delta": {"type": "input_json_delta", "partial_json": p.text}}))
        elif p.kind == "done":
            out += self._close()
            for i, raw in self.args.items():
                try:
                    self.content[i]["input"] = json.loads(raw) if raw.strip() else {}
                except ValueError:  # only a call cut by max_tokens (stop_reason says so): what is complete
                    self.content[i]["input"] = {}
        return out


def _stop(p: Piece) -> tuple[str, Optional[str]]:
    if p.stop is not None:
        return "stop_sequence", p.stop
    return STOP_REASONS.get(p.finish, "end_turn"), None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def register(app: FastAPI, server: Server) -> None:
    def guarded(handler):
        async def route(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except Exception as e:  # an internal error, in this API's shape
                return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        return route

    async def messages(request: Request):
        body = await server.read_body(request)
        with renamed(FIELDS):
            turn = Turn(server, chat_body(body))
        stream = _field(body, "stream", bool, False)
        turn.submit()
        head = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": server.name}
        blocks = Blocks()
        if not stream:
            end = None
            try:
                async for p in turn.pieces(request):
                    blocks.feed(p)
                    end = p if p.kind == "done" else end
            finally:
                turn.cancel()
            if end is None:  # the client left
                return JSONResponse({}, status_code=499)
            reason, seq = _stop(end)
            inp, out = turn.usage()
            return {**head, "content": blocks.content, "stop_reason": reason, "stop_sequence": seq,
                    "usage": {"input_tokens": inp, "output_tokens": out}}

        async def sse():
            try:
                yield _event("message_start", {"type": "message_start", "message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": len(turn.prompt), "output_tokens": 0}}})
                yield _event("ping", {"type": "ping"})
                async for p in turn.pieces(request):
                    for name, data in blocks.feed(p):
                        yield _event(name, data)
                    if p.kind == "done":
                        reason, seq = _stop(p)
                        yield _event("message_delta", {"type": "message_delta",
                                                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                       "usage": {"output_tokens": turn.usage()[1]}})
                        yield _event("message_stop", {"type": "message_stop"})
            except APIError as e:
                yield _event("error", error_body(e))
            finally:
                turn.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def count_tokens(request: Request):
        body = await server.read_body(request)
        with renamed(FIELDS):
            chat = chat_body(body, count=True)
            plan = server.chat_plan(chat)
            prompt, _ = server.chat_prompt(chat, plan)
        return {"input_tokens": len(prompt)}

    app.add_api_route("/v1/messages", guarded(messages), methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"])
