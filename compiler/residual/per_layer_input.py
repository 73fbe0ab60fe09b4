"""Per-layer input embeddings (PLE; Gemma 3n / 4): each layer gets an extra input of its own,
gated into the residual stream after its FFN.

Model side (PerLayerInputs), once per step, from the token ids and their (scaled) embeddings e:

    table   [Vp, Nl*Dp]  looked up by the ids, times sqrt(Dp)            -> t [B, L, Nl, Dp]
    proj    [Nl*Dp, D]   applied to e, times D ** -0.5, viewed per layer -> RMSNorm over Dp -> c
    inputs  (c + t) * 2 ** -0.5                                           [B, L, Nl, Dp]

Layer side (PerLayerGate), layer i reading inputs[:, :, i] = u [B, L, Dp] after the FFN residual:

    h = h + norm(up(gelu_tanh(gate(h)) * u))       gate [Dp, D], up [D, Dp], norm over D

(glossary letters: Nl layers, Dp the per-layer width, Vp the per-layer vocabulary.) The engine
hands the inputs to every block in the step context ("per_layer", compiler/engine/core.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..norm.norms import make_norm


class PerLayerInputs(nn.Module):
    """ids [B, L] and embeddings e [B, L, D] -> per-layer inputs [B, L, Nl, Dp] (module docstring)."""

    def __init__(self, vocab: int, n_layers: int, width: int, dim: int, norm_spec):
        super().__init__()
        self.n_layers, self.width, self.dim = n_layers, width, dim
        # built on the meta device and loaded later (no init here: see model.ScaledEmbedding)
        self.table = nn.Embedding(vocab, n_layers * width, _weight=torch.empty(vocab, n_layers * width))
        self.proj = nn.Linear(dim, n_layers * width, bias=False)
        self.norm = make_norm(norm_spec, width)

    def forward(self, ids: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shape = (*ids.shape, self.n_layers, self.width)
        # both scales rounded to the weight dtype first, as the reference's scaled embedding does
        token = self.table(ids) * torch.tensor(self.width ** 0.5, dtype=torch.float32).to(self.table.weight.dtype)
        context = self.norm((self.proj(e) * self.dim ** -0.5).view(shape))
        return (context + token.view(shape)) * 2.0 ** -0.5


class PerLayerGate(nn.Module):
    """h [B, L, D] and this layer's input u [B, L, Dp] -> h + norm(up(gelu_tanh(gate(h)) * u))."""

    def __init__(self, width: int, dim: int, norm_spec):
        super().__init__()
        self.gate = nn.Linear(dim, width, bias=False)
        self.up = nn.Linear(width, dim, bias=False)
        self.norm = make_norm(norm_spec, dim)

    def forward(self, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return h + self.norm(self.up(F.gelu(self.gate(h), approximate="tanh") * u))
