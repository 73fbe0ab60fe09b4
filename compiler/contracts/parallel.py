"""What a kind's `shard(plan)` hook and the loader share about tensor / expert parallelism: the
part of a stored tensor one rank holds (`Slice`) and the rows of a range of heads (`span`). The
plan that records them and the driver that applies them are compiler/parallel/plan.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
