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
anthropic = pytest.importorskip("anthropic")
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


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, timeout=120, max_retries=0)


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


# ------------------------------------------------------------------ Anthropic Messages

CLAUDE_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_text_stop_sequence_and_stream(server, claude):
    kw = dict(model=NAME, max_tokens=16, system=[{"type": "text", "text": "Be brief."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me about Paris."}]}])
    r = claude.messages.create(**kw, extra_body=GREEDY)
    text = _text(r)
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("max_tokens", "end_turn")
    assert r.usage.output_tokens <= 16 and r.usage.input_tokens == claude.messages.count_tokens(
        model=NAME, system=kw["system"], messages=kw["messages"]).input_tokens
    # a stop sequence from the greedy text ends it there
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isalnum())
    stop = text[at:at + 2]
    s = claude.messages.create(**kw, stop_sequences=["\x00never", stop], extra_body=GREEDY)
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", stop)
    assert _text(s) == text[:text.find(stop)].strip()
    # streamed: the same text, in text_delta events between the block's start and stop
    with claude.messages.stream(**kw, extra_body=GREEDY) as st:
        kinds = [ev.type for ev in st]
        final = st.get_final_message()
    assert _text(final) == text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    # the raw events, as the API names them (ping included)
    with httpx.stream("POST", server + "/v1/messages", json={**kw, **GREEDY, "stream": True},
                      headers={"x-api-key": KEY}, timeout=60) as raw:
        names = [line[7:] for line in raw.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"] and "content_block_delta" in names


def test_messages_thinking_blocks(claude):
    kw = dict(model=NAME, max_tokens=6, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": "Think first."}], extra_body=GREEDY)
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking"] and r.content[0].thinking and r.stop_reason == "max_tokens"
    with claude.messages.stream(**kw) as st:
        deltas = [ev.delta.type for ev in st if ev.type == "content_block_delta"]
        final = st.get_final_message()
    assert set(deltas) == {"thinking_delta"} and final.content[0].thinking == r.content[0].thinking
    off = claude.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]


def test_messages_tool_use_round_trip(claude):
    kw = dict(model=NAME, max_tokens=80, tools=CLAUDE_TOOLS,
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    r = claude.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    _valid("get_weather", use.input)
    history = kw["messages"] + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                                {"role": "user", "content": [
                                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                                    {"type": "text", "text": "So?"}]}]
    a = claude.messages.create(**{**kw, "messages": history, "max_tokens": 8}, tool_choice={"type": "none"},
                               extra_body=GREEDY)
    assert a.stop_reason in ("end_turn", "max_tokens") and [b.type for b in a.content] == ["text"]
    assert a.usage.input_tokens > r.usage.input_tokens  # the call and its result went into the prompt
    # any, streamed: the input_json_delta fragments add up to the whole reply's input
    any_kw = dict(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    whole = claude.messages.create(**any_kw)
    with claude.messages.stream(**any_kw) as st:
        parts = [ev.delta.partial_json for ev in st if ev.type == "content_block_delta"]
        final = st.get_final_message()
    (w,), (f,) = whole.content, final.content
    assert final.stop_reason == whole.stop_reason == "tool_use" and len(parts) > 2
    assert (f.name, f.input) == (w.name, w.input) == (w.name, json.loads("".join(parts)))
    _valid(w.name, w.input)


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "image blocks are not supported"),
    ({"max_tokens": None}, 400, "invalid_request_error", "'max_tokens'"),
    ({"tools": CLAUDE_TOOLS}, 400, "invalid_request_error", "tool_choice auto"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice.name: 'nope'"),
    ({"messages": ASK + [{"role": "assistant", "content": "The"}]}, 400, "invalid_request_error", "prefill"),
    ({"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
    ({"tools": [{"name": "f", "input_schema": {"type": "objekt"}}], "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tools[0].input_schema: invalid JSON schema"),
    ({"max_tokens": 5000}, 400, "invalid_request_error", "maximum context length"),
    ({"model": "other"}, 404, "not_found_error", "does not exist"),
    ({"key": "wrong"}, 401, "authentication_error", "API key"),
])
def test_messages_errors_are_anthropic_errors(server, claude, body, status, kind, says):
    req = {"model": NAME, "max_tokens": 4, "messages": ASK, **body}
    key = req.pop("key", KEY)
    r = _post(server, "/v1/messages", {k: v for k, v in req.items() if v is not None}, headers={"x-api-key": key})
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and says in r.json()["error"]["message"], r.text
    ok = claude.messages.create(model=NAME, max_tokens=2, messages=ASK)  # and the server goes on
    assert ok.usage.output_tokens >= 1


def test_messages_client_errors(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "document" in e.value.body["error"]["message"]
    r = httpx.post(server + "/v1/messages", content=b"{oops", headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ OpenAI Responses

RESP_TOOLS = [{"type": "function", "name": n, "description": n, "parameters": s} for n, s in SCHEMAS.items()]


def test_responses_text_and_stream(oai):
    kw = dict(model=NAME, input="Tell me about Paris.", instructions="Be brief.", max_output_tokens=8, temperature=0)
    r = oai.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    events = list(oai.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 8
    # input as items: messages with input_text parts (developer = system)
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about Paris."}]}]
    same = oai.responses.create(**{**kw, "input": items, "instructions": None})
    assert same.output_text == r.output_text


def test_responses_json_schema_format(oai):
    r = oai.responses.create(model=NAME, input="Weather as JSON", max_output_tokens=120, temperature=0.8,
                             text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                                              "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_responses_function_calls_round_trip(oai):
    kw = dict(model=NAME, input="What time is it?", tools=RESP_TOOLS, max_output_tokens=80, temperature=0)
    r = oai.responses.create(**kw, tool_choice={"type": "function", "name": "get_time"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    _valid("get_time", call.arguments)
    history = [{"role": "user", "content": "What time is it?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    a = oai.responses.create(**{**kw, "input": history, "max_output_tokens": 6}, tool_choice="none")
    assert [o.type for o in a.output] == ["message"] and a.usage.input_tokens > r.usage.input_tokens
    # required, streamed: the argument deltas add up to the done event's and the whole reply's arguments
    req = dict(**kw, tool_choice="required", parallel_tool_calls=False)
    (whole,) = oai.responses.create(**req).output
    events = list(oai.responses.create(**req, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == whole.arguments and done.name == whole.name
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == whole.arguments
    _valid(whole.name, whole.arguments)


def test_responses_reasoning_items(oai):
    r = oai.responses.create(model=NAME, input="Think first.", max_output_tokens=6, temperature=0,
                             reasoning={"effort": "high"})
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].text and r.usage.output_tokens_details.reasoning_tokens == 6
    events = list(oai.responses.create(model=NAME, input="Think first.", max_output_tokens=6, temperature=0,
                                       reasoning={"effort": "high"}, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == item.content[0].text


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": RESP_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format.schema"),
    ({"text": {"format": "x"}}, "text.format"),
    ({"input": []}, "input"),
])
def test_responses_errors_are_openai_errors(server, oai, body, param):
    r = _post(server, "/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 4, **body},
              headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert oai.responses.create(model=NAME, input="hi", max_output_tokens=2).usage.output_tokens >= 1


# ------------------------------------------------------------------ cancellation

def _cancelled(base) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith('zoo_sequences_finished_total{reason="cancelled"}'):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 960, "messages": ASK}),
    ("/v1/responses", {"max_output_tokens": 960, "input": "hi"}),
])
def test_a_client_that_leaves_a_stream_frees_its_row(server, path, body):
    import time

    before = _cancelled(server)
    with httpx.stream("POST", server + path, json={"model": NAME, "stream": True, "ignore_eos": True, **body},
                      headers={"x-api-key": KEY}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event:") and line.endswith("delta"):  # the first token is out: leave
                break
    deadline = time.monotonic() + 30
    while httpx.get(server + "/health").json()["running"] or _cancelled(server) == before:
        assert time.monotonic() < deadline, "the row was not freed"
        time.sleep(0.1)
    assert _cancelled(server) == before + 1


# ------------------------------------------------------------------ the rest of the bad-input matrix

@pytest.mark.parametrize("path, body, status, kind, says", [
    ("/v1/messages", {"max_tokens": "ten"}, 400, "invalid_request_error", "'max_tokens' must be int"),
    ("/v1/messages", {"messages": "hi"}, 400, "invalid_request_error", "'messages' must be list"),
    ("/v1/messages", {"stream": "yes"}, 400, "invalid_request_error", "'stream' must be bool"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi " * 1100}]}, 400, "invalid_request_error",
     "maximum context length is 1024"),
    ("/v1/messages", b"[1, 2]", 400, "invalid_request_error", "must be a JSON object"),
    ("/v1/responses", {"model": "other"}, 404, "invalid_request_error", "does not exist"),
    ("/v1/responses", {"max_output_tokens": "ten"}, 400, "invalid_request_error", "'max_output_tokens' must be int"),
    ("/v1/responses", {"stream": "yes"}, 400, "invalid_request_error", "'stream' must be bool"),
    ("/v1/responses", {"max_output_tokens": 5000}, 400, "invalid_request_error", "maximum context length is 1024"),
    ("/v1/responses", b"{oops", 400, "invalid_request_error", "not valid JSON"),
    ("/v1/responses", {"key": "wrong"}, 401, "authentication_error", "API key"),
])
def test_bad_requests_get_each_apis_error_shape(server, oai, path, body, status, kind, says):
    anthropic_api = path == "/v1/messages"
    base = {"model": NAME, "max_tokens": 4, "messages": ASK} if anthropic_api else \
        {"model": NAME, "max_output_tokens": 4, "input": "hi"}
    req = body if isinstance(body, bytes) else {**base, **body}
    key = KEY if isinstance(req, bytes) else req.pop("key", KEY)
    headers = {"x-api-key": key} if anthropic_api else {"Authorization": f"Bearer {key}"}
    r = httpx.post(server + path, content=req if isinstance(req, bytes) else json.dumps(req),
                   headers={**headers, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if anthropic_api:
        assert r.json()["type"] == "error" and set(err) == {"type", "message"}, r.text
    else:
        assert {"message", "type", "param", "code"} <= set(err), r.text
    assert err["type"] == kind and says in err["message"], r.text
    assert oai.responses.create(model=NAME, input="hi", max_output_tokens=2).usage.output_tokens >= 1
