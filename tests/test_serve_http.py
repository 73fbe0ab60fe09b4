"""A real `zoo serve` process on 127.0.0.1 (a random free port, started and stopped here) with a
tiny random Llama checkpoint that has a real tokenizer, talked to with the official `openai`
client and raw HTTP: the endpoints and fields users send, the bad-input matrix, and a bounded
load test (200 requests, 32 concurrent clients, some leaving mid-stream)."""
from __future__ import annotations

import asyncio
import json
import random
import time

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


def test_load(server):
    """200 requests from 32 concurrent clients (random lengths, a quarter streamed, some of those
    leaving mid-stream, some completions echoing their prompt's log-probabilities): every request
    that stayed gets a complete valid answer, nothing hangs, every row is free afterwards, the
    server's RSS stays flat."""
    base, proc = server
    rng = random.Random(0)
    words = "the capital of france is paris one two three four five model question answer".split()

    async def one(c, i, stats):
        n = rng.randint(1, 24)
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        mode = rng.random()
        kw = dict(model=NAME, max_tokens=n, temperature=rng.choice([0, 0.8]), seed=i, extra_body={"ignore_eos": True})
        if mode < 0.25:
            leave = mode < 0.1
            # some echo their prompt first (with its log-probabilities), some of those leave
            echo = dict(echo=True, logprobs=1) if mode < 0.05 or 0.2 < mode else {}
            stream = await c.completions.create(prompt=prompt, stream=True, **echo, **kw)
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
        elif mode < 0.6:
            r = await c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
        elif mode < 0.85:
            r = await c.completions.create(prompt=prompt, **kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
            assert isinstance(r.choices[0].text, str)
        else:  # lm-eval's scoring request: echo with the prompt's log-probabilities, max_tokens 0 or n
            kw["max_tokens"] = n = rng.choice([0, n])
            r = await c.completions.create(prompt=prompt, echo=True, logprobs=1, **kw)
            lp = r.choices[0].logprobs
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
            assert len(lp.token_logprobs) == r.usage.prompt_tokens + n and lp.token_logprobs[0] is None
        stats["ok"] += 1

    async def run(total):
        stats = {"ok": 0, "left": 0}
        # the client retries 429s (a full queue) itself, honouring Retry-After
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=8) as c:
            sem = asyncio.Semaphore(32)

            async def guarded(i):
                async with sem:
                    await one(c, i, stats)
            await asyncio.gather(*(guarded(i) for i in range(total)))
        return stats

    asyncio.run(asyncio.wait_for(run(32), 300))  # warm: allocator pools, every prompt length class
    before = _rss(proc)
    stats = asyncio.run(asyncio.wait_for(run(200), 600))
    assert stats["ok"] + stats["left"] == 200 and stats["left"] > 0
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
