"""CUDA-graph replay: the whole decode step (embedding, every layer, head, position update) is
captured once over the engine's static buffers and replayed. The layers inside the capture, and
every prefill, run through the runner the options would get without a CUDA graph (compiled
regions or eager)."""
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
        self.graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the captured step's output [max_batch, V]

    @property
    def name(self) -> str:
        return f"{self.kind}+{self.inner.name}"

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

    def decode(self) -> torch.Tensor:
        if self.graph is None:
            raise RuntimeError("CUDA graph not captured; call warmup() after building")
        self.graph.replay()
        return self._logits.clone()

    def warm_decode(self) -> None:
        """Capture the step (after two runs outside the capture: compile, settle allocations)."""
        engine = self.engine
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                engine.decode_step(self.decode_layers)
        torch.cuda.current_stream().wait_stream(stream)
        engine.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = engine.decode_step(self.decode_layers)
        self.graph = graph

    def graph_counts(self) -> dict[str, int]:
        return self.inner.graph_counts()
