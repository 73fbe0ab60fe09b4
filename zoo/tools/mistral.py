"""Mistral: [TOOL_CALLS] then the calls. Tokenizer v3 (Mistral-7B-Instruct-v0.3, Mixtral) writes a
JSON list, v11+ (Mistral Small 3.1 and later) each call as NAME[ARGS]{arguments}:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""
from __future__ import annotations

import uuid

from .base import Call, ToolFormat, alternatives, call_schema, json_call, json_rule, json_value, until

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class Mistral(ToolFormat):
    name = "mistral"
    markers = (TOOL_CALLS,)
    start = (TOOL_CALLS,)

    def new_id(self) -> str:
        # Mistral's templates refuse any id but 9 letters or digits
        return uuid.uuid4().hex[:9]

    def calls(self, region: str, final: bool) -> list[Call]:
        out = []
        for part in region.split(TOOL_CALLS)[1:]:
            body = part.lstrip()
            if ARGS in body or not body.startswith("["):
                name, named, after = until(body, (ARGS,), final)
                if named:
                    raw, done = json_value(body, after)
                    out.append(Call(name.strip(), raw, done))
                continue
            rest = body[1:]
            while True:  # the list's objects, the last one maybe open
                call, end = json_call(rest)
                if call.name is None and end < 0:
                    break
                out.append(call)
                if end < 0:
                    break
                rest = rest[end:].lstrip()
                if not rest.startswith(","):
                    break
                rest = rest[1:]
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        one = alternatives([json_rule(call_schema(t)) for t in tools])
        return f'start: {lit(TOOL_CALLS + " [")} call{" (" + lit(", ") + " call)*" if parallel else ""} {lit("]")}' \
               f'\ncall: {one}'


class MistralArgs(Mistral):
    """The v11+ spelling (the template writes [ARGS])."""

    name = "mistral_args"
    markers = (TOOL_CALLS, ARGS)

    def grammar(self, tools, lit, parallel: bool) -> str:
        one = alternatives([f'{lit(t["name"] + ARGS)} {json_rule(t["parameters"])}' for t in tools])
        return f"start: call{' call*' if parallel else ''}\ncall: {lit(TOOL_CALLS)} {one}"
