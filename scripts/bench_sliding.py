"""Decode step time of sliding-window layers as the context grows (ring cache), against the same
twin with full attention (a cache of max_seq slots).

    python scripts/bench_sliding.py                                   # contexts 1024 and 16384, window 512
    python scripts/bench_sliding.py --contexts 64 256 --window 32 --steps 8 --rounds 1   # quick check
    python scripts/bench_sliding.py --json scripts/results/sliding_mistral_tiny.json

The model is a tiny twin (default mistral_7b_tiny: every layer GQA) with random weights, compiled,
batch 1, float32. Each engine is built with max_seq = context + steps, fills its cache to
`context` tokens for real (a prefill of --prompt tokens, then one decode step per token), then
times `steps` further decode steps; the best median of `rounds` is reported. A sliding layer
keeps min(window, max_seq) slots, so its step time should not move between contexts; the full
attention twin reads max_seq slots a step and grows.
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

import zoo  # noqa: E402


def measure(conf: str, window: int | None, context: int, steps: int, prompt: int, rounds: int,
            mixer: str) -> dict:
    overrides = [f"mixers.{mixer}.window={'null' if window is None else window}"]
    m = zoo.build(conf, overrides=overrides, compile=True, max_batch=1, max_seq=context + steps)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.spec.vocab_size, (1, min(prompt, context)), generator=gen)
    best = None
    for _ in range(rounds):
        logits = m.prefill(ids)
        tok = logits[:, -1].argmax(-1)
        for _ in range(context - ids.shape[1]):  # fill the cache to `context` tokens
            tok = m.decode(tok).argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = m.decode(tok).argmax(-1)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        best = med if best is None else min(best, med)
    cache = sum(t.numel() * t.element_size() for layer in m.engine.caches for t in layer.values())
    return {"window": window, "context": context, "step_ms": best * 1e3, "cache_bytes": cache,
            "graphs": m.engine.graph_counts()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conf", default="mistral_7b_tiny")
    p.add_argument("--mixer", default="attn", help="the mixers.<name> whose window is set")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per round")
    p.add_argument("--prompt", type=int, default=256, help="prefill length before the cache is filled by decode")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = []
    for window in (args.window, None):
        for context in args.contexts:
            row = measure(args.conf, window, context, args.steps, args.prompt, args.rounds, args.mixer)
            rows.append(row)
            kind = f"sliding {window}" if window else "full"
            print(f"{kind:>12}  context {context:>6}: {row['step_ms']:.3f} ms/step, "
                  f"cache {row['cache_bytes'] / 2**20:.2f} MiB, graphs {row['graphs']}", flush=True)
    first, last = args.contexts[0], args.contexts[-1]
    for window in (args.window, None):
        a, b = (next(r for r in rows if r["window"] == window and r["context"] == c) for c in (first, last))
        print(f"{'sliding' if window else 'full':>7}: step time x{b['step_ms'] / a['step_ms']:.2f} "
              f"from context {first} to {last}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
