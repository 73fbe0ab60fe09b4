"""runtime.aot over the shipped tiny presets: does each family's prefill and decode export as
AOTInductor packages, and do they equal the eager model? (not a test: ~1-2 min a family cold)

    python scripts/check_aot.py [--json scripts/results/aot_check.json] [conf ...]   default: every *_tiny preset

Each preset in its own process: built with runtime.aot=true and with compile=false from the same
seed (random weights, max_seq 32, batch 1); prefill at lengths 2, 5, 9 and 32 (the whole range of
the one prefill package, shorter and longer than the tiny sliding windows) and 4 greedy decode
steps after the 9-token prompt, each compared as max |a - e| / max |e|. A family whose layers
cannot be packaged fails with zoo's ConfigError, printed as it is.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import json, sys, torch, zoo
c = sys.argv[1]
try:
    a = zoo.build(c, ["runtime.aot=true"], max_seq=32, seed=0, max_batch=1)
    e = zoo.build(c, [], compile=False, max_seq=32, seed=0, max_batch=1)
    rel = lambda x, y: (x - y).abs().max().item() / y.abs().max().item()
    worst = {}
    for n in (2, 5, 32, 9):
        ids = torch.randint(0, a.spec.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        pa, pe = a.prefill(ids), e.prefill(ids)
        worst[f"prefill {n}"] = rel(pa, pe)
    tok = pe[:, -1].argmax(-1)
    for step in range(4):
        x, y = a.decode(tok), e.decode(tok)
        worst[f"decode {step}"] = rel(x, y)
        tok = y.argmax(-1)
    print(json.dumps({"conf": c, "ok": True, "max_rel": max(worst.values()), "rel": worst,
                      "packages": a.engine.graph_counts()}))
except Exception as ex:
    print(json.dumps({"conf": c, "ok": False, "error": f"{type(ex).__name__}: {str(ex).splitlines()[0][:400]}"}))
'''


def _cpu() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _torch_version() -> str:
    from importlib import metadata

    return metadata.version("torch")


def main() -> int:
    args = sys.argv[1:]
    out = None
    if args[:1] == ["--json"]:
        out, args = Path(args[1]), args[2:]
    confs = args or sorted(Path(p).stem for p in glob.glob(str(ROOT / "conf" / "*_tiny.yaml")))
    results = []
    for c in confs:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-W", "ignore", "-c", WORKER, c], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
        lines = proc.stdout.strip().splitlines()
        r = json.loads(lines[-1]) if lines else {"conf": c, "ok": False, "error": proc.stderr[-400:]}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{c:28s} " + (f"ok   max rel {r['max_rel']:.1e}  {r['packages']}" if r["ok"] else f"FAIL {r['error']}")
              + f"  ({r['seconds']} s)", flush=True)
        if out is not None:  # after each preset: a stopped run keeps what it measured
            out.write_text(json.dumps({"cpu": _cpu(), "torch": _torch_version(), "results": results}, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
