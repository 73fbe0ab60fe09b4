"""Multi-token prediction at run time: the MTP blocks' caches and their pass after a prefill.
The MTPLayer modules are built with the model (compiler/mtp.py, which draws the scheme); each
block runs through the engine's compiled block prefill (`Engine.block_prefill`).
"""
from __future__ import annotations

import torch

from ..contracts.cache import CachePlan
from ..errors import InputError


def mtp_caches(model, max_batch: int, max_seq: int, dtype: torch.dtype, device) -> list[dict]:
    """The MTP blocks' own caches (their attention runs over their own positions) of the
    model.Decoder `model`."""
    plan = CachePlan(tuple(layer.mixer.cache_fields(max_batch, max_seq, dtype) for layer in model.mtp),
                     max_batch, max_seq)
    return plan.allocate(device)


def mtp_prefill(engine, ids: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
    """After the main prefill of ids [b, L] (a bucket's rows) by `engine` (graphs.Engine; this
    module is below it) with last residual state h: per depth k = 1..n, logits [b, L - k, V] (float32) for tokens
    t + k + 1 at positions t = 0..L-1-k."""
    model = engine.model
    if not len(model.mtp):
        raise InputError("return_mtp: this model has no multi-token-prediction layers (the config has "
                         "mtp.n_layers=0, or checkpoint.mtp=false so they were not built)")
    hidden = model.final_hidden(h)  # hidden^0: what the main head reads
    out = []
    b = ids.shape[0]  # the prefill's bucket: the MTP caches' first b rows
    for k, (layer, cache) in enumerate(zip(model.mtp, engine.mtp_caches), start=1):
        cache = {name: t[:b] for name, t in cache.items()}
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
