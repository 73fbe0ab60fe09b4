"""gpt-oss (OpenAI harmony): the reply is messages on channels. `analysis` is the reasoning,
`final` the answer, a `commentary` message addressed to functions.NAME a tool call:

    <|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(<|call|> and <|return|> end the turn: they are end tokens, never in the text.)
"""
from __future__ import annotations

import re

from .base import Call, Parsed, ToolFormat, alternatives, json_rule, until

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


class Harmony(ToolFormat):
    name = "harmony"
    markers = (CHANNEL, MESSAGE)
    start = (CHANNEL,)
    channels = True

    def parse(self, text: str, final: bool) -> Parsed:
        out, reasoning, content = Parsed(), [], []
        for msg in text.split(START):
            header, opened, after = until(msg, (MESSAGE,), final)
            if not opened:
                continue
            body, _, _ = until(msg[after:], (END, CALL, RETURN), final)
            channel = _CHANNEL.search(header)
            to = _RECIPIENT.search(header)
            if to:
                closed = END in msg[after:] or CALL in msg[after:] or final
                out.calls.append(Call(to.group(1), body.strip() if closed else body.lstrip(), closed))
            elif channel and channel.group(1) == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        out.reasoning, out.content = "\n".join(reasoning), "\n".join(content)
        return out

    def _think(self, lit) -> str:
        return f'think: {lit(CHANNEL + "analysis" + MESSAGE)} /(?s:.*)/ {lit(END + START + "assistant")}'

    def answer_prefix(self, lit):
        return f'think? {lit(CHANNEL + "final" + MESSAGE)}', self._think(lit)

    def grammar(self, tools, lit, parallel: bool) -> str:
        # a call may follow an analysis message (the reasoning stays free text)
        head = lambda t: lit(f'{CHANNEL}commentary to=functions.{t["name"]} {CONSTRAIN}json{MESSAGE}')  # noqa: E731
        one = alternatives([f'{head(t)} {json_rule(t["parameters"])}' for t in tools])
        return f"start: think? {one}\n{self._think(lit)}"
