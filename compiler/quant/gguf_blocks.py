"""llama.cpp's block formats read in torch: every block type as integer codes times a scale per
group plus an offset, the form zoo's quantized layouts hold.

    LAYOUTS[ggml type] -> Layout(block, nbytes, group, codes)
    codes(blocks [N, nbytes] uint8) -> Codes(q [N, block] int32, d [N, block/group] float32,
                                             m [N, block/group] float32 or None)
    w[n, j] = q[n, j] * d[n, j // group] (+ m[n, j // group])

Byte layouts (ggml-common.h; gguf.quants holds llama.cpp's reference dequantization in numpy,
which `dequantize` equals bit for bit, tests/test_gguf_quants.py):

    Q4_0    32: d f16 | qs[16]                       q = nibble - 8
    Q4_1    32: d f16 | m f16 | qs[16]               q = nibble, offset m
    Q5_0    32: d f16 | qh[4] | qs[16]               q = (nibble | bit << 4) - 16
    Q5_1    32: d f16 | m f16 | qh[4] | qs[16]       q = nibble | bit << 4, offset m
    Q8_0    32: d f16 | qs[32] int8
    IQ4_NL  32: d f16 | qs[16]                       q = KVALUES[nibble]
    Q2_K   256: scales[16] | qs[64] | d | dmin       16 groups of 16: d * (s & 15), -dmin * (s >> 4)
    Q3_K   256: hmask[32] | qs[64] | scales[12] | d  16 groups of 16: d * (6-bit s - 32), q in -4..3
    Q4_K   256: d | dmin | scales[12] | qs[128]      8 groups of 32: d * sc, -dmin * mn (6-bit each)
    Q5_K   256: d | dmin | scales[12] | qh[32] | qs[128]   as Q4_K with a fifth bit
    Q6_K   256: ql[128] | qh[64] | scales[16] int8 | d     16 groups of 16: d * s, q in -32..31
    IQ4_XS 256: d | scales_h u16 | scales_l[4] | qs[128]  8 groups of 32: d * (6-bit s - 32), KVALUES
    MXFP4   32: e u8 | qs[16]                        d = 2^(e - 128) (E8M0, halved), q = 2 * e2m1[nibble]
    IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S 256: d f16 | grid indices, signs, 4-bit scales:
            q = grid value * sign (gguf.quants' codebooks), d per 32 (IQ2_XS / IQ2_S: per 16)
    IQ1_S  256: d f16 | qs[32] | qh u16[8]           q = 8 * grid (+-1) +- 1 (the delta), d / 8 per 32
    IQ1_M  256: qs[32] | qh[16] | scales[8] (d f16 spread over them)   as IQ1_S, per 16
    TQ1_0 / TQ2_0 256: base-3 / 2-bit codes | d f16   q in -1..1, one d per block
    NVFP4   64: UE4M3 scales[4] | qs[32]            q = 2 * e2m1[nibble], d per 16

Nibbles: in a run of n bytes the low nibbles are inputs 0..n-1 and the high ones n..2n-1 (n = 16
for the 32-blocks, 32 for Q4_K / Q5_K, 64 for Q6_K's ql). The group scales d of every type are
a float16 times an integer of at most 8 bits (MXFP4's a power of two), exact in float32, so q * d
(+ m) rounds as llama.cpp's own dequantization does.

zoo's int4 layout (QuantLinear, cpu_kernels.py) is w = q * d + m per group of 32 with q in 0..15:
Q4_0 (m = -8 d), Q4_1 and Q4_K are that with the same codes; Q4_0 / Q4_1's d and m are float16
as stored, Q4_K's d * sc and dmin * mn need float32 (`int4_parts`). Its int5 layout adds a fifth
bit per code, q in 0..31: Q5_0 (m = -16 d) and Q5_1 at their stored width, the blocks' own nibbles,
high-bit words and float16 d, m (`int5_parts`), and Q5_K with the same codes and float32 d * sc, -dmin * mn. The other types need more than 5 bits per code (or
IQ4's codebook). Q6_K is kept as its bytes (`Q6K_TYPES`: zoo_quant.q6k_linear reads the blocks
at their 6.5625 bits a weight). The rest: zoo's int8g layout holds their codes as int8 with d, m float32 per group
(`block_codes`), and weights joined from parts of different types go through
the ZQ8 block format below (`mixed_format`, `to_mixed`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ..errors import CheckpointError
from ..contracts import StoredBlocks

BLOCK = 32
QK_K = 256
CHUNK_BLOCKS = 1 << 14  # blocks converted at a time: the temporaries stay a few MB
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4's codebook


class Codes(NamedTuple):
    """q [N, block] int32, d [N, block/g] float32, m [N, block/g] float32 or None (no offset)."""

    q: torch.Tensor
    d: torch.Tensor
    m: Optional[torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """One GGML block type: `block` weights in `nbytes` bytes, scales per `group` weights;
    half: its d (and m) are stored float16 values, not products of sub-scales (held as float16)."""

    block: int
    nbytes: int
    group: int
    codes: Callable[[torch.Tensor], Codes]
    half: bool = False


# ----------------------------------------------------------------------------- bit fields


def _f16(two: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 (little-endian float16) -> [N, 1] float32."""
    return two.contiguous().view(torch.float16).float()


def _fields(x: torch.Tensor, run: int, width: int) -> torch.Tensor:
    """x [N, k] uint8 -> its `width`-bit fields [N, 8k / width] int32: per run of `run` bytes,
    field 0 of each byte (the lowest bits), then field 1 of each, ..."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).reshape(1, 1, -1, 1)
    r = x.reshape(len(x), -1, 1, run) >> shifts
    return (r & ((1 << width) - 1)).reshape(len(x), -1).int()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """qs [N, k] uint8 -> [N, 2k] int32: per run of `run` bytes, the low nibbles then the high."""
    return _fields(qs, run, 4)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, k] uint8 -> 2-bit fields [N, 4k] int32: per run of 32 bytes, bits 0-1 of each byte,
    then 2-3, 4-5, 6-7."""
    return _fields(qs, 32, 2)


def _bits(h: torch.Tensor, run: int) -> torch.Tensor:
    """h [N, k] uint8 -> bits [N, 8k] int32: per run of `run` bytes, bit 0 of each byte, then bit 1,
    ... (run 1: bit j of a little-endian word at j)."""
    return _fields(h, run, 1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [N, 12] -> 6-bit (scale, min) [N, 8] int32 each."""
    s = s.reshape(len(s), 3, 4).int()
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


# ----------------------------------------------------------------------------- the types


def _q4_0(b):
    return Codes(_nibbles(b[:, 2:], 16) - 8, _f16(b[:, 0:2]), None)


def _q4_1(b):
    return Codes(_nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4]))


def _q5_0(b):
    return Codes((_nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 1) << 4)) - 16, _f16(b[:, 0:2]), None)


def _q5_1(b):
    return Codes(_nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8], 1) << 4), _f16(b[:, 0:2]), _f16(b[:, 2:4]))


def _q8_0(b):
    return Codes(b[:, 2:].contiguous().view(torch.int8).int(), _f16(b[:, 0:2]), None)


_KV = torch.tensor(KVALUES, dtype=torch.int32)


def _iq4_nl(b):
    return Codes(_KV[_nibbles(b[:, 2:], 16).long()], _f16(b[:, 0:2]), None)


def _q2_k(b):
    s = b[:, :16].int()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    return Codes(_crumbs(b[:, 16:80]), d * (s & 0xF).float(), -(dmin * (s >> 4).float()))


def _q3_k(b):
    s = b[:, 96:108]
    low = _nibbles(s[:, :8], 8)  # [N, 16]: low nibbles of bytes 0-7, then their high nibbles
    high = _fields(s[:, 8:12], 4, 2)  # [N, 16]: bits 0-1 of bytes 8-11, then 2-3, 4-5, 6-7
    sc = ((low | (high << 4)) - 32).float()
    hbit = _bits(b[:, :32], 32)
    return Codes(_crumbs(b[:, 32:96]) - ((hbit ^ 1) << 2), _f16(b[:, 108:110]) * sc, None)


def _q4_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return Codes(_nibbles(b[:, 16:], 32), d * sc.float(), -(dmin * mn.float()))


def _q5_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32) << 4)
    return Codes(q, d * sc.float(), -(dmin * mn.float()))


def _q6_k(b):
    ql = _nibbles(b[:, :128], 64)
    qh = _crumbs(b[:, 128:192])
    s = b[:, 192:208].contiguous().view(torch.int8).float()
    return Codes((ql | (qh << 4)) - 32, _f16(b[:, 208:210]) * s, None)


def _iq4_xs(b):
    d = _f16(b[:, 0:2])
    sh = b[:, 2].int() | (b[:, 3].int() << 8)  # [N] 16 bits: 2 per group
    high = (sh[:, None] >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [N, 8]
    low = _fields(b[:, 4:8], 1, 4)  # [N, 8]: byte 0 low, byte 0 high, byte 1 low, ...
    q = _KV[_nibbles(b[:, 8:], 16).long()]
    return Codes(q, d * ((low | (high << 4)) - 32).float(), None)


# MXFP4's e2m1 values doubled (gguf.quants.MXFP4.kvalues): integer codes, the block's scale halved
_MX = torch.tensor((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=torch.int32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes [N, 1] -> 2 ** (e - 128) float32 [N, 1] (ggml_e8m0_to_fp32_half: e < 2 are
    the float32 subnormals 2 ** -127, 2 ** -126 / 2... as bits 0x00200000 << e)."""
    e = e.int()
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b):
    return Codes(_MX[_nibbles(b[:, 1:], 16).long()], _e8m0_half(b[:, 0:1]), None)



# ----------------------------------------------------------------------------- the i-quants and ternaries
# Their codebooks (llama.cpp's grids and the 7-bit sign masks) are read from gguf.quants, the
# oracle itself, rather than typed again. Every code is a grid value times a sign: int8.


@functools.cache
def _grid(name: str) -> torch.Tensor:
    """gguf.quants' codebook of type `name`: [entries, 8 or 4] int32 (the grid values as integers)."""
    import numpy as np
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype(np.int32))


@functools.cache
def _ksigns() -> torch.Tensor:
    """The IQ2 / IQ3 sign masks [128] int32: 7 sign bits and their parity as the eighth."""
    from gguf import quants

    return torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).int()


def _words(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [N, k] uint8 -> little-endian words of `width` bytes [N, k / width] int64."""
    shifts = torch.arange(0, 8 * width, 8, dtype=torch.int64)
    return (x.reshape(len(x), -1, width).long() << shifts).sum(-1)


def _sign(neg: torch.Tensor) -> torch.Tensor:
    """Sign bits (1: negative) -> +-1 int32."""
    return 1 - 2 * neg.int()


def _mask_bits(masks: torch.Tensor) -> torch.Tensor:
    """Sign-mask indices [...] (7 bits each) -> their 8 sign bits [..., 8] (1: negative)."""
    return (_ksigns()[masks.long()][..., None] >> torch.arange(8, dtype=torch.int32)) & 1


def _iq2_xxs(b):
    n = len(b)
    w = _words(b[:, 2:], 4).reshape(n, 8, 2)  # per 32: 4 grid indices | 4 x 7 sign bits, 4-bit scale
    grid = _grid("IQ2_XXS")[b[:, 2:].reshape(n, 8, 2, 4)[:, :, 0].long()]  # [n, 8, 4, 8]
    neg = _mask_bits((w[:, :, 1:] >> torch.tensor([0, 7, 14, 21])) & 0x7F)  # [n, 8, 4, 8]
    d = _f16(b[:, 0:2]) * (0.5 + (w[:, :, 1] >> 28).float()) * 0.25
    return Codes((grid * _sign(neg)).reshape(n, -1), d, None)


def _iq2_xs(b):
    n = len(b)
    qs = _words(b[:, 2:66], 2)  # [n, 32]: 9-bit grid index | 7-bit sign mask
    q = _grid("IQ2_XS")[qs & 511] * _sign(_mask_bits(qs >> 9))
    d = _f16(b[:, 0:2]) * (0.5 + _fields(b[:, 66:74], 1, 4).float()) * 0.25  # 16 scales: per 16
    return Codes(q.reshape(n, -1), d, None)


def _iq2_s(b):
    n = len(b)
    idx = b[:, 2:34].int() | (_fields(b[:, 66:74], 1, 2) << 8)  # [n, 32] 10-bit grid indices
    q = _grid("IQ2_S")[idx.long()].reshape(n, -1) * _sign(_bits(b[:, 34:66], 1))
    d = _f16(b[:, 0:2]) * (0.5 + _fields(b[:, 74:82], 1, 4).float()) * 0.25
    return Codes(q, d, None)


def _iq3_xxs(b):
    n = len(b)
    grid = _grid("IQ3_XXS")[b[:, 2:66].long()].reshape(n, 8, 4, 8)  # 64 indices of 4 values
    w = _words(b[:, 66:98], 4)  # [n, 8] per 32: 4 x 7 sign bits, 4-bit scale
    neg = _mask_bits((w[:, :, None] >> torch.tensor([0, 7, 14, 21])) & 0x7F)
    d = _f16(b[:, 0:2]) * (0.5 + (w >> 28).float()) * 0.5
    return Codes((grid * _sign(neg)).reshape(n, -1), d, None)


def _iq3_s(b):
    n = len(b)
    idx = b[:, 2:66].int() | (_bits(b[:, 66:74], 1) << 8)  # [n, 64] 9-bit grid indices
    q = _grid("IQ3_S")[idx.long()].reshape(n, -1) * _sign(_bits(b[:, 74:106], 1))
    d = _f16(b[:, 0:2]) * (1 + 2 * _fields(b[:, 106:110], 1, 4)).float()
    return Codes(q, d, None)


# IQ1_S / IQ1_M: w = dl * (grid + delta), grid in -1..1, delta = +-1/8 per 32 (IQ1_S) or 8 (IQ1_M).
# Held as codes 8 grid +- 1 with d = dl / 8: the same real product (dl / 8 is exact), so the same
# float32 rounding; an offset m = dl delta would round twice.

def _iq1_s(b):
    n = len(b)
    qh = _words(b[:, 34:50], 2)  # [n, 8] per 32: 4 x 3 high index bits, 3-bit scale, delta sign
    idx = b[:, 2:34].int() | (((qh[:, :, None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 32) << 8)
    q = 8 * _grid("IQ1_S")[idx.long()].reshape(n, 8, 32) + _sign(qh >> 15)[:, :, None]
    d = _f16(b[:, 0:2]) * (2 * ((qh >> 12) & 7) + 1).float() * 0.125
    return Codes(q.reshape(n, -1), d, None)


def _iq1_m(b):
    n = len(b)
    sc = _words(b[:, 48:56], 2)  # [n, 4]: 4 x 3-bit scales each, and a nibble of the float16 d
    top = (sc >> 12).to(torch.uint8)
    d = _f16(torch.stack((top[:, 0] | (top[:, 1] << 4), top[:, 2] | (top[:, 3] << 4)), dim=1))
    nib = _fields(b[:, 32:48], 1, 4)  # [n, 32] per 8: 3 high index bits, delta sign
    q = 8 * _grid("IQ1_S")[(b[:, :32].int() | ((nib & 7) << 8)).long()] + _sign(nib >> 3)[:, :, None]
    s = ((sc[:, :, None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 16)  # per 16
    return Codes(q.reshape(n, -1), d * (2 * s + 1).float() * 0.125, None)


_POW3 = torch.tensor((1, 3, 9, 27, 81), dtype=torch.int32)


def _tq1_0(b):
    # base-3 digits: byte * 3^k (mod 256) keeps the k-th digit on top, (x * 3) >> 8 reads it
    def digits(x, k):
        return ((x.int()[:, None, :] * _POW3[:k, None]) & 0xFF).reshape(len(x), -1)
    x = torch.cat((digits(b[:, :32], 5), digits(b[:, 32:48], 5), digits(b[:, 48:52], 4)), dim=1)
    return Codes(((x * 3) >> 8) - 1, _f16(b[:, 52:54]), None)


def _tq2_0(b):
    return Codes(_crumbs(b[:, :64]) - 1, _f16(b[:, 64:66]), None)


def _ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's unsigned E4M3 scale bytes [N, k] -> their values halved, float32 (exact)."""
    e, m = ((x >> 3) & 0xF).int(), (x & 7).float()
    v = torch.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * torch.exp2((e - 7).float()))
    return torch.where((x == 0) | (x == 0x7F), torch.zeros_like(v), v * 0.5)


def _nvfp4(b):
    return Codes(_MX[_nibbles(b[:, 4:], 8).long()], _ue4m3_half(b[:, 0:4]), None)


LAYOUTS: dict[str, Layout] = {
    "Q4_0": Layout(32, 18, 32, _q4_0, half=True),
    "Q4_1": Layout(32, 20, 32, _q4_1, half=True),
    "Q5_0": Layout(32, 22, 32, _q5_0, half=True),
    "Q5_1": Layout(32, 24, 32, _q5_1, half=True),
    "Q8_0": Layout(32, 34, 32, _q8_0, half=True),
    "IQ4_NL": Layout(32, 18, 32, _iq4_nl, half=True),
    "Q2_K": Layout(QK_K, 84, 16, _q2_k),
    "Q3_K": Layout(QK_K, 110, 16, _q3_k),
    "Q4_K": Layout(QK_K, 144, 32, _q4_k),
    "Q5_K": Layout(QK_K, 176, 32, _q5_k),
    "Q6_K": Layout(QK_K, 210, 16, _q6_k),
    "IQ4_XS": Layout(QK_K, 136, 32, _iq4_xs),
    "MXFP4": Layout(32, 17, 32, _mxfp4),
    "NVFP4": Layout(64, 36, 16, _nvfp4),
    "IQ2_XXS": Layout(QK_K, 66, 32, _iq2_xxs),
    "IQ2_XS": Layout(QK_K, 74, 16, _iq2_xs),
    "IQ2_S": Layout(QK_K, 82, 16, _iq2_s),
    "IQ3_XXS": Layout(QK_K, 98, 32, _iq3_xxs),
    "IQ3_S": Layout(QK_K, 110, 32, _iq3_s),
    "IQ1_S": Layout(QK_K, 50, 32, _iq1_s),
    "IQ1_M": Layout(QK_K, 56, 16, _iq1_m),
    "TQ1_0": Layout(QK_K, 54, QK_K, _tq1_0, half=True),
    "TQ2_0": Layout(QK_K, 66, QK_K, _tq2_0, half=True),
}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # codes 0..15 (Q4_0 shifted by 8) with one d, m per 32
INT5_TYPES = ("Q5_0", "Q5_1", "Q5_K")  # codes 0..31 (Q5_0 shifted by 16) with one d, m per 32
Q6K_TYPES = ("Q6_K",)  # kept as their bytes (zoo_quant.q6k_linear reads the blocks)


# zoo's own block format for weights whose parts are stored in different types (llama.cpp's
# Q4_K_M keeps attn_v in Q6_K next to Q4_K q / k, and zoo's rules cat them into one wqkv): every
# part's codes re-blocked as ZQ8_G<g> = g int8 codes | d float32 | m float32, g the smallest group
# of the parts (a group of 32's scales repeated for its two 16s: exact). Rows of it cat like any
# blocks; QuantLinear holds it as int8g.
def _zq8(b):
    g = b.shape[1] - 8
    dm = b[:, g:].contiguous().view(torch.float32)  # [N, 2]
    return Codes(b[:, :g].contiguous().view(torch.int8).int(), dm[:, :1], dm[:, 1:])


MIXED_LAYOUTS = {f"ZQ8_G{g}": Layout(g, g + 8, g, _zq8) for g in (16, 32)}


def mixed_format(ggml_types) -> Optional[str]:
    """The ZQ8 format that holds weights of all these block types exactly, or None (a type without a
    block reader, e.g. F16)."""
    if not all(t in LAYOUTS for t in ggml_types):
        return None
    return f"ZQ8_G{min(LAYOUTS[t].group for t in ggml_types)}"


def to_mixed(data: torch.Tensor, ggml_type: str, fmt: str) -> torch.Tensor:
    """Stored bytes uint8 [R, nb * nbytes] of `ggml_type` -> the same weights in ZQ8 format `fmt`,
    uint8 [R, I / g * (g + 8)]."""
    g = layout(fmt).group
    q, d, m = codes(data, ggml_type)
    R, I = q.shape
    rep = LAYOUTS[ggml_type].group // g
    d = d.repeat_interleave(rep, dim=1)
    m = torch.zeros_like(d) if m is None else m.repeat_interleave(rep, dim=1)
    dm = torch.stack((d, m), dim=-1).reshape(R, I // g, 2).contiguous().view(torch.uint8)  # [R, I/g, 8]
    qb = q.to(torch.int8).reshape(R, I // g, g).view(torch.uint8)
    return torch.cat((qb, dm), dim=-1).reshape(R, -1)


# ----------------------------------------------------------------------------- reading


@functools.cache
def has_offset(ggml_type: str) -> bool:
    """Whether the type's codes come with an offset m per group (Q4_1, Q5_1, the K-quants but Q3_K /
    Q6_K, ZQ8), read off the type's own decoder on one zero block."""
    lay = layout(ggml_type)
    return lay.codes(torch.zeros(1, lay.nbytes, dtype=torch.uint8)).m is not None


def layout(ggml_type: str, where: str = "") -> Layout:
    """The Layout of `ggml_type`; CheckpointError naming it (and `where`) and the known types."""
    found = LAYOUTS.get(ggml_type) or MIXED_LAYOUTS.get(ggml_type)
    if found is None:
        raise CheckpointError(f"{where}{': ' if where else ''}GGML type {ggml_type} has no block reader "
                              f"(known: {', '.join(LAYOUTS)})")
    return found


def _as_blocks(data: torch.Tensor, lay: Layout, ggml_type: str) -> torch.Tensor:
    """Stored bytes [..., nb * nbytes] uint8 -> [N, nbytes] (checks the size)."""
    if data.dtype != torch.uint8 or data.shape[-1] % lay.nbytes:
        raise CheckpointError(f"{ggml_type} data of {data.dtype} {list(data.shape)}: expected uint8 rows of "
                              f"whole {lay.nbytes}-byte blocks")
    return data.reshape(-1, lay.nbytes)


def _values(c: Codes, group: int) -> torch.Tensor:
    """Codes -> [N, block] float32 in llama.cpp's order of operations (d * q, then + m)."""
    n, block = c.q.shape
    w = c.d[..., None] * c.q.reshape(n, block // group, group).float()
    if c.m is not None:
        w = w + c.m[..., None]
    return w.reshape(n, block)


def dequantize(data: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Stored bytes uint8 [..., nb * nbytes] -> float32 [..., nb * block], equal bit for bit to
    gguf.quants.dequantize (a few thousand blocks at a time, into one output). BF16 / F16: uint8
    [..., 2 n] -> [..., n]."""
    if ggml_type in ("BF16", "F16"):
        if data.dtype != torch.uint8 or data.shape[-1] % 2:
            raise CheckpointError(f"{ggml_type} data of {data.dtype} {list(data.shape)}: expected uint8 pairs")
        half = data.contiguous().view(torch.int16 if ggml_type == "BF16" else torch.float16)
        return (half.int() << 16).view(torch.float32) if ggml_type == "BF16" else half.float()
    lay = layout(ggml_type)
    blocks = _as_blocks(data, lay, ggml_type)
    out = torch.empty(len(blocks), lay.block, dtype=torch.float32)
    for s in range(0, len(blocks), CHUNK_BLOCKS):
        out[s:s + CHUNK_BLOCKS] = _values(lay.codes(blocks[s:s + CHUNK_BLOCKS]), lay.group)
    return out.reshape(*data.shape[:-1], data.shape[-1] // lay.nbytes * lay.block)


def codes(data: torch.Tensor, ggml_type: str) -> Codes:
    """Stored bytes uint8 [R, nb * nbytes] -> Codes with q [R, nb * block] and d, m [R, nb * block / group]."""
    lay = layout(ggml_type)
    R = data.shape[0]
    c = lay.codes(_as_blocks(data, lay, ggml_type))
    return Codes(c.q.reshape(R, -1), c.d.reshape(R, -1), None if c.m is None else c.m.reshape(R, -1))


# ----------------------------------------------------------------------------- into zoo's layouts


def _blocks(b: StoredBlocks) -> torch.Tensor:
    """b.data [O, nb * bytes] -> checked against b.shape [O, I]."""
    lay = layout(b.ggml_type)
    O, I = b.shape
    if I % lay.block or tuple(b.data.shape) != (O, I // lay.block * lay.nbytes):
        raise CheckpointError(f"{b.ggml_type} blocks of shape {list(b.data.shape)} do not hold a [{O}, {I}] "
                              f"weight ({lay.nbytes} bytes per {lay.block} weights)")
    return b.data


def block_bytes(b: StoredBlocks) -> torch.Tensor:
    """b.data [O, nb * bytes] uint8, checked against b.shape [O, I] (the layouts that keep the bytes)."""
    return _blocks(b)


def block_codes(b: StoredBlocks) -> Codes:
    """Any known block type -> Codes with q [O, I] and d, m [O, I / group] (checks the sizes)."""
    return codes(_blocks(b), b.ggml_type)


def q4_codes(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K blocks -> (q [O, I] int32 in 0..15, scale [O, I/32], zero [O, I/32]
    float32) with w = (q - 8) * scale + zero (torch's int4 kernels' convention)."""
    q, d, m = int4_parts_f32(b)
    return q, d, m + 8.0 * d


def int4_parts_f32(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4_TYPES blocks -> (q [O, I] int32 in 0..15, d, m [O, I/32] float32), w = q d + m."""
    if b.ggml_type not in INT4_TYPES:
        raise CheckpointError(f"{b.ggml_type} blocks are not 4-bit affine codes (int4 takes {', '.join(INT4_TYPES)})")
    q, d, m = codes(_blocks(b), b.ggml_type)
    if b.ggml_type == "Q4_0":  # d (n - 8) = n d - 8 d, both exact in float32
        return q + 8, d, -8.0 * d
    return q, d, m


def int4_parts(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4_TYPES blocks -> zoo's CPU int4 layout, bit for bit: (qs [O, I/2] uint8, d, m [O, I/32])
    with w = q d + m; float16 d, m for Q4_0 / Q4_1 (as stored; Q4_0's m = -8 d is exact), float32
    for Q4_K (d * sc has up to 17 significant bits)."""
    data = _blocks(b)
    O = b.shape[0]
    if b.ggml_type == "Q4_K":
        q, d, m = int4_parts_f32(b)
        pairs = q.to(torch.uint8).reshape(O, -1, 2, BLOCK // 2)
        return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(O, -1), d, m
    blocks = data.reshape(O, -1, LAYOUTS[b.ggml_type].nbytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if b.ggml_type == "Q4_1":
        m, qs = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1), blocks[..., 4:]
    else:
        m, qs = -8.0 * d, blocks[..., 2:]
    return qs.reshape(O, -1).contiguous(), d, m


def int5_parts(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 / Q5_1 / Q5_K blocks -> zoo's CPU int5 layout: (qs [O, I/2] uint8 the low nibbles, qh
    [O, I/8] uint8 the fifth bits, d, m [O, I/32]) with w = q d + m, q = nibble | bit << 4 in 0..31.
    Q5_0 / Q5_1: their bytes as stored, float16 d, m (Q5_0's m = -16 d, exact in float16 below its
    largest finite d / 16). Q5_K: its codes re-packed per 32 (the same bits, 5.5 -> 6 + 64 / 32 bits a
    weight) with float32 d * sc and -dmin * mn (products of up to 17 significant bits), as Q4_K in int4."""
    if b.ggml_type not in INT5_TYPES:
        raise CheckpointError(f"{b.ggml_type} blocks are not 5-bit affine codes (int5 takes {', '.join(INT5_TYPES)})")
    O = b.shape[0]
    if b.ggml_type == "Q5_K":
        q, d, m = codes(_blocks(b), b.ggml_type)  # q [O, I] in 0..31
        low = (q & 0xF).to(torch.uint8).reshape(O, -1, 2, BLOCK // 2)  # per 32: inputs 0-15, 16-31
        bits = (q >> 4).to(torch.uint8).reshape(O, -1, 8) << torch.arange(8, dtype=torch.uint8)
        return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(O, -1), bits.sum(-1, dtype=torch.uint8), d, m
    blocks = _blocks(b).reshape(O, -1, LAYOUTS[b.ggml_type].nbytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if b.ggml_type == "Q5_1":
        m, rest = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1), blocks[..., 4:]
    else:
        m, rest = -16.0 * d, blocks[..., 2:]
        if not torch.isfinite(m[torch.isfinite(d)]).all():
            raise CheckpointError(f"Q5_0 blocks of a [{O}, {b.shape[1]}] weight: a block scale d of magnitude over "
                                  f"{65504 / 16} has no float16 offset -16 d (int5 holds d, m in float16)")
    return rest[..., 4:].reshape(O, -1).contiguous(), rest[..., :4].reshape(O, -1).contiguous(), d, m


def q4_parts(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks -> (qs [O, I/2] uint8, d, m [O, I/32] float16): int4_parts of the types
    whose scales are float16."""
    if b.ggml_type not in ("Q4_0", "Q4_1"):
        raise CheckpointError(f"q4_parts takes Q4_0 / Q4_1 blocks, not {b.ggml_type}")
    return int4_parts(b)


def q8_0_values(b: StoredBlocks) -> torch.Tensor:
    """Q8_0 blocks -> float32 [O, I] (d * qs)."""
    return values(b)


def values(b: StoredBlocks) -> torch.Tensor:
    """Any known block type -> float32 [O, I], as gguf.quants.dequantize."""
    return dequantize(_blocks(b), b.ggml_type).reshape(b.shape)
