"""The clients' other APIs on `zoo serve`, through the official clients, against one tiny twin
whose chat template writes no tool-call format and thinks when asked (enable_thinking: the
prompt then opens a <think> block): tool_choice named / required on such a model (the forced
JSON call, zoo/tools/forced.py) on /v1/chat/completions; the Anthropic Messages API
(/v1/messages, count_tokens) with the `anthropic` client; the OpenAI Responses API
(/v1/responses) with the `openai` client. Whole and streamed replies agree, call arguments
validate against their schemas, bad requests are 4xx in each API's own error shape and the server
keeps serving, a client that leaves a stream frees its row. Eager model."""
from __future__ import annotations

import json

import pytest

from tests.serve_fixtures import running_server, write_tiny_llama

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

NAME, KEY = "tiny-apis", "sk-apis"
# ChatML that knows no tools; thinking off unless enable_thinking (as Qwen3's, inverted)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}}
              for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_llama(tmp_path_factory.mktemp("apis") / "ckpt", vocab_size=420, chat_template=TEMPLATE,
                            added=("<think>", "</think>"))
    args = [f"weights={ckpt}", f"api_key={KEY}", f"model_name={NAME}", "max_seq=1024", "max_batch=4",
            "compile=false", "log_level=warning"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, _):
        yield base


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _valid(name: str, arguments) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def _post(base, path, body, headers=None):
    return httpx.post(base + path, json=body, headers=headers if headers is not None else {"x-api-key": KEY},
                      timeout=60)


# ------------------------------------------------------------------ forced calls on any model

def test_named_and_required_calls_on_a_model_without_a_tool_format(oai):
    r = oai.chat.completions.create(model=NAME, messages=ASK, tools=CHAT_TOOLS, max_tokens=80, temperature=1.0, seed=3,
                                    n=2, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for ch in r.choices:
        (call,) = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls" and call.function.name == "get_weather" and call.id.startswith("call_")
        _valid("get_weather", call.function.arguments)
    r = oai.chat.completions.create(model=NAME, messages=ASK, tools=CHAT_TOOLS, max_tokens=80, temperature=1.0, seed=4,
                                    n=2, tool_choice="required", parallel_tool_calls=False)
    for ch in r.choices:
        (call,) = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls"
        _valid(call.function.name, call.function.arguments)
    # parallel: an array of one or more calls, each valid
    r = oai.chat.completions.create(model=NAME, messages=ASK, tools=CHAT_TOOLS, max_tokens=300, temperature=1.0,
                                    seed=5, n=3, tool_choice="required")
    done = [ch for ch in r.choices if ch.finish_reason == "tool_calls"]
    assert done and max(len(ch.message.tool_calls) for ch in done) > 1, r.choices
    for ch in done:
        for call in ch.message.tool_calls:
            _valid(call.function.name, call.function.arguments)


def test_a_streamed_forced_call_equals_the_whole_reply(oai):
    kw = dict(model=NAME, messages=ASK, tools=CHAT_TOOLS, max_tokens=80, temperature=0, tool_choice="required",
              parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls, finish = {}, []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        finish += [ch.finish_reason] if ch.finish_reason else []
        for t in ch.delta.tool_calls or ():
            c = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": "", "n": 0})
            c["arguments"] += t.function.arguments or ""
            c["n"] += 1
    (call,) = whole.message.tool_calls
    assert finish == ["tool_calls"] and list(calls) == [0] and calls[0]["n"] > 2  # the arguments in fragments
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_auto_on_a_model_without_a_tool_format_is_a_400(server):
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK, "tools": CHAT_TOOLS, "max_tokens": 4},
              headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tool_choice auto" in r.json()["error"]["message"]
