"""Multi-token prediction (DeepSeek-V3 MTP): blocks after the main stack that predict one token
further ahead each.

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
(unless `mtp.share_embeddings`). Its block runs through the engine's compiled block prefill (`Engine.block_prefill`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .cache import CachePlan
from ..errors import InputError
from ..block import Block, BuildContext
from ..norm.norms import make_norm
from ..spec import LayerSpec

if TYPE_CHECKING:
    from .core import Engine
    from ..model import Decoder


class MTPLayer(Block):
    def __init__(self, layer: LayerSpec, ctx: BuildContext):
        super().__init__(layer, ctx)
        spec = ctx.spec
        D = spec.dim
        self.enorm = make_norm(spec.norm, D)
        self.hnorm = make_norm(spec.norm, D)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.norm = make_norm(spec.norm, D)
        if not spec.mtp.share_embeddings:
            self.embed = nn.Embedding(spec.vocab_size, D)
            self.head = nn.Linear(D, spec.vocab_size, bias=False)

    def step_in(self, model: "Decoder", prev: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """prev [B, L, D] (hidden^(k-1) at t), ids [B, L] (tokens t + k) -> block input [B, L, D]."""
        embed = getattr(self, "embed", model.embed)
        x = torch.cat((self.enorm(embed(ids)), self.hnorm(prev)), dim=-1)
        return model.streams.expand(self.eh_proj(x))

    def step_out(self, model: "Decoder", h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block output (residual state) -> (hidden^k [B, L, D], logits [B, L, V] float32)."""
        hidden = self.norm(model.streams.collapse(h))
        head = getattr(self, "head", model.head)
        return hidden, head(hidden).float()


def mtp_layers(ctx: BuildContext) -> nn.ModuleList:
    """The MTP layers a spec asks for: none unless `checkpoint.mtp` (they are built to be loaded)."""
    spec = ctx.spec
    if not spec.checkpoint.mtp:
        return nn.ModuleList()
    return nn.ModuleList(MTPLayer(layer, ctx) for layer in spec.mtp_layers)


def mtp_caches(model: "Decoder", max_batch: int, max_seq: int, dtype: torch.dtype, device) -> list[dict]:
    """The MTP blocks' own caches (their attention runs over their own positions)."""
    plan = CachePlan(tuple(layer.mixer.cache_fields(max_batch, max_seq, dtype) for layer in model.mtp),
                     max_batch, max_seq)
    return plan.allocate(device)


def mtp_prefill(engine: "Engine", ids: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
    """After the main prefill of ids [B, L] with last residual state h: per depth k = 1..n,
    logits [B, L - k, V] (float32) for tokens t + k + 1 at positions t = 0..L-1-k."""
    model = engine.model
    if not len(model.mtp):
        raise InputError("return_mtp: this model has no multi-token-prediction layers (the config has "
                         "mtp.n_layers=0, or checkpoint.mtp=false so they were not built)")
    hidden = model.final_hidden(h)  # hidden^0: what the main head reads
    out = []
    for k, (layer, cache) in enumerate(zip(model.mtp, engine.mtp_caches), start=1):
        n = ids.shape[1] - k  # positions this depth predicts from
        if n < 1:
            out.append(hidden.new_zeros(ids.shape[0], 0, model.spec.vocab_size, dtype=torch.float32))
            continue
        nxt = ids[:, k:]
        x = layer.step_in(model, hidden[:, :n], nxt)
        x = engine.block_prefill(layer, x, cache, nxt)
        hidden, logits = layer.step_out(model, x)
        out.append(logits)
    return out
