"""Loading benchmark: peak memory and time to load a sharded checkpoint, zoo vs transformers.

    python scripts/bench_load.py                      # Llama-shaped ~335M params, bf16, 5 shards
    python scripts/bench_load.py --dtype float32      # load the bf16 checkpoint into float32
    python scripts/bench_load.py --json scripts/results/load_llama335m_bf16.json

Each engine loads in a fresh process (eager, no compile: only loading is measured). Memory is
the growth of resident memory during the load: the peak (VmHWM, reset through
/proc/self/clear_refs after imports) minus the resident size before the call, divided by the
bytes of the loaded weights. zoo reads each tensor by offset straight into its parameter (no
memory map, no temporary copy when no rule transforms it); transformers memory-maps the shards.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench import _llama_reference  # noqa: E402  (the bench model writer, any size)

LLAMA_335M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4)


def _status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def worker(engine: str, path: str, dtype: str) -> dict:
    dt = getattr(torch, dtype)
    if engine == "zoo":
        import zoo

        def load():
            m = zoo.from_pretrained(path, dtype=dt, compile=False, max_seq=256)
            return m.module
    else:
        from transformers import AutoModelForCausalLM

        def load():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    before = _status("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    module = load()
    seconds = time.perf_counter() - t0
    # touch every weight so lazily mapped pages count (a model must have its weights resident)
    weights = 0
    for p in module.parameters():
        weights += p.numel() * p.element_size()
        p.detach().view(-1)[:: max(1, 4096 // p.element_size())].sum()
    return {"seconds": seconds, "rss_before": before, "peak": _status("VmHWM"), "after": _status("VmRSS"),
            "peak_reset": reset, "weight_bytes": weights}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shard", default="300MB", help="max_shard_size of the written checkpoint")
    ap.add_argument("--repeats", type=int, default=2, help="processes per engine (best time is kept)")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.dtype)))
        return 0

    results: dict = {"model": "Llama-shaped " + ", ".join(f"{k}={v}" for k, v in LLAMA_335M.items()),
                     "stored": "bfloat16", "dtype": args.dtype, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        _llama_reference(path, dtype=torch.bfloat16, max_shard_size=args.shard, **LLAMA_335M)
        shards = sorted(path.glob("*.safetensors"))
        results["shards"] = len(shards)
        results["checkpoint_bytes"] = sum(f.stat().st_size for f in shards)
        for engine in ("zoo", "transformers"):
            runs = []
            for _ in range(args.repeats):  # alternate engines would be fairer on a busy machine
                cmd = [sys.executable, __file__, "--worker", engine, "--path", str(path), "--dtype", args.dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if proc.returncode != 0:
                    raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-4000:]}")
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            best = min(runs, key=lambda r: r["seconds"])
            best["peak_growth"] = max(r["peak"] - r["rss_before"] for r in runs)
            results[engine] = best
    z, t = results["zoo"], results["transformers"]
    print(f"\n== loading {results['model']}\n   {results['shards']} shards, "
          f"{results['checkpoint_bytes'] / 2**20:.0f} MiB stored (bf16) -> {args.dtype}, torch {torch.__version__}")
    print(f"{'':28s}{'zoo':>14s}{'transformers':>14s}")
    print(f"{'load time (s)':28s}{z['seconds']:>14.2f}{t['seconds']:>14.2f}")
    for label, key in (("peak RSS growth (MiB)", "peak_growth"),):
        print(f"{label:28s}{z[key] / 2**20:>14.0f}{t[key] / 2**20:>14.0f}")
    for e, r in (("zoo", z), ("transformers", t)):
        print(f"{e}: peak growth / weight bytes = {r['peak_growth'] / r['weight_bytes']:.2f}x "
              f"(weights {r['weight_bytes'] / 2**20:.0f} MiB)")
    print(f"zoo load time / transformers: {z['seconds'] / t['seconds']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
