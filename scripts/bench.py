"""Benchmark zoo against transformers on the same weights, in one run (not a timed test).

    python scripts/bench.py                       # the Llama-shaped ~40M model (fp32)
    python scripts/bench.py --case llama40m --new-tokens 128 --prompt 512
    python scripts/bench.py --list

Each engine runs in its own subprocess (clean peak RSS, no shared compile state); with --rounds N
the engines take turns N times and each keeps its best prefill and decode rate:
  zoo          zoo.from_pretrained(compile=True): regional-compiled prefill + decode graphs
  zoo_eager    the same without torch.compile (not run by default: what compilation buys)
  hf_eager     transformers, eager, dynamic cache
  hf_static    transformers, static cache + torch.compile(forward)
Decode rates are per step over `--new-tokens` steps after the prompt: zoo's timed loop of
decode + greedy pick; transformers' generate() timed from inside (a logits processor stamps each
step), so neither includes prefill or set-up.
For each: load time, compile time, prefill tok/s, decode tok/s, peak RSS. Then ratios, and the
weight-read roofline: bytes a decode step must read (weights + the cache it attends over) divided
by the measured memory read bandwidth of this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------- cases

def _llama_reference(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                     **dims) -> None:
    """A random Llama-3-style checkpoint of `dims`, saved by transformers (sharded if asked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**dims, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(path, **kwargs)


def _deepseek_v3_reference(path: Path, **dims) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(**dims, rope_parameters=rope, max_position_embeddings=4096, tie_word_embeddings=False,
                           n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a selection bias that matters, as in the real checkpoint
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(path)


# conf/deepseek_v3_tiny.yaml's dims (the tiny twin), and a larger model of the same shape
DEEPSEEK_V3_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
DEEPSEEK_V3_SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                         num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
                         q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                         v_head_dim=32, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)

def _qwen3_next_reference(path: Path, **dims) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(**dims, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    Qwen3NextForCausalLM(cfg).save_pretrained(path)


# conf/qwen3_next_tiny.yaml's dims (the tiny twin: 2 x (3 Gated DeltaNet + 1 gated attention))
QWEN3_NEXT_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

def _glm5_reference(path: Path) -> None:
    from tests.test_glm5 import make_reference  # the parity tests' writer: conf/glm5_tiny's dims

    make_reference("glm", path)


def _deepseek_v4_reference(path: Path) -> None:
    """The V4 parity tests' tiny model (sliding, CSA and HCA layers, mHC 4 streams), written twice:
    in the Hub's layout (what zoo loads, quantization aside) and under path/transformers in
    transformers' own layout (what DeepseekV4ForCausalLM.from_pretrained reads)."""
    from tests.test_deepseek_v4 import make_reference, save_checkpoint

    ref = make_reference(seed=0, max_position_embeddings=4096)
    path.mkdir(parents=True, exist_ok=True)
    save_checkpoint(ref, path)
    ref.save_pretrained(path / "transformers")


CASES = {
    # name: (writer(path), description)
    "llama40m": (lambda p: _llama_reference(p, vocab_size=32000, hidden_size=512, intermediate_size=1536,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2),
                 "Llama-shaped, d 512, 8 layers, GQA 8/2, ffn 1536, vocab 32000"),
    "deepseek_v3_tiny": (lambda p: _deepseek_v3_reference(p, **DEEPSEEK_V3_TINY),
                         "DeepSeek-V3 tiny twin (conf/deepseek_v3_tiny): d 64, 3 layers, MLA 4 heads latent 32+8, "
                         "8 experts top-2 in 4 groups, YaRN"),
    "deepseek_v3_small": (lambda p: _deepseek_v3_reference(p, **DEEPSEEK_V3_SMALL),
                          "DeepSeek-V3-shaped, d 512, 8 layers, MLA 16 heads latent 128+16, 32 experts top-4, "
                          "vocab 32000"),
    # python scripts/bench.py --case qwen3_next_tiny --prompt 2048 --new-tokens 64 --engines zoo,hf_eager
    "qwen3_next_tiny": (lambda p: _qwen3_next_reference(p, **QWEN3_NEXT_TINY),
                        "Qwen3-Next tiny twin (conf/qwen3_next_tiny): d 64, 8 layers = 2 x (3 Gated DeltaNet "
                        "+ 1 gated attention), 8 experts top-2 + gated shared expert"),
    "glm5_tiny": (_glm5_reference, "GLM-5 tiny twin (conf/glm5_tiny): d 64, 3 layers, MLA + DeepSeek Sparse Attention "
                                   "(indexer 16 heads, top-8), 8 experts top-2"),
    # python scripts/bench.py --case deepseek_v4_tiny --prompt 128 --new-tokens 64
    "deepseek_v4_tiny": (_deepseek_v4_reference,
                         "DeepSeek-V4 tiny (the parity tests' model): d 64, mHC 4 streams, sliding + compressed-sparse "
                         "(ratio 4, top-2) + heavily-compressed (ratio 8) layers, hash and learned MoE"),
}


# transformers' StaticCache has no layer type for these families' recurrent / compressed layers
NO_STATIC_CACHE = {"qwen3_next_tiny", "deepseek_v4_tiny"}


# ----------------------------------------------------------------------------- measurements

def machine() -> dict:
    """What every result records of the machine: lscpu's model name and L3 ("cpu"), its flags,
    the instruction set zoo's CPU kernels run at, torch's version and threads."""
    from zoo.compiler import native

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    cpu = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
    return {"cpu": " / ".join(cpu[k] for k in ("Model name", "L3 cache") if k in cpu) or "unknown",
            "cpu_flags": cpu.get("Flags", ""), "kernel_isa": native.isa(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (sum over a float32 tensor of `nbytes`), best of `repeats`.

    1 GiB measures DRAM. A buffer the size of a decode step's reads measures what that step can
    hope for: on a CPU whose last-level cache holds the whole step (this machine's L3 is 260 MiB,
    the 40M bench model reads 160 MiB a step) the weights stay in cache between steps."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _timed(fn, repeats: int = 1):
    best = float("inf")
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def worker_zoo(path: str, prompt: int, new: int, dtype: str, compile: bool = True, quant: str | None = None,
               quant_group: int | None = None, overrides: tuple[str, ...] = ()) -> dict:
    import zoo

    dt = getattr(torch, dtype)
    t0 = time.perf_counter()
    m = zoo.from_pretrained(path, dtype=dt, compile=compile, max_seq=prompt + new, quant=quant, quant_group=quant_group,
                            overrides=list(overrides))
    total = time.perf_counter() - t0
    compile_s = dict(m.info.compile_seconds)
    ids = torch.randint(0, m.spec.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    # logits of the last position only, as generation (and transformers' generate) computes them
    prefill_s, logits = _timed(lambda: m.prefill(ids, last_only=True), repeats=3)
    tok = logits[:, -1].argmax(-1)

    def decode_all():
        m.prefill(ids, last_only=True)  # as generation does: no [L, V] logits
        t = tok
        t0 = time.perf_counter()
        for _ in range(new):
            t = m.decode(t).argmax(-1)
        return time.perf_counter() - t0

    decode_s = min(decode_all() for _ in range(2))
    weights = m.info.param_bytes  # distinct parameters (a tied head counted once)
    embed = m.module.embed.weight  # None: the lookups read the tied head's kept blocks
    cache_bytes = m.engine.plan.total_bytes()
    # what the same attention would cache with per-head K/V (MLA reports it; others cache K/V)
    expanded = sum(f.nbytes for block, layer in zip(m.module.layers, m.engine.plan.layers) for f in (
        block.mixer.expanded_cache_fields(*next(iter(layer.values())).shape[:1], m.engine.max_seq,
                                          next(iter(layer.values())).dtype)
        if hasattr(block.mixer, "expanded_cache_fields") else layer).values())
    # a decode step of one sequence reads top_k of a MoE layer's routed experts
    # (a quantized stack, compiler/quant/experts.py, holds its bytes in buffers)
    per_expert = lambda w: w.quantized_bytes() // w.n_experts if hasattr(w, "quantized_bytes") else w[0].nbytes
    inactive = sum((b.ffn.n_experts - b.ffn.top_k) * (per_expert(b.ffn.w13) + per_expert(b.ffn.w2))
                   for b in m.module.layers if hasattr(b.ffn, "n_experts"))
    return {"expanded_cache_bytes": expanded, "inactive_expert_bytes": inactive, "load_s": m.info.load_seconds,
            "build_total_s": total, "compile_s": compile_s,
            "prefill_tok_s": prompt / prefill_s, "decode_tok_s": new / decode_s,
            "peak_rss": peak_rss_bytes(), "graphs": m.engine.graph_counts(),
            "weight_bytes": weights, "embed_bytes": 0 if embed is None else embed.numel() * embed.element_size(),
            "tied": m.spec.tie_embeddings, "cache_bytes_read": cache_bytes,
            "cache_bytes_per_token": m.info.cache_bytes_per_token,
            "state_bytes_per_sequence": m.info.state_bytes_per_sequence}


def worker_hf(path: str, prompt: int, new: int, dtype: str, static: bool) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    dt = getattr(torch, dtype)
    if (Path(path) / "transformers").is_dir():  # the case also wrote transformers' own layout
        path = str(Path(path) / "transformers")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
    def gen(n):
        return _timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), repeats=2)[0]

    class Clock(LogitsProcessor):
        """Called once per generated token, right after that step's forward: the gaps between
        calls are the decode steps (forward + greedy pick), as zoo's timed loop measures them."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    def decode_step_s() -> float:
        clock = Clock()
        model.generate(ids, max_new_tokens=full, min_new_tokens=full, logits_processor=LogitsProcessorList([clock]),
                       **kw)
        return (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)

    full = new + 1  # the first token comes from the prefill, then `new` decode steps
    compile_s = 0.0
    with torch.no_grad():
        if static:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, fullgraph=True)
            t0 = time.perf_counter()
            # compiles the prefill and decode shapes of every length measured below
            model.generate(ids, max_new_tokens=full, min_new_tokens=full, **kw)
            compile_s = time.perf_counter() - t0
        prefill_s = gen(1)
        decode_s = min(decode_step_s() for _ in range(2))
    return {"load_s": load_s, "compile_s": {"total": compile_s}, "prefill_tok_s": prompt / prefill_s,
            "decode_tok_s": 1.0 / decode_s, "peak_rss": peak_rss_bytes()}


# ----------------------------------------------------------------------------- driver

def take_turns(kinds: list[str], rounds: int, run) -> dict[str, dict]:
    """run(kind) -> result, for every engine in turn, `rounds` times (engines alternate, so a busy
    spell hits them all alike); each engine's best decode run, with its best prefill rate."""
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in runs:
            print(f"round {r + 1}/{rounds}: {kind} ...", file=sys.stderr, flush=True)
            runs[kind].append(run(kind))
    best = {}
    for kind, got in runs.items():
        best[kind] = dict(max(got, key=lambda x: x["decode_tok_s"]))
        best[kind]["prefill_tok_s"] = max(x["prefill_tok_s"] for x in got)
        best[kind]["decode_runs"] = [x["decode_tok_s"] for x in got]
    return best


def run_worker(kind: str, path: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--path", str(path), "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--dtype", args.dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="llama40m", choices=sorted(CASES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", help="comma-separated; default zoo,hf_eager,hf_static (no hf_static where "
                                      "transformers has no static cache for the family)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines in turn this many times and keep each one's best (busy machines)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.list:
        for name, (_, desc) in CASES.items():
            print(f"{name:16s} {desc}")
        return 0
    if args.worker:
        if args.worker in ("zoo", "zoo_eager"):
            out = worker_zoo(args.path, args.prompt, args.new_tokens, args.dtype, compile=args.worker == "zoo")
        else:
            out = worker_hf(args.path, args.prompt, args.new_tokens, args.dtype, static=args.worker == "hf_static")
        print(json.dumps(out))
        return 0

    writer, desc = CASES[args.case]
    args.engines = args.engines or ",".join(e for e in ("zoo", "hf_eager", "hf_static")
                                            if e != "hf_static" or args.case not in NO_STATIC_CACHE)
    results: dict = {"case": args.case, "description": desc, "prompt": args.prompt,
                     "new_tokens": args.new_tokens, "dtype": args.dtype, "threads": torch.get_num_threads(),
                     "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        writer(path)
        results["checkpoint_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        results.update(take_turns(args.engines.split(","), args.rounds, lambda kind: run_worker(kind, path, args)))
        results["rounds"] = args.rounds
    results["read_bandwidth"] = read_bandwidth()
    if "zoo" in results:
        results["step_bytes"] = roofline(results["zoo"], 1.0)[0]
        results["working_set_bandwidth"] = read_bandwidth(results["step_bytes"] // 4 * 4, repeats=10)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def roofline(z: dict, bandwidth: float) -> tuple[int, float]:
    """Bytes one decode step must read and the tok/s that bandwidth allows."""
    step = z["weight_bytes"] - (0 if z["tied"] else z["embed_bytes"])  # one embedding row only
    step -= z.get("inactive_expert_bytes", 0)  # experts the router did not pick
    step += z["cache_bytes_read"]  # the decode graph attends over the whole static cache
    return step, bandwidth / step


def report(r: dict) -> None:
    print(f"\n== {r['case']}: {r['description']}  ({r['dtype']}, prompt {r['prompt']}, {r['new_tokens']} new tokens, "
          f"{r['threads']} threads, torch {r['torch']})")
    engines = [k for k in ("zoo", "zoo_eager", "hf_eager", "hf_static") if k in r]
    print(f"{'':22s}" + "".join(f"{e:>14s}" for e in engines))

    def row(label, fn):
        print(f"{label:22s}" + "".join(f"{fn(r[e]):>14s}" for e in engines))

    row("load (s)", lambda x: f"{x['load_s']:.2f}")
    row("compile (s)", lambda x: " ".join(f"{v:.1f}" for v in x["compile_s"].values()) or "-")
    row("prefill (tok/s)", lambda x: f"{x['prefill_tok_s']:.0f}")
    row("decode (tok/s)", lambda x: f"{x['decode_tok_s']:.1f}")
    row("peak RSS (MiB)", lambda x: f"{x['peak_rss'] / 2**20:.0f}")
    if "zoo" in r:
        z = r["zoo"]
        for e in engines[1:]:
            print(f"zoo / {e}: decode {z['decode_tok_s'] / r[e]['decode_tok_s']:.2f}x, "
                  f"prefill {z['prefill_tok_s'] / r[e]['prefill_tok_s']:.2f}x")
        step, limit = roofline(z, r["read_bandwidth"])
        print(f"decode step reads {step / 2**20:.1f} MiB (weights + cache); DRAM read bandwidth (1 GiB stream) "
              f"{r['read_bandwidth'] / 1e9:.1f} GB/s -> roofline {limit:.1f} tok/s; zoo reaches "
              f"{z['decode_tok_s'] / limit:.0%} of it")
        if "working_set_bandwidth" in r:
            _, cached = roofline(z, r["working_set_bandwidth"])
            print(f"a stream of the step's own size reads at {r['working_set_bandwidth'] / 1e9:.1f} GB/s (cache-"
                  f"resident if the LLC holds it) -> roofline {cached:.1f} tok/s; zoo reaches "
                  f"{z['decode_tok_s'] / cached:.0%}, " + ", ".join(
                      f"{e} {r[e]['decode_tok_s'] / cached:.0%}" for e in engines[1:]))
        if z.get("expanded_cache_bytes", z["cache_bytes_read"]) != z["cache_bytes_read"]:
            print(f"decode attends over a latent cache of {z['cache_bytes_read'] / 2**20:.2f} MiB; per-head K/V "
                  f"would be {z['expanded_cache_bytes'] / 2**20:.2f} MiB "
                  f"({z['expanded_cache_bytes'] / z['cache_bytes_read']:.1f}x)")
        if z.get("state_bytes_per_sequence"):
            print(f"caches: {z['cache_bytes_per_token']:,} B per token (grows with context) + "
                  f"{z['state_bytes_per_sequence']:,} B of constant state per sequence (does not grow)")
        print(f"zoo compile: {z['compile_s']}, graphs {z['graphs']}, build total {z['build_total_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
