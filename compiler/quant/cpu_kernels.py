"""zoo's CPU kernels for weight-only quantized linears (cpu_kernels.cpp), and their reference.

    int4_linear(x [M, I] f32, qs [O, I/2] u8, sm [O, 2, I/g] f16 or f32, g) -> [M, O] f32
        qs in llama.cpp's Q4 block layout (byte t of a 32-input block: input t in the low nibble,
        input t + 16 in the high one), W[o, i] = q * d + m with d, m = sm[o, :, i // g]
        (float32 sm for GGUF Q4_K, whose d * sc has more bits than a float16)
    int5_linear(x [M, I] f32, qs [O, I/2] u8, qh [O, I/8] u8, sm [O, 2, I/g] f16 or f32, g) -> [M, O] f32
        int4 with a fifth bit per code (GGUF Q5_0 / Q5_1 at their stored width, 24 bytes per 32
        weights with float16 sm): q = nibble (qs, as int4) | bit << 4, the bits of each 32-input
        block in 4 bytes of qh, a little-endian word with input t's bit at t (the blocks' own qh)
    int8_linear(x [M, I] f32, qw [O, I] i8, scale [O] f32) -> [M, O] f32,  W = qw * scale[:, None]
    int8g_linear(x [M, I] f32, qw [O, I] i8, sm [O, 2, I/g] f32 or f16, g) -> [M, O] f32
        W[o, i] = qw * d + m per group of g = 16 or a multiple of 32 inputs: every GGUF block
        type's integer codes with their group scales and offsets, exactly (gguf_blocks.py);
        sm [O, 1, I/g] holds d only (W = qw * d: the types without an offset, Q8_0, Q3_K, ...);
        float16 sm for the types whose d is a stored float16 (Q8_0: 34 bytes per 32 weights)
    q6k_linear(x [M, I] f32, blocks [O, I/256 * 210] u8) -> [M, O] f32
        GGUF Q6_K at its stored width (6.5625 bits a weight), the file's blocks as they are:
        W = d * sc * (q - 32) per group of 16 (gguf_blocks.py), computed as int8g's d-only case
    expert_linear(x [N, I] f32, offs [E] i64, kind, qw [E, O, ...], qh, sm [E, O, ns, I/g], g,
                  act, limit, alpha, up_offset) -> [N, O] f32 (act 1: [N, O/2])
        a stack of experts in one of the layouts above (EXPERT_KINDS: int4, int5, int8g, q6k),
        x's rows sorted by expert and offs the cumulative end of each expert's segment: row n
        times its expert's weight, each (row, output) the sum the linear kernel gives it (so the
        same bits whatever other rows chose the expert); the activations rounded once for all
        rows, one parallel region over (expert, output tile). act 1 (gate rows, then up rows):
        act(gate) * (up + up_offset) with act(g) = g * sigmoid(alpha g) after the clamps
        gate <= limit, |up| <= limit (limit > 0): SwiGLU experts without their [N, O] floats

Why our own kernels: torch's weight-only CPU ops (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) stream a fraction of what a plain read does at one row (their float32
path is a scalar fallback; scripts/results/design-measurements.md), and
torchao's CPU int4 layout calls the same op (its int8-activation kernels need AVX512-VNNI / AMX).
Decode is a matrix-vector product per linear, so its speed is how fast the codes can be read:
the kernels round x to int8 per block of 32 inputs (llama.cpp's Q8 activations, on the same file)
and take each block's dot product in integers, 32 multiply-adds per instruction. They do so at
every row count, with one fixed order of the float sums per (row, output) (cpu_kernels.cpp's row
tiles), so a row's output is bit for bit the same alone, in a decode bucket, in a prefill chunk or
among a whole prompt's rows, and whichever threads split the outputs (batch invariance: a greedy
answer does not depend on the path its cache took; tests/test_quant.py and tests/test_invariance.py).
`float_rows` (runtime.quant_prefill=float: FLOAT_ROWS) trades that away for the old prefill: calls
of more rows dequantize a chunk of weight rows to float32 at a time and call the BLAS GEMM with x
as it is. `round_activations` and the references below say what each path computes (the
references' sums run in torch's order, so they match the kernels within float32 rounding, not
bit for bit); tests/test_quant.py holds the kernels to them.

Built on first use (compiler/native.py: the C++ compiler inductor uses, into the zoo cache) and
loaded with torch.ops.load_library; `register_fake` gives the compiled graphs their shapes. Where
no compiler works the reference below runs instead and `status()` says why (the build report
shows it): the same numbers, slower.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import native
from . import gguf_blocks

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
BLOCK = 32  # inputs per Q4 block (the nibble pairing of qs) and per activation scale
Q6K_GROUP = 16  # inputs per Q6_K group scale
FLOAT_ROWS = 16  # runtime.quant_prefill=float: calls of more rows take the float GEMM (the kernels' float_rows)
PREFILL_MODES = {"int8": 0, "float": FLOAT_ROWS}  # runtime.quant_prefill -> the kernels' float_rows


# ----------------------------------------------------------------------------- reference

def int4_dequantize(qs: torch.Tensor, sm: torch.Tensor, qh: torch.Tensor | None = None) -> torch.Tensor:
    """qs [O, I/2] uint8, sm [O, 2, I/g] float16 or float32 -> W [O, I] float32 (see the module
    docstring); with qh [O, I/8] uint8 int5's W (the codes' fifth bits)."""
    O, half = qs.shape
    blocks = qs.view(O, half // 16, 16)
    q = torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(O, 2 * half).int()  # [O, I]
    if qh is not None:  # bit t of each block's 4 bytes (little-endian) is input t's
        q |= ((qh[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(O, 2 * half).int() << 4
    g = 2 * half // sm.shape[2]
    d, m = sm.float().unbind(1)  # [O, I/g]
    return q.float() * d.repeat_interleave(g, dim=1) + m.repeat_interleave(g, dim=1)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, I] float32 -> x rounded to int8 per block of 32 inputs, as the kernels' integer path
    does: codes round(x * 127 / max|x|), scale max|x| / 127 (returned dequantized)."""
    M, I = x.shape
    blocks = x.reshape(M, I // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(M, I)


def _float_gemm(x: torch.Tensor, float_rows: int) -> bool:
    return float_rows > 0 and x.shape[0] > float_rows


def int4_reference(x: torch.Tensor, qs: torch.Tensor, sm: torch.Tensor, group: int,
                   qh: torch.Tensor | None = None, float_rows: int = 0) -> torch.Tensor:
    """What int4_linear computes (int5_linear with qh), in torch ops: W times the int8-rounded x
    (the m part too, over the rounded x's sums, as llama.cpp's Q4_1 / Q5_1 dots); with
    float_rows > 0, calls of more rows with x as it is (the float GEMM)."""
    return F.linear(x if _float_gemm(x, float_rows) else round_activations(x), int4_dequantize(qs, sm, qh))


def int5_reference(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor, sm: torch.Tensor, group: int,
                   float_rows: int = 0) -> torch.Tensor:
    """What int5_linear computes (int4_reference with the fifth bits)."""
    return int4_reference(x, qs, sm, group, qh, float_rows)


def int8g_dequantize(qw: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """qw [O, I] int8, sm [O, 2, I/g] float32 or float16 -> W [O, I] float32 (W = qw d + m per
    group); sm [O, 1, I/g]: W = qw d."""
    g, sm = qw.shape[1] // sm.shape[2], sm.float()
    w = qw.float() * sm[:, 0].repeat_interleave(g, dim=1)
    return w + sm[:, 1].repeat_interleave(g, dim=1) if sm.shape[1] == 2 else w


def int8g_reference(x: torch.Tensor, qw: torch.Tensor, sm: torch.Tensor, group: int,
                    float_rows: int = 0) -> torch.Tensor:
    """What int8g_linear computes (as int4_reference: W times the int8-rounded x, the m part, if
    any, too; float_rows as there)."""
    return F.linear(x if _float_gemm(x, float_rows) else round_activations(x), int8g_dequantize(qw, sm))


def q6k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks [O, I/256 * 210] uint8 -> (qw [O, I] int8 in -32..31, sm [O, 1, I/16] float32
    d * sc): int8g's d-only layout of the same weights (gguf_blocks.py reads the blocks)."""
    c = gguf_blocks.codes(blocks, "Q6_K")
    return c.q.to(torch.int8), c.d[:, None]


def q6k_reference(x: torch.Tensor, blocks: torch.Tensor, float_rows: int = 0) -> torch.Tensor:
    """What q6k_linear computes: int8g_reference of the blocks' codes and group scales."""
    qw, sm = q6k_codes(blocks)
    return int8g_reference(x, qw, sm, Q6K_GROUP, float_rows)


EXPERT_KINDS = {"int4": 0, "int5": 1, "int8g": 2, "q6k": 3}  # expert_linear's kind codes


def gated_act(h: torch.Tensor, limit: float = 0.0, alpha: float = 1.0, up_offset: float = 0.0) -> torch.Tensor:
    """h [N, 2F] (gate | up) -> [N, F]: expert_linear's act 1 in torch ops (dense.swiglu with
    limit 0 for none: silu is alpha 1)."""
    from ..activation import swiglu

    gate, up = h.chunk(2, dim=-1)
    return swiglu(gate, up, limit if limit > 0 else None, alpha=None if alpha == 1.0 else alpha, up_offset=up_offset)


def expert_reference(x: torch.Tensor, offs: torch.Tensor, kind: str, qw: torch.Tensor, qh: torch.Tensor | None,
                     sm: torch.Tensor | None, group: int, act: int = 0, limit: float = 0.0, alpha: float = 1.0,
                     up_offset: float = 0.0, float_rows: int = 0) -> torch.Tensor:
    """What expert_linear computes: each expert's segment through its layout's reference (float_rows
    per segment, as the kernel), act 1 through gated_act; rows past offs[-1] are zeros."""
    O = qw.shape[1]
    out = x.new_zeros(x.shape[0], O // 2 if act else O)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xs = x[start:end]
            if kind == "q6k":
                h = q6k_reference(xs, qw[e], float_rows)
            elif kind == "int8g":
                h = int8g_reference(xs, qw[e], sm[e], group, float_rows)
            else:
                h = int4_reference(xs, qw[e], sm[e], group, qh[e] if kind == "int5" else None, float_rows)
            out[start:end] = gated_act(h, limit, alpha, up_offset) if act else h
        start = end
    return out


def int8_reference(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, float_rows: int = 0) -> torch.Tensor:
    """What int8_linear computes (x rounded to int8 per 32 inputs; float_rows as int4_reference's)."""
    return F.linear(x if _float_gemm(x, float_rows) else round_activations(x), qw.float() * scale[:, None])


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [O, I] in 0..15 and d, m [O, I/g] (W = q d + m) -> (qs [O, I/2] uint8, sm [O, 2, I/g]
    float16) in the kernel's layout."""
    O, I = q.shape
    pairs = q.to(torch.uint8).view(O, I // BLOCK, 2, BLOCK // 2)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(O, I // 2)
    return qs, torch.stack((d, m), dim=1).to(torch.float16)


def pack_int5(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q [O, I] in 0..31 and d, m [O, I/g] -> (qs [O, I/2], qh [O, I/8] uint8, sm [O, 2, I/g]
    float16) in int5_linear's layout."""
    O, I = q.shape
    qs, sm = pack_int4(q & 0xF, d, m)
    bits = (q >> 4).to(torch.uint8).reshape(O, I // 8, 8) << torch.arange(8, dtype=torch.uint8)
    return qs, bits.sum(-1, dtype=torch.uint8), sm


# ----------------------------------------------------------------------------- build and load

@functools.cache
def _load() -> str | None:
    """Build (once per cache) and load the library (compiler/native.py); None when it works,
    else the reason."""
    why = native.load(SOURCE)
    if why is None:
        torch.library.register_fake("zoo_quant::int4_linear")(
            lambda x, qs, sm, group, float_rows=0: x.new_empty(x.shape[0], qs.shape[0]))
        torch.library.register_fake("zoo_quant::int5_linear")(
            lambda x, qs, qh, sm, group, float_rows=0: x.new_empty(x.shape[0], qs.shape[0]))
        torch.library.register_fake("zoo_quant::int8_linear")(
            lambda x, qw, scale, float_rows=0: x.new_empty(x.shape[0], qw.shape[0]))
        torch.library.register_fake("zoo_quant::int8g_linear")(
            lambda x, qw, sm, group, float_rows=0: x.new_empty(x.shape[0], qw.shape[0]))
        torch.library.register_fake("zoo_quant::q6k_linear")(
            lambda x, blocks, float_rows=0: x.new_empty(x.shape[0], blocks.shape[0]))
        torch.library.register_fake("zoo_quant::expert_linear")(
            lambda x, offs, kind, qw, qh, sm, group, act=0, limit=0.0, alpha=1.0, up_offset=0.0, float_rows=0:
            x.new_empty(x.shape[0], qw.shape[1] // (2 if act else 1)))
    return why


def available() -> bool:
    return _load() is None


def status() -> str:
    """What the CPU quantized linears run on, for the build report."""
    why = _load()
    if why is not None:
        return f"torch reference (dequantize + matmul; zoo's kernel did not build: {why})"
    simd = torch.ops.zoo_quant.simd_level()
    return "zoo cpu kernel (" + {4: "avx512 + vnni", 3: "avx512", 2: "avx2 + fma"}.get(simd, "portable loops") + ", float32)"

