"""Fixed sinusoidal absolute position embeddings, added to the first block's input as learned
positions are (model.py), computed from the positions on the fly (no table, nothing to load):

    positions [...] -> [..., D] = [sin(p * f_j) | cos(p * f_j)], j = 0..D/2-1, p = position + offset

`style` is the frequency schedule, each written the way its reference computes it (float32):
    tensor2tensor  f_j = exp(-j * ln(10000) / (D/2 - 1))   (fairseq; XGLM, with offset 2)
    transformer    f_j = 1 / 10000 ** (2j / D)              ("Attention Is All You Need"; CTRL)
"""
from __future__ import annotations

import math

import torch
from torch import nn



class SinusoidalPositions(nn.Module):
    """style and an even dim checked by spec.validate (spec.SINUSOID_STYLES)."""

    def __init__(self, dim: int, style: str, offset: int):
        super().__init__()
        self.dim, self.style, self.offset = dim, style, offset

    def freqs(self, device) -> torch.Tensor:
        """[D/2] float32 frequencies f_j."""
        half = self.dim // 2
        j = torch.arange(half, dtype=torch.int64, device=device)
        if self.style == "tensor2tensor":
            return torch.exp(j.float() * -(math.log(10000) / (half - 1)))
        return 1 / torch.pow(10000, (2 * j).float() / self.dim)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        """pos [...] (int) -> [..., D] float32."""
        angles = (pos + self.offset).float()[..., None] * self.freqs(pos.device)
        return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1)
