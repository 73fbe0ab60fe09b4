"""The step context: what the engine hands every mixer and FFN entry point besides x and the
cache, one dict per prefill or decode step (built by compiler/engine/core.py).

    "ids"               token ids [B, L] in prefill and extend, [B, 1] in decode (hash routing
                        reads them)
    "rope"              {rope key: (cos, sin)}, cos/sin [L, R/2] in prefill, [B, R/2] in decode,
                        [B, L, R/2] in extend (each row's positions start..start+L-1)
                        (the key: position/rope.rope_key(R, slot))
    "per_layer"         per-layer input embeddings [B, L, Nl, Dp] (absent without them; Gemma 4:
                        residual/per_layer_input.py), each block reading its own layer's
    "pos"               decode only: [B] the slot each row writes
    "start"             extend only: [B] long, tokens each row's cache holds (its first new position)
    "one_query_kernel"  decode and extend: bool, zoo's CPU decode-attention kernel is built
                        (absent: no); asked for by attention's Mixer.decode_context
"""
from __future__ import annotations

from typing import TypedDict

import torch


class StepContext(TypedDict, total=False):
    """See the module docstring; a plain dict at run time (graphs are traced through it)."""

    ids: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    per_layer: torch.Tensor
    pos: torch.Tensor
    start: torch.Tensor
    one_query_kernel: bool
