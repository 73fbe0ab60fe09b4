"""What every tool-call format shares: the parsed pieces, the scanning helpers, the grammar pieces.

A format reads the text a model wrote (all of it so far, while streaming) and returns `Parsed`:
the visible content, the reasoning text and the calls, each only as far as it is certain (text
that may still turn into a marker is held back), so that what a later call returns extends what
an earlier one returned: the streamed deltas are the differences.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Call:
    """One tool call as far as it is written: `name` once complete (None before), `arguments`
    the raw JSON text of the arguments so far (complete when `done`)."""

    name: Optional[str] = None
    arguments: str = ""
    done: bool = False


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)
    # the text from the first call marker on could not be read as calls (only set when final)
    unparsed: str = ""


def held_back(text: str, markers) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def until(text: str, ends, final: bool) -> tuple[str, bool, int]:
    """text up to the first of `ends` -> (body, whether an end was found, index after it).
    Without an end the body holds back what could start one (unless final)."""
    hits = [(text.find(e), e) for e in ends if e in text]
    if hits:
        at, end = min(hits)
        return text[:at], True, at + len(end)
    keep = 0 if final else held_back(text, ends)
    return text[:len(text) - keep], False, len(text)


_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_value(text: str, at: int = 0) -> tuple[str, bool]:
    """The JSON value starting at text[at] (after whitespace) -> (its raw text, complete). An
    incomplete value is the rest of the text (a prefix of the value once complete)."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    try:
        _, end = _DECODER.raw_decode(text, at)
        return text[at:end], True
    except ValueError:
        return text[at:], False


def json_call(body: str, args_keys=("arguments", "parameters")) -> tuple[Call, int]:
    """A call written as one JSON object {"name": ..., "arguments": {...}} (Hermes, Llama 3,
    Mistral v3), possibly incomplete -> (Call, index after the object, or -1 while open)."""
    start = body.find("{")
    if start < 0:
        return Call(), -1
    try:
        obj, end = _DECODER.raw_decode(body, start)
    except ValueError:
        obj, end = None, -1
    call = Call()
    if isinstance(obj, dict):
        name = obj.get("name")
        args = next((obj[k] for k in args_keys if k in obj), None)
        if not isinstance(name, str) or args is None:
            return Call(), end  # a JSON object that is no call
        call.name = name
        # the arguments as the model wrote them (raw text, so that the streamed fragments add up)
        call.arguments = _args_text(body[start:end], args_keys) or json.dumps(args, ensure_ascii=False)
        call.done = True
        return call, end
    m = _NAME.search(body, start)
    if m:
        call.name = json.loads(f'"{m.group(1)}"')
    k = re.search(r'"(%s)"\s*:\s*' % "|".join(map(re.escape, args_keys)), body[start:])
    if k:
        raw, complete = json_value(body, start + k.end())
        call.arguments = raw
    return call, -1


def _args_text(obj_text: str, args_keys) -> Optional[str]:
    k = re.search(r'"(%s)"\s*:\s*' % "|".join(map(re.escape, args_keys)), obj_text)
    if not k:
        return None
    raw, complete = json_value(obj_text, k.end())
    return raw if complete else None


class ToolFormat:
    """One way of writing tool calls. Subclasses set:

    name      the `tool_format` name
    markers   strings the chat template of a model that writes this format contains (detection:
              a model's format is the first in zoo.tools.FORMATS whose markers all appear)
    start     the strings that open a tool call in the output (the content ends there)
    """

    name: str = ""
    markers: tuple[str, ...] = ()
    start: tuple[str, ...] = ()
    channels: bool = False  # the whole reply is on channels (reasoning, answer): parsed even without tools

    def parse(self, text: str, final: bool) -> Parsed:
        """The content before the first call marker, then the calls (`calls`)."""
        hits = [text.find(s) for s in self.start if s in text]
        if not hits:
            keep = 0 if final else held_back(text, self.start)
            return Parsed(content=text[:len(text) - keep])
        at = min(hits)
        calls = self.calls(text[at:], final)
        unparsed = text[at:] if final and not any(c.name for c in calls) else ""
        return Parsed(content=text[:at], calls=[c for c in calls if c.name], unparsed=unparsed)

    def calls(self, region: str, final: bool) -> list[Call]:
        """The calls written in `region` (the output from the first call marker on)."""
        raise NotImplementedError

    def new_id(self) -> str:
        """A fresh tool-call id (templates that render ids back may require a shape)."""
        return "call_" + uuid.uuid4().hex[:24]

    def bind(self, tools: list[dict]) -> ToolFormat:
        """This format for a request's tools (a format whose parse needs their schemas copies
        itself with them)."""
        return self

    def answer_prefix(self, lit):
        """For a format on channels: the (head, rules) prefix before the answer a response_format
        constrains (zoo.constrain._after)."""
        return None

    def grammar(self, tools: list[dict], lit, parallel: bool) -> str:
        """Lark (llguidance) text of one call (or, parallel, one or more) to one of `tools`
        ([{"name", "parameters"}]). lit(text) -> the grammar of a fixed string (special tokens
        as token references)."""
        raise NotImplementedError


def call_schema(tool: dict, args_key: str = "arguments") -> dict:
    """JSON schema of the object {"name": <the tool's name>, args_key: <its parameters>}."""
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, args_key: tool["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def json_rule(schema: dict) -> str:
    """Lark for a JSON value of `schema`, spaced as response_format's JSON (zoo.constrain)."""
    from ..constrain import JSON_DEFAULTS

    return "%json " + json.dumps({"x-guidance": JSON_DEFAULTS, **schema}, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` inside a Lark /regex/ (llguidance's regex syntax: metacharacters and / escaped)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$/&~#-" else ch for ch in text)


def alternatives(rules: list[str]) -> str:
    return "(" + " | ".join(rules) + ")"
