"""Time to first token of a second request that shares a long prefix with the first (prefix
reuse, compiler/engine/prefix.py), against the same request on a cold server (issue 28 item 3:
>= 5x better at a 2k-token shared prefix).

    python scripts/bench_prefix.py                                   # SmolLM2-135M int4, 2048-token prefix
    python scripts/bench_prefix.py --conf smollm2_135m --prefix 2048 --rounds 3 --json scripts/results/prefix.json
    python scripts/bench_prefix.py --conf llama3_8b_tiny --prefix 256 --rounds 1 --no-compile   # quick check

Each round runs the scheduler (zoo/serve/scheduler.py, stepped on this thread, no HTTP) of one
built model twice: cold (prefix_cache_bytes=0) and warm (the default store). In both, request A
(the shared prefix + question A) runs to its first token first; then request B (the shared
prefix + question B) is submitted and timed from submission to its first token. Cold, B
prefills prefix + question; warm, B copies A's cached prefix into its row and extends only its
question. Reported: the median over rounds of each TTFT, their ratio, whether B's first token is
the same both ways (greedy), and the tokens the warm store reused in each round (the prefix).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/bench.py: machine())

import zoo  # noqa: E402
from zoo.serve.scheduler import PREFIX_CACHE_BYTES, SamplingParams, Scheduler, Sequence  # noqa: E402


def first_token_seconds(sched: Scheduler, prompt: list[int]) -> tuple[float, int]:
    """Submit one greedy request, step until its first token: (seconds, the token)."""
    seq = Sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0), sink=lambda ev: None)
    t0 = time.perf_counter()
    sched.submit([seq])
    while not seq.tokens:
        sched.step()
    seconds = time.perf_counter() - t0
    while sched.step():  # let it finish (the conversation is stored, as a server would)
        pass
    return seconds, seq.tokens[0]


def scenario(model, prefix: int, question: int, rounds: int, seed: int = 0) -> dict:
    """TTFT of request B (prefix + its question) after request A (prefix + another), cold and
    warm; the function the README's number comes from."""
    gen = torch.Generator().manual_seed(seed)
    V = model.spec.vocab_size
    cold, warm, same, reused = [], [], True, []
    for r in range(rounds):
        shared = torch.randint(0, V, (prefix,), generator=gen).tolist()
        a = shared + torch.randint(0, V, (question,), generator=gen).tolist()
        b = shared + torch.randint(0, V, (question,), generator=gen).tolist()
        tokens = {}
        for name, nbytes, out in (("cold", 0, cold), ("warm", PREFIX_CACHE_BYTES, warm)):
            sched = Scheduler(model, eos_ids=[], prefix_cache_bytes=nbytes)
            sched.warmup()
            first_token_seconds(sched, a)
            seconds, tokens[name] = first_token_seconds(sched, b)
            out.append(seconds)
            if sched.prefix is not None:
                reused.append(sched.prefix.tokens_reused)
        same = same and tokens["cold"] == tokens["warm"]
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix": prefix, "question": question, "rounds": rounds, "ttft_cold_s": c, "ttft_warm_s": w,
            "speedup": c / w, "same_first_token": same, "warm_tokens_reused": reused}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conf", default="smollm2_135m")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = zoo.build(args.conf, quant=args.quant or None, compile=not args.no_compile, max_batch=4,
                      max_seq=args.prefix + args.question + 8)
    result = {**bench.machine(), "conf": args.conf, "quant": args.quant, "runner": model.engine.runner,
              **scenario(model, args.prefix, args.question, args.rounds)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
