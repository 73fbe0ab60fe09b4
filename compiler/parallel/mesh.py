"""The process layout of a tensor/expert-parallel run and its collectives (torch.distributed).

    P ranks (torchrun --nproc-per-node P), one 1-D DeviceMesh "tp" over all of them.
    tp in {1, P}   attention heads and dense FFN columns split P ways (1: replicated)
    ep | P         routed experts split ep ways; each expert's hidden width F split P / ep ways

So every sharded sub-layer leaves a partial sum over the same P ranks, and one all-reduce per
sub-layer (after the mixer, after the FFN) completes it. Collectives are the functional ones
(`_c10d_functional`), which dynamo traces into the compiled block graphs; NCCL on CUDA, gloo on
CPU. The group is created from torchrun's environment when none exists yet.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError


def all_reduce(x: torch.Tensor, group_name: str, op: str = "sum") -> torch.Tensor:
    """Sum (or op: "max", ...) of x over the ranks of the group (a functional collective: traced
    into graphs)."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, op, group_name))


def all_gather(x: torch.Tensor, dim: int, group_name: str, size: int) -> torch.Tensor:
    """The ranks' x concatenated along `dim` in rank order."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group_name)
    out = torch.ops._c10d_functional.wait_tensor(out)  # [size * x.shape[0], ...]
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(size, dim=0), dim=dim)


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the layout (see the module docstring).

    size P, rank r; tp (1 or P) splits heads and dense columns; ep splits experts; group_name is
    the mesh's process group (what the collectives take)."""

    size: int
    rank: int
    tp: int
    ep: int
    group_name: str
    device: torch.device

    # ranges of a split dimension
    def split(self, n: int, parts: int | None = None, index: int | None = None) -> tuple[int, int]:
        """This rank's [start, stop) of n units split `parts` ways (default tp) at part `index`
        (default this rank's tp position)."""
        parts = self.tp if parts is None else parts
        index = (self.rank if parts > 1 else 0) if index is None else index
        return n * index // parts, n * (index + 1) // parts

    @property
    def expert_group(self) -> int:
        """Which of the ep groups of experts this rank holds."""
        return self.rank // (self.size // self.ep)

    @property
    def expert_split(self) -> tuple[int, int]:
        """(parts, index): how each local expert's hidden width is split (P / ep ways)."""
        parts = self.size // self.ep
        return parts, self.rank % parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self.group_name)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of x over the ranks, back on x's device (a load-time reduction:
        an int8 row-parallel weight's whole-row max |w|, compiler/parallel/plan.py)."""
        return all_reduce(x.to(self.device), self.group_name, "max").to(x.device)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return all_gather(x, dim, self.group_name, self.size)


def setup(tp: int, ep: int, device: str, where: str) -> Mesh | None:
    """The mesh for runtime.parallel tp/ep (None for a single process). Creates the process group
    from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR) when none exists."""
    if tp < 1 or ep < 1:
        raise ConfigError(f"{where}: runtime.parallel.tp={tp} and runtime.parallel.ep={ep} must be >= 1")
    if tp == 1 and ep == 1:
        return None
    if not dist.is_available():
        raise ConfigError(f"{where}: runtime.parallel.tp={tp} ep={ep} needs torch.distributed, which this "
                          f"torch build lacks")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                f"{where}: runtime.parallel.tp={tp} ep={ep} needs a process group: launch under "
                f"`torchrun --nproc-per-node {max(tp, ep)} -m zoo ...` or call "
                f"torch.distributed.init_process_group() first")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    size, rank = dist.get_world_size(), dist.get_rank()
    if max(tp, ep) != size or tp not in (1, size) or size % ep:
        raise ConfigError(
            f"{where}: runtime.parallel.tp={tp} ep={ep} on {size} ranks: expected tp = 1 or the number of "
            f"ranks ({size}), ep dividing it, and max(tp, ep) = {size} (launch with "
            f"--nproc-per-node {max(tp, ep)})")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (size,), mesh_dim_names=("tp",))
    return Mesh(size=size, rank=rank, tp=tp, ep=ep, group_name=mesh.get_group("tp").group_name, device=dev)


def shutdown(wait: bool = True) -> None:
    """End this process's part in the process group (no-op without one). `wait`: a barrier first,
    so that no rank tears its connections down while another still reads from them (gloo aborts
    the process with "terminate called without an active exception" otherwise); pass False where
    a rank may have failed and the others would wait for it forever."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to wait for
            pass
    dist.destroy_process_group()


def check_same_on_all_ranks(mesh: Mesh, what: str, text: str) -> None:
    """Raise unless every rank passes the same `text` (compared as a hash, one all-gather)."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=mesh.device)
    every = [torch.zeros_like(mine) for _ in range(mesh.size)]
    dist.all_gather(every, mine)
    hashes = [int(t.item()) for t in every]
    if len(set(hashes)) > 1:
        groups: dict[int, list[int]] = {}
        for r, h in enumerate(hashes):
            groups.setdefault(h, []).append(r)
        listing = "; ".join(f"ranks {ranks}: {h & 0xFFFFFFFF:08x}" for h, ranks in groups.items())
        raise ConfigError(f"the ranks disagree on {what} (hash per rank group: {listing}); every rank must "
                          f"build the same model from the same checkpoint")
