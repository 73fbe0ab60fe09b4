"""The prepared GPU check of issue #8 (item 5): one NVIDIA H200, a few minutes, one markdown result.

    python scripts/gpu_check.py                       # full run on the CUDA device (H200 sizes)
    python scripts/gpu_check.py --out DIR             # write the result under DIR
    python scripts/gpu_check.py --device cpu --smoke  # tiny sizes, compile off: exercises the script here

Sections (each writes its numbers into the result; a crash in one is recorded and the rest still run):

1. bf16 parity. Tiny twins (llama3_8b_tiny; then deepseek_v3_tiny, qwen3_next_tiny while the time
   budget lasts) with random weights. The reference is the float32 model on the CPU, eager. The
   device models get the reference's exact weights (load_state_dict) and run the user path
   (prefill of a prompt, then decode steps fed the same tokens); their logits are compared with
   the reference's one-pass prefill over the whole sequence. bf16 compiled (+ CUDA graph) within
   5e-2, float32 on the device within 1e-4. Tolerance test, as tests/helpers.assert_logits_close:
   |a - e| <= tol * |e| + tol * max|e| for every logit; reported: max |a - e|, that max relative to
   max|e| ("rel"), the share of positions within tol, and top-1 agreement. bf16 on a model with
   routed experts (MoE twins): a position whose top-k expert choice flips under rounding moves
   further (seen on the CPU: one position of 32 at rel 0.077 for deepseek_v3_tiny), so there >= 90%
   of positions must be within tol and none above rel 0.25; float32 stays strict everywhere.
2. CUDA-graph decode replay (CUDA only; a "skipped: no CUDA" line otherwise). engine.use_cuda_graph,
   the graph captured at build, decode replay == eager uncompiled decode on the same device (float32
   within 1e-4, bf16 within 5e-2), a second batch (new prefill, other batch size and prompt length)
   replaying the same graph object with no decode recompile, and still matching the reference.
3. Decode tok/s, batch 1, of a Llama-3-8B-shaped model (conf llama3_8b, random weights drawn on the
   device, bf16, compile=True, CUDA graph), 512-token prompt, 128 new tokens, warmed up first, timed
   with CUDA events. Roofline: bytes a decode step must read = zoo.compiler.analysis' decode step bytes
   (every weight but the untied embedding table, one embedding row, the KV cache attended at the
   mean context of the timed steps) / bandwidth, for the nominal bandwidth of conf/hardware/
   devices.yaml and a measured device-to-device copy bandwidth (read + write bytes / time). Target
   >= 85% (reported, does not change the exit code). Also: the bytes zoo's decode graph really reads
   (its attention reads the whole static cache, max_seq = prompt + new tokens) and the time of bare
   graph replays (no Python between steps).
5. (--parallel, under torchrun on N GPUs; NOT RUN yet: no multi-GPU machine so far) tensor and
   expert parallel over NCCL: llama3_8b_tiny and deepseek_v3_tiny with tp = ep = N, compiled, the
   decode step captured as one CUDA graph with the all-reduces inside, against the same weights
   in one process (float32 within 1e-4); decode tok/s of the Llama-3-8B shape at tp = N.
       torchrun --nproc-per-node 8 scripts/gpu_check.py --parallel --out DIR
4. Prefill throughput of the same model, batch 1, prompts 2048 and 4096: tokens/s and TFLOP/s
   (zoo.compiler.analysis' prefill FLOPs: 2 x active matmul parameters per token + causal attention;
   logits of the last position only, as generation computes them, so the head counts once) as a
   fraction of the nominal bf16 peak (devices.yaml) and of a measured 8192^3 bf16 matmul.

The result, scripts/results/gpu_check_<device>_<date>.md (`_smoke` appended in smoke mode), holds
the device, torch/CUDA versions, date, every number and each check's verdict; it is also printed.
Exit status 1 when a correctness check fails or a section crashes, else 0.

Running it through the device tool (the GPU machine: python3 3.12, torch 2.11 + CUDA, transformers,
safetensors, numpy, PyYAML; it probably lacks hydra-core / omegaconf / antlr4-python3-runtime, which
zoo needs, and it cannot reach a package index). Here, put the three wheels into .whl/ (ignored by
git: never commit it). zoo runs with hydra-core 1.3.8, omegaconf 2.3.1 and antlr4-python3-runtime
4.9.3 on the CPU machine (antlr4 must stay 4.9.x: omegaconf's grammar is generated with it).
antlr4 4.9.3 is an sdist only on PyPI (wheels start at 4.11), so `--only-binary` cannot fetch it;
build its pure-Python wheel instead:

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl hydra-core==1.3.8 omegaconf==2.3.1
    pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3    # -> antlr4_python3_runtime-4.9.3-py3-none-any.whl

then call the device tool's `run` with carry=[".whl"], timeout_s=480 and the command

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site:. python3 scripts/gpu_check.py --out $OUT

(add `--commit <hash>`: the copied tree has no .git) and commit the markdown file that comes back
(it lands under the run's files_at; the file is rewritten after every section, so a run cut short
still returns what it measured). Nothing else zoo
imports at build time is missing there (`import zoo` + compose pulls omegaconf, antlr4, yaml, numpy,
torch; hydra (needs `packaging`) at compose time; huggingface_hub, gguf, tokenizers, jinja2 and rich
only when loading checkpoints or tokenizers, which this script never does). zoo declares
torch>=2.13; the device has 2.11, so an API difference shows up as a section error in the result.
Expected time on an H200: about 3-5 minutes (most of it inductor compiling cold graphs); the two
extra family twins of section 1 are skipped, with a line saying so, once --budget-s is spent.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BF16_TOL = 5e-2  # as tests/test_cuda.py (bf16 vs float32 logits, relative to the logits' scale)
FP32_TOL = 1e-4  # float32 on the device (compiled, other kernels) vs float32 on the CPU
TARGET = 0.85  # decode: fraction of the HBM roofline (issue #8)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass
class Sizes:
    perf_conf: str  # the Llama-3-8B-shaped model of sections 3 and 4
    prompt: int  # decode: prompt length
    new_tokens: int  # decode: timed steps
    prefill_lens: tuple[int, ...]
    repeats: int
    copy_bytes: int  # bandwidth probe buffer
    matmul_n: int  # peak probe: n x n x n bf16 matmul
    parity_prompt: int = 24  # section 1/2: first batch (2 rows) prompt and decode steps
    parity_steps: int = 16
    second_prompt: int = 7  # second batch (1 row)
    second_steps: int = 6
    parity_max_seq: int = 64


FULL = Sizes("llama3_8b", 512, 128, (2048, 4096), 3, 4 << 30, 8192)
SMOKE = Sizes("llama3_8b_tiny", 16, 8, (32, 64), 1, 32 << 20, 256)


# ----------------------------------------------------------------------------- result record

class Report:
    """Every number and verdict, by section; rendered as markdown at the end."""

    def __init__(self):
        self.meta: dict = {}
        self.sections: dict[str, list[str]] = {}
        self.checks: list[dict] = []  # correctness: ok False fails the run
        self.targets: list[dict] = []  # performance targets: reported only
        self.errors: list[str] = []
        self.data: dict = {}
        self.seconds: dict[str, float] = {}  # wall time of each section run

    def line(self, section: str, text: str, listed: bool = True) -> None:
        """A line of the section (listed: also a bullet of the markdown; parity rows go to its table)."""
        lines = self.sections.setdefault(section, [])
        if listed:
            lines.append(text)
        print(f"[{section}] {text}", file=sys.stderr, flush=True)

    def check(self, section: str, name: str, ok: bool, detail: str = "", **numbers) -> bool:
        self.checks.append({"section": section, "name": name, "ok": bool(ok), "detail": detail, **numbers})
        self.line(section, f"{'PASS' if ok else '**FAIL**'}: {name}" + (f" ({detail})" if detail else ""),
                  listed="max_abs" not in numbers)
        return ok

    def target(self, section: str, name: str, value: float, target: float) -> None:
        self.targets.append({"section": section, "name": name, "value": value, "target": target,
                             "met": value >= target})

    def failed(self) -> bool:
        return bool(self.errors) or not all(c["ok"] for c in self.checks)


ROUTED_MIN_POSITIONS = 0.9  # models with routed experts: share of positions within the tolerance
ROUTED_MAX_REL = 0.25  # ... and no position's max |a - e| above this fraction of max|e|


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: float, routed: bool = False) -> dict:
    """Logits [..., V] vs reference: |a - e| <= tol * |e| + tol * max|e| elementwise
    (tests/helpers.assert_logits_close), at every position. With routed experts (routed=True) a
    position whose top-k choice flips under rounding moves further: then ROUTED_MIN_POSITIONS of
    the positions must meet the bound and none may exceed ROUTED_MAX_REL."""
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    if a.shape != e.shape:
        return {"ok": False, "max_abs": float("nan"), "rel": float("nan"), "top1": float("nan"),
                "positions": float("nan"), "shape": f"{tuple(a.shape)} vs {tuple(e.shape)}"}
    diff = (a - e).abs()
    scale = max(e.abs().max().item(), 1e-30)
    within = (diff <= tol * e.abs() + tol * scale).all(-1)  # per position
    positions = within.float().mean().item()
    rel = diff.max().item() / scale
    finite = bool(torch.isfinite(a).all())
    ok = finite and (positions >= ROUTED_MIN_POSITIONS and rel <= ROUTED_MAX_REL if routed else bool(within.all()))
    return {"ok": ok, "max_abs": diff.max().item(), "rel": rel, "positions": positions,
            "top1": (a.argmax(-1) == e.argmax(-1)).float().mean().item(), "scale": scale, "finite": finite}


def has_routed_experts(model) -> bool:
    """Structural: a layer whose ffn routes tokens to experts (its discrete choice can flip)."""
    return any(hasattr(block.ffn, "n_experts") for block in model.module.layers)


def parity_row(report: Report, section: str, model: str, what: str, actual, expected, tol: float,
               routed: bool = False) -> bool:
    c = compare(actual, expected, tol, routed)
    rule = (f"{tol:g} at >= {ROUTED_MIN_POSITIONS:.0%} of positions, all <= {ROUTED_MAX_REL:g} (routed experts)"
            if routed else f"{tol:g} at every position")
    detail = (f"max|d| {c['max_abs']:.3g}, rel {c['rel']:.3g}, positions within tol {c['positions']:.1%}, "
              f"top-1 {c['top1']:.1%}, tol {rule}" + ("" if c.get("finite", True) else ", NON-FINITE")
              + (f", shape {c['shape']}" if "shape" in c else ""))
    return report.check(section, f"{model}: {what}", c["ok"], detail, model=model, what=what, tol=rule,
                        max_abs=c["max_abs"], rel=c["rel"], top1=c["top1"], positions=c["positions"])


# ----------------------------------------------------------------------------- timing, probes

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds fn() takes on `device`: CUDA events around it on CUDA, wall clock elsewhere."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int, inner: int = 5, repeats: int = 5) -> float:
    """Device-to-device copy: (read + write) bytes / s, best of `repeats` loops of `inner` copies."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: [dst.copy_(src) for _ in range(inner)], device) for _ in range(repeats))
    del src, dst
    return 2 * nbytes * inner / best


def read_bandwidth(device: torch.device, nbytes: int, inner: int = 5, repeats: int = 5) -> float:
    """Streaming read (a sum over a bf16 tensor): bytes read / s, best of `repeats`."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    best = min(timed(lambda: [x.sum() for _ in range(inner)], device) for _ in range(repeats))
    del x
    return nbytes * inner / best


def matmul_flops(device: torch.device, n: int, inner: int = 10, repeats: int = 3) -> float:
    """Achieved FLOP/s of an n x n x n bf16 matmul (2 n^3 per product), best of `repeats`."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=g)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=g)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    best = min(timed(lambda: [torch.matmul(a, b, out=c) for _ in range(inner)], device) for _ in range(repeats))
    del a, b, c
    return 2 * n ** 3 * inner / best


# ----------------------------------------------------------------------------- models

def build_tiny(conf: str, device, dtype, compile: bool, sizes: Sizes, cuda_graph: bool = True, ref=None):
    """zoo.build (the user path) of a tiny twin; with `ref`, its exact weights are copied in
    (in place: the storages the compiled graphs and the CUDA graph captured stay the same)."""
    import zoo

    overrides = [] if cuda_graph else ["runtime.cuda_graph=false"]
    m = zoo.build(conf, overrides, device=str(device), dtype=dtype, compile=compile, max_batch=2,
                  max_seq=sizes.parity_max_seq)
    if ref is not None:
        m.module.load_state_dict(ref.module.state_dict())
    return m


@torch.no_grad()
def run_sequence(model, seq: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill seq[:, :prompt], then decode the rest of seq token by token (teacher forcing).
    Returns (prefill logits [B, prompt, V], decode logits [B, steps, V]) on the CPU."""
    dev = model.engine.device
    pre = model.prefill(seq[:, :prompt].to(dev)).float().cpu()
    steps = [model.decode(seq[:, t].to(dev)).float().cpu() for t in range(prompt, seq.shape[1])]
    return pre, torch.stack(steps, dim=1)


def build_random_on_device(conf: str, device: torch.device, dtype: torch.dtype):
    """The spec and module of `conf` with random weights drawn on `device` itself (zoo.build draws
    them there: no host copy of 8B parameters). Only the module is kept: the decode and prefill
    sections put two engines of their own on the one set of weights."""
    import zoo

    m = zoo.build(conf, ["runtime.cuda_graph=false"], device=device, dtype=dtype, compile=False, max_batch=1,
                  max_seq=2)
    return m.spec, m.module


# ----------------------------------------------------------------------------- sections

S1, S2, S3, S4, SP = ("1. bf16 parity against float32", "2. CUDA-graph decode replay",
                      "3. Decode tok/s vs the HBM roofline", "4. Prefill throughput", "0. Probes")
S5 = "5. Tensor / expert parallel (NCCL)"


@torch.no_grad()
def copy_sharded(par, ref) -> None:
    """The single-process model's weights into a parallel rank's share (records.shard.slices, in
    place: the compiled graphs and the captured CUDA graph keep their storages)."""
    full = ref.module.state_dict()
    slices = par.records.shard.slices
    for name, p in par.module.named_parameters():
        s = slices.get(name)
        if s is not None and s.zero:
            p.zero_()
        else:
            p.copy_(full[name] if s is None else s.apply(full[name]))


def section_parallel(report: Report, args, sizes: Sizes, device: torch.device) -> None:
    """Under torchrun on several GPUs (--parallel): tiny twins with tp = ep = world size, compiled,
    decode replayed as one CUDA graph with the NCCL all-reduces captured inside, against the same
    weights in one process on the same GPU (float32 within FP32_TOL: only the sum order of the
    all-reduce differs); then decode tok/s of the Llama-3-8B-shaped model split over the ranks."""
    import torch.distributed as dist

    import zoo

    world, rank = dist.get_world_size(), dist.get_rank()
    par_overrides = [f"runtime.parallel.tp={world}", f"runtime.parallel.ep={world}"]
    report.line(S5, f"{world} ranks, backend {dist.get_backend()}")
    gen = torch.Generator().manual_seed(0)
    # 8 heads (and 8 experts), so that up to 8 ranks split them
    wide = {"llama3_8b_tiny": ["mixers.attn.n_heads=8", "mixers.attn.head_dim=16"],
            "deepseek_v3_tiny": ["mixers.attn.n_heads=8"]}
    for conf, overrides in wide.items():
        ref = zoo.build(conf, overrides + ["runtime.cuda_graph=false"], device=str(device), dtype=torch.float32,
                        compile=False, max_batch=2, max_seq=sizes.parity_max_seq)
        par = zoo.build(conf, overrides + par_overrides, device=str(device), dtype=torch.float32,
                        compile=args.compile, max_batch=2, max_seq=sizes.parity_max_seq)
        copy_sharded(par, ref)
        seq = torch.randint(0, ref.spec.vocab_size, (2, sizes.parity_prompt + sizes.parity_steps), generator=gen)
        ep, ed = run_sequence(ref, seq, sizes.parity_prompt)
        ap_, ad = run_sequence(par, seq, sizes.parity_prompt)
        parity_row(report, S5, conf, f"tp={world} ep={world} float32 prefill", ap_, ep, FP32_TOL)
        parity_row(report, S5, conf, f"tp={world} ep={world} float32 decode (CUDA graph)", ad, ed, FP32_TOL)
        report.check(S5, f"{conf}: decode captured as a CUDA graph", par.engine.use_cuda_graph and
                     par.engine._graph is not None)
        if args.compile:
            report.check(S5, f"{conf}: one graph per layer kind per entry point", True,
                         detail=str(par.engine.graph_counts()))
        del ref, par
    # decode speed of the Llama-3-8B shape split over the ranks (random weights, bf16)
    m = zoo.build(sizes.perf_conf, par_overrides[:1], device=str(device), dtype=torch.bfloat16, compile=args.compile,
                  max_batch=1, max_seq=sizes.prompt + sizes.new_tokens + 1)
    ids = torch.randint(0, m.spec.vocab_size, (1, sizes.prompt), generator=gen).to(device)
    logits = m.prefill(ids, last_only=True)[:, -1]
    tok = logits.argmax(-1)
    for _ in range(4):  # warm
        tok = m.decode(tok).argmax(-1)
    m.prefill(ids, last_only=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(sizes.new_tokens):
        tok = m.decode(tok).argmax(-1)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / sizes.new_tokens
    report.line(S5, f"{sizes.perf_conf} bf16 tp={world}: decode {1e3 / ms:.1f} tok/s ({ms:.2f} ms per step, batch 1, "
                    f"{sizes.prompt}-token prompt, rank {rank}); weights per rank {m.info.param_bytes / 2**30:.2f} GiB")
    report.data[f"parallel_decode_ms_rank{rank}"] = ms


def section_llama_parity_and_graph(report: Report, args, sizes: Sizes, device: torch.device) -> None:
    """Sections 1 and 2 on llama3_8b_tiny: they share the engines."""
    conf = "llama3_8b_tiny"
    gen = torch.Generator().manual_seed(0)
    ref = build_tiny(conf, "cpu", torch.float32, False, sizes)
    V = ref.spec.vocab_size
    seq1 = torch.randint(0, V, (2, sizes.parity_prompt + sizes.parity_steps), generator=gen)
    seq2 = torch.randint(0, V, (1, sizes.second_prompt + sizes.second_steps), generator=gen)
    full1, full2 = ref.prefill(seq1), ref.prefill(seq2)

    def vs_ref(section, label, out, full, prompt, tol):
        parity_row(report, section, conf, f"{label} prefill", out[0], full[:, :prompt], tol)
        parity_row(report, section, conf, f"{label} decode x{out[1].shape[1]}", out[1], full[:, prompt:], tol)

    cuda = device.type == "cuda"
    kind = "compiled" if args.compile else "eager"
    for dtype, tol in ((torch.bfloat16, BF16_TOL), (torch.float32, FP32_TOL)):
        name = DTYPE_NAMES[dtype]
        t0 = time.perf_counter()
        m = build_tiny(conf, device, dtype, args.compile, sizes, ref=ref)
        report.line(S1, f"{conf} {name} on {device} ({kind}"
                        f"{', CUDA graph' if m.engine.use_cuda_graph else ''}): built in {time.perf_counter() - t0:.1f} s")
        graph0 = m.engine._graph
        counts0 = m.engine.graph_counts()
        out1 = run_sequence(m, seq1, sizes.parity_prompt)
        out2 = run_sequence(m, seq2, sizes.second_prompt)
        vs_ref(S1, f"{name} {device.type} {kind} vs float32 cpu eager, first batch (2 rows):", out1, full1, sizes.parity_prompt, tol)
        if not cuda:
            continue
        vs_ref(S2, f"{name} {kind} + CUDA graph, second batch (1 row, new prefill) vs float32 cpu:", out2, full2,
               sizes.second_prompt, tol)
        e = m.engine
        report.check(S2, f"{name}: engine.use_cuda_graph", e.use_cuda_graph)
        report.check(S2, f"{name}: decode graph captured at build", graph0 is not None)
        report.check(S2, f"{name}: second batch replays the same CUDA graph object", e._graph is graph0)
        counts = e.graph_counts()
        report.line(S2, f"{name}: compiled graphs after build {counts0}, after both batches {counts}")
        if args.compile:
            report.check(S2, f"{name}: no decode recompile over both batches", counts["decode"] == counts0["decode"],
                         f"decode graphs {counts0['decode']} -> {counts['decode']}")
        # the same weights, eager and uncompiled, no CUDA graph: replay must equal it
        eager = build_tiny(conf, device, dtype, False, sizes, cuda_graph=False, ref=ref)
        report.check(S2, f"{name} eager reference has no CUDA graph", not eager.engine.use_cuda_graph)
        eo1, eo2 = run_sequence(eager, seq1, sizes.parity_prompt), run_sequence(eager, seq2, sizes.second_prompt)
        parity_row(report, S2, conf, f"{name} replayed decode vs eager uncompiled decode (cuda), first batch",
                   out1[1], eo1[1], tol)
        parity_row(report, S2, conf, f"{name} replayed decode vs eager uncompiled decode (cuda), second batch",
                   out2[1], eo2[1], tol)
        if dtype == torch.float32:
            vs_ref(S1, "float32 cuda eager vs float32 cpu eager, first batch (2 rows):", eo1, full1, sizes.parity_prompt, FP32_TOL)
        del eager
    if not cuda:
        report.line(S2, f"skipped: no CUDA (device {device}); the CUDA-graph checks need a GPU")
        if not args.compile:
            report.line(S1, "compile off (smoke): the device models ran eagerly")


def section_family_parity(report: Report, args, sizes: Sizes, device: torch.device, conf: str, deadline: float) -> None:
    """bf16 (compiled, CUDA graph on CUDA) and float32 eager on the device vs float32 CPU eager."""
    if time.perf_counter() > deadline:
        report.line(S1, f"skipped: {conf} (time budget --budget-s={args.budget_s:g} spent)")
        return
    gen = torch.Generator().manual_seed(1)
    ref = build_tiny(conf, "cpu", torch.float32, False, sizes)
    seq = torch.randint(0, ref.spec.vocab_size, (2, sizes.parity_prompt + sizes.parity_steps), generator=gen)
    full = ref.prefill(seq)
    kind = "compiled" if args.compile else "eager"
    routed = has_routed_experts(ref)
    for dtype, compile, tol in ((torch.bfloat16, args.compile, BF16_TOL), (torch.float32, False, FP32_TOL)):
        if dtype == torch.float32 and device.type == "cpu":
            continue  # the reference itself
        if time.perf_counter() > deadline:
            report.line(S1, f"skipped: {conf} {DTYPE_NAMES[dtype]} (time budget spent)")
            continue
        t0 = time.perf_counter()
        # float32 runs eagerly without a CUDA graph (eager data-dependent ops may not be capturable)
        m = build_tiny(conf, device, dtype, compile, sizes, cuda_graph=compile, ref=ref)
        label = (f"{DTYPE_NAMES[dtype]} {device.type} {kind if compile else 'eager'}"
                 f"{' + CUDA graph' if m.engine.use_cuda_graph else ''} vs float32 cpu eager:")
        out = run_sequence(m, seq, sizes.parity_prompt)
        report.line(S1, f"{conf} {DTYPE_NAMES[dtype]}: built and ran in {time.perf_counter() - t0:.1f} s")
        # float32 stays strict even with routed experts: a flip there would be a real discrepancy
        strict = dtype == torch.float32
        parity_row(report, S1, conf, f"{label} prefill", out[0], full[:, :sizes.parity_prompt], tol,
                   routed and not strict)
        parity_row(report, S1, conf, f"{label} decode x{out[1].shape[1]}", out[1], full[:, sizes.parity_prompt:], tol,
                   routed and not strict)
        del m


def section_probes(report: Report, args, sizes: Sizes, device: torch.device) -> dict:
    copy_bw = copy_bandwidth(device, sizes.copy_bytes)
    read_bw = read_bandwidth(device, sizes.copy_bytes)
    mm = matmul_flops(device, sizes.matmul_n)
    report.line(SP, f"device-to-device copy bandwidth (read + write, {sizes.copy_bytes / 2**30:.2f} GiB buffer): "
                    f"{copy_bw / 1e12:.3f} TB/s")
    report.line(SP, f"streaming read bandwidth (bf16 sum): {read_bw / 1e12:.3f} TB/s")
    report.line(SP, f"bf16 matmul {sizes.matmul_n}^3: {mm / 1e12:.1f} TFLOP/s")
    out = {"copy_bandwidth": copy_bw, "read_bandwidth": read_bw, "matmul_flops": mm}
    report.data["probes"] = out
    return out


def perf_model(perf: dict, sizes: Sizes, device: torch.device):
    """The random bf16 model of sections 3 and 4, built once (kept in `perf`)."""
    if "module" not in perf:
        t0 = time.perf_counter()
        perf["spec"], perf["module"] = build_random_on_device(sizes.perf_conf, device, torch.bfloat16)
        perf["init_s"] = time.perf_counter() - t0
    return perf["spec"], perf["module"], perf["init_s"]


def section_decode(report: Report, args, sizes: Sizes, device: torch.device, probes: dict, profile: dict | None,
                   perf: dict) -> None:
    from zoo.compiler.analysis import analyze
    from zoo.compiler.engine.core import Engine
    from zoo.compiler.model import parameter_bytes

    dtype = torch.bfloat16
    P, N = sizes.prompt, sizes.new_tokens
    spec, module, init_s = perf_model(perf, sizes, device)
    engine = Engine(module, max_batch=1, max_seq=P + N, cache_dtype=dtype, compile=args.compile, cuda_graph=True)
    compile_s = engine.warmup() if (args.compile or engine.use_cuda_graph) else {}
    report.line(S3, f"{sizes.perf_conf}: {sum(p.numel() for p in module.parameters()):,} parameters, "
                    f"bf16, random init on {device} in {init_s:.1f} s; compile/capture "
                    f"{ {k: round(v, 1) for k, v in compile_s.items()} } s; CUDA graph {engine.use_cuda_graph}")
    ids = torch.randint(0, spec.vocab_size, (1, P), generator=torch.Generator().manual_seed(0)).to(device)

    def start():
        logits = engine.prefill(ids, last_only=True)
        return logits[:, -1].argmax(-1)

    def decode_loop():
        tok = start()
        sync(device)
        box = {}

        def steps():
            t = tok
            for _ in range(N):
                t = engine.decode(t).argmax(-1)
            box["last"] = t
        secs = timed(steps, device)
        return secs, box["last"]

    decode_loop()  # warm-up: the prefill length's graph, allocator, clocks
    times = [decode_loop()[0] for _ in range(sizes.repeats)]
    best = min(times)
    tok_s = N / best
    replay = None
    if engine.use_cuda_graph:
        def replays():
            start()
            sync(device)
            return timed(lambda: [engine._graph.replay() for _ in range(N)], device)
        replays()
        replay = min(replays() for _ in range(sizes.repeats))
    finite = bool(torch.isfinite(engine.prefill(ids, last_only=True)).all())
    report.check(S3, f"{sizes.perf_conf} prefill logits are finite (random init sane)", finite)

    # bytes a step must read: zoo.compiler.analysis' convention at the mean attended context
    mean_ctx = P + (N + 1) / 2
    a = analyze(spec, context=round(mean_ctx), batch=1, cache_dtype="bfloat16", weight_dtype="bfloat16")
    need = a["decode_bytes_per_step"]
    weights = parameter_bytes(module)
    embed = module.embed.weight.numel() * module.embed.weight.element_size()
    static_cache = engine.plan.total_bytes()
    zoo_reads = weights - (0 if spec.tie_embeddings else embed) + static_cache
    report.line(S3, f"prompt {P}, {N} new tokens, batch 1; decode times over {sizes.repeats} runs: "
                    + ", ".join(f"{t * 1e3:.1f} ms" for t in times))
    report.line(S3, f"decode (Engine.decode, what Model.decode calls, + argmax, per step): **{tok_s:.1f} tok/s** "
                    f"({best / N * 1e3:.3f} ms/step, {need / (best / N) / 1e12:.3f} TB/s effective); "
                    f"Engine.decode checks the token ids on the host, one device sync per step")
    if replay is not None:
        report.line(S3, f"bare CUDA-graph replays back to back: {N / replay:.1f} tok/s ({replay / N * 1e3:.3f} ms/step, "
                        f"{need / (replay / N) / 1e12:.3f} TB/s effective)")
    report.line(S3, f"bytes per step (analysis, context {round(mean_ctx)}): {need / 1e9:.3f} GB = weights "
                    f"{weights / 1e9:.3f} GB - embedding table {embed / 1e9:.3f} GB + one row + KV cache "
                    f"{a['decode_cache_bytes_read_per_sequence'] / 1e6:.1f} MB; zoo's graph reads "
                    f"{zoo_reads / 1e9:.3f} GB (whole static cache, max_seq {P + N}: {static_cache / 1e6:.1f} MB)")
    bws = [("measured copy", probes["copy_bandwidth"])]
    if profile is not None:
        bws.insert(0, (f"nominal ({args.profile})", profile["bandwidth"]))
    rows = []
    for label, bw in bws:
        limit = bw / need
        frac = tok_s / limit
        rframe = (N / replay) / limit if replay else None
        rows.append((label, bw, limit, frac, rframe))
        report.target(S3, f"decode tok/s / roofline at {label} bandwidth", frac, TARGET)
        report.line(S3, f"roofline at {label} {bw / 1e12:.3f} TB/s: {limit:.1f} tok/s -> decode reaches "
                        f"{frac:.1%}" + (f" (graph replay {rframe:.1%})" if rframe else "")
                        + f"; target >= {TARGET:.0%}: {'met' if frac >= TARGET else 'NOT met'}")
    if device.type == "cuda":
        report.line(S3, f"peak memory allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    report.data["decode"] = {"conf": sizes.perf_conf, "prompt": P, "new_tokens": N, "times_s": times,
                             "tok_s": tok_s, "replay_tok_s": N / replay if replay else None,
                             "bytes_per_step": need, "zoo_bytes_per_step": zoo_reads, "compile_s": compile_s,
                             "init_s": init_s, "rooflines": [
                                 {"bandwidth": label, "bytes_per_s": bw, "tok_s": limit, "fraction": frac,
                                  "replay_fraction": rf} for label, bw, limit, frac, rf in rows]}
    del engine


def section_prefill(report: Report, args, sizes: Sizes, device: torch.device, probes: dict, profile: dict | None,
                    perf: dict) -> None:
    from zoo.compiler.analysis import analyze
    from zoo.compiler.engine.core import Engine

    dtype = torch.bfloat16
    spec, module, _ = perf_model(perf, sizes, device)
    engine = Engine(module, max_batch=1, max_seq=max(sizes.prefill_lens), cache_dtype=dtype, compile=args.compile,
                    cuda_graph=False)
    head = module.head.weight.numel()
    peaks = [("measured matmul", probes["matmul_flops"])]
    if profile is not None:
        peaks.insert(0, (f"nominal ({args.profile})", profile["flops"]["bfloat16"]))
    results = []
    for L in sizes.prefill_lens:
        ids = torch.randint(0, spec.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(device)
        t0 = time.perf_counter()
        engine.prefill(ids, last_only=True)  # compiles this length's graph if it needs one
        sync(device)
        first = time.perf_counter() - t0
        times = [timed(lambda: engine.prefill(ids, last_only=True), device) for _ in range(sizes.repeats + 1)]
        best = min(times)
        a = analyze(spec, context=L, batch=1, cache_dtype="bfloat16", weight_dtype="bfloat16")
        flops = a["prefill_flops_per_token"] * L - 2 * head * (L - 1)  # head on the last position only
        fl_s = flops / best
        fr = [(label, peak, fl_s / peak) for label, peak in peaks]
        results.append({"prompt": L, "seconds": best, "tok_s": L / best, "flops": flops, "flop_s": fl_s,
                        "first_call_s": first, "fractions": {label: f for label, _, f in fr}})
        report.line(S4, f"prompt {L}: {best * 1e3:.1f} ms -> **{L / best:,.0f} tok/s**, {flops / 1e12:.2f} TFLOP "
                        f"-> {fl_s / 1e12:.1f} TFLOP/s = " + ", ".join(f"{f:.1%} of {label} {peak / 1e12:.3g}"
                                                                          for label, peak, f in fr)
                        + f" (first call incl. compile {first:.1f} s)")
    report.line(S4, f"compiled prefill graphs: {engine.graph_counts()['prefill']} for lengths {list(sizes.prefill_lens)}")
    report.data["prefill"] = results
    del engine


# ----------------------------------------------------------------------------- markdown

def render(report: Report) -> str:
    m = report.meta
    out = [f"# GPU check (issue #8, item 5): {m['device_name']}, {m['date']}{' (smoke)' if m['smoke'] else ''}", ""]
    out += [f"- {k}: {v}" for k, v in m.items()]
    out += [f"- seconds per section: {report.seconds}"]
    ok = not report.failed()
    out += ["", f"**Correctness: {'PASS' if ok else 'FAIL'}** ({sum(c['ok'] for c in report.checks)}/"
                f"{len(report.checks)} checks pass, {len(report.errors)} section errors)", ""]
    if report.targets:
        if m["smoke"]:
            out += ["(smoke sizes: the performance figures below only show that the code runs)", ""]
        out += ["| performance target | value | target | met |", "|---|---|---|---|"]
        out += [f"| {t['name']} | {t['value']:.1%} | >= {t['target']:.0%} | {'yes' if t['met'] else 'no'} |"
                for t in report.targets]
        out.append("")
    for title in sorted(report.sections):
        out += [f"## {title}", ""]
        rows = [c for c in report.checks if c["section"] == title and "max_abs" in c]
        if rows:
            out += ["| model | comparison | max abs diff | rel (max abs diff / max abs ref) | positions within tol "
                    "| top-1 agree | tolerance | result |", "|---|---|---|---|---|---|---|---|"]
            out += [f"| {c['model']} | {c['what']} | {c['max_abs']:.3g} | {c['rel']:.3g} | {c['positions']:.1%} | "
                    f"{c['top1']:.1%} | {c['tol']} | {'PASS' if c['ok'] else '**FAIL**'} |" for c in rows]
            out.append("")
        out += [f"- {line}" for line in report.sections[title]]
        out.append("")
    if report.errors:
        out += ["## Errors", ""]
        for e in report.errors:
            out += ["```", e.rstrip(), "```", ""]
    out += ["## Raw numbers", "", "```json", json.dumps(report.data, indent=1, default=str), "```", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- driver

def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pick_profile(name: str | None, device: torch.device, device_name: str, smoke: bool) -> tuple[str | None, dict | None]:
    from zoo.compiler.analysis import devices

    profiles = devices()
    if name is not None:
        if name not in profiles:
            raise SystemExit(f"--profile {name!r}: not in conf/hardware/devices.yaml (known: {sorted(profiles)})")
        return name, profiles[name]
    if device.type == "cpu":
        return "cpu", profiles["cpu"]
    matches = [k for k in profiles if k != "cpu" and k in device_name.lower()]
    if len(matches) == 1:
        return matches[0], profiles[matches[0]]
    if smoke:
        return None, None
    raise SystemExit(f"device {device_name!r} matches {matches or 'no'} profile of conf/hardware/devices.yaml "
                     f"(known: {sorted(profiles)}); pass --profile NAME")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes everywhere (and compile off unless --compile)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the graphs (default: on, off with --smoke)")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results", help="folder of the markdown result")
    ap.add_argument("--profile", help="devices.yaml entry for nominal peaks (default: from the device name)")
    ap.add_argument("--families", default="deepseek_v3_tiny,qwen3_next_tiny",
                    help="extra tiny twins for bf16 parity (comma list; empty for none)")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="seconds after which the extra family parity checks are skipped")
    ap.add_argument("--commit", help="zoo commit to record (default: git rev-parse HEAD, where there is a .git)")
    ap.add_argument("--prompt", type=int, help="decode prompt length (default 512; smoke 16)")
    ap.add_argument("--new-tokens", type=int, help="timed decode steps (default 128; smoke 8)")
    ap.add_argument("--prefill-lens", help="comma list of prefill prompt lengths (default 2048,4096; smoke 32,64)")
    ap.add_argument("--parallel", action="store_true",
                    help="section 5 only, under torchrun on several GPUs: torchrun --nproc-per-node N "
                         "scripts/gpu_check.py --parallel (NCCL; rank 0 writes the result)")
    args = ap.parse_args(argv)
    if args.parallel:
        import os

        import torch.distributed as dist

        if "WORLD_SIZE" not in os.environ:
            raise SystemExit("--parallel: launch under torchrun --nproc-per-node N (N GPUs)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"

    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible (use --device cpu --smoke here)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise SystemExit(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    if args.compile is None:
        args.compile = not args.smoke
    sizes = SMOKE if args.smoke else FULL
    if args.prompt or args.new_tokens or args.prefill_lens:
        sizes = Sizes(**{**sizes.__dict__, **({"prompt": args.prompt} if args.prompt else {}),
                         **({"new_tokens": args.new_tokens} if args.new_tokens else {}),
                         **({"prefill_lens": tuple(int(x) for x in args.prefill_lens.split(","))}
                            if args.prefill_lens else {})})
    torch.set_float32_matmul_precision("highest")  # float32 parity: no TF32

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    args.profile, profile = pick_profile(args.profile, device, device_name, args.smoke)
    now = datetime.datetime.now(datetime.timezone.utc)
    report = Report()
    report.meta = {"device_name": device_name, "device": str(device), "date": now.strftime("%Y-%m-%d %H:%M UTC"),
                   "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                   "zoo commit": args.commit or _git_commit(), "profile (nominal peaks)": args.profile,
                   "nominal bandwidth": f"{profile['bandwidth'] / 1e12:.2f} TB/s" if profile else None,
                   "nominal bf16 peak": f"{profile['flops']['bfloat16'] / 1e12:.3g} TFLOP/s" if profile else None,
                   "compile": args.compile, "smoke": args.smoke, "float32 matmul precision": "highest (no TF32)",
                   "sizes": {k: v for k, v in sizes.__dict__.items()}, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.meta["device memory"] = f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"

    def run(section: str, fn, *a) -> object:
        t0 = time.perf_counter()
        try:
            return fn(report, args, sizes, device, *a)
        except Exception:  # noqa: BLE001 - recorded in the result, the other sections still run
            report.errors.append(f"{section}:\n{traceback.format_exc()}")
            report.line(section, f"ERROR: {traceback.format_exc().strip().splitlines()[-1]}")
            return None
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report.seconds[f"{section} ({fn.__name__.removeprefix('section_')}{''.join(f' {x}' for x in a if isinstance(x, str))})"] = \
                round(time.perf_counter() - t0, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or device.type
    path = args.out / f"gpu_check_{slug}_{now:%Y-%m-%d}{'_smoke' if args.smoke else ''}.md"

    def save(final: bool = False) -> str:
        """The result so far (rewritten after every section: a run cut short still leaves one)."""
        report.meta["total seconds"] = round(time.perf_counter() - t_start, 1)
        report.meta["complete"] = final
        text = render(report)
        path.write_text(text)
        return text

    deadline = t_start + args.budget_s
    if args.parallel:
        import torch.distributed as dist

        path = path.with_name(path.stem + f"_parallel{dist.get_world_size()}.md")
        run(S5, section_parallel)
        text = render(report)
        if dist.get_rank() == 0:
            report.meta["total seconds"] = round(time.perf_counter() - t_start, 1)
            report.meta["complete"] = True
            text = render(report)
            path.write_text(text)
            print(text)
        failed = torch.tensor([int(report.failed())], device=device)
        dist.all_reduce(failed)
        dist.destroy_process_group()
        return 1 if int(failed) else 0
    run(S1, section_llama_parity_and_graph)
    save()
    probes = run(SP, section_probes)
    if probes is not None:
        perf: dict = {}
        run(S3, section_decode, probes, profile, perf)
        save()
        run(S4, section_prefill, probes, profile, perf)
        perf.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    for conf in [c for c in args.families.split(",") if c]:
        run(S1, section_family_parity, conf, deadline)
        save()
    text = save(final=True)
    print(text)
    print(f"written: {path}", file=sys.stderr)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
