"""The sharding plan: each kind states which of its parameters split on which dimension (its
`shard(plan)` hook, contracts.py); the driver here applies those declarations to a model on the
meta device and hands the loader, per parameter, the part of the stored tensor this rank reads.

    shard_model(model, mesh) -> {parameter name: Slice}

A kind's `shard(plan)` shrinks its own head / width counts, declares each split parameter with
`plan.param(module, name, {dim: ranges})` (which swaps in a meta parameter of the local shape)
and returns True when its output is a partial sum over the ranks; the driver then puts one
all-reduce after that sub-layer (Block.mixer_reduce / ffn_reduce). Everything not declared is
replicated: norms, routers, MLA's latent projections and latent cache, the DSA indexer.

Embedding and head (stated, see docs/parallel.md): the embedding is replicated (a lookup reads B
rows, so sharding it saves only memory and costs one more all-reduce per step); the head is
vocab-parallel when the ranks split attention (every decode step reads the whole head, V x D:
for Llama-3-8B at tp=8 a replicated head, 0.98 GiB in bf16, would add 60% to the 1.63 GiB of
other weights a rank reads per step), its local logits [.., V/P] joined by one all-gather. When V does not divide by P the head stays replicated
and the build info says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .mesh import Mesh, all_gather, all_reduce

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Slice:
    """The part of a full stored tensor one rank holds.

    full: the full shape; cuts: (dim, ranges) pairs, the local tensor being, along each such dim,
    the concatenation of full[start:stop] for each range; zero: the rank holds zeros of the local
    shape and reads nothing (the bias of a row-parallel projection, added by one rank only)."""

    full: tuple[int, ...]
    cuts: tuple[tuple[int, Ranges], ...]
    zero: bool = False

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full)
        for dim, ranges in self.cuts:
            shape[dim] = sum(b - a for a, b in ranges)
        return tuple(shape)

    def ranges(self, dim: int) -> Ranges | None:
        return next((r for d, r in self.cuts if d == dim), None)

    def without(self, dim: int) -> "Slice":
        """The slice of one row along `dim` (a stacked parameter's row: dims shift down by one)."""
        cuts = tuple((d - 1 if d > dim else d, r) for d, r in self.cuts if d != dim)
        return Slice(self.full[:dim] + self.full[dim + 1:], cuts, self.zero)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The full tensor t -> this rank's part."""
        for dim, ranges in self.cuts:
            parts = [t.narrow(dim, a, b - a) for a, b in ranges]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        return t


def span(offset: int, units: tuple[int, int], width: int) -> tuple[int, int]:
    """Rows [offset + a * width, offset + b * width) of units [a, b) of `width` rows each."""
    return offset + units[0] * width, offset + units[1] * width


class ShardPlan:
    """What a kind's shard(plan) hook works with: the mesh, split helpers, and the record of
    declared slices (read by the driver and the loader)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.where = ""  # the config node being sharded (mixers.NAME / ffns.NAME), for errors
        self.source = ""  # the config's file
        self._slices: dict[int, Slice] = {}  # id(parameter) -> Slice

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
        return {name: self._slices[id(p)] for name, p in model.named_parameters() if id(p) in self._slices}


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
    if len(model.mtp):
        raise ConfigError(f"{spec.source}: multi-token-prediction layers (checkpoint.mtp=true) have no "
                          f"sharding plan yet; use checkpoint.mtp=false with runtime.parallel")
    plan = ShardPlan(mesh)
    plan.source = spec.source
    for block, layer in zip(model.layers, spec.layers):
        if mesh.tp > 1:
            plan.where = f"mixers.{layer.mixer_name}"
            if block.mixer.shard(plan):
                block.mixer_reduce = AllReduce(mesh.group_name)
        plan.where = f"ffns.{layer.ffn_name}"
        if block.ffn.shard(plan):
            block.ffn_reduce = AllReduce(mesh.group_name)
    head = "replicated (attention is not split: runtime.parallel.tp=1)"
    if mesh.tp > 1 and spec.vocab_size % mesh.size == 0:
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
