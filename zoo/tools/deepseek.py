"""DeepSeek V3 / R1 and V3.1+ tool calls between their own special tokens. V3 writes the type,
the name and a fenced JSON block, V3.1 the name and the bare arguments:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""
from __future__ import annotations

from .base import Call, ToolFormat, alternatives, json_rule, until

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


class DeepSeekV31(ToolFormat):
    name = "deepseek_v31"
    markers = (CALLS_BEGIN, SEP)
    start = (CALLS_BEGIN,)

    def calls(self, region: str, final: bool) -> list[Call]:
        out = []
        for part in region.split(CALL_BEGIN)[1:]:
            name, named, after = until(part, (SEP,), final)
            if not named:
                continue
            args, closed, _ = until(part[after:], (CALL_END, CALLS_END), final)
            out.append(Call(name.strip(), args.strip() if closed or final else args.lstrip(), closed or final))
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        one = alternatives([f'{lit(t["name"] + SEP)} {json_rule(t["parameters"])}' for t in tools])
        return f"start: {lit(CALLS_BEGIN)} call{' call*' if parallel else ''} {lit(CALLS_END)}\n" \
               f"call: {lit(CALL_BEGIN)} {one} {lit(CALL_END)}"


class DeepSeekV3(DeepSeekV31):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, "```json")  # V3.1's template writes the bare arguments

    def calls(self, region: str, final: bool) -> list[Call]:
        out = []
        for part in region.split(CALL_BEGIN)[1:]:
            _, typed, after = until(part, (SEP,), final)
            if not typed:
                continue
            name, named, after2 = until(part[after:], ("\n",), final)
            if not named:
                continue
            rest = part[after + after2:]
            if not rest.startswith("```json\n"):
                if not "```json\n".startswith(rest):
                    out.append(Call(name.strip(), "", False))
                continue
            args, closed, _ = until(rest[len("```json\n"):], (FENCE_CLOSE, CALL_END), final)
            out.append(Call(name.strip(), args, closed or final))
        return out

    def grammar(self, tools, lit, parallel: bool) -> str:
        one = alternatives([f'{lit("function" + SEP + t["name"] + FENCE_OPEN)} {json_rule(t["parameters"])} '
                            f'{lit(FENCE_CLOSE)}' for t in tools])
        return f"start: {lit(CALLS_BEGIN)} call{' call*' if parallel else ''} {lit(CALLS_END)}\n" \
               f"call: {lit(CALL_BEGIN)} {one} {lit(CALL_END)}"
