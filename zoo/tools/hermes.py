"""Hermes / Qwen2.5 / Qwen3 / SmolLM3: each call a JSON object between <tool_call> and </tool_call>.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

from .base import Call, ToolFormat, alternatives, call_schema, json_call, json_rule, until

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    markers = (OPEN, CLOSE)
    start = (OPEN,)

    def calls(self, region: str, final: bool) -> list[Call]:
        out = []
        for part in region.split(OPEN)[1:]:
            body, closed, _ = until(part, (CLOSE,), final)
            call, end = json_call(body)
            call.done = call.done and (closed or final)
            out.append(call)
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        call = f'{lit(OPEN)} {lit(chr(10))} {alternatives([json_rule(call_schema(t)) for t in tools])} ' \
               f'{lit(chr(10))} {lit(CLOSE)}'
        return f"start: call{' (' + lit(chr(10)) + ' call)*' if parallel else ''}\ncall: {call}"
