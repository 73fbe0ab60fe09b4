"""Forced calls on a model whose chat template writes no tool-call format: the reply is bare JSON
the grammar engine holds to the tools' schemas (as vLLM answers tool_choice named / required for
any model). Only a forced call uses it: `auto` must recognise the model's own format.

    named:    the function's arguments, one JSON object      {"city": "Paris", "days": 2}
    required: a JSON array of one call (several if parallel)  [{"name": "get_weather", "arguments": {...}}]

Not in zoo.tools.FORMATS: it has no markers to detect and no template renders it.
"""
from __future__ import annotations

from typing import Optional

from .base import Call, Parsed, ToolFormat, alternatives, call_schema, json_call, json_rule, json_value


class ForcedJson(ToolFormat):
    name = "json"

    def __init__(self, named: Optional[str] = None):
        self.named = named  # the function tool_choice names (the reply is its arguments), else required

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if self.named is not None:
            raw, _ = json_value(body)
            return Parsed(calls=[Call(self.named, raw.rstrip(), done=final)] if raw.strip() else [])
        if not body.startswith("["):  # the grammar writes "[" first: only an empty reply lacks it
            return Parsed(unparsed=text if final else "")
        return Parsed(calls=self.calls(body[1:], final))

    def calls(self, region: str, final: bool) -> list[Call]:
        out, rest = [], region
        while rest.strip() and not rest.lstrip().startswith("]"):
            call, end = json_call(rest, ("arguments",))
            if call.name:
                out.append(call)
            if end < 0:
                break
            rest = rest[end:].lstrip().removeprefix(",")
        return out

    def grammar(self, tools: list[dict], lit, parallel: bool) -> str:
        if self.named is not None:
            (tool,) = [t for t in tools if t["name"] == self.named]
            return f"start: {json_rule(tool['parameters'])}"
        call = alternatives([json_rule(call_schema(t)) for t in tools])
        more = f" ({lit(', ')} call)*" if parallel else ""
        return f"start: {lit('[')} call{more} {lit(']')}\ncall: {call}"
