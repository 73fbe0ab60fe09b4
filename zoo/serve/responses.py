"""The OpenAI Responses API: POST /v1/responses (whole or streamed), translated into a chat turn
(serve/turn.py) and written back as output items (reasoning, message, function_call) and the
Responses stream events.

    request   input (a string, or items: messages with input_text / output_text content,
              function_call and function_call_output items; reasoning items of earlier turns are
              dropped as the chat templates drop earlier reasoning), instructions, tools (function
              tools, the flat {type: function, name, description, parameters}), tool_choice,
              parallel_tool_calls, text.format (text / json_object / json_schema: the grammar
              engine holds the output to the schema), max_output_tokens, temperature, top_p
              (and zoo's extras top_k, ignore_eos), reasoning.effort (the template's
              enable_thinking / reasoning_effort), stream
    response  {"object": "response", "status": completed | incomplete, "output": [items],
              "usage": {input_tokens, output_tokens, output_tokens_details.reasoning_tokens, ...}}
    stream    response.created, response.in_progress, per item response.output_item.added,
              (response.content_part.added, response.output_text.delta..., response.output_text.done,
              response.content_part.done | response.reasoning_text.delta..., response.reasoning_text.done
              | response.function_call_arguments.delta..., response.function_call_arguments.done),
              response.output_item.done; then response.completed (response.incomplete when cut by
              max_output_tokens); each with its sequence_number. A failure mid-stream: error.

Stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation` and
`background: true` are refused by name (send the whole conversation as `input` items); so are
image / file inputs and tools other than functions. Errors are OpenAI error objects, as on
/v1/chat/completions.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .api import APIError, Server, _field
from .turn import Piece, Turn, check_tools_as, renamed

FIELDS = {"max_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
          "response_format": "text.format", "tool_choice.function": "tool_choice", "messages": "input"}
REFUSED = {"previous_response_id": "this server keeps no responses: send the whole conversation as `input` items",
           "conversation": "this server keeps no conversations: send the whole conversation as `input` items",
           "store": "this server is stateless and stores no responses (send store: false or leave it out)",
           "background": "background responses need a stored response, and this server stores none"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _text_parts(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of content parts, got {json.dumps(content)[:80]}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}]", f"{kind} parts are not supported (this server's model reads text)")
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise _bad(f"{where}[{j}]", f'must be {{"type": "input_text" | "output_text", "text": ...}}, got '
                                        f'{json.dumps(part)[:80]}')
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    """instructions + input -> chat messages (function_call items -> the assistant's tool_calls,
    function_call_output -> role tool)."""
    out = []
    instructions = _field(body, "instructions", str, None)
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty list of items", param="input",
                       code="missing_field" if items is None else "invalid_type")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", f"must be user, assistant, system or developer, got {json.dumps(role)}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_parts(it.get("content"), f"{where}.content", role)})
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(where, f'a function_call item needs "call_id", "name" and "arguments" (JSON text), got '
                                  f'{json.dumps(it)[:80]}')
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(where, f'a function_call_output item needs "call_id", got {json.dumps(it)[:80]}')
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text_parts(it.get("output", ""), f"{where}.output", "tool")})
        elif kind == "reasoning":
            continue  # earlier reasoning: the templates drop it too
        elif kind == "item_reference":
            raise _bad(where, "item references need stored items, and this server stores none")
        else:
            raise _bad(f"{where}.type", f"unsupported item type {json.dumps(kind)} (expected message, function_call, "
                                        f"function_call_output or reasoning)")
    return out


def _tools(body: dict) -> dict:
    out = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"must be a list of tools, got {json.dumps(tools)[:80]}")
        chat = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise _bad(f"tools[{i}].type", f"only function tools are supported, got "
                                               f"{json.dumps(t.get('type') if isinstance(t, dict) else t)[:80]}")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat.append({"type": "function", "function": fn})
        if chat:
            check_tools_as(chat, lambda f: f.replace(".function", ""))
        out["tools"] = chat or None
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
                                      f'got {json.dumps(choice)[:80]}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _format(body: dict) -> Optional[dict]:
    """text.format -> the chat request's response_format."""
    text = _field(body, "text", dict, {})
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"must be an object with a type (text, json_object or json_schema), got "
                                  f"{json.dumps(fmt)[:80]}")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", f"a json_schema format needs schema, a JSON schema object; got "
                                             f"{json.dumps(fmt.get('schema'))[:80]}")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise _bad("text.format.type", f"must be text, json_object or json_schema, got {json.dumps(kind)}")


def chat_body(body: dict) -> dict:
    """A Responses request -> the chat-completions request it is run as (APIError naming the field)."""
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False) and not (key == "previous_response_id" and body[key] == ""):
            raise APIError(400, f"'{key}' is not supported: {why}", param=key, code="unsupported")
    out = {"model": body.get("model"), "messages": _messages(body), **_tools(body)}
    fmt = _format(body)
    if fmt is not None:
        out["response_format"] = fmt
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("ignore_eos", "ignore_eos")):  # top_k, ignore_eos: zoo's extras
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    reasoning = _field(body, "reasoning", dict, {})
    effort = reasoning.get("effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
            raise _bad("reasoning.effort", f"must be none, minimal, low, medium, high or xhigh, got "
                                           f"{json.dumps(effort)}")
        out["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    return out


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Items:
    """Pieces -> output items: the stream's item events as they come, and the whole output."""

    def __init__(self):
        self.output: list[dict] = []
        self.calls: dict[int, int] = {}  # call index -> output index
        self.open: Optional[int] = None

    def _close(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        item, out = self.output[i], []
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            out += [{"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                     "logprobs": []},
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            out.append({"type": "response.reasoning_text.done", **at, "content_index": 0,
                        "text": item["content"][0]["text"]})
        else:
            out.append({"type": "response.function_call_arguments.done", **at, "name": item["name"],
                        "arguments": item["arguments"]})
        if "status" in item:
            item["status"] = status
        return out + [{"type": "response.output_item.done", "output_index": i, "item": item}]

    def _start(self, item: dict) -> list[dict]:
        out = self._close()
        self.open = len(self.output)
        self.output.append(item)
        # the added event shows the item empty, as it starts
        shown = {**item, **({"content": []} if "content" in item else {}),
                 **({"arguments": ""} if "arguments" in item else {})}
        out.append({"type": "response.output_item.added", "output_index": self.open, "item": shown})
        if item["type"] == "message":
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": self.open,
                        "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}})
        return out

    def feed(self, p: Piece) -> list[dict]:
        out = []
        cur = self.output[self.open] if self.open is not None else None
        if p.kind == "reasoning":
            if cur is None or cur["type"] != "reasoning":
                out += self._start({"type": "reasoning", "id": _new("rs"), "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}]})
            item = self.output[self.open]
            item["content"][0]["text"] += p.text
            out.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self.open,
                        "content_index": 0, "delta": p.text})
        elif p.kind == "content":
            if cur is None or cur["type"] != "message":
                out += self._start({"type": "message", "id": _new("msg"), "status": "in_progress", "role": "assistant",
                                    "content": [{"type": "output_text", "text": "", "annotations": [],
                                                 "logprobs": []}]})
            item = self.output[self.open]
            item["content"][0]["text"] += p.text
            out.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self.open,
                        "content_index": 0, "delta": p.text, "logprobs": []})
        elif p.kind == "call":
            out += self._start({"type": "function_call", "id": _new("fc"), "call_id": p.id, "name": p.name,
                                "arguments": "", "status": "in_progress"})
            self.calls[p.index] = self.open
        elif p.kind == "args":
            i = self.calls[p.index]
            self.output[i]["arguments"] += p.text
            out.append({"type": "response.function_call_arguments.delta", "item_id": self.output[i]["id"],
                        "output_index": i, "delta": p.text})
        elif p.kind == "done":
            out += self._close("incomplete" if p.finish == "length" else "completed")
        return out


def register(app: FastAPI, server: Server) -> None:
    async def responses(request: Request):
        body = await server.read_body(request)
        with renamed(FIELDS):
            chat = chat_body(body)
            turn = Turn(server, chat)
        stream = _field(body, "stream", bool, False)
        turn.submit()
        items = Items()
        snapshot = {"id": _new("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                    "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
                    "max_output_tokens": body.get("max_output_tokens"), "model": server.name, "output": [],
                    "parallel_tool_calls": chat.get("parallel_tool_calls", True), "previous_response_id": None,
                    "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
                    "store": False, "temperature": body.get("temperature"), "text": body.get("text") or
                    {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
                    "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
                    "usage": None, "metadata": body.get("metadata") or {}}

        def final(end: Piece) -> dict:
            inp, out = turn.usage()
            cut = end.finish == "length"
            return {**snapshot, "status": "incomplete" if cut else "completed", "output": items.output,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                    "usage": {"input_tokens": inp, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out,
                              "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
                              "total_tokens": inp + out}}

        if not stream:
            end = None
            try:
                async for p in turn.pieces(request):
                    items.feed(p)
                    end = p if p.kind == "done" else end
            finally:
                turn.cancel()
            if end is None:  # the client left
                return JSONResponse({}, status_code=499)
            return final(end)

        async def sse():
            seq = 0

            def event(data: dict) -> str:
                nonlocal seq
                data = {**data, "sequence_number": seq}
                seq += 1
                return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

            try:
                yield event({"type": "response.created", "response": snapshot})
                yield event({"type": "response.in_progress", "response": snapshot})
                async for p in turn.pieces(request):
                    for data in items.feed(p):
                        yield event(data)
                    if p.kind == "done":
                        whole = final(p)
                        yield event({"type": "response.incomplete" if whole["status"] == "incomplete" else
                                     "response.completed", "response": whole})
            except APIError as e:
                yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            finally:
                turn.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.add_api_route("/v1/responses", responses, methods=["POST"])
