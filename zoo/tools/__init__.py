"""Tool calls: how each model family writes them, read back into OpenAI `tool_calls`.

A model's format is a property of its chat template (the template teaches the model the format
and renders earlier calls in it), so it is chosen from the template's text: the first format in
FORMATS whose markers all appear in it (`zoo serve tool_format=NAME` names one instead). One
module per format; each parses (zoo.tools.base.ToolFormat.parse) and writes the grammar that
enforces a call (tool_choice `required` or a named function); a template that writes no format still gets
forced calls, as bare JSON under the tools' schemas (zoo.tools.forced).

    fmt = detect(tokenizer.chat_template)        # None: the template knows no tool format
    tools = check_tools(body["tools"])           # [{"name", "description", "parameters"}]
    fmt.parse(text, final=True) -> Parsed(content, reasoning, calls)
"""
from __future__ import annotations

import json
from typing import Optional

from .base import Call, Parsed, ToolFormat
from .deepseek import DeepSeekV3, DeepSeekV31
from .glm import GLM
from .harmony import Harmony
from .hermes import Hermes
from .llama3 import Llama3Json
from .mistral import Mistral, MistralArgs

# the most specific first: a template may contain the markers of a later format too
FORMATS: tuple[ToolFormat, ...] = (Harmony(), DeepSeekV3(), DeepSeekV31(), MistralArgs(), Mistral(), GLM(),
                                   Hermes(), Llama3Json())


class ToolError(ValueError):
    """A request's tools / tool_choice that cannot be used; `field` names which."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def by_name(name: str) -> ToolFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise ToolError("tool_format", f"unknown tool format {name!r}; expected one of "
                                   f"{', '.join(f.name for f in FORMATS)}")


def detect(template: Optional[str]) -> Optional[ToolFormat]:
    """The format a chat template writes tool calls in (None: it renders no tools)."""
    if not template:
        return None
    for f in FORMATS:
        if all(m in template for m in f.markers):
            return f
    return None


def check_tools(tools) -> list[dict]:
    """A request's `tools` ([{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]) -> [{"name", "description", "parameters"}]; ToolError naming the field."""
    import jsonschema

    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", f"must be a non-empty list of tools, got {json.dumps(tools)[:80]}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(where, f'must be {{"type": "function", "function": {{...}}}}, got {json.dumps(t)[:80]}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or \
                not all(c.isalnum() or c in "_-." for c in name):
            raise ToolError(f"{where}.function.name", f"must be 1-64 letters, digits, _ - or ., got {json.dumps(name)}")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{name!r} names two tools")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters",
                            f"must be a JSON schema object, got {json.dumps(params)[:80]}")
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            raise ToolError(f"{where}.function.parameters",
                            f"invalid JSON schema: {e.message} (at {'/'.join(map(str, e.path)) or 'the root'})")
        out.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    return out


def check_choice(choice, tools: Optional[list[dict]]):
    """tool_choice -> "auto" | "none" | "required" | the name of the function it forces."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", '
                                           f'"function": {{"name": ...}}}}, got {json.dumps(choice)}')
        if choice != "none" and not tools:
            raise ToolError("tool_choice", f"{choice!r} needs `tools`, and the request has none")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", "function": '
                                       f'{{"name": ...}}}}, got {json.dumps(choice)[:80]}')
    if not tools:
        raise ToolError("tool_choice", f"names the function {name!r}, and the request has no `tools`")
    if name not in {t["name"] for t in tools}:
        raise ToolError("tool_choice.function.name", f"{name!r} is not one of the request's tools "
                                                     f"({', '.join(t['name'] for t in tools)})")
    return {"name": name}


__all__ = ["Call", "Parsed", "ToolFormat", "ToolError", "FORMATS", "by_name", "detect", "check_tools", "check_choice"]
