"""Multi-token prediction (DeepSeek-V3 MTP): blocks after the main stack that predict one token
further ahead each. Built here with the model (model.Decoder.mtp); run by engine/mtp.py.

    depth k = 1..n (one MTPLayer each), position t of a prompt ids [B, L]:

      ids[t + k] -> embed -> enorm --.
                                      cat [2D] -> eh_proj [D] -> block (its own attention and
      hidden^(k-1)[t]  -> hnorm -----'                         cache over positions 0..t)
                                                                 -> norm = hidden^k[t] -> head
                                                                 -> logits for token t + k + 1

    hidden^0 is the main model's final-normed state (what its head reads), as in the DeepSeek
    serving code; depth k covers positions 0..L-1-k.

An MTPLayer is a decoder Block (same module paths: mixer_norm, mixer, ffn_norm, ffn, ...) plus
enorm, hnorm, eh_proj, norm (the checkpoint's shared_head.norm) and its own embed/head copies
(unless `mtp.share_embeddings`).
"""
from __future__ import annotations

import torch
from torch import nn

from .block import Block, BuildContext
from .norm.norms import make_norm
from .spec import LayerSpec


class MTPLayer(Block):
    def __init__(self, layer: LayerSpec, ctx: BuildContext):
        super().__init__(layer, ctx)
        spec = ctx.spec
        D = spec.dim
        self.enorm = make_norm(spec.norm, D)
        self.hnorm = make_norm(spec.norm, D)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.norm = make_norm(spec.norm, D)
        self.shares_embeddings = spec.mtp.share_embeddings  # read the main model's embed / head
        if not self.shares_embeddings:
            self.embed = nn.Embedding(spec.vocab_size, D)
            self.head = nn.Linear(D, spec.vocab_size, bias=False)

    def step_in(self, model, prev: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """prev [B, L, D] (hidden^(k-1) at t), ids [B, L] (tokens t + k) -> block input [B, L, D];
        `model` is the model.Decoder that holds this layer (it imports this module)."""
        embed = model.embed if self.shares_embeddings else self.embed
        x = torch.cat((self.enorm(embed(ids)), self.hnorm(prev)), dim=-1)
        return model.streams.expand(self.eh_proj(x))

    def step_out(self, model, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block output (residual state) -> (hidden^k [B, L, D], logits [B, L, V] float32)."""
        hidden = self.norm(model.streams.collapse(h))
        head = model.head if self.shares_embeddings else self.head
        return hidden, head(hidden).float()
