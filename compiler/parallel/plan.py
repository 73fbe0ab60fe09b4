"""The sharding plan: each kind states which of its parameters split on which dimension (its
`shard(plan)` hook, compiler/contracts/slots.py); the driver here applies those declarations to a model on the
meta device and hands the loader, per parameter, the part of the stored tensor this rank reads.

    shard_model(model, mesh) -> {parameter name: Slice}

A kind's `shard(plan)` shrinks its own head / width counts, declares each split parameter with
`plan.param(module, name, {dim: ranges})` (which swaps in a meta parameter of the local shape)
and returns True when its output is a partial sum over the ranks; the driver then puts one
all-reduce after that sub-layer (Block.mixer_reduce / ffn_reduce). Everything not declared is
replicated: norms, routers, MLA's latent projections and latent cache, the DSA indexer.

Quantized linears (runtime.quant, compiler/quant): the model is quantized on meta BEFORE it is
sharded, so every rank makes the single process's choices (which linears, int8 or int4), and a
QuantLinear declared split is re-made at its local shape; the loader hands it this rank's slice of
the float (or stored) weight and the rank quantizes that. Equal to the slice of the one-process
quantization, bit for bit, because
  - a row cut (column-parallel: output channels) never spans a scale: int8 scales one output
    channel, int4 one group of g inputs of one output channel;
  - an input cut (row-parallel) keeps int4's groups whole when every cut is a multiple of g
    (checked by QuantLinear.localize: ConfigError otherwise); int8's one scale per output channel spans all of a
    row's inputs, so the loader gives it the whole row's max |w|, one all-reduce(max) over the
    ranks per such weight at load (execute(row_absmax=...)).
The kernel's bfloat16 compute rounds a row-parallel rank's partial sum before the all-reduce
adds them, so logits agree to bfloat16 rounding, not to float32's (tests/test_parallel.py).

Embedding and head (stated, see docs/parallel.md): the embedding is replicated (a lookup reads B
rows, so sharding it saves only memory and costs one more all-reduce per step); the head is
vocab-parallel when the ranks split attention (every decode step reads the whole head, V x D:
for Llama-3-8B at tp=8 a replicated head, 0.98 GiB in bf16, would add 60% to the 1.63 GiB of
other weights a rank reads per step), its local logits [.., V/P] joined by one all-gather. When V does not divide by P the head stays replicated
and the build info says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..contracts import Slice, WeightSink
from ..errors import ConfigError
from .mesh import Mesh, all_gather, all_reduce

class ShardPlan:
    """What a kind's shard(plan) hook works with: the mesh, split helpers, and the record of
    declared slices (read by the driver and the loader)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.where = ""  # the config node being sharded (mixers.NAME / ffns.NAME), for errors
        self.layer: int | None = None  # the layer being sharded, for errors
        self.source = ""  # the config's file
        self._slices: dict[int, Slice] = {}  # id(parameter) -> Slice
        self._sinks: dict[int, Slice] = {}  # id(WeightSink) -> Slice of its (float) weight

    def units(self, n: int, key: str, parts: int | None = None, index: int | None = None,
              replicate: bool = False) -> tuple[int, int]:
        """Part `index` (default this rank's) [a, b) of n heads / channels split `parts` ways
        (default tp). replicate: when n < parts and n divides parts, the part is the one unit its
        group of parts / n ranks shares (GQA kv heads, DeltaNet key heads)."""
        parts = self.mesh.tp if parts is None else parts
        index = (self.mesh.rank if parts > 1 else 0) if index is None else index
        if n % parts == 0:
            return self.mesh.split(n, parts, index)
        if replicate and parts % n == 0:
            u = index * n // parts
            return u, u + 1
        extra = " nor divide it (ranks then share one)" if replicate else ""
        raise ConfigError(f"{self.source}: {self.where}.{key}={n} does not divide by {parts} ranks (runtime.parallel "
                          f"tp={self.mesh.tp} ep={self.mesh.ep}){extra}; choose tp/ep that divide it")

    def param(self, module: nn.Module, name: str, cuts: dict[int, Sequence[tuple[int, int]]],
              zero: bool = False) -> None:
        """Replace module.<name> (on meta) by its local part, recording the slice the loader reads."""
        if isinstance(module, WeightSink) and name == "weight":  # a quantized linear (compiler/quant)
            s = Slice(tuple(module.weight_shape), tuple((d, tuple(r)) for d, r in sorted(cuts.items())))
            module.localize(s, f"{self.source}: {self.where}", f"runtime.parallel tp={self.mesh.tp}")
            self._sinks[id(module)] = s
            return
        p = getattr(module, name)
        s = Slice(tuple(p.shape), tuple((d, tuple(r)) for d, r in sorted(cuts.items())), zero)
        new = nn.Parameter(torch.empty(s.local_shape(), dtype=p.dtype, device=p.device), requires_grad=False)
        setattr(module, name, new)
        self._slices[id(new)] = s

    def column(self, linear: nn.Linear, rows: Sequence[tuple[int, int]]) -> None:
        """A column-parallel linear (output rows split): weight and bias keep `rows`."""
        self.param(linear, "weight", {0: rows})
        if linear.bias is not None:
            self.param(linear, "bias", {0: rows})

    def row(self, linear: nn.Linear, cols: Sequence[tuple[int, int]]) -> None:
        """A row-parallel linear (input columns split, output a partial sum): the bias is added by
        rank 0 only."""
        self.param(linear, "weight", {1: cols})
        if linear.bias is not None:
            n = linear.bias.shape[0]
            self.param(linear, "bias", {0: ((0, n),)}, zero=self.mesh.rank != 0)

    def slices(self, model: nn.Module) -> dict[str, Slice]:
        out = {name: self._slices[id(p)] for name, p in model.named_parameters() if id(p) in self._slices}
        out.update({f"{name}.weight": self._sinks[id(m)] for name, m in model.named_modules() if id(m) in self._sinks})
        return out


class AllReduce(nn.Module):
    """The sum over the ranks of a sub-layer's partial output (inside the compiled block graph)."""

    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self.group_name)


class VocabParallelHead(nn.Linear):
    """The head with this rank's V/P rows; logits of all ranks joined by one all-gather. With tied
    embeddings its weight is the (replicated) embedding, of which it reads its rows."""

    def __init__(self, dim: int, vocab: int, mesh: Mesh):
        super().__init__(dim, vocab // mesh.size, bias=False)
        self.rows = mesh.split(vocab, mesh.size, mesh.rank)
        self.group_name, self.size = mesh.group_name, mesh.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.shape[0] != self.out_features:  # tied: the full embedding
            w = w[self.rows[0]:self.rows[1]]
        return all_gather(F.linear(x, w), -1, self.group_name, self.size)


@dataclass(frozen=True)
class ShardReport:
    slices: dict[str, Slice]
    head: str  # "vocab-parallel" or "replicated (why)"


def shard_model(model, mesh: Mesh) -> ShardReport:
    """Apply every kind's declared sharding to `model` (on meta), add the all-reduces, make the
    head vocab-parallel; returns the slices the loader reads."""
    spec = model.spec
    plan = ShardPlan(mesh)
    plan.source = spec.source
    # the MTP blocks as the stack's (their eh_proj, norms and own embed / head copies replicated)
    for block, layer in zip((*model.layers, *model.mtp), (*spec.layers, *spec.mtp_layers[:len(model.mtp)])):
        plan.layer = layer.index
        if mesh.tp > 1:
            plan.where = f"mixers.{layer.mixer_name}"
            if block.mixer.shard(plan):
                block.mixer_reduce = AllReduce(mesh.group_name)
        plan.where = f"ffns.{layer.ffn_name}"
        if block.ffn.shard(plan):
            block.ffn_reduce = AllReduce(mesh.group_name)
    head = "replicated (attention is not split: runtime.parallel.tp=1)"
    if mesh.tp > 1 and spec.vocab_size % mesh.size == 0 and isinstance(model.head, WeightSink):
        gather = partial(all_gather, dim=-1, group_name=mesh.group_name, size=mesh.size)
        new = model.head.vocab_parallel(mesh.split(spec.vocab_size, mesh.size, mesh.rank), gather)
        plan._sinks[id(new)] = Slice((spec.vocab_size, spec.dim), ((0, (new.rows,)),))
        model.head = new
        head = "vocab-parallel"
    elif mesh.tp > 1 and spec.vocab_size % mesh.size == 0:
        with torch.device("meta"):
            new = VocabParallelHead(spec.dim, spec.vocab_size, mesh)
        new.to(model.head.weight.dtype).requires_grad_(False)
        if not spec.tie_embeddings:
            plan._slices[id(new.weight)] = Slice((spec.vocab_size, spec.dim), ((0, (new.rows,)),))
        model.head = new
        model.tie_weights()
        head = "vocab-parallel"
    elif mesh.tp > 1:
        head = f"replicated (vocab_size={spec.vocab_size} does not divide by {mesh.size} ranks)"
    return ShardReport(plan.slices(model), head)
