"""The Runner contract and the registry the Engine picks its runner from, once, at construction.

A runner decides how a step executes; the engine core (core.py) owns everything else (caches,
rope tables, per-row state, the checks) and calls it for:

    prefill_layers(where, layers, caches, h, ctx) -> h    layers' prefill in order over h [B, L, ...D]
    decode_layers(h, ctx) -> h                            every layer's decode over h [max_batch, 1, ...D]
    extend_layers(where, layers, caches, h, ctx) -> h     layers' extend in order, h [n, L, ...D]
    decode() -> logits [max_batch, V]                     one whole decode step (core.decode_step)
    warmup() -> {"prefill": s, "decode": s}               make (or load) what the steps need

`where` names the caches a prefill writes ("batch": the engine's own; ("rows", start, stop): views
of some rows; ("block", id): an MTP block's; an extend's: ("extend", n), n rows' views or copies),
for runners that keep something per cache layout.
The runners register here with a priority; the Engine takes the highest one whose `wants` accepts
its options, so adding a runner is one new file in this folder.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, ClassVar, Protocol, TypeVar

import torch

from ...errors import ConfigError



class EngineCore(Protocol):
    """What a runner uses of the engine core (core.Engine), declared here so that the runners
    stand below the core: its caches and token buffer, the step contexts and the step around a
    runner's layers."""

    model: torch.nn.Module  # model.Decoder: layers, mtp, embed, logits
    device: torch.device
    max_batch: int
    max_seq: int
    caches: list[dict]  # one dict of tensors per layer
    token_buffer: torch.Tensor  # [max_batch] the decode step's tokens

    def reset(self) -> None: ...
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...
    def prefill_ctx(self, ids: torch.Tensor) -> dict: ...
    def decode_ctx(self) -> dict: ...
    def decode_step(self, layers: Callable[[torch.Tensor, dict], torch.Tensor]) -> torch.Tensor: ...
    def warm_prefill(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """What the Engine was asked for: compile (torch.compile or packages), cuda_graph (capture
    the decode step where the device allows), aot (CPU layers as AOTInductor packages)."""

    device: torch.device
    compile: bool
    cuda_graph: bool
    aot: bool


class Runner:
    """How the engine's steps execute. Subclasses set nothing but what differs: the layers of a
    prefill and of a decode step; the rest has a default here."""

    kind: ClassVar[str]  # set by @register
    # declared for reports and tests, each with its default: the captured CUDA graph (None: no
    # capture, or not yet) and whether compiled decode steps skip dynamo's guards (None: not
    # decided, or nothing compiled)
    graph: "torch.cuda.CUDAGraph | None" = None
    trusted: bool | None = None
    extends: bool = True  # whether extend_layers runs (False: it refuses, see extend_layers)

    def __init__(self, engine: EngineCore, options: RunnerOptions):
        self.engine = engine

    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        """Whether this runner serves these options (it may raise on options it refuses)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """For reports (Engine.runner)."""
        return self.kind

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """layers' prefill in order over h [B, L, ...D]; fills their caches (dicts of tensors)."""
        raise NotImplementedError

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Every layer's decode over h [max_batch, 1, ...D] and the engine's caches."""
        raise NotImplementedError

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        """layers' extend in order over h [n, L, ...D] (rows that already hold tokens, ctx
        "start"); appends to their caches. Default: refused, naming the runner."""
        raise ConfigError(f"the {self.name} runner cannot extend rows (extend_rows: chunked prefill, "
                                  f"prefix reuse, speculative decoding); build without it")

    def decode(self) -> torch.Tensor:
        """One decode step of the engine's token buffer -> logits [max_batch, V]; advances every
        row's position by one."""
        return self.engine.decode_step(self.decode_layers)

    def warm_decode(self) -> None:
        """What warmup does for the decode step: run it once (its graphs compile)."""
        self.decode()

    def warmup(self) -> dict[str, float]:
        """Wall seconds of each step's first run (compile + one run) on dummy tokens; the engine
        resets its state after each."""
        engine, seconds = self.engine, {}
        if engine.max_seq >= 2:
            t0 = time.perf_counter()
            engine.warm_prefill()
            seconds["prefill"] = time.perf_counter() - t0
        engine.reset()
        t0 = time.perf_counter()
        self.warm_decode()
        seconds["decode"] = time.perf_counter() - t0
        engine.reset()
        return seconds

    def graph_counts(self) -> dict[str, int]:
        """Graphs compiled so far per entry point (or packages in use)."""
        return {"prefill": 0, "decode": 0}

    def packages_built(self) -> list[str]:
        """Keys of the packages this runner compiled (AOTInductor runners only)."""
        return []


_RUNNERS: dict[str, tuple[int, type[Runner]]] = {}

R = TypeVar("R", bound=type)


def register(kind: str, priority: int) -> Callable[[R], R]:
    """Class decorator: offer a runner to every Engine; the highest priority that wants the
    options is chosen."""

    def deco(cls: R) -> R:
        if kind in _RUNNERS:
            raise ValueError(f"runner {kind!r} registered twice ({_RUNNERS[kind][1].__module__} and {cls.__module__})")
        cls.kind = kind
        _RUNNERS[kind] = (priority, cls)
        return cls

    return deco


def runner_kinds() -> list[str]:
    """Every registered runner's kind."""
    return sorted(_RUNNERS)


def runner_class(options: RunnerOptions) -> type[Runner]:
    """The registered runner of highest priority that wants these options."""
    for _, cls in sorted(_RUNNERS.values(), key=lambda pc: -pc[0]):
        if cls.wants(options):
            return cls
    raise ValueError(f"no runner serves {options} (registered: {sorted(_RUNNERS)})")


def choose(engine: EngineCore, options: RunnerOptions) -> Runner:
    """The engine's runner for these options (see register)."""
    return runner_class(options)(engine, options)
