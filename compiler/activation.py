"""Gated activations, shared by the float feed-forward networks (ffn/) and the quantized expert
kernels' references (quant/): act(gate) * (up + up_offset), with the optional clamp gate <= limit,
|up| <= limit (DeepSeek-V4, gpt-oss) and gpt-oss's gate sharpness alpha (gate * sigmoid(alpha gate)
in place of silu). gate, up [..., F] -> [..., F]."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float] = None, activation: str = "silu",
           alpha: Optional[float] = None, up_offset: float = 0.0) -> torch.Tensor:
    """act(gate) * (up + up_offset), with the optional clamp and gpt-oss's gate sharpness alpha
    (gate * sigmoid(alpha * gate) in place of silu); see the module docstring."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if alpha is not None:
        act = gate * torch.sigmoid(alpha * gate)
    elif activation == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        act = F.silu(gate)
    return act * (up + up_offset if up_offset else up)
