"""Compile cost: a cold build (empty compile cache) against warm builds that reuse it.

    python scripts/bench_compile.py                       # the Llama-shaped ~40M bench model
    python scripts/bench_compile.py --case deepseek_v3_tiny --warm 2
    python scripts/bench_compile.py --json scripts/results/compile_llama40m.json

Every build runs `zoo.from_pretrained(compile=True)` in a fresh process with
ZOO_CACHE_DIR pointing at a new, empty folder for this run (TORCHINDUCTOR_CACHE_DIR unset, so
inductor uses the zoo cache): the first process compiles from scratch, the later ones find the
graphs in the cache. Reported per process: import, load, compile (setup = the CPU ISA probe,
prefill and decode = the first run of each graph, compile included) and the whole build.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def worker(path: str, max_seq: int) -> dict:
    t0 = time.perf_counter()
    import torch

    import zoo
    imported = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = zoo.from_pretrained(path, dtype=torch.float32, compile=True, max_seq=max_seq)
    build = time.perf_counter() - t0
    return {"import_s": imported, "build_s": build, "load_s": m.info.load_seconds,
            "compile_s": dict(m.info.compile_seconds), "graphs": m.engine.graph_counts()}


def main(argv=None) -> int:
    from scripts.bench import CASES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="llama40m", choices=sorted(CASES))
    ap.add_argument("--max-seq", type=int, default=640, help="the engine's max_seq (bench.py: 512 + 128)")
    ap.add_argument("--warm", type=int, default=3, help="warm processes after the cold one")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.max_seq)))
        return 0

    import torch

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        CASES[args.case][0](path)
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        env |= {"ZOO_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": str(ROOT)}
        for i in range(1 + args.warm):
            cmd = [sys.executable, __file__, "--worker", str(path), "--max-seq", str(args.max_seq)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"build {i} failed:\n{proc.stderr[-4000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs[0], runs[1:]
    total = {i: sum(r["compile_s"].values()) for i, r in enumerate(runs)}
    print(f"\n== compile cost, case {args.case} (max_seq {args.max_seq}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'process':10s}{'import':>9s}{'load':>8s}{'setup':>8s}{'prefill':>9s}{'decode':>9s}"
          f"{'compile':>9s}{'build':>8s}  graphs")
    for i, r in enumerate(runs):
        c = r["compile_s"]
        print(f"{'cold' if i == 0 else f'warm {i}':10s}{r['import_s']:>9.2f}{r['load_s']:>8.2f}"
              f"{c.get('setup', 0):>8.2f}{c['prefill']:>9.2f}{c['decode']:>9.2f}{total[i]:>9.2f}"
              f"{r['build_s']:>8.2f}  {r['graphs']}")
    best = min(total[i] for i in range(1, len(runs))) if warm else float("nan")
    best_build = min(r["build_s"] for r in warm) if warm else float("nan")
    print(f"cold compile {total[0]:.1f} s; warm compile {best:.2f} s = {best / total[0]:.0%} of cold; "
          f"warm build (config, load, engine, compile) {best_build:.2f} s = {best_build / total[0]:.0%} of "
          f"the cold compile")
    if args.json:
        Path(args.json).write_text(json.dumps({"case": args.case, "max_seq": args.max_seq, "torch": torch.__version__,
                                               "threads": torch.get_num_threads(), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
