"""Quantized MoE experts: which formulation is faster (not a test).

--suite kept (the default): GGUF expert stacks kept as stored on zoo's CPU kernels, at Qwen3-30B-A3B's
expert shape, decode (1 token x top-8) and a 512-token prefill: the one-call op with the SwiGLU fused
(zoo_quant.expert_linear), without the fusion, and the previous per-expert loop (kept_suite below).

    python scripts/bench_quant_experts.py --threads 2
    python scripts/bench_quant_experts.py --dim 256 --ffn 256 --experts 8 --layers 1 --prefill 64 --repeat 2  (smoke)

--suite torch: the bfloat16 experts on torch's weight-only kernels. The routed experts of the DeepSeek-V3-small benchmark shape (scripts/bench.py CASES
deepseek_v3_small: D 512, expert F 256, E 32, top-4), `--layers` layers of them so that the
weights do not sit in the cache, one decode step of `--batch` tokens through every layer (w13, the
SwiGLU, w2), each formulation compiled (torch.compile, static shapes):

  float32_gathered  MoE.decode's float path: the chosen experts' float rows gathered, batched matmuls
  int8_op / int4_op the shipped path (compiler/quant/experts.py): pairs sorted by expert, one
                    `zoo::quant_expert_mm` op calling torch's weight-only kernel per chosen expert
  int8_gather /     the alternative: the chosen experts' codes gathered in the graph, dequantized,
  int4_gather       batched matmul (int4 as two codes per byte, scale and zero per group)

    python scripts/bench_quant_experts.py --suite torch --threads 2 --layers 8 --batch 1
Prints microseconds per decode step (best of --repeat) and each one's error against float32.
Run on an idle machine.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import numpy as np

from zoo.compiler.contracts import StoredBlocks
from zoo.compiler.ffn.moe import expert_mm
from zoo.compiler.quant import cpu_kernels, gguf_blocks
from zoo.compiler.quant.experts import QuantExperts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("kept", "torch"), default="kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="kept: 4, torch: 8")
    ap.add_argument("--batch", type=int, default=1, help="tokens per step (kept: decode; --prefill for prompts)")
    ap.add_argument("--prefill", type=int, default=512, help="kept: the prompt's tokens (0: no prefill case)")
    ap.add_argument("--experts", type=int, default=None, help="kept: 64, torch: 32")
    ap.add_argument("--top-k", type=int, default=None, help="kept: 8, torch: 4")
    ap.add_argument("--dim", type=int, default=None, help="kept: 2048, torch: 512")
    ap.add_argument("--ffn", type=int, default=None, help="kept: 768, torch: 256")
    ap.add_argument("--w13-type", default="Q4_K")
    ap.add_argument("--w2-type", default="Q6_K")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=None, help="kept: 20, torch: 200")
    ap.add_argument("--only", help="comma-separated formulations")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    (kept_suite if args.suite == "kept" else torch_suite)(args)


def _fill(args, **defaults) -> None:
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


# byte offsets of the float16 scale fields of each block type the kept suite writes (random bytes
# elsewhere: any code; d and dmin small and finite)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


def random_stack(ggml_type: str, E: int, O: int, I: int, rng) -> QuantExperts:
    """A QuantExperts [E, O, I] holding random `ggml_type` blocks as a GGUF file's stack."""
    lay = gguf_blocks.layout(ggml_type)
    b = rng.integers(0, 256, (E * O * I // lay.block, lay.nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        b[:, off:off + 2] = (rng.uniform(0.5, 1.0, len(b)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    q = QuantExperts(E, O, I, "int4", 32, torch.bfloat16)
    q.blocks_only = True
    q.prepare_blocks(ggml_type)
    q.load_weight(StoredBlocks(ggml_type, torch.from_numpy(b).reshape(E, O, -1), (E, O, I)))
    return q


def per_expert_calls(q: QuantExperts, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The previous zoo::block_expert_mm: one linear kernel call per active expert (each rounds its
    rows' activations again and starts its own parallel region)."""
    out = x.new_empty(x.shape[0], q.out_features)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xs = x[start:end]
            if q.layout == "q6k":
                out[start:end] = torch.ops.zoo_quant.q6k_linear(xs, q.qweight[e])
            elif q.layout == "int5":
                out[start:end] = torch.ops.zoo_quant.int5_linear(xs, q.qweight[e], q.qhigh[e], q.scales[e], q.group)
            elif q.layout == "q4":
                out[start:end] = torch.ops.zoo_quant.int4_linear(xs, q.qweight[e], q.scales[e], q.group)
            else:
                out[start:end] = torch.ops.zoo_quant.int8g_linear(xs, q.qweight[e], q.scales[e], q.group)
        start = end
    return out


def kept_suite(args) -> None:
    """GGUF expert stacks kept as stored (QuantExperts' block layouts, zoo's float32 CPU kernels) at
    Qwen3-30B-A3B's expert shape: D 2048, 64 experts of F 768, top-8, w13 Q4_K and w2 Q6_K (Q4_K_M's
    ffn_down), `--layers` layers so that the weights do not sit in the cache. Per layer a decode
    step (--batch tokens x top-k rows) and a prefill (--prefill tokens: pairs sorted by expert), as
    MoE.prefill runs them:
      fused     w13.grouped_act (one zoo_quant.expert_linear call with the SwiGLU inside) + w2.grouped_mm
      unfused   w13.grouped_mm, the SwiGLU in torch, w2.grouped_mm (one call per stack each)
      loop      the previous op: one linear kernel call per active expert, the SwiGLU in torch
    Prints microseconds per layer and tokens per second (decode: per whole step over the layers)."""
    _fill(args, layers=4, experts=64, top_k=8, dim=2048, ffn=768, repeat=20)
    E, K, D, Fd, L = args.experts, args.top_k, args.dim, args.ffn, args.layers
    rng = np.random.default_rng(0)
    layers = [(random_stack(args.w13_type, E, 2 * Fd, D, rng), random_stack(args.w2_type, E, D, Fd, rng))
              for _ in range(L)]
    gen = torch.Generator().manual_seed(0)

    def routing(T):
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        offs = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0)
        return order // K, offs

    def silu_mul(h):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    forms = {
        "fused": lambda a, b, x, offs: b.grouped_mm(a.grouped_act(x, offs), offs),
        "unfused": lambda a, b, x, offs: b.grouped_mm(silu_mul(a.grouped_mm(x, offs)), offs),
        "loop": lambda a, b, x, offs: per_expert_calls(b, silu_mul(per_expert_calls(a, x, offs)), offs),
    }
    chosen = args.only.split(",") if args.only else list(forms)
    print(f"kept: E {E} top-{K}, D {D}, F {Fd}, w13 {args.w13_type}, w2 {args.w2_type}, {L} layers, "
          f"{args.threads} threads, {cpu_kernels.status()}, torch {torch.__version__}")
    cases = [("decode", args.batch)] + ([("prefill", args.prefill)] if args.prefill else [])
    with torch.no_grad():
        for case, T in cases:
            token, offs = routing(T)
            x = torch.randn(T, D)[token]  # [T*K, D] the sorted pairs' rows
            ref = forms["fused"](*layers[0], x, offs)
            for name in chosen:
                fn = forms[name]
                err = ((fn(*layers[0], x, offs) - ref).norm() / ref.norm()).item()
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(args.repeat):
                        for a, b in layers:
                            fn(a, b, x, offs)
                    best = min(best, (time.perf_counter() - t0) / args.repeat / L)
                print(f"{case:7s} {T:4d} tokens  {name:8s} {best * 1e6:10.1f} us per layer  "
                      f"{T / best / 48:9.1f} tok/s at 48 layers   rel. diff {err:.1e}", flush=True)


def torch_suite(args) -> None:
    """The bfloat16 / float16 experts on torch's weight-only kernels (below)."""
    _fill(args, layers=8, experts=32, top_k=4, dim=512, ffn=256, repeat=200)
    torch.manual_seed(0)
    E, K, D, Fd, T, G, L = args.experts, args.top_k, args.dim, args.ffn, args.batch, args.group, args.layers

    w13 = [torch.randn(E, 2 * Fd, D) / D ** 0.5 for _ in range(L)]  # unit-scale outputs through L layers
    w2 = [torch.randn(E, D, Fd) / Fd ** 0.5 for _ in range(L)]
    x = torch.randn(T, D)  # unit scale
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # the same experts in every layer: worst case

    def stacks(mode):
        out = []
        for a, b in zip(w13, w2):
            qa = QuantExperts(E, 2 * Fd, D, mode, G, torch.bfloat16)
            qb = QuantExperts(E, D, Fd, mode, G, torch.bfloat16)
            qa.load_weight(a)
            qb.load_weight(b)
            out.append((qa, qb))
        return out

    def act(h):
        gate, up = h.split(Fd, dim=-1)
        return F.silu(gate) * up

    def rms(y):  # the next layer's input at unit scale (the SwiGLU is quadratic: L layers would overflow)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)

    def float32_gathered(x, idx):
        for a, b in zip(w13, w2):
            h = torch.matmul(a[idx], x[:, None, :, None]).squeeze(-1)
            x = rms(torch.matmul(b[idx], act(h)[..., None]).squeeze(-1).sum(1))
        return x

    def grouped(layers):
        def run(x, idx):
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            token = order // K
            offs = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0)
            inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
            for qa, qb in layers:
                h = qa.grouped_mm(x[token], offs) if isinstance(qa, QuantExperts) else expert_mm(x[token], qa, offs)
                y = qb.grouped_mm(act(h), offs) if isinstance(qb, QuantExperts) else expert_mm(act(h), qb, offs)
                x = rms(y[inverse].view(T, K, D).sum(1))
            return x
        return run

    # the gather alternative's storage
    def int8_tables():
        out = []
        for a, b in zip(w13, w2):
            pair = []
            for w in (a, b):
                s = w.abs().amax(-1) / 127
                pair.append((torch.round(w / s[..., None]).clamp(-127, 127).to(torch.int8), s))
            out.append(pair)
        return out

    def int4_tables():
        out = []
        for a, b in zip(w13, w2):
            pair = []
            for w in (a, b):
                E_, O, I = w.shape
                g = w.reshape(E_, O, I // G, G)
                lo, hi = g.amin(-1), g.amax(-1)
                sc = (hi - lo) / 15
                q = torch.round((g - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.uint8).reshape(E_, O, I)
                pair.append(((q[..., ::2] << 4) | q[..., 1::2], sc, lo))
            out.append(pair)
        return out

    def int8_gather(tables):
        def run(x, idx):
            for (qa, sa), (qb, sb) in tables:
                h = torch.matmul(qa[idx].float(), x[:, None, :, None]).squeeze(-1) * sa[idx]
                x = rms((torch.matmul(qb[idx].float(), act(h)[..., None]).squeeze(-1) * sb[idx]).sum(1))
            return x
        return run

    def dequant4(p, sc, lo, idx):
        q = torch.stack((p[idx] >> 4, p[idx] & 15), -1).float()  # [T, K, O, I/2, 2]
        T_, K_, O = q.shape[:3]
        w = q.view(T_, K_, O, -1, G) * sc[idx][..., None] + lo[idx][..., None]
        return w.view(T_, K_, O, -1)

    def int4_gather(tables):
        def run(x, idx):
            for a, b in tables:
                h = torch.matmul(dequant4(*a, idx), x[:, None, :, None]).squeeze(-1)
                x = rms(torch.matmul(dequant4(*b, idx), act(h)[..., None]).squeeze(-1).sum(1))
            return x
        return run

    candidates = {
        "float32_gathered": lambda: float32_gathered,
        "float32_grouped": lambda: grouped(list(zip(w13, w2))),
        "int8_op": lambda: grouped(stacks("int8")),
        "int4_op": lambda: grouped(stacks("int4")),
        "int8_gather": lambda: int8_gather(int8_tables()),
        "int4_gather": lambda: int4_gather(int4_tables()),
    }
    chosen = args.only.split(",") if args.only else list(candidates)
    print(f"E {E} top-{K}, D {D}, F {Fd}, {L} layers, batch {T}, {args.threads} threads, torch {torch.__version__}")
    with torch.no_grad():
        ref = float32_gathered(x, idx)
        for name in chosen:
            fn = torch.compile(candidates[name](), dynamic=False)
            y = fn(x, idx)
            err = ((y - ref).norm() / ref.norm()).item()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    fn(x, idx)
                best = min(best, (time.perf_counter() - t0) / args.repeat)
            print(f"{name:18s} {best * 1e6:9.1f} us per step   rel. error {err:.4f}", flush=True)


if __name__ == "__main__":
    main()
