"""Checkpoint sources: where raw tensors come from.

A source lists every tensor it holds (name, shape, dtype) from headers alone, and reads one
tensor at a time on demand. The loader plans the whole mapping from `entries()` before a byte of
tensor data is read, then walks `read_order()` shard by shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor.

    shape: the logical shape torch will see after `read` (for quantized formats: the
        dequantized shape, [out, in] for linear weights).
    dtype: the stored dtype as a string ("BF16", "F32", "F8_E4M3", "Q4_1", ...).
    file: the shard or file that holds it (for error messages and read grouping).
    nbytes: bytes of stored data.
    offset: where the data starts in `file` (formats read by offset; 0 otherwise).
    """

    shape: tuple[int, ...]
    dtype: str
    file: str
    nbytes: int
    offset: int = 0


@dataclass(frozen=True)
class StoredBlocks:
    """A weight in a block format as the checkpoint stores it, handed on unconverted to a
    `WeightSink` that takes that format (compiler/quant/linear.py: every GGUF block type on zoo's
    float32 kernels, Q4_0 / Q4_1 into torch's int4 group 32).

    ggml_type: "Q4_0", "Q4_K", ... or a source's re-blocking ("ZQ8_G16", gguf_blocks.py); data: uint8 [O, bytes per row] (the row's blocks in order:
    row-wise rule ops such as cat / unpermute_rope apply to it as to the values); shape: (O, I).
    """

    ggml_type: str
    data: torch.Tensor
    shape: tuple[int, ...]


class Source(Protocol):
    """What the loader needs from a checkpoint."""

    description: str  # e.g. "/path/to/dir (4 shards)" -- used in error messages

    def entries(self) -> dict[str, TensorInfo]:
        """Every stored tensor, from headers only (no tensor data is read)."""

    def read_order(self) -> list[list[str]]:
        """Tensor names grouped by file, in the order files should be read (one at a time)."""

    def read(self, name: str) -> torch.Tensor:
        """One tensor, as stored (safetensors) or dequantized to float32 (GGUF)."""

    # optional: read_into(name, out) -> bool fills a contiguous CPU tensor of the stored dtype
    # and shape in place (no temporary copy); False when it cannot
    # optional: read_blocks(name) -> uint8 [rows, bytes per row], a block-quantized tensor's
    # stored bytes (GGUF), for weight sinks that keep the format

    def config(self) -> dict:
        """The Hugging Face style config dict (config.json, or one derived from metadata)."""

    def format_stages(self) -> list[str]:
        """Rule files that bring the format's own tensor names to the Hugging Face names the
        family's rules read (GGUF: conf/rules/gguf_<architecture>.yaml); [] when they match."""

    def close(self) -> None:
        """Release file handles / memory maps."""
