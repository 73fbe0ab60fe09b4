"""A bounded soak of `zoo serve`: a fixed count of requests (and a time limit) from a fixed
number of concurrent clients, a mix of streamed, structured (json_schema), tool-call, cancelled
(the client leaves mid-stream) and long-prompt requests, every one greedy. Then each distinct
request that was answered whole is sent again, one at a time, and the two answers compared.

    python scripts/soak_serve.py [--conf smollm2_135m | --tiny] [--requests 300] [--seconds 300]
                                 [--concurrency 8] [--max-seq 1024] [--out scripts/results/soak_serve.json]

What it reports (and its exit code checks): no 5xx, every answered request complete, the
server's RSS sampled every --sample seconds (first / last / max, and its growth from the end of
the warm-up to the end of the load besides the prefix store's, which fills up to
prefix_cache_mib by design: under 128 MiB), greedy answers under load equal to the same requests sent alone.
Committed: scripts/results/soak_serve.json (--tiny, 300 requests) and soak_serve_smollm2.json
(`--requests 150 --seconds 180`). --tiny serves the random checkpoint the tests use (tests/serve_fixtures.py), written to a temp
dir. The server runs eagerly (compile=false): the soak is about the server, not the graphs.
Timings depend on the machine's load: on a shared machine they are no measurement.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results" / "soak_serve.json"
KINDS = ("stream", "structured", "tool", "cancelled", "long", "plain")
TOPICS = ["the capital of France", "a small model", "the number seven", "rain in spring", "a red bicycle",
          "the sea at night", "three friends", "a good breakfast", "the oldest tree", "counting to ten"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24},
                                           "sure": {"type": "boolean"}}, "required": ["answer", "sure"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 16}},
                                               "required": ["city"]}}}]


def request(i: int, long_words: int) -> tuple[str, dict]:
    """The i-th request of the mix: (kind, body). Requests repeat every len(KINDS) x len(TOPICS)."""
    kind = KINDS[i % len(KINDS)]
    topic = TOPICS[(i // len(KINDS)) % len(TOPICS)]
    body = {"model": "soak", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}
    if kind in ("stream", "cancelled"):
        body["stream"] = True
    if kind == "structured":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        body["max_tokens"] = 40
    elif kind == "tool":
        body["tools"], body["tool_choice"] = TOOLS, "required"
        body["messages"][0]["content"] = f"What is the weather where {topic} is?"
        body["max_tokens"] = 40
    elif kind == "long":
        body["messages"][0]["content"] = (f"Here are some notes about {topic}: "
                                          + " ".join(TOPICS[(i + k) % len(TOPICS)] for k in range(long_words))
                                          + ". Summarize them.")
    return kind, body


def answer_of(kind: str, resp: dict | None, chunks: list[dict]) -> dict:
    """What is compared: content (and tool calls) with the finish reason."""
    if kind in ("stream", "cancelled"):
        text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
        finish = next((c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")
                       and c["choices"][0].get("finish_reason")), None)
        return {"content": text, "finish": finish}
    msg = resp["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return {"content": msg.get("content"), "tool_calls": calls, "finish": resp["choices"][0]["finish_reason"]}


async def send(client, i: int, long_words: int, stats: dict, leave: bool = True):
    """-> (kind, answer or None (cancelled / failed))."""
    import httpx

    kind, body = request(i, long_words)
    try:
        if body.get("stream"):
            chunks = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return kind, _status(stats, r.status_code, kind, r.text)
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunks.append(json.loads(line[6:]))
                    if "error" in chunks[-1]:
                        return kind, _status(stats, 500, kind, line)
                    if kind == "cancelled" and leave and len(chunks) >= 3:
                        stats["cancelled"] += 1
                        return kind, None  # leaving: the context manager closes the connection
            stats["ok"] += 1
            return kind, answer_of(kind, None, chunks)
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return kind, _status(stats, r.status_code, kind, r.text)
        stats["ok"] += 1
        return kind, answer_of(kind, r.json(), [])
    except httpx.HTTPError as e:
        stats["transport_errors"].append(f"{kind}: {type(e).__name__}: {e}")
        return kind, None


def _status(stats: dict, status: int, kind: str, text: str):
    key = "5xx" if status >= 500 else "4xx"
    stats[key] += 1
    stats["errors"].append(f"{status} {kind}: {text[:300]}")
    return None


def prefix_bytes(base: str) -> int:
    """The prefix store's bytes (zoo_prefix_cache_bytes): host memory that grows up to its cap
    by design, apart from any leak."""
    import httpx

    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("zoo_prefix_cache_bytes "):
            return int(float(line.split()[1]))
    return 0


def rss_sampler(pid: int, every: float, samples: list, stop):
    import psutil

    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            samples.append((round(time.monotonic(), 1), proc.memory_info().rss))
        except psutil.Error:
            return
        stop.wait(every)


async def load_phase(base: str, total: int, seconds: float, concurrency: int, long_words: int, answers: dict):
    import httpx

    stats = {"ok": 0, "cancelled": 0, "4xx": 0, "5xx": 0, "errors": [], "transport_errors": [], "sent": 0}
    deadline = time.monotonic() + seconds
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def one(i):
            async with sem:
                if time.monotonic() > deadline:
                    return
                stats["sent"] += 1
                kind, ans = await send(client, i, long_words, stats)
                if ans is not None:
                    answers.setdefault(i % (len(KINDS) * len(TOPICS)), []).append(ans)
        await asyncio.gather(*(one(i) for i in range(total)))
    return stats


async def alone_phase(base: str, keys, long_words: int) -> dict:
    """Each distinct request once, one at a time (streams read to the end)."""
    import httpx

    stats = {"ok": 0, "cancelled": 0, "4xx": 0, "5xx": 0, "errors": [], "transport_errors": []}
    out = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for k in keys:
            _, ans = await send(client, k, long_words, stats, leave=False)
            out[k] = ans
    return out, stats


def calibrate(base: str, target: int) -> int:
    """Topics in a long prompt whose chat prompt has about `target` tokens (usage.prompt_tokens
    of two probes: the slope per topic)."""
    import httpx

    def tokens(n: int) -> int:
        body = request(KINDS.index("long"), n)[1]
        r = httpx.post(base + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens"]

    a, b = tokens(2), tokens(6)
    return max(2, 2 + int((target - a) / max((b - a) / 4, 1e-9)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conf", default="smollm2_135m")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random checkpoint instead of --conf")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--long-words", type=int, default=0, help="topics in a long prompt (0: ~3/4 of max_seq)")
    ap.add_argument("--sample", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    import threading

    import httpx

    sys.path.insert(0, str(ROOT))
    from tests.serve_fixtures import free_port

    tmp = tempfile.TemporaryDirectory(prefix="zoo-soak-")
    if args.tiny:
        from tests.serve_fixtures import write_tiny_llama

        target = [f"weights={write_tiny_llama(Path(tmp.name) / 'ckpt')}"]
        label = "tiny random Llama (tests/serve_fixtures.py)"
    else:
        target = [f"conf={args.conf}"]
        label = f"conf={args.conf}"
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "zoo.cli", "serve", *target, f"port={port}", "model_name=soak",
           f"max_seq={args.max_seq}", f"max_batch={args.max_batch}", "compile=false", "log_level=warning",
           "tool_format=hermes", "max_queue=256"]
    log = open(Path(tmp.name) / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    base = f"http://127.0.0.1:{port}"
    samples: list = []
    stop = threading.Event()
    result = {"model": label, "command": " ".join(cmd[1:]), "requests": args.requests, "seconds_limit": args.seconds,
              "concurrency": args.concurrency, "kinds": list(KINDS),
              "note": "run on a shared machine at nice 19: durations are not measurements"}
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"zoo serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                raise SystemExit("zoo serve did not answer /health within 900 s")
            time.sleep(1)
        result["startup_seconds"] = round(time.monotonic() - t0, 1)
        # a long prompt fills about three quarters of the context (its length in topics measured
        # through the server's own token count)
        long_words = args.long_words or calibrate(base, args.max_seq * 3 // 4)
        result["long_prompt_topics"] = long_words
        sampler = threading.Thread(target=rss_sampler, args=(proc.pid, args.sample, samples, stop), daemon=True)
        sampler.start()
        warm: dict = {}
        asyncio.run(load_phase(base, len(KINDS) * 4, 600, args.concurrency, long_words, warm))  # allocator pools
        warm_rss = samples[-1][1] if samples else None
        warm_prefix = prefix_bytes(base)
        answers: dict = {}
        t1 = time.monotonic()
        stats = asyncio.run(load_phase(base, args.requests, args.seconds, args.concurrency, long_words, answers))
        result["load_seconds"] = round(time.monotonic() - t1, 1)
        time.sleep(args.sample)  # a sample after the load
        health = httpx.get(base + "/health", timeout=10).json()
        load_prefix = prefix_bytes(base)
        end_rss = samples[-1][1]
        alone, alone_stats = asyncio.run(alone_phase(base, sorted(answers), long_words))
        stop.set()
        sampler.join(5)
        differ = []
        compared = 0
        for k, got in sorted(answers.items()):
            for a in got:
                compared += 1
                if alone.get(k) is None or a != alone[k]:
                    differ.append({"request": k, "kind": request(k, long_words)[0], "under_load": a, "alone": alone.get(k)})
        rss = [r for _, r in samples]
        mib = 2 ** 20
        result.update({
            "load": {k: v for k, v in stats.items() if k not in ("errors", "transport_errors")},
            "errors": stats["errors"][:20], "transport_errors": stats["transport_errors"][:20],
            "after_load_health": health,
            "alone": {k: v for k, v in alone_stats.items() if k not in ("errors", "transport_errors")},
            "alone_errors": alone_stats["errors"][:20],
            "compared": compared, "distinct_requests": len(answers), "differ": differ[:20], "n_differ": len(differ),
            "rss_mib": {"first": round(rss[0] / mib, 1), "after_warmup": round((warm_rss or rss[0]) / mib, 1),
                        "last": round(rss[-1] / mib, 1), "max": round(max(rss) / mib, 1), "samples": len(rss),
                        "every_seconds": args.sample},
            # RSS growth over the load with the prefix store's own growth (bounded by
            # prefix_cache_mib, default 1024) taken out: what a leak would show in
            "prefix_cache_mib": {"after_warmup": round(warm_prefix / mib, 1), "after_load": round(load_prefix / mib, 1)},
            "growth_mib_besides_prefix_cache": round(((end_rss - (warm_rss or rss[0])) - (load_prefix - warm_prefix)) / mib, 1),
        })
        ok = (result["growth_mib_besides_prefix_cache"] < 128 and stats["5xx"] == 0 and alone_stats["5xx"] == 0 and not stats["transport_errors"] and not differ
              and health["running"] == 0 and health["waiting"] == 0)
        result["verdict"] = "ok" if ok else "failed"
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        tmp.cleanup()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("verdict", "load", "n_differ", "rss_mib", "prefix_cache_mib",
                                             "growth_mib_besides_prefix_cache") if k in result}, indent=1))
    print(f"wrote {out}")
    return 0 if result.get("verdict") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
