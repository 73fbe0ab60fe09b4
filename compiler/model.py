"""The decoder stack, assembled from a ModelSpec. Built on the meta device, materialized once.

    ids [B, L] -> embed -> streams.expand -> layers[0..n) -> streams.collapse -> norm -> head

Model-level options of the spec: `embed_scale` multiplies the embeddings (Gemma: sqrt(dim), as a
scalar in the embedding dtype, as transformers does; Granite's embedding_multiplier),
`per_layer_dim` builds per-layer input embeddings (Gemma 3n / 4: per_layer_inputs, handed to
the blocks in the step context; residual/per_layer_input.py), `logits_scaling` divides the logits (Granite), `logit_softcap` squashes them to
softcap * tanh(logits / softcap) (Gemma 2), `embed_norm` normalises the embeddings (Bloom:
embed.norm), `head_bias` gives the head a bias (GPT-J), `learned_positions` adds a learned
absolute position embedding pos_embed [max_position + position_offset, D] (GPT-2, OPT) to the
first block's input, `sinusoidal_positions` fixed sinusoidal ones (XGLM, CTRL; position/sinusoidal.py).

Each of layers[i] is a Block (block.py); the MTP blocks after the stack are in mtp.py.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from .block import Block, BuildContext
from .contracts import KeepFloat32, OwnInit, RowTable
from .errors import ConfigError, ContractError
from .mtp import MTPLayer
from .norm.norms import make_norm
from .position.rope import make_rope
from .position.sinusoidal import SinusoidalPositions
from .residual.per_layer_input import PerLayerInputs
from .residual.prenorm import residual_kind
from .spec import DTYPES, ModelSpec


class ScaledEmbedding(nn.Embedding, RowTable):
    """nn.Embedding whose output is multiplied by `scale` (None: 1) cast to the weight dtype
    (Gemma's sqrt(dim), Granite's embedding_multiplier).

    ids [...] -> [..., D]. After `read_rows_from(sink)` (the loader's plan, when a quantized tied
    head keeps the file's blocks: contracts.RowTable) `weight` is None and the rows come from the
    sink's blocks, in the dtype the weight had."""

    def __init__(self, num: int, dim: int, scale: float | None, norm: nn.Module | None = None):
        # built on the meta device (build_model) and loaded later: no init, since normal_ on meta
        # runs torch._refs, whose first use imports torch._dynamo (2.6 s of every start-up)
        super().__init__(num, dim, _weight=torch.empty(num, dim))
        self.scale = scale
        self.norm = norm  # Bloom's word_embeddings_layernorm
        self.rows_dtype = None  # the weight's dtype, once its rows come from a sink

    def read_rows_from(self, sink) -> None:
        if tuple(sink.weight_shape) != (self.num_embeddings, self.embedding_dim):
            raise ContractError(f"{type(sink).__name__} {list(sink.weight_shape)} cannot serve the rows of an "
                                f"embedding [{self.num_embeddings}, {self.embedding_dim}]")
        self.rows_dtype = self.weight.dtype
        del self.weight
        self.register_parameter("weight", None)
        self.__dict__["rows_from"] = sink  # a reference: the model owns the head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            out = self.rows_from.dequantize_rows(ids.reshape(-1)).to(self.rows_dtype).reshape(*ids.shape, -1)
        else:
            out = super().forward(ids)
        if self.scale is not None:
            # rounded to the weight dtype first (bfloat16 sqrt(3584) = 60.0, not 59.87), as the references do
            out = out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)
        return out if self.norm is None else self.norm(out)


class LearnedPositions(nn.Embedding):
    """Learned absolute position embeddings: positions [...] -> rows [..., D] of weight
    [max_position + offset, D], position p at row p + offset (OPT keeps two unused rows)."""

    def __init__(self, rows: int, dim: int, offset: int):
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))  # no init: see ScaledEmbedding
        self.offset = offset

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(pos + self.offset if self.offset else pos)


class Decoder(nn.Module):
    """mtp: build the spec's multi-token-prediction layers (`spec.mtp_layers`) after the stack, to
    be loaded from a checkpoint that has them; an input of the build, not a field of the spec."""

    def __init__(self, spec: ModelSpec, *, mtp: bool):
        super().__init__()
        self.spec = spec
        self.rope_impl = make_rope(spec.rope)
        # rope slot -> schedule: `rope`, plus the spec's extra `ropes` (mixers pick one by rope_slot)
        self.rope_impls = {"rope": self.rope_impl, **{name: make_rope(r) for name, r in spec.ropes.items()}}
        ctx = BuildContext(spec, self.rope_impl)
        self.embed = ScaledEmbedding(spec.vocab_size, spec.dim, spec.embed_scale,
                                     make_norm(spec.norm, spec.dim) if spec.embed_norm else None)
        res = residual_kind(spec.residual)
        self.streams = res.model_streams(spec.residual, ctx)
        self.layers = nn.ModuleList(Block(layer, ctx) for layer in spec.layers)
        # per-layer input embeddings (Gemma 3n / 4): one input per layer, from the ids and embeddings
        self.per_layer_inputs = (PerLayerInputs(spec.per_layer_vocab, spec.n_layers, spec.per_layer_dim, spec.dim,
                                                spec.norm) if spec.per_layer_dim else None)
        if spec.learned_positions:
            if res.n_streams(spec.residual) != 1:
                raise ConfigError(f"{spec.source}: learned_positions needs a one-stream residual, not "
                                  f"residual kind {spec.residual.kind!r}")
            self.pos_embed = LearnedPositions(spec.max_position + spec.position_offset, spec.dim,
                                              spec.position_offset)
            self.layers[0].__dict__["positions"] = self.pos_embed  # a reference: the model owns it
        elif spec.sinusoidal_positions is not None:
            if res.n_streams(spec.residual) != 1:
                raise ConfigError(f"{spec.source}: sinusoidal_positions needs a one-stream residual, not "
                                  f"residual kind {spec.residual.kind!r}")
            # no parameters: the first block computes them from its positions
            self.layers[0].__dict__["positions"] = SinusoidalPositions(spec.dim, spec.sinusoidal_positions,
                                                                       spec.position_offset)
        # post-LN (sublayer_norms post_residual): the last block ends in a norm, no final one
        self.norm = nn.Identity() if spec.sublayer_norms == "post_residual" else make_norm(spec.norm, spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab_size, bias=spec.head_bias)
        self.mtp = nn.ModuleList(MTPLayer(layer, ctx) for layer in spec.mtp_layers) if mtp else nn.ModuleList()
        self.tie_weights()

    @property
    def device(self) -> torch.device:
        """Where the weights live (materialize puts them all on one device)."""
        return next(itertools.chain(self.parameters(), self.buffers())).device

    def tie_weights(self) -> None:
        # a quantized head (compiler/quant) holds its own quantized copy of the embedding
        if self.spec.tie_embeddings and isinstance(self.head, nn.Linear):
            self.head.weight = self.embed.weight

    def rope_slots(self) -> list[tuple[str, int]]:
        """(rope slot, rotary width) pairs the layers need cos/sin tables for; a mixer reads the
        slot named by its `rope_slot` (contracts.Mixer)."""
        return sorted({(block.mixer.rope_slot, r)
                       for block in (*self.layers, *self.mtp) for r in block.mixer.rope_dims()})

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random weights for configs built without a checkpoint, drawn from `generator` (modules
        with their own `init_weights(generator)` — norms, hyper-connections, ... — use theirs)."""
        for module in self.modules():
            if module is not self and isinstance(module, OwnInit):
                module.init_weights(generator)
            elif isinstance(module, (nn.Linear, nn.Embedding)) and module.weight is not None:
                module.weight.data.normal_(0.0, std, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.data.zero_()
            elif module is not self:  # bare parameters (stacked experts, ...)
                for p in module.parameters(recurse=False):
                    p.data.normal_(0.0, std, generator=generator)
        self.tie_weights()

    def per_layer(self, ids: torch.Tensor) -> dict:
        """ids [B, L] -> the step context's per-layer inputs {"per_layer": [B, L, Nl, Dp]}, or {}
        without per-layer embeddings (residual/per_layer_input.py)."""
        if self.per_layer_inputs is None:
            return {}
        return {"per_layer": self.per_layer_inputs(ids, self.embed(ids))}

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Last residual state [..., D] (or streams) -> the final-normed state [..., D] the head reads."""
        return self.norm(self.streams.collapse(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Last residual state [..., D] (or streams) -> logits [..., V] in float32."""
        logits = self.head(self.final_hidden(h))
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        logits = logits.float()
        if self.spec.logit_softcap is not None:
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return logits


def build_model(spec: ModelSpec, *, mtp: bool) -> Decoder:
    """The module tree on the meta device: no memory is allocated. mtp: with the spec's
    multi-token-prediction layers (a build reads it from checkpoint.mtp, compiler/build.py)."""
    with torch.device("meta"):
        model = Decoder(spec, mtp=mtp)
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
    return getattr(torch, name)  # reflection over torch's dtypes, the name checked above


def cast(model: Decoder, dtype: torch.dtype) -> Decoder:
    """Parameters to `dtype`, except modules marked contracts.KeepFloat32 (routing and
    stream-mixing weights stay float32, as in the checkpoints). Free on the meta device."""
    model = model.to(dtype=dtype)
    for module in model.modules():
        if isinstance(module, KeepFloat32):
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
    # empty_strided, not Module.to_empty's empty_like: that one takes torch's Python meta path
    # for meta inputs (0.9 s of a SmolLM2 start-up, the symbolic-shapes import included)
    model = cast(model, dtype)._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
    model.tie_weights()
    return model.requires_grad_(False)
