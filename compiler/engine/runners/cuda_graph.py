"""CUDA-graph replay: the whole decode step (embedding, every layer, head, position update) is
captured once per decode bucket over the engine's static buffers (a bucket's rows are views of
them) and replayed. The layers inside the captures, and every prefill, run through the runner the
options would get without a CUDA graph (compiled regions or eager). The captures share one memory
pool, the largest bucket captured first: they are replayed one at a time on one stream, and each
keeps its own output tensor alive, so only what a step frees inside is shared."""
from __future__ import annotations

import dataclasses

import torch

from .base import Runner, RunnerOptions, choose, register


@register("cuda_graph", priority=20)
class CUDAGraphRunner(Runner):
    @classmethod
    def wants(cls, options: RunnerOptions) -> bool:
        return options.cuda_graph and options.device.type == "cuda"

    def __init__(self, engine, options: RunnerOptions):
        super().__init__(engine, options)
        self.inner = choose(engine, dataclasses.replace(options, cuda_graph=False))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its captured step
        self._logits: dict[int, torch.Tensor] = {}  # bucket b -> its captured step's output [b, V]
        self._pool = None  # the captures' shared memory pool (the first capture's)

    @property
    def name(self) -> str:
        return f"{self.kind}+{self.inner.name}"

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The largest bucket's capture (None before warmup)."""
        return self.graphs.get(self.engine.max_batch)

    @property
    def extends(self) -> bool:
        return self.inner.extends

    @property
    def trusted(self) -> bool | None:
        """The inner runner's (outside the captured step, e.g. in warm-up)."""
        return self.inner.trusted

    def prefill_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self.inner.prefill_layers(where, layers, caches, h, ctx)

    def decode_layers(self, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self.inner.decode_layers(h, ctx)

    def extend_layers(self, where, layers, caches: list[dict], h: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self.inner.extend_layers(where, layers, caches, h, ctx)

    def decode(self, b: int) -> torch.Tensor:
        graph = self.graphs.get(b)
        if graph is None:
            raise RuntimeError(f"CUDA graph of decode bucket {b} not captured; call warmup() after building")
        graph.replay()
        return self._logits[b].clone()

    def warm_decode(self, b: int) -> None:
        """Capture bucket b's step (after two runs outside the capture: compile, settle allocations)."""
        engine = self.engine
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                engine.decode_step(self.decode_layers, b)
        torch.cuda.current_stream().wait_stream(stream)
        engine.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[b] = engine.decode_step(self.decode_layers, b)
        self._pool = self._pool if self._pool is not None else graph.pool()
        self.graphs[b] = graph

    def graph_counts(self) -> dict[str, int]:
        return self.inner.graph_counts()
