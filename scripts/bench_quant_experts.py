"""Quantized MoE experts in decode: which formulation is faster (not a test).

The routed experts of the DeepSeek-V3-small benchmark shape (scripts/bench.py CASES
deepseek_v3_small: D 512, expert F 256, E 32, top-4), `--layers` layers of them so that the
weights do not sit in the cache, one decode step of `--batch` tokens through every layer (w13, the
SwiGLU, w2), each formulation compiled (torch.compile, static shapes):

  float32_gathered  MoE.decode's float path: the chosen experts' float rows gathered, batched matmuls
  int8_op / int4_op the shipped path (compiler/quant/experts.py): pairs sorted by expert, one
                    `zoo::quant_expert_mm` op calling torch's weight-only kernel per chosen expert
  int8_gather /     the alternative: the chosen experts' codes gathered in the graph, dequantized,
  int4_gather       batched matmul (int4 as two codes per byte, scale and zero per group)

    python scripts/bench_quant_experts.py --threads 2 --layers 8 --batch 1
Prints microseconds per decode step (best of --repeat) and each one's error against float32.
Run on an idle machine.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from zoo.compiler.ffn.moe import expert_mm
from zoo.compiler.quant.experts import QuantExperts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--only", help="comma-separated formulations")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
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
