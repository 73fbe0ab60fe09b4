"""llama.cpp block formats -> the quantized layouts of QuantLinear, without float weights.

Byte layouts of one block of 32 weights (ggml-common.h; gguf.quants' reference dequantization):

    Q4_0  d f16 | qs[16]          w[j] = d * (q[j] - 8)
    Q4_1  d f16 | m f16 | qs[16]  w[j] = d * q[j] + m
    Q8_0  d f16 | qs[32] int8     w[j] = d * qs[j]

with q[j] = qs[j] & 0xF and q[j + 16] = qs[j] >> 4 for j < 16 (low nibbles first). torch's int4
kernels compute w = (q - 8) * scale + zero with q in 0..15, so a Q4 block is int4 group 32 with
the same codes, scale = d and zero = m + 8 d (Q4_1) or 0 (Q4_0). Q8_0's per-block scales have no
kernel (torch's int8 kernel scales whole rows): it is converted to int8 per channel through its
values (tests/test_quant.py measures that error).
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..contracts import StoredBlocks

BLOCK = 32
_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _blocks(b: StoredBlocks) -> torch.Tensor:
    """b.data [O, nb * bytes] -> [O, nb, bytes] uint8 (checks the sizes)."""
    per = _BYTES.get(b.ggml_type)
    O, I = b.shape
    if per is None or I % BLOCK or tuple(b.data.shape) != (O, I // BLOCK * per):
        raise CheckpointError(f"{b.ggml_type} blocks of shape {list(b.data.shape)} do not hold a [{O}, {I}] "
                              f"weight ({per} bytes per {BLOCK} weights)")
    return b.data.reshape(O, I // BLOCK, per)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian float16) -> [...] float32."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def q4_codes(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks -> (q [O, I] int32 in 0..15, scale [O, I/32], zero [O, I/32] float32)
    with w = (q - 8) * scale + zero."""
    blocks = _blocks(b)
    d = _f16(blocks[..., 0:2])
    if b.ggml_type == "Q4_1":
        zero = _f16(blocks[..., 2:4]) + 8.0 * d
        qs = blocks[..., 4:]
    else:
        zero = torch.zeros_like(d)
        qs = blocks[..., 2:]
    q = torch.cat((qs & 0xF, qs >> 4), dim=-1).to(torch.int32)  # [O, nb, 32]: low nibbles first
    return q.reshape(b.shape), d, zero


def q4_parts(b: StoredBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks -> (qs [O, I/2] uint8, d [O, I/32], m [O, I/32] float16), bit for bit
    (Q4_0: m = -8 d, exact in float16): w = q d + m, the zoo CPU kernel's layout."""
    blocks = _blocks(b)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if b.ggml_type == "Q4_1":
        m, qs = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1), blocks[..., 4:]
    else:
        m, qs = -8.0 * d, blocks[..., 2:]
    return qs.reshape(b.shape[0], -1).contiguous(), d, m


def q8_0_values(b: StoredBlocks) -> torch.Tensor:
    """Q8_0 blocks -> float32 [O, I] (d * qs)."""
    blocks = _blocks(b)
    d = _f16(blocks[..., 0:2])
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (qs * d[..., None]).reshape(b.shape)
