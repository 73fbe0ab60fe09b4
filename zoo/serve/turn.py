"""One chat turn as the Anthropic Messages (serve/anthropic.py) and OpenAI Responses
(serve/responses.py) endpoints run it. Each API translates its request into a chat-completions
request, the internal representation (messages, tools, tool_choice, parallel_tool_calls,
sampling, response_format, chat_template_kwargs), which the same code as /v1/chat/completions
checks, templates, plans and constrains (Server.chat_plan / chat_prompt / sampling, serve/chat.py,
zoo.constrain): named / required tool calls, grammars and the reasoning split exist once. The
reply comes back as Pieces, which each API writes as its own events or its own whole object.

    with renamed({"max_tokens": "max_output_tokens"}):   # errors name the API's own fields
        turn = Turn(server, chat_body)
    turn.submit()
    async for piece in turn.pieces(request): ...         # reasoning / content / call / args / done
    turn.usage() -> (prompt tokens, generated tokens)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import Request

from ..tools import ToolError, check_tools
from .api import APIError, Run, Server


@dataclass
class Piece:
    """A step of the reply. kind "reasoning" / "content": new text; "call": call `index` starts
    (its id and name); "args": more of call `index`'s JSON arguments; "done": the end, finish
    "stop" | "length" | "tool_calls" and `stop`, the stop string that ended it (else None)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""
    finish: Optional[str] = None
    stop: Optional[str] = None


@contextlib.contextmanager
def renamed(names: dict[str, str]):
    """APIErrors raised inside name the translating API's fields: {chat field: its field}."""
    try:
        yield
    except APIError as e:
        for ours, theirs in names.items():  # the more specific names first
            e.message = e.message.replace(f"'{ours}'", f"'{theirs}'")
            if e.message.startswith(ours) and e.message[len(ours):len(ours) + 1] in (":", ".", "["):
                e.message = theirs + e.message[len(ours):]
            if e.param == ours or (e.param or "")[len(ours):len(ours) + 1] in (".", "[") and e.param.startswith(ours):
                e.param = theirs + e.param[len(ours):]
        raise


def check_tools_as(tools: list[dict], rename) -> None:
    """zoo.tools.check_tools on tools translated into chat's shape; a bad one is a 400 naming the
    field as the translating API calls it (rename(chat field) -> its field)."""
    try:
        check_tools(tools)
    except ToolError as e:
        field = rename(e.field)
        raise APIError(400, f"{field}: {str(e)[len(e.field) + 2:]}", param=field, code="invalid_value") from e


def pieces_of(delta: dict) -> list[Piece]:
    """A ChatOutput delta (serve/chat.py) -> Pieces."""
    out = []
    if delta.get("reasoning_content"):
        out.append(Piece("reasoning", delta["reasoning_content"]))
    if delta.get("content"):
        out.append(Piece("content", delta["content"]))
    for c in delta.get("tool_calls", ()):
        fn = c.get("function", {})
        if c.get("id"):
            out.append(Piece("call", index=c["index"], id=c["id"], name=fn.get("name", "")))
        if fn.get("arguments"):
            out.append(Piece("args", fn["arguments"], index=c["index"]))
    return out


class Turn:
    """One chat request (a chat-completions body) checked, templated and ready to run; one choice."""

    def __init__(self, server: Server, body: dict):
        self.server = server
        plan = server.chat_plan(body)
        prompt, text = server.chat_prompt(body, plan)
        params, _ = server.sampling(body, len(prompt), chat=True, plan=plan, prompt_text=text)
        self.prompt, self.params = prompt, params[:1]
        self.output = plan.output(text)  # parses content / reasoning / calls even when the plan is inactive
        self.reasoning_tokens = 0
        self.run: Optional[Run] = None

    def submit(self) -> None:
        """Queue the turn (429 when the queue is full); needs the running event loop."""
        self.run = Run(self.server, [self.prompt], self.params)
        self.run.submit()

    def usage(self) -> tuple[int, int]:
        return self.run.prompt_tokens, len(self.run.seqs[0].tokens)

    async def pieces(self, request: Request) -> AsyncIterator[Piece]:
        """The reply until its "done" piece; the row is freed if the client leaves (Run.events)."""
        answered = False  # content or a call seen: later tokens are no reasoning tokens
        async for _, ev in self.run.events(request):
            deltas = self.output.feed(ev.text)
            finish = None
            if ev.kind == "done":
                more, finish = self.output.finish(ev.finish_reason)
                deltas += more
            out = [p for d in deltas for p in pieces_of(d)]
            answered = answered or any(p.kind != "reasoning" for p in out)
            if ev.kind == "token" and not answered and self.output.thinks:
                self.reasoning_tokens += 1
            for p in out:
                yield p
            if ev.kind == "done":
                yield Piece("done", finish=finish, stop=self.run.seqs[0].text.hit if finish == "stop" else None)

    def cancel(self) -> None:
        if self.run is not None:
            self.run.cancel()
