"""GLM-4.5 / GLM-5: the name, then each argument as a key / value pair of tags (a string value
as it is, any other as JSON):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>2</arg_value>
    </tool_call>

The arguments come back as the JSON object of the pairs, one pair at a time while streaming.
"""
from __future__ import annotations

import json
import re

from .base import Call, ToolFormat, alternatives, json_rule, until

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(re.escape(KEY) + r"(.*?)" + re.escape(KEY_END) + r"\s*" + re.escape(VALUE) + r"(.*?)"
                   + re.escape(VALUE_END), re.S)


def _is_text(schema: dict) -> bool:
    """A value the template writes as it is (a string), not as JSON."""
    enum = schema.get("enum")
    return schema.get("type") == "string" or (bool(enum) and all(isinstance(e, str) for e in enum))


def _value(text: str, schema) -> str:
    """A value as JSON: a string where the tool's schema says so, else itself when it is JSON."""
    if schema is None or not _is_text(schema):
        try:
            if not isinstance(json.loads(text), str):
                return text.strip()
        except ValueError:
            pass
    return json.dumps(text, ensure_ascii=False)


class GLM(ToolFormat):
    name = "glm"
    markers = (OPEN, KEY, VALUE)
    start = (OPEN,)

    def __init__(self, tools=()):
        # {tool: {argument: schema}}: whether a value is a string is the tool's schema's call
        self._schemas = {t["name"]: t["parameters"].get("properties", {}) for t in tools}

    def bind(self, tools) -> GLM:
        return GLM(tools)

    def calls(self, region: str, final: bool) -> list[Call]:
        out = []
        for part in region.split(OPEN)[1:]:
            name, named, after = until(part, ("\n", KEY, CLOSE), final)
            if not named and not final:
                continue
            body, closed, _ = until(part[after:], (CLOSE,), final)
            schemas = self._schemas.get(name.strip(), {})
            pairs = [f"{json.dumps(k.strip(), ensure_ascii=False)}: {_value(v, schemas.get(k.strip()))}"
                     for k, v in _PAIR.findall(body)]
            done = closed or final
            out.append(Call(name.strip(), "{" + ", ".join(pairs) + ("}" if done else ""), done))
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        end, calls = lit(VALUE_END), []
        for t in tools:
            props = t["parameters"].get("properties", {})
            required = set(t["parameters"].get("required", []))
            pairs = []
            for k, schema in props.items():
                pair = f"{lit(KEY + k + KEY_END + chr(10) + VALUE)} {_value_rule(schema, lit)} {end} {lit(chr(10))}"
                pairs.append(pair if k in required else f"({pair})?")
            calls.append(f"{lit(OPEN + t['name'] + chr(10))} {' '.join(pairs)} {lit(CLOSE)}")
        return f"start: call{' (' + lit(chr(10)) + ' call)*' if parallel else ''}\ncall: {alternatives(calls)}"


def _value_rule(schema: dict, lit) -> str:
    """Lark for one value as the template writes it: a string raw (its enum, pattern or length
    kept; no "<", which would open the closing tag), anything else as JSON."""
    if not _is_text(schema):
        return json_rule(schema)
    if schema.get("enum"):
        return alternatives([lit(e) for e in schema["enum"]])
    if "pattern" in schema:
        return "/" + schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else hi}}}/"
