"""The decoder stack, assembled from a ModelSpec. Built on the meta device, materialized once.

    ids [B, L] -> embed -> streams.expand -> layers[0..n) -> streams.collapse -> norm -> head
    Block:  h -> mixer_residual(mixer_norm -> mixer) -> ffn_residual(ffn_norm -> ffn) -> h

Every block has the same attribute names whatever its kinds (see glossary.py). Blocks have two
entry points, `prefill` and `decode`, which call the same-named entry points of their mixer and
FFN: the entry point decides the algorithm, never the sequence length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .norm import make_norm
from .registry import lookup
from .residual import residual_kind
from .rope import make_rope
from .errors import ConfigError
from .spec import DTYPES, LayerSpec, ModelSpec


@dataclass(frozen=True)
class BuildContext:
    """What a module may read from the model while it is built."""

    spec: ModelSpec
    rope_impl: Any

    @property
    def dim(self) -> int:
        return self.spec.dim


class Block(nn.Module):
    def __init__(self, layer: LayerSpec, ctx: BuildContext):
        super().__init__()
        spec = ctx.spec
        res = residual_kind(spec.residual)
        self.mixer_norm = make_norm(spec.norm, spec.dim)
        self.mixer = lookup("mixer", layer.mixer.kind, f"mixers.{layer.mixer_name}")(layer.mixer, ctx)
        self.ffn_norm = make_norm(spec.norm, spec.dim)
        self.ffn = lookup("ffn", layer.ffn.kind, f"ffns.{layer.ffn_name}")(layer.ffn, ctx)
        self.mixer_residual = res.connection(spec.residual, ctx)
        self.ffn_residual = res.connection(spec.residual, ctx)

    def prefill(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, L, ...D] -> same shape."""
        x, aux = self.mixer_residual.enter(h)
        h = self.mixer_residual.exit(h, self.mixer.prefill(self.mixer_norm(x), cache, ctx), aux)
        x, aux = self.ffn_residual.enter(h)
        return self.ffn_residual.exit(h, self.ffn.prefill(self.ffn_norm(x), ctx), aux)

    def decode(self, h: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """h: residual state [B, 1, ...D] -> same shape."""
        x, aux = self.mixer_residual.enter(h)
        h = self.mixer_residual.exit(h, self.mixer.decode(self.mixer_norm(x), cache, ctx), aux)
        x, aux = self.ffn_residual.enter(h)
        return self.ffn_residual.exit(h, self.ffn.decode(self.ffn_norm(x), ctx), aux)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.rope_impl = make_rope(spec.rope)
        # rope slot -> schedule: `rope`, plus the spec's extra `ropes` (mixers pick one by rope_slot)
        self.rope_impls = {"rope": self.rope_impl, **{name: make_rope(r) for name, r in spec.ropes.items()}}
        ctx = BuildContext(spec, self.rope_impl)
        self.embed = nn.Embedding(spec.vocab_size, spec.dim)
        self.streams = residual_kind(spec.residual).model_streams(spec.residual, ctx)
        self.layers = nn.ModuleList(Block(layer, ctx) for layer in spec.layers)
        self.norm = make_norm(spec.norm, spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab_size, bias=False)
        from .mtp import mtp_layers  # mtp.py builds on Block

        self.mtp = mtp_layers(ctx)  # multi-token-prediction blocks; empty unless enabled
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.spec.tie_embeddings:
            self.head.weight = self.embed.weight

    def rope_dims(self) -> list[int]:
        """Distinct rotary widths the layers need cos/sin tables for."""
        return sorted({r for block in (*self.layers, *self.mtp) for r in block.mixer.rope_dims()})

    def rope_slots(self) -> list[tuple[str, int]]:
        """(rope slot, rotary width) pairs the layers need cos/sin tables for; a mixer reads the
        slot named by its `rope_slot` attribute (default `rope`)."""
        return sorted({(getattr(block.mixer, "rope_slot", "rope"), r)
                       for block in (*self.layers, *self.mtp) for r in block.mixer.rope_dims()})

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random weights for configs built without a checkpoint, drawn from `generator` (modules
        with their own `init_weights(generator)` — norms, hyper-connections, ... — use theirs)."""
        for module in self.modules():
            if module is not self and hasattr(module, "init_weights"):
                module.init_weights(generator)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.data.zero_()
            elif module is not self:  # bare parameters (stacked experts, ...)
                for p in module.parameters(recurse=False):
                    p.data.normal_(0.0, std, generator=generator)
        self.tie_weights()

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Last residual state [..., D] (or streams) -> the final-normed state [..., D] the head reads."""
        return self.norm(self.streams.collapse(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Last residual state [..., D] (or streams) -> logits [..., V] in float32."""
        return self.head(self.final_hidden(h)).float()


def build_model(spec: ModelSpec) -> Decoder:
    """The module tree on the meta device: no memory is allocated."""
    with torch.device("meta"):
        model = Decoder(spec)
    return model.requires_grad_(False)


def count_parameters(model: nn.Module) -> int:
    """Exact number of distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def torch_dtype(name: str) -> torch.dtype:
    """A runtime dtype name (one of spec.DTYPES) -> the torch dtype."""
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r}: expected one of {list(DTYPES)}")
    return getattr(torch, name)


def cast(model: Decoder, dtype: torch.dtype) -> Decoder:
    """Parameters to `dtype`, except modules that declare `keep_float32 = True` (routing and
    stream-mixing weights stay float32, as in the checkpoints). Free on the meta device."""
    model = model.to(dtype=dtype)
    for module in model.modules():
        if getattr(module, "keep_float32", False):
            module.to(torch.float32)
    return model


def parameter_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def materialize(model: Decoder, device, dtype: torch.dtype) -> Decoder:
    """Allocate storage once on `device` in `dtype` (contents undefined until loaded or init)."""
    model = cast(model, dtype).to_empty(device=device)
    model.tie_weights()
    return model.requires_grad_(False)
