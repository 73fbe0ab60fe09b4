"""GGUF blocks repacked into zoo's int4 / int5 kernel layouts, written straight into the buffers.

    into_int4(b: StoredBlocks [R, I], qs [R, I/2] u8, d, m [R, I/32])          w = q d + m
    into_int5(b: StoredBlocks [R, I], qs [R, I/2] u8, qh [R, I/8] u8, d, m [R, I/32])

The outputs are the final buffers (or views of them with a contiguous inner dim: the d and m rows
of scales [O, 2, I/32], or of a whole expert stack's [E * O, 2, I/32]); the input is the stored
bytes, typically a view of the file's memory map. Q4_K and Q5_K, whose codes and scales are
re-packed, go through one native call (repack.cpp, built like the kernels by compiler/native.py:
a pass over the bytes, parallel over rows, no float or int32 temporaries). Every other type, and
any type where the library did not build, goes through gguf_blocks' torch reference
(`int4_parts` / `int5_parts`) chunk_rows rows at a time: the same bits (tests/test_repack.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .. import native
from ..contracts import StoredBlocks
from ..errors import CheckpointError
from . import gguf_blocks
from .gguf_blocks import int4_parts, int5_parts

SOURCE = Path(__file__).with_name("repack.cpp")
NATIVE = ("Q4_K", "Q5_K")  # the types repack.cpp packs into int4 / int5 (the others are copies of their bytes)
ZQ8_NATIVE = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # the types repack.cpp re-blocks into ZQ8 (its type ids)
_BLOCK_ROWS = 1 << 12  # rows per reference call: its int32 temporaries stay a few MB


@functools.cache
def _load() -> str | None:
    """Build (once per cache) and load repack.cpp; None when it works, else why."""
    return native.load(SOURCE)


def native_available() -> bool:
    return _load() is None


def _rows(b: StoredBlocks) -> torch.Tensor:
    data = b.data if b.data.dim() == 2 else b.data.reshape(-1, b.data.shape[-1])
    return data if data.stride(-1) == 1 else data.contiguous()


def _check(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols) or (cols > 1 and t.stride(1) != 1):
        raise CheckpointError(f"repack: output {name} of shape {list(t.shape)} strides {list(t.stride())}: expected "
                              f"[{rows}, {cols}] with a contiguous inner dim")


def _chunks(b: StoredBlocks, data: torch.Tensor):
    step = max(1, _BLOCK_ROWS * 256 // b.shape[1])
    for r in range(0, len(data), step):
        yield r, StoredBlocks(b.ggml_type, data[r:r + step], (len(data[r:r + step]), b.shape[1]))


def _stacked(b: StoredBlocks, outs: tuple, cols: tuple, op: str) -> bool:
    """A part of an expert stack, b [E, n, I] with outputs [E, n, cols]: one native call over its
    E * n rows (True), or per expert through the 2-D path (False)."""
    E, n, I = b.shape
    for name, t, c in zip(("qs", "d", "m") if len(outs) == 3 else ("qs", "qh", "d", "m"), outs, cols):
        if t.dim() != 3 or tuple(t.shape) != (E, n, c) or (c > 1 and t.stride(-1) != 1):
            raise CheckpointError(f"repack: output {name} of shape {list(t.shape)} strides {list(t.stride())}: "
                                  f"expected [{E}, {n}, {c}] with a contiguous inner dim")
    lay = gguf_blocks.layout(b.ggml_type)
    if (b.ggml_type in NATIVE and native_available() and b.data.dim() == 3 and b.data.stride(-1) == 1
            and tuple(b.data.shape) == (E, n, I // lay.block * lay.nbytes)):
        getattr(torch.ops.zoo_repack, op)(b.data, *outs)
        return True
    return False


@torch.no_grad()
def into_int4(b: StoredBlocks, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """INT4_TYPES blocks b [R, I] -> qs [R, I/2] uint8, d, m [R, I/32] (gguf_blocks.int4_parts'
    values, exactly: float32 for Q4_K, float16 as stored for Q4_0 / Q4_1). Also b [E, n, I] with
    outputs [E, n, ...] (strided per expert: a part of a stack's rows)."""
    if len(b.shape) == 3:
        I = b.shape[2]
        ok = b.ggml_type == "Q4_K" and _stacked(b, (qs, d, m), (I // 2, I // 32, I // 32), "q4k_int4")
        for e in range(0 if ok else b.shape[0]):
            into_int4(StoredBlocks(b.ggml_type, b.data[e], tuple(b.shape[1:])), qs[e], d[e], m[e])
        return
    R, I = b.shape
    for name, t, cols in (("qs", qs, I // 2), ("d", d, I // 32), ("m", m, I // 32)):
        _check(name, t, R, cols)
    data = _rows(b)
    if b.ggml_type == "Q4_K" and native_available() and data.shape == (R, I // 256 * 144):
        torch.ops.zoo_repack.q4k_int4(data, qs, d, m)
        return
    for r, part in _chunks(b, data):
        pq, pd, pm = int4_parts(part)
        n = len(pq)
        qs[r:r + n].copy_(pq)
        d[r:r + n].copy_(pd)
        m[r:r + n].copy_(pm)


@torch.no_grad()
def into_int5(b: StoredBlocks, qs: torch.Tensor, qh: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """INT5_TYPES blocks b [R, I] -> qs [R, I/2], qh [R, I/8] uint8, d, m [R, I/32]
    (gguf_blocks.int5_parts' values, exactly); b [E, n, I] as into_int4."""
    if len(b.shape) == 3:
        I = b.shape[2]
        ok = b.ggml_type == "Q5_K" and _stacked(b, (qs, qh, d, m), (I // 2, I // 8, I // 32, I // 32), "q5k_int5")
        for e in range(0 if ok else b.shape[0]):
            into_int5(StoredBlocks(b.ggml_type, b.data[e], tuple(b.shape[1:])), qs[e], qh[e], d[e], m[e])
        return
    R, I = b.shape
    for name, t, cols in (("qs", qs, I // 2), ("qh", qh, I // 8), ("d", d, I // 32), ("m", m, I // 32)):
        _check(name, t, R, cols)
    data = _rows(b)
    if b.ggml_type == "Q5_K" and native_available() and data.shape == (R, I // 256 * 176):
        torch.ops.zoo_repack.q5k_int5(data, qs, qh, d, m)
        return
    for r, part in _chunks(b, data):
        pq, ph, pd, pm = int5_parts(part)
        n = len(pq)
        qs[r:r + n].copy_(pq)
        qh[r:r + n].copy_(ph)
        d[r:r + n].copy_(pd)
        m[r:r + n].copy_(pm)


def to_mixed(data: torch.Tensor, ggml_type: str, fmt: str) -> torch.Tensor:
    """gguf_blocks.to_mixed (stored bytes [R, nb * nbytes] -> ZQ8 format `fmt` [R, I / g * (g + 8)]),
    natively for Q4_K / Q5_K / Q6_K (no int32 codes or float copies), the same bytes."""
    g = gguf_blocks.layout(fmt).group
    lay = gguf_blocks.layout(ggml_type)
    if (ggml_type not in ZQ8_NATIVE or g > lay.group or not native_available() or data.dim() != 2
            or data.shape[1] % lay.nbytes):
        return gguf_blocks.to_mixed(data, ggml_type, fmt)
    data = data if data.stride(-1) == 1 else data.contiguous()
    out = torch.empty(data.shape[0], data.shape[1] // lay.nbytes * (lay.block // g) * (g + 8), dtype=torch.uint8)
    torch.ops.zoo_repack.k_to_zq8(data, ZQ8_NATIVE[ggml_type], g, out)
    return out


@torch.no_grad()
def into_int8g_zq8(data: torch.Tensor, fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """ZQ8 bytes [R, n * (g + 8)] -> the int8g layout's q [R, n * g] int8, d, m [R, n] float32 (the
    format's codes and scales as they are: a split, one native pass where it built)."""
    g = gguf_blocks.layout(fmt).group
    R = data.shape[0]
    for name, t, cols in (("q", q, data.shape[1] // (g + 8) * g), ("d", d, data.shape[1] // (g + 8)),
                          ("m", m, data.shape[1] // (g + 8))):
        _check(name, t, R, cols)
    data = data if data.stride(-1) == 1 else data.contiguous()
    if native_available() and q.dtype == torch.int8 and d.dtype == m.dtype == torch.float32:
        torch.ops.zoo_repack.zq8_int8g(data, g, q, d, m)
        return
    step = max(1, (1 << 20) // max(1, data.shape[1]))
    for r in range(0, R, step):
        pq, pd, pm = zq8_parts(data[r:r + step], fmt)
        n = len(pq)
        q[r:r + n].copy_(pq.reshape(n, -1))
        d[r:r + n].copy_(pd)
        m[r:r + n].copy_(pm)


def zq8_parts(data: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZQ8 bytes [R, n * (g + 8)] -> views (q [R, n, g] int8, d [R, n], m [R, n] float32) of them: the
    format is the int8g layout's codes and scales already, so filling it is strided copies."""
    g = gguf_blocks.layout(fmt).group
    R = data.shape[0]
    blocks = data.reshape(R, -1, g + 8)
    dm = blocks[..., g:].contiguous().view(torch.float32)  # [R, n, 2] (8 bytes a group: small)
    return blocks[..., :g].view(torch.int8), dm[..., 0], dm[..., 1]
