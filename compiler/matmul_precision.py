"""bfloat16 models on CPUs without native bfloat16 matmuls: many-token linears compute in float32.

On such CPUs (AVX2 without AVX512-BF16 / AMX: oneDNN reports no bfloat16 support) a bfloat16 GEMM
is a slow path: [512, 576] x [576, 1536] took 114 ms against 20.6 ms in float32 (one thread, AMD
EPYC, AVX2), while upcasting both operands and multiplying in float32 took 19 ms; that is why a
bfloat16 prefill ran at a fifth of float32's speed. Rows of one token (decode) keep bfloat16: a
matrix-vector product is bound by reading the weights, where bfloat16's half-size read wins.

The weights stay bfloat16 (memory and the checkpoint's values as they are); only the product is
taken in float32 and rounded back to bfloat16, which is at least as accurate.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (oneDNN's verdict)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Float32ProductLinear(nn.Linear):
    """nn.Linear whose products over more than one token run in float32 (see the module docstring).
    x [..., L, I] -> [..., L, O] in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] == 1:  # a decode step: bound by the weight read
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def upcast_products(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Make the plain nn.Linear modules of a bfloat16 CPU model Float32ProductLinear when the CPU
    has no native bfloat16 matmul (a class refinement at build, before loading: parameters, ties
    and names stay as they are). Returns how many were changed."""
    if dtype != torch.bfloat16 or device.type != "cpu" or native_bfloat16():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float32ProductLinear
            n += 1
    return n
