"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is one JSON object (several joined by
"; "), optionally after <|python_tag|>.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""
from __future__ import annotations

from .base import Call, Parsed, ToolFormat, call_schema, held_back, json_call, json_rule

TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    markers = ('"parameters"',)
    start = (TAG, "{")

    def parse(self, text: str, final: bool) -> Parsed:
        # a call is the whole reply: only a reply that opens with the tag or "{" is one
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if not body or (not final and held_back(body, (TAG,)) == len(body)):
            return Parsed(content="" if not final else text)
        if not (body.startswith(TAG) or body.startswith("{")):
            return Parsed(content=text)
        calls = self.calls(body.removeprefix(TAG), final)
        named = [c for c in calls if c.name]
        return Parsed(calls=named, unparsed=text if final and not named else "")

    def calls(self, region: str, final: bool) -> list[Call]:
        out, rest = [], region
        while rest.strip():
            call, end = json_call(rest)
            out.append(call)
            if end < 0:
                break
            rest = rest[end:].lstrip().removeprefix(";")
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        call = " | ".join(json_rule(call_schema(t, "parameters")) for t in tools)
        return f"start: call{' (' + lit('; ') + ' call)*' if parallel else ''}\ncall: {call}"
