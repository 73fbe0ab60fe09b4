"""`zoo serve` under hostile requests (zoo/serve/limits.py): absurd fields, bodies that are not
JSON, not UTF-8, nested past the bound or larger than the cap, grammars that explode, thousands
of tools, a client that never reads its stream. Each gets a 4xx in the OpenAI error shape, or a
bounded answer, and never holds up another client. And the KV budget refused at start. The
server is a real process on the tiny checkpoint the serve tests use (tests/serve_fixtures.py);
the long version of this is scripts/soak_serve.py."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.serve_fixtures import running_server, write_tiny_llama

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

NAME = "tiny"
MAX_SEQ, MAX_BATCH = 128, 4
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("hostile") / "ckpt")


@pytest.fixture(scope="module")
def base(ckpt, tmp_path_factory):
    args = [f"weights={ckpt}", f"model_name={NAME}", f"max_seq={MAX_SEQ}", f"max_batch={MAX_BATCH}",
            "compile=false", "log_level=warning", "prefix_cache_mib=64"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (url, _):
        yield url


def _nested_schema(levels: int) -> dict:
    s = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _chat(**kw) -> dict:
    return {"model": NAME, "messages": CHAT, "max_tokens": 4, **kw}


def _tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


HOSTILE = [
    # (name, path, body (dict) or raw bytes, status, code)
    ("max_tokens 1e18", "/v1/chat/completions", _chat(max_tokens=10 ** 18), 400, "context_length_exceeded"),
    ("n 1e9", "/v1/chat/completions", _chat(n=10 ** 9), 400, "invalid_value"),
    ("top_logprobs 1e9", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=10 ** 9), 400, "invalid_value"),
    ("logprobs 1e9", "/v1/completions", {"model": NAME, "prompt": "hi", "logprobs": 10 ** 9}, 400, "invalid_value"),
    ("seed 1e30", "/v1/completions", {"model": NAME, "prompt": "hi", "seed": 10 ** 30, "max_tokens": 2}, 400,
     "invalid_value"),
    ("prompt past the context", "/v1/completions", {"model": NAME, "prompt": "one two " * 400, "max_tokens": 2}, 400,
     "context_length_exceeded"),
    ("prompt of megabytes", "/v1/completions", {"model": NAME, "prompt": "x" * (4 << 20), "max_tokens": 2}, 400,
     "context_length_exceeded"),
    ("schema nested 40 deep", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(40)}}),
     400, "invalid_json"),
    ("JSON nested 10^5 deep", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("5000 tools", "/v1/chat/completions", _chat(tools=_tools(5000)), 400, "invalid_value"),
    ("10^5 choices", "/v1/chat/completions", _chat(choice=[f"c{i}" for i in range(100_000)]), 400, "invalid_grammar"),
    ("1 MB stop string", "/v1/completions", {"model": NAME, "prompt": "hi", "stop": ["x" * 10 ** 6]}, 400,
     "invalid_value"),
    ("invalid UTF-8", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     400, "invalid_json"),
    ("not JSON", "/v1/completions", b"hello", 400, "invalid_json"),
    ("NaN temperature", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400,
     "invalid_value"),
    # llguidance's lexer runs out of fuel on its first token (zoo's GRAMMAR_LIMITS): that request only
    ("regex blowup", "/v1/chat/completions", _chat(regex="((a{100}){100}){100}"), 400, "invalid_grammar"),
    ("right-recursive Lark", "/v1/chat/completions",
     # every output starts with "(" (no short way out), after which the parser's row predicts
     # all 3001 branches: past llguidance's max_items_in_row whatever token comes first
     _chat(grammar='start: x\nx: "(" y\ny: ' + " | ".join(f'"{i}" x' for i in range(3000)) + ' | ")"', temperature=0),
     400, "invalid_grammar"),
]


def _post(base: str, path: str, body, timeout: float = 60):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


@pytest.mark.parametrize("name, path, body, status, code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_an_openai_error(base, name, path, body, status, code):
    t0 = time.perf_counter()
    r = _post(base, path, body)
    assert r.status_code == status, r.text[:400]
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error", err
    assert time.perf_counter() - t0 < 20, f"{name}: answered after {time.perf_counter() - t0:.1f} s"


def test_body_cap_by_length_and_by_bytes_read(base):
    from zoo.serve.limits import MAX_BODY_BYTES

    big = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = _post(base, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert str(MAX_BODY_BYTES) in r.json()["error"]["message"]

    def pieces():  # chunked: no Content-Length, so the cap is counted on the bytes read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = httpx.post(base + "/v1/completions", content=pieces(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]


def _answer(base: str, out: dict) -> None:
    t0 = time.perf_counter()
    r = _post(base, "/v1/completions", {"model": NAME, "prompt": "one two three", "max_tokens": 8,
                                         "temperature": 0, "ignore_eos": True})
    out["status"], out["seconds"] = r.status_code, time.perf_counter() - t0
    out["tokens"] = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None


def test_a_client_that_never_reads_holds_up_no_one(base):
    """A stream whose client sends its request and never reads (n=2 with 20 top logprobs each
    token: more than the socket buffers hold) runs to its bounded end; another client's request
    meanwhile is answered, and afterwards every row is free though that socket stays open."""
    body = json.dumps({"model": NAME, "prompt": "one two three", "max_tokens": MAX_SEQ - 8, "n": 2, "logprobs": 20,
                       "stream": True, "ignore_eos": True}).encode()
    host, port = base.removeprefix("http://").split(":")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    slow.connect((host, int(port)))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health").json()["running"] == 0:  # the hostile stream is in flight
            assert time.monotonic() < deadline, "the never-read stream never started"
            time.sleep(0.01)
        out: dict = {}
        t = threading.Thread(target=_answer, args=(base, out))
        t.start()
        t.join(60)
        assert out.get("status") == 200 and out["tokens"] == 8, out
        deadline = time.monotonic() + 60
        while (h := httpx.get(base + "/health").json())["running"] or h["waiting"]:
            assert time.monotonic() < deadline, f"rows still held by the client that never reads: {h}"
            time.sleep(0.2)
    finally:
        slow.close()


def test_an_exploding_grammar_holds_up_no_one(base):
    """While a request whose grammar exhausts the lexer's fuel is refused, another is answered."""
    out: dict = {}
    t = threading.Thread(target=_answer, args=(base, out))
    bad = {}

    def hostile():
        bad["r"] = _post(base, "/v1/chat/completions", _chat(regex="((a{100}){100}){100}"))
    h = threading.Thread(target=hostile)
    h.start()
    t.start()
    t.join(60)
    h.join(60)
    assert out.get("status") == 200 and out["tokens"] == 8, out
    assert bad["r"].status_code == 400 and bad["r"].json()["error"]["code"] == "invalid_grammar"


def test_usual_requests_still_served(base):
    """The bounds leave ordinary requests alone: a schema, a choice, stop strings, a seed."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = _post(base, "/v1/chat/completions", _chat(max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}))
    assert r.status_code == 200, r.text[:300]
    r = _post(base, "/v1/chat/completions", _chat(choice=["Paris", "Rome"]))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("Paris", "Rome")
    r = _post(base, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3, "stop": ["\n"] * 16,
                                        "seed": -5})
    assert r.status_code == 200, r.text[:300]


# ---------------------------------------------------------------------------- the KV budget at start

def test_kv_budget_is_the_cache_plan(ckpt):
    """kv_bytes = bytes per token x max_batch x max_seq (+ state) is the build's whole cache
    plan; past the available memory it is a ConfigError naming each size."""
    from zoo.compiler.errors import ConfigError
    from zoo.serve.limits import check_kv_budget

    from zoo.runtime import from_pretrained_config

    dry = from_pretrained_config(str(ckpt), ["runtime.compile=false", "runtime.max_batch=3", "runtime.max_seq=96"], dry=True)
    b = check_kv_budget(dry.info, 3, 96, 1 << 20, available=1 << 40)
    assert b["kv_bytes"] == dry.info.cache_bytes == b["bytes_per_token"] * 3 * 96 > 0
    with pytest.raises(ConfigError, match=rf"{b['bytes_per_token']:,} bytes per token x 3 x 96") as e:
        check_kv_budget(dry.info, 3, 96, 1 << 20, available=b["needed_bytes"] - 1)
    assert "available" in str(e.value) and "max_batch=3" in str(e.value)


def test_serve_refuses_a_kv_budget_past_the_machine(ckpt, capsys):
    from zoo.cli import main

    assert main(["serve", f"weights={ckpt}", "max_batch=64", f"max_seq={10 ** 9}", "compile=false"]) == 2
    err = capsys.readouterr().err
    assert "max_batch=64 x max_seq=1000000000" in err and "bytes per token" in err and "available" in err, err
