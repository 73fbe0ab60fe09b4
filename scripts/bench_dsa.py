"""Decode step time vs context length: DeepSeek Sparse Attention against dense MLA (not a test).

    python scripts/bench_dsa.py                                   # glm5_tiny, top-k 64, batch 8
    python scripts/bench_dsa.py --contexts 256,1024,4096 --topk 32 --batch 4 --compile

Two models of the same shape with random weights: conf/glm5_tiny with index_topk=K (the dsa
mixer: each decode step gathers the top-K latent entries and attends over those), and its MLA
twin (the same conf with the mixer swapped for `mla`, no indexer: attention over the whole
context). For each context T, the caches are filled with random values up to T (a prefill of T
tokens would only cost time; the decode step cost does not depend on the cached values) and the
decode step is timed:

  step        the whole decode step (embedding, 3 blocks, head)
  mixers      every layer's mixer.decode on the filled cache, called eagerly even with --compile
              (DSA: indexer over T keys + attention over K; MLA: attention over T)
  indexer     DSA only: the indexers' share (keys, scores over the T cached keys, top-K)
  attention   DSA mixers - indexer: projections, the gather of K latent entries and attention
              over them; flat in T
Times in ms, best of --repeats.

Runs in this process on the CPU, threads as torch sets them (--threads to pin). With --compile,
keep batch * (T + 1) * 2 < 32767 and T < 4096: beyond, the compiled prefill graph (built at
warm-up) hits inductor guards (MoE's argsort indices, CPU sum reductions) for any MoE/MLA model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(kind: str, topk: int, batch: int, max_seq: int, compile: bool):
    from omegaconf import OmegaConf

    from zoo.compiler.config import compose
    from zoo.runtime import _runtime_overrides, build_from_config

    cfg = compose("glm5_tiny", [f"mixers.attn.index_topk={topk}"])
    if kind == "mla":  # the MLA twin: the same attention without the indexer
        attn = OmegaConf.to_container(cfg.mixers.attn)
        cfg.mixers.attn = {k: v for k, v in attn.items() if not k.startswith("index_")} | {"kind": "mla"}
    _runtime_overrides(cfg, max_batch=batch, max_seq=max_seq, compile=compile)
    return build_from_config(cfg, f"conf/glm5_tiny ({kind})")


@torch.no_grad()
def fill(model, context: int, batch: int) -> None:
    """Random cache contents at positions 0..context-1, every row ready to decode at `context`."""
    e = model.engine
    e.reset()
    gen = torch.Generator().manual_seed(0)
    for layer in e.caches:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    e.pos.fill_(context)
    e.length, e.batch = context, batch


def best_ms(fn, repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@torch.no_grad()
def measure(model, context: int, batch: int, repeats: int) -> dict:
    e = model.engine
    tok = torch.zeros(batch, dtype=torch.long)

    def step():
        fill_pos = e.pos.clone()
        model.decode(tok)
        e.pos.copy_(fill_pos)  # decode the same position again (no growth between repeats)
        e.length -= 1

    fill(model, context, batch)
    x = torch.randn(batch, 1, model.spec.dim, generator=torch.Generator().manual_seed(1))
    pos = torch.full((batch,), context)
    ctx = {"pos": pos, "ids": tok[:, None],
           "rope": {k: (cos[pos], sin[pos]) for k, (cos, sin) in e.rope.items()}}

    def mixers():
        for block, cache in zip(model.module.layers, e.caches):
            block.mixer.decode(x, cache, ctx)

    out = {"step_ms": best_ms(step, repeats), "mixer_ms": best_ms(mixers, repeats), "indexer_ms": 0.0}
    indexers = [(b.mixer, c) for b, c in zip(model.module.layers, e.caches) if hasattr(b.mixer, "indexer")]
    if indexers:
        def select():
            for mixer, cache in indexers:
                cos, sin = ctx["rope"][mixer.rope]
                mixer.indexer.keys(x, cos[:, None], sin[:, None])
                mixer.indexer.select_decode(x, mixer.query_residual(x), cache["index_k"], pos, cos, sin)

        out["indexer_ms"] = best_ms(select, repeats)
    out["attention_ms"] = out["mixer_ms"] - out["indexer_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="regional-compiled decode graphs (one per context)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for T in contexts:
        row = {"context": T}
        for kind in ("dsa", "mla"):
            model = build(kind, args.topk, args.batch, T + 1, args.compile)
            row[kind] = measure(model, T, args.batch, args.repeats)
            del model
        rows.append(row)
        print(f"T={T:>6} done", flush=True)
    print(f"\nglm5_tiny, index_topk={args.topk}, batch {args.batch}, threads {torch.get_num_threads()}, "
          f"{'compiled' if args.compile else 'eager'}; ms, best of {args.repeats}")
    print(f"{'context':>8} | {'DSA step':>9} {'MLA step':>9} | {'DSA mixers':>10} {'indexer':>8} {'attention':>9} | "
          f"{'MLA mixers':>10} | mixers MLA/DSA")
    for r in rows:
        d, m = r["dsa"], r["mla"]
        print(f"{r['context']:>8} | {d['step_ms']:9.3f} {m['step_ms']:9.3f} | {d['mixer_ms']:10.3f} "
              f"{d['indexer_ms']:8.3f} {d['attention_ms']:9.3f} | {m['mixer_ms']:10.3f} | "
              f"{m['mixer_ms'] / d['mixer_ms']:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"topk": args.topk, "batch": args.batch, "compile": args.compile,
                                               "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
