"""Chat requests with tools or reasoning: the request side (tools, tool_choice, the grammar that
enforces a call, what the template is given) and the reply side (the model's text split into
content, reasoning_content and tool_calls, whole or as streamed deltas).

    plan = ChatPlan.of(server, body)        # ToolError / ValueError naming the field on bad input
    plan.messages, plan.template_args       # what the chat template renders
    plan.constraint(grammars, prompt_text)  # (kind, value, field, prefix) for zoo.constrain, or None
    out = plan.output(prompt_text)          # one ChatOutput per choice
    out.feed(text) -> [delta, ...]; out.finish(reason) -> ([delta, ...], finish_reason); out.message()
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from ..reasoning import Reasoning, detect as detect_reasoning
from ..tools import ToolError, ToolFormat, by_name, check_choice, check_tools, detect as detect_format
from ..tools.base import Parsed, regex_literal
from ..tools.forced import ForcedJson

# template variables a request may not set through chat_template_kwargs
RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


class Arguments(dict):
    """A call's arguments as templates take them: a mapping (`arguments | tojson`, `is mapping`:
    Qwen, Llama 3, Mistral) that is also its JSON text where a template writes it as a string
    (`'<｜tool▁sep｜>' + arguments`: DeepSeek V3.1, `{{ arguments }}`)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other

    def __radd__(self, other):
        return other + str(self)


def _clean_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls as templates read them: arguments as Arguments (the API
    sends a JSON string)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolError(where, f"must be a list, got {json.dumps(calls)[:80]}")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}[{k}]", f'must be {{"id", "type": "function", "function": {{"name", '
                                             f'"arguments"}}}}, got {json.dumps(c)[:80]}')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ToolError(f"{where}[{k}].function.arguments", f"must be a JSON object, got {args[:80]!r}")
        if not isinstance(args, dict):
            raise ToolError(f"{where}[{k}].function.arguments", f"must be a JSON object, got {json.dumps(args)[:80]}")
        out.append({**c, "type": "function", "function": {**fn, "arguments": Arguments(args)}})
    return out


@dataclass
class ChatPlan:
    """How one chat request's reply is shaped (None fields: not in play)."""

    # the reply's tool-call format: with tools (tool_choice not "none"), and always for one on channels
    fmt: Optional[ToolFormat] = None
    tools: list[dict] = field(default_factory=list)  # checked: [{"name", "description", "parameters"}]
    raw_tools: Optional[list] = None  # as sent: what the template is given
    choice: object = "none"  # "auto" | "none" | "required" | {"name": ...}
    parallel: bool = True
    reasoning: Optional[Reasoning] = None
    template_args: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer, body: dict, tool_format: Optional[str] = None) -> ChatPlan:
        plan = cls()
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict) or RESERVED & set(kwargs):
                raise ToolError("chat_template_kwargs", f"must be an object of template variables other than "
                                                        f"{', '.join(sorted(RESERVED))}, got {json.dumps(kwargs)[:80]}")
            plan.template_args = dict(kwargs)
        template = tokenizer.chat_template if tokenizer is not None else None
        plan.reasoning = detect_reasoning(template)
        tools = body.get("tools")
        plan.tools = check_tools(tools) if tools is not None else []
        plan.choice = check_choice(body.get("tool_choice"), plan.tools)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ToolError("parallel_tool_calls", f"must be a boolean, got {json.dumps(parallel)}")
        plan.parallel = parallel
        fmt = by_name(tool_format) if tool_format else detect_format(template)
        if fmt is not None and fmt.channels:
            plan.fmt = fmt  # a reply on channels is parsed with tools or without
        if plan.tools:
            plan.raw_tools = tools
            if plan.choice != "none":
                plan.fmt = fmt
                if plan.fmt is None and plan.choice == "auto":  # only auto must read the model's own format
                    raise ToolError("tools", "tool_choice auto: this model's chat template writes no tool-call "
                                             "format zoo knows (start the server with tool_format=NAME to name "
                                             "one, or force a call with tool_choice required or a named function)")
                if plan.fmt is None:  # a forced call as bare JSON under the grammar (zoo/tools/forced.py)
                    plan.fmt = ForcedJson(plan.choice["name"] if isinstance(plan.choice, dict) else None)
        return plan

    @property
    def forces_call(self) -> bool:
        """tool_choice required or a named function: the call is enforced by a grammar."""
        return self.fmt is not None and bool(self.tools) and self.choice not in ("auto", "none")

    @property
    def active(self) -> bool:
        """Whether the reply is parsed (else it is plain content, as without this module)."""
        return self.fmt is not None or self.reasoning is not None

    def messages(self, messages: list[dict]) -> list[dict]:
        return [{**m, "tool_calls": _clean_tool_calls(m["tool_calls"], i)} if m.get("tool_calls") else m
                for i, m in enumerate(messages)]

    def reasoning_opened(self, prompt: str) -> Optional[bool]:
        return None if self.reasoning is None else self.reasoning.opened(prompt)

    def constraint(self, lit, prompt: str) -> tuple[Optional[tuple], Optional[tuple]]:
        """-> (the tool-call grammar as (kind, value, field, prefix) when tool_choice forces a
        call, else None; the prefix (zoo.constrain._after) a response_format / regex / grammar /
        choice constraint starts after, or None). A prefix leaves the reasoning free text."""
        tool = None
        if self.forces_call:
            tools = self.tools if self.choice == "required" else \
                [t for t in self.tools if t["name"] == self.choice["name"]]
            # a named function is called once (as vLLM does); required may call several
            tool = ("lark", self.fmt.grammar(tools, lit, self.parallel and self.choice == "required"), "tool_choice")
        if self.fmt is not None and self.fmt.channels:  # its call grammar holds the reasoning already
            return tool and (*tool, None), self.fmt.answer_prefix(lit)
        opened = self.reasoning_opened(prompt)
        prefix = None
        if opened is not None:
            end = lit(self.reasoning.end)
            if end.startswith("<["):  # a token: free text, then it
                body = f"thought: /(?s:.*)/ {end}"
            else:  # text: the shortest text that ends with it (a greedy .* would swallow it)
                body = f"thought[lazy]: /(?s:.*){regex_literal(self.reasoning.end)}/"
            ws = "/[ \\t\\r\\n]*/"
            prefix = (f"thought {ws}", body) if opened else \
                ("think?", f"think: {lit(self.reasoning.start)} thought {ws}\n{body}")
        return tool and (*tool, prefix), prefix

    def output(self, prompt: str) -> ChatOutput:
        return ChatOutput(self.fmt and self.fmt.bind(self.tools), self.reasoning, bool(self.reasoning_opened(prompt)),
                          self.reasoning is not None and self.reasoning_opened(prompt) is not None)


class ChatOutput:
    """One choice's reply: the raw text so far -> content / reasoning / calls, and the deltas
    that take a streaming client from what it was sent to what is known now."""

    def __init__(self, fmt: Optional[ToolFormat], reasoning: Optional[Reasoning], opened: bool, thinks: bool):
        self.fmt, self.reasoning, self.opened, self.thinks = fmt, reasoning, opened, thinks
        self.text = ""
        self._sent_content, self._sent_reasoning = "", ""
        self._sent_calls: list[tuple[str, str]] = []  # (id, arguments sent) per call headed

    def parse(self, final: bool) -> Parsed:
        reasoning, rest = ("", self.text)
        if self.thinks:
            reasoning, rest = self.reasoning.split(self.text, self.opened, final)
        p = self.fmt.parse(rest, final) if self.fmt is not None else Parsed(content=rest)
        p.reasoning = "\n".join(r for r in (reasoning, p.reasoning) if r)
        p.content += p.unparsed  # what is not a call stays the reply
        return p

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return self._deltas(self.parse(final=False))

    def finish(self, reason: Optional[str]) -> tuple[list[dict], Optional[str]]:
        p = self.parse(final=True)
        return self._deltas(p), "tool_calls" if p.calls and reason == "stop" else reason

    def message(self, reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """The whole reply as a chat.completion message, and its finish_reason."""
        deltas, reason = self.finish(reason)  # gives every call its id
        p = self.parse(final=True)
        msg = {"role": "assistant", "content": p.content.strip() or (None if p.calls else "")}
        if self.reasoning is not None or (self.fmt is not None and self.fmt.channels):
            msg["reasoning_content"] = p.reasoning.strip() or None
        if p.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments.strip()}}
                                 for (cid, _), c in zip(self._sent_calls, p.calls)]
        return msg, reason

    def _deltas(self, p: Parsed) -> list[dict]:
        out = []
        r = p.reasoning.strip()
        if r.startswith(self._sent_reasoning) and len(r) > len(self._sent_reasoning):
            out.append({"reasoning_content": r[len(self._sent_reasoning):]})
            self._sent_reasoning = r
        c = p.content.strip()
        if c.startswith(self._sent_content) and len(c) > len(self._sent_content):
            out.append({"content": c[len(self._sent_content):]})
            self._sent_content = c
        for k, call in enumerate(p.calls):
            args = call.arguments.strip()
            if k == len(self._sent_calls):
                cid = self.fmt.new_id()
                self._sent_calls.append((cid, ""))
                out.append({"tool_calls": [{"index": k, "id": cid, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            cid, sent = self._sent_calls[k]
            if args.startswith(sent) and len(args) > len(sent):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": args[len(sent):]}}]})
                self._sent_calls[k] = (cid, args)
        return out
