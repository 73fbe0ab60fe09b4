"""A real `zoo serve` process on 127.0.0.1 (a random free port, started and stopped here) with a
tiny random Llama checkpoint that has a real tokenizer, talked to with the official `openai`
client and raw HTTP: the endpoints and fields users send, the bad-input matrix, and a bounded
load test (200 requests, 32 concurrent clients, some leaving mid-stream) over every endpoint:
completions and chat, the Anthropic Messages API (the `anthropic` client) and the Responses API."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
import types

import jsonschema
import pytest

from tests.serve_fixtures import running_server, write_tiny_llama

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("transformers")

KEY = "sk-test-key"
NAME = "tiny"
MAX_SEQ, MAX_BATCH, MAX_QUEUE = 128, 8, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_llama(tmp_path_factory.mktemp("serve") / "ckpt")
    # eager (compile=false): the graphs' compile is covered by test_serve_rows; here the server is tested,
    # with every scheduler policy on (prompt chunks, prefix reuse by default, prompt-lookup drafts)
    # so that the load test below holds with them
    args = [f"weights={ckpt}", f"api_key={KEY}", f"model_name={NAME}", f"max_seq={MAX_SEQ}",
            f"max_batch={MAX_BATCH}", f"max_queue={MAX_QUEUE}", "compile=false", "log_level=warning",
            "step_tokens=24", "speculative=ngram", "draft_tokens=3"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, timeout=60, max_retries=0)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    client.completions.create(model=NAME, prompt="one two", max_tokens=2)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("zoo_requests_total", "zoo_prompt_tokens_total", "zoo_generation_tokens_total", "zoo_queue_depth",
                 "zoo_batch_occupancy", "zoo_time_to_first_token_seconds_bucket",
                 "zoo_inter_token_latency_seconds_bucket"):
        assert name in text, name


def test_chat_greedy_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    c = full.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == c.finish_reason
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == c.message.content


def test_seed_repeats_text_and_n_choices(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95, seed=123,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(**{**kw, "n": 2})
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert two.usage.completion_tokens == 32 and two.usage.prompt_tokens == a.usage.prompt_tokens


def test_stop_strings_end_and_are_held_back_in_streams(client):
    kw = dict(model=NAME, prompt="The capital of", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 8, text
    stop = text[4:7]
    cut = text[:text.index(stop)]
    stopped = client.completions.create(**kw, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].text for ch in client.completions.create(**kw, stop=[stop], stream=True) if ch.choices]
    assert "".join(pieces) == cut
    assert not any(stop in p for p in pieces)


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens
    assert all(len(t) == 3 and max(t.values()) >= chosen - 1e-5 for t, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-5 for c in content)


def _post(base, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base + path, content=raw if raw is not None else json.dumps(body),
                      headers={**headers, "Content-Type": "application/json"}, timeout=60)


BAD = [
    # (path, body or raw bytes, status, code)
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/chat/completions", {"model": NAME}, 400, "missing_field"),
    ("/v1/completions", {"model": NAME}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": "ten"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "stream": "yes"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model_not_found"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": MAX_SEQ}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": [1] * MAX_SEQ}, 400, "context_length_exceeded"),
    # no max_tokens and a prompt that fills the context: the context is named, not "max_tokens -N"
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi " * MAX_SEQ}]}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": -0.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 1.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 10 ** 6]}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": [1, -3]}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -1}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "n": 99}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "stop": [1]}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": {"a": 1}}, 400, "invalid_type"),
    ("/v1/nowhere", {}, 404, "not_found"),
]


@pytest.mark.parametrize("path, body, status, code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_an_openai_error(server, path, body, status, code):
    r = _post(server[0], path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err
    if code == "context_length_exceeded":
        assert str(MAX_SEQ) in err["message"]


def test_keys(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 1}
    for key in (None, "sk-wrong"):
        r = _post(server[0], "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    assert _post(server[0], "/v1/completions", body).status_code == 200


def test_full_queue_is_429_with_retry_after(server):
    async def main():
        body = {"model": NAME, "prompt": "one two three", "max_tokens": 60, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server[0], timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3 * (MAX_BATCH + MAX_QUEUE))))
    rs = asyncio.run(asyncio.wait_for(main(), 300))
    busy = [r for r in rs if r.status_code == 429]
    assert busy and all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "queue_full" for r in busy)
    ok = [r for r in rs if r.status_code == 200]
    assert ok and all(r.json()["usage"]["completion_tokens"] == 60 for r in ok)
    assert len(ok) + len(busy) == len(rs)


def _rss(proc) -> int:
    return psutil.Process(proc.pid).memory_info().rss


# the load's other APIs: a system prompt every /v1/messages and /v1/responses text request shares (so
# admissions reuse its prefix), tools whose forced calls are short, an output schema
SYSTEM = "You are a small model. Answer every question."
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SCHEMAS = {"get_time": TIME, "get_weather": WEATHER}
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "n"], "additionalProperties": False}
# bad requests, each answered in its API's own error shape: (path, body fields over a good one, status,
# Anthropic error type | OpenAI error param)
LOAD_BAD = [
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error"),
    ("/v1/messages", {"max_tokens": None}, 400, "invalid_request_error"),
    ("/v1/messages", {"tools": [{"name": "get_time", "input_schema": TIME}]}, 400, "invalid_request_error"),
    ("/v1/messages", {"stop_sequences": "x"}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": "other"}, 404, "not_found_error"),
    ("/v1/responses", {"store": True}, 400, "store"),
    ("/v1/responses", {"input": []}, 400, "input"),
    ("/v1/responses", {"text": {"format": "x"}}, 400, "text.format"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ("/v1/responses", {"max_output_tokens": 0}, 400, "max_output_tokens"),
    ("/v1/chat/completions", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt"),
]
MESSAGE_EVENTS = re.compile(r"message_start( ping)?( content_block_start( content_block_delta)* content_block_stop)*"
                            r" message_delta message_stop")
_TEXT_ITEM = (r" response\.output_item\.added response\.content_part\.added( response\.output_text\.delta)*"
              r" response\.output_text\.done response\.content_part\.done response\.output_item\.done")
_CALL_ITEM = (r" response\.output_item\.added( response\.function_call_arguments\.delta)*"
              r" response\.function_call_arguments\.done response\.output_item\.done")
RESPONSE_EVENTS = re.compile(rf"response\.created response\.in_progress({_TEXT_ITEM}|{_CALL_ITEM})*"
                             r" response\.(completed|incomplete)")


def _message_of_events(events: list[dict]) -> dict:
    """A streamed /v1/messages reply's events (dicts, in order) -> the message they add up to;
    asserts their order (message_start, blocks opened, fed and closed one at a time, message_delta,
    message_stop) and that each delta feeds the open block with its own kind."""
    kinds = " ".join(e["type"] for e in events)
    assert MESSAGE_EVENTS.fullmatch(kinds), kinds
    start, delta = events[0]["message"], events[-2]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 0
    blocks, json_of = [], {}
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks), e
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            assert e["index"] == len(blocks) - 1, e
            b, d = blocks[-1], e["delta"]
            if d["type"] == "text_delta":
                assert b["type"] == "text", e
                b["text"] += d["text"]
            else:
                assert (b["type"], d["type"]) == ("tool_use", "input_json_delta"), e
                json_of[e["index"]] = json_of.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "content_block_stop":
            assert e["index"] == len(blocks) - 1, e
    for i, raw in json_of.items():
        blocks[i]["input"] = json.loads(raw)
    return {"type": "message", "content": blocks, "stop_reason": delta["delta"]["stop_reason"],
            "stop_sequence": delta["delta"]["stop_sequence"],
            "usage": {"input_tokens": start["usage"]["input_tokens"], "output_tokens": delta["usage"]["output_tokens"]}}


def _check_message(m: dict, n: int, stops=(), tool=None) -> None:
    """A whole /v1/messages reply: text cut by max_tokens (n tokens) or one of the stop sequences,
    or (tool: the tool_choice sent) one tool_use block whose input validates against its schema."""
    assert m["type"] == "message" and m["usage"]["input_tokens"] > 0, m
    if tool is not None:
        (use,) = m["content"]
        assert m["stop_reason"] == "tool_use" and use["type"] == "tool_use" and use["id"].startswith("toolu_"), m
        assert use["name"] == tool.get("name", use["name"]), m
        jsonschema.validate(use["input"], SCHEMAS[use["name"]])
        return
    assert len(m["content"]) <= 1 and all(b["type"] == "text" for b in m["content"]), m
    text = "".join(b["text"] for b in m["content"])
    if m["stop_reason"] == "stop_sequence":
        assert m["stop_sequence"] in stops and m["usage"]["output_tokens"] <= n, m
        assert not any(s in text for s in stops), m
    else:
        assert (m["stop_reason"], m["stop_sequence"], m["usage"]["output_tokens"]) == ("max_tokens", None, n), m


def _response_of_events(events: list[dict]) -> dict:
    """A streamed /v1/responses reply's events (dicts) -> its terminal event's response; asserts
    the sequence numbers, the events' order (created, in_progress, each item added, fed and done,
    then completed or incomplete) and that the deltas add up to each done event and the output."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = " ".join(e["type"] for e in events)
    assert RESPONSE_EVENTS.fullmatch(kinds), kinds
    final, items, fed = events[-1]["response"], [], ""
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items), e
            items.append(e["item"])
            fed = ""
        elif e["type"].endswith(".delta"):
            assert (e["item_id"], e["output_index"]) == (items[-1]["id"], len(items) - 1), e
            fed += e["delta"]
        elif e["type"] == "response.output_text.done":
            assert e["text"] == fed, e
        elif e["type"] == "response.function_call_arguments.done":
            assert e["arguments"] == fed, e
        elif e["type"] == "response.output_item.done":
            items[-1] = e["item"]
            assert e["item"] == final["output"][len(items) - 1], e
    assert len(items) == len(final["output"])
    return final


def _check_response(r: dict, n: int, kind: str, tool=None) -> None:
    """A whole /v1/responses reply: kind "text" (ignore_eos: cut at max_output_tokens = n), "json"
    (one message validating against ANSWER) or "call" (one function_call valid for its schema;
    tool: the tool_choice sent)."""
    u = r["usage"]
    assert r["object"] == "response" and u["total_tokens"] == u["input_tokens"] + u["output_tokens"], r
    if kind == "call":
        (call,) = r["output"]
        assert r["status"] == "completed" and call["type"] == "function_call" and call["call_id"].startswith("call_"), r
        assert call["name"] == (tool["name"] if isinstance(tool, dict) else call["name"]), r
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        return
    assert all(o["type"] == "message" for o in r["output"]) and len(r["output"]) <= 1, r
    text = "".join(p["text"] for o in r["output"] for p in o["content"])
    if kind == "json":
        assert r["status"] == "completed", r
        jsonschema.validate(json.loads(text), ANSWER)
    else:
        assert (r["status"], r["incomplete_details"], u["output_tokens"]) == (
            "incomplete", {"reason": "max_output_tokens"}, n), r


async def _sse(c, path: str, body: dict, leave: str | None = None):
    """POST a streamed request with raw HTTP -> its events (dicts, the event line checked against
    each data's type), or None when `leave` names the event after which the client left. A 429
    (the queue is full) is retried after its Retry-After, as the official clients do."""
    for _ in range(8):
        events = []
        async with c.stream("POST", path, json=body) as r:
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            assert r.status_code == 200, await r.aread()
            name = None
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    assert events[-1]["type"] == name, (name, events[-1])
                    if name == leave:
                        return None
        return events
    pytest.fail(f"{path} still answered 429 after 8 tries")


def test_load(server):
    """200 requests from 32 concurrent clients over every endpoint: completions and chat (random
    lengths, some streamed, some leaving mid-stream, some completions echoing their prompt's
    log-probabilities), the Anthropic Messages API (system, content blocks, stop sequences, forced
    tool_use, streamed with its event types, some leaving) and the Responses API (input as text and
    as items, instructions, text.format json_schema, function calls, streamed, some leaving), and
    bad requests. Every request that stayed gets a complete valid answer in its API's shape (call
    inputs and schema outputs validate, streams' events in order to their terminal event), each bad
    one a 4xx in its API's error shape, nothing hangs, every row is free afterwards, the server's
    RSS stays flat."""
    anthropic = pytest.importorskip("anthropic")
    base, proc = server
    rng = random.Random(0)
    words = "the capital of france is paris one two three four five model question answer".split()
    claude_tools = [{"name": k, "description": k, "input_schema": v} for k, v in SCHEMAS.items()]
    resp_tools = [{"type": "function", "name": k, "description": k, "parameters": v} for k, v in SCHEMAS.items()]
    kinds = {"completions_stream": 14, "chat": 14, "completions": 10, "lmeval": 8, "messages": 10,
             "messages_stream": 8, "messages_tool": 6, "responses": 8, "responses_stream": 8, "responses_json": 5,
             "responses_tool": 5, "bad": 4}

    async def one(c, i, stats, kind):
        stats["kinds"].add(kind)  # every kind was sent (a failed request fails the run)
        n = rng.randint(1, 24)
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        short = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        mode, streamed = rng.random(), rng.random() < 0.4
        temperature = rng.choice([0, 0.8])
        kw = dict(model=NAME, max_tokens=n, temperature=temperature, seed=i, extra_body={"ignore_eos": True})
        if kind == "completions_stream":
            leave = mode < 0.4
            # some echo their prompt first (with its log-probabilities), some of those leave
            echo = dict(echo=True, logprobs=1) if mode < 0.2 or 0.8 < mode else {}
            stream = await c.oai.completions.create(prompt=prompt, stream=True, **echo, **kw)
            got, finish = 0, None
            async for ch in stream:
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                got += 1
                if leave and got == 2:
                    await stream.close()
                    stats["left"] += 1
                    return
            assert finish == "length"
        elif kind == "chat":
            r = await c.oai.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
        elif kind == "completions":
            r = await c.oai.completions.create(prompt=prompt, **kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
            assert isinstance(r.choices[0].text, str)
        elif kind == "lmeval":  # lm-eval's scoring request: echo with the prompt's log-probabilities, max_tokens 0 or n
            kw["max_tokens"] = n = rng.choice([0, n])
            r = await c.oai.completions.create(prompt=prompt, echo=True, logprobs=1, **kw)
            lp = r.choices[0].logprobs
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
            assert len(lp.token_logprobs) == r.usage.prompt_tokens + n and lp.token_logprobs[0] is None
        elif kind.startswith("messages"):
            # the system prompt as a string or text blocks, the question as a string or split into blocks
            system = SYSTEM if mode < 0.5 else [{"type": "text", "text": SYSTEM[:9]}, {"type": "text", "text": SYSTEM[9:]}]
            content = short if mode < 0.25 or mode > 0.75 else [{"type": "text", "text": w + " "} for w in short.split()]
            body = dict(model=NAME, max_tokens=n, system=system, messages=[{"role": "user", "content": content}],
                        stop_sequences=rng.sample(["e", "the", "one", "\x00never"], 2))
            extra = {"ignore_eos": True, "temperature": temperature}  # sampling: not in this client's signature
            tool = None
            if kind == "messages_tool":  # forced calls: the tool named, or any tool (one call)
                tool = {"type": "tool", "name": rng.choice(list(SCHEMAS))} if mode < 0.5 else \
                    {"type": "any", "disable_parallel_tool_use": True}
                body.update(max_tokens=72, tools=claude_tools, tool_choice=tool, messages=[
                    {"role": "user", "content": "Weather in Paris?"}])
                del body["system"], body["stop_sequences"]
            if kind == "messages" or (kind == "messages_tool" and not streamed):
                m = (await c.claude.messages.create(**body, extra_body=extra)).model_dump()
            elif mode < 0.5 and kind == "messages_stream":  # the raw events, ping included; some leave
                body["max_tokens"] = n = 24 if mode < 0.3 else n
                events = await _sse(c.raw, "/v1/messages", {**body, **extra, "stream": True},
                                    leave="content_block_delta" if mode < 0.3 else None)
                if events is None:
                    stats["left"] += 1
                    return
                m = _message_of_events(events)
            else:  # through the client's stream
                events = [e.model_dump() async for e in await c.claude.messages.create(
                    **body, stream=True, extra_body=extra)]
                m = _message_of_events(events)
            _check_message(m, body["max_tokens"], body.get("stop_sequences", ()), tool)
        elif kind.startswith("responses"):
            body = dict(model=NAME, max_output_tokens=n, temperature=temperature, extra_body={"ignore_eos": True})
            if mode < 0.5:  # text, with instructions; else items: the instructions as a developer message
                body.update(input=short, instructions=SYSTEM)
            else:
                body["input"] = [{"role": "developer", "content": SYSTEM},
                                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": short}]}]
            check, tool = "text", None
            if kind == "responses_json":
                body.update(max_output_tokens=40, text={"format": {"type": "json_schema", "name": "answer",
                                                                    "schema": ANSWER, "strict": True}})
                check = "json"
            elif kind == "responses_tool":
                tool = {"type": "function", "name": rng.choice(list(SCHEMAS))} if mode < 0.5 else "required"
                body.update(max_output_tokens=72, tools=resp_tools, tool_choice=tool, parallel_tool_calls=False,
                            input="Weather in Paris?")
                body.pop("instructions", None)
                check = "call"
            if kind == "responses_stream" or (kind != "responses" and streamed):
                leave = kind == "responses_stream" and mode < 0.3
                if leave:
                    body["max_output_tokens"] = 24
                stream = await c.oai.responses.create(**body, stream=True)
                events = []
                async for e in stream:
                    events.append(e.model_dump())
                    if leave and e.type == "response.output_text.delta":
                        await stream.close()
                        stats["left"] += 1
                        return
                r = _response_of_events(events)
            else:
                r = (await c.oai.responses.create(**body)).model_dump()
            _check_response(r, body["max_output_tokens"], check, tool)
        else:  # a bad request: a 4xx in its API's own error shape
            path, fields, status, what = rng.choice(LOAD_BAD)
            good = {"/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": short}]},
                    "/v1/responses": {"max_output_tokens": 4, "input": short},
                    "/v1/chat/completions": {"max_tokens": 4, "messages": [{"role": "user", "content": short}]},
                    "/v1/completions": {"max_tokens": 4, "prompt": short}}[path]
            req = {k: v for k, v in {"model": NAME, **good, **fields}.items() if v is not None}
            r = await c.raw.post(path, json=req)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            if path == "/v1/messages":
                assert r.json()["type"] == "error" and set(err) == {"type", "message"} and err["type"] == what, r.text
            else:
                assert {"message", "type", "param", "code"} <= set(err) and err["param"] == what, r.text
            stats["bad"] += 1
            return
        stats["ok"] += 1

    async def run(total, warm=False):
        stats = {"ok": 0, "left": 0, "bad": 0, "kinds": set()}
        # the clients retry 429s (a full queue) themselves, honouring Retry-After
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=8) as oai, \
                anthropic.AsyncAnthropic(base_url=base, api_key=KEY, timeout=120, max_retries=8) as claude, \
                httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {KEY}",
                                                                       "x-api-key": KEY}) as raw:
            c = types.SimpleNamespace(oai=oai, claude=claude, raw=raw)
            sem = asyncio.Semaphore(32)
            # warm: every kind in turn (allocator pools, prompt length classes, grammars); then at random
            order = [list(kinds)[i % len(kinds)] for i in range(total)] if warm else \
                rng.choices(list(kinds), weights=list(kinds.values()), k=total)

            async def guarded(i):
                async with sem:
                    await one(c, i, stats, order[i])
            await asyncio.gather(*(guarded(i) for i in range(total)))
        return stats

    asyncio.run(asyncio.wait_for(run(36, warm=True), 300))
    before = _rss(proc)
    stats = asyncio.run(asyncio.wait_for(run(200), 600))
    assert stats["ok"] + stats["left"] + stats["bad"] == 200 and stats["left"] > 0 and stats["bad"] > 0, stats
    assert stats["kinds"] == set(kinds), stats
    deadline = time.monotonic() + 30
    while (h := httpx.get(base + "/health").json())["running"] or h["waiting"]:
        assert time.monotonic() < deadline, f"rows still held after the load: {h}"
        time.sleep(0.2)
    growth = _rss(proc) - before
    assert growth < 64 * 2**20, f"server RSS grew by {growth / 2**20:.1f} MiB over 200 requests"
    assert _post(base, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
    # the load went through the policies the fixture turned on: drafts verified, prefixes reused
    seen = {line.split()[0]: float(line.split()[1]) for line in httpx.get(base + "/metrics").text.splitlines()
            if line and not line.startswith("#")}
    assert seen["zoo_spec_draft_tokens_total"] > 0 and seen["zoo_prefix_cache_hits_total"] > 0, seen
