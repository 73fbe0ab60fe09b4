"""Where weights come from and where they go: checkpoint sources, stored block-quantized
tensors, and the modules that take their weight through `load_weight` (weight sinks).

    Source      what the loader reads (compiler/checkpoint: safetensors, GGUF)
    StoredBlocks  a block-quantized weight as stored, handed on unconverted
    WeightSink  a module the loader fills through load_weight (compiler/quant: QuantLinear,
                QuantExperts); the parallel plan re-makes one at a rank's shape through it
    RowTable    a lookup table (the token embedding) that can read its rows from the weight sink
                tied to it when that sink keeps the stored blocks: no float copy of the table

Each optional capability is declared here with its default, and a class that claims one
without providing it is refused when it is defined (ContractError, naming it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError, ContractError
from .parallel import Slice


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

    ggml_type: "Q4_0", "Q4_K", ... or a source's re-blocking ("ZQ8_G16", quant/gguf_blocks.py);
    data: uint8 [O, bytes per row] (the row's blocks in order:
    row-wise rule ops such as cat / unpermute_rope apply to it as to the values); shape: (O, I).
    A stacked sink (QuantExperts) may get a whole stack: data [E, O, bytes per row], shape (E, O, I).
    """

    ggml_type: str
    data: torch.Tensor
    shape: tuple[int, ...]


def _claims(cls: type, flag: str, method: str, base: type) -> None:
    """A class that sets `flag` must define `method` itself (not inherit the base's refusal)."""
    if getattr(cls, flag) and getattr(cls, method) is getattr(base, method):
        raise ContractError(f"{cls.__module__}.{cls.__qualname__} sets {flag} = True but does not "
                            f"define {method}() ({base.__module__}.{base.__name__})")


class Source(ABC):
    """What the loader needs from a checkpoint.

    The plan is made from `entries()` alone (headers: no tensor data read); `read_order()` then
    walks the files one at a time. Optional capabilities, each off by default:
      read_into(name, out)   fill a contiguous CPU tensor of the stored dtype and shape in place
                             (no temporary copy); returns False when it cannot (the default)
      reads_parts            read_part(name, part: Slice) reads only one rank's part
      reads_blocks           read_blocks(name, as_format) gives a block-quantized tensor's stored
                             bytes uint8 [..., rows, bytes per row] (GGUF), for sinks that keep the format;
                             mixed_blocks(types) names the format parts of different types are
                             re-blocked into exactly so they can be joined (default None: none)
      release(name)          the loader is done with a stored tensor: a memory-mapped source may
                             drop its pages from the process (the default: nothing)
    """

    description: str  # e.g. "/path/to/dir (4 shards)": named in error messages
    # problems a header-only check found in the data (hub.open_source(verify_data=False)); None
    # when the source verified its data while opening
    data_problems: Optional[list[str]] = None
    reads_parts: bool = False
    reads_blocks: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _claims(cls, "reads_parts", "read_part", Source)
        _claims(cls, "reads_blocks", "read_blocks", Source)

    @abstractmethod
    def entries(self) -> dict[str, TensorInfo]:
        """Every stored tensor, from headers only (no tensor data is read)."""

    @abstractmethod
    def read_order(self) -> list[list[str]]:
        """Tensor names grouped by file, in the order files should be read (one at a time)."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """One tensor, as stored (safetensors) or dequantized to float32 (GGUF)."""

    @abstractmethod
    def config(self) -> dict:
        """The Hugging Face style config dict (config.json, or one derived from metadata)."""

    @abstractmethod
    def format_stages(self) -> list[str]:
        """Rule files that bring the format's own tensor names to the Hugging Face names the
        family's rules read (GGUF: conf/rules/gguf_<architecture>.yaml); [] when they match."""

    @abstractmethod
    def close(self) -> None:
        """Release file handles / memory maps."""

    def release(self, name: str) -> None:
        """The loader read `name` for the last time (its values are copied, or mapped by a sink
        that keeps a view): a memory-mapped source may hand its pages back (a view re-reads them
        from the file when touched). Default: nothing."""

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` with the stored tensor in place; False: this source cannot (read() it)."""
        return False

    def read_part(self, name: str, part: Slice) -> torch.Tensor:
        """Only `part` of a stored tensor (sources with reads_parts = True)."""
        raise ContractError(f"{type(self).__name__} does not read parts (reads_parts is False)")

    def read_blocks(self, name: str, as_format: Optional[str] = None) -> torch.Tensor:
        """A block-quantized tensor's stored bytes (sources with reads_blocks = True); as_format:
        a `mixed_blocks` format to re-block them into."""
        raise ContractError(f"{type(self).__name__} does not read stored blocks (reads_blocks is False)")

    def mixed_blocks(self, ggml_types: list[str]) -> Optional[str]:
        """The block format `read_blocks(as_format=...)` re-blocks tensors of all these (different)
        types into, or None: this source cannot (the default)."""
        return None


class WeightSink(ABC):
    """A module that takes its weight through `load_weight` instead of holding it as a parameter
    (a quantized linear, compiler/quant). The loader addresses it as `{module}{sink_suffix}`:
    `{module}.weight` by default, `{module}` for one that stands in for a parameter (quantized
    experts). Declared here with their defaults:

    weight_shape: the full weight's shape it takes ([O, I], or [E, O, I] stacked).
    tied_to: a parameter whose stored tensor this weight copies (a tied head), or None.
    stacked: it takes a stacked parameter's rows, `load_weight(value, index)`.
    prepare_blocks(format): the loader's plan will hand it blocks of that format (its buffers take
        their layout on the meta model); default: nothing to prepare.
    why_not_kept(stored type): for the load report, why blocks of a type it was offered were
        dequantized; default None (nothing to say).
    """

    weight_shape: tuple[int, ...]
    tied_to: Optional[str] = None
    stacked: bool = False
    sink_suffix: str = ".weight"

    @abstractmethod
    def accepts_blocks(self, ggml_type: str) -> bool:
        """True when `load_weight` takes the stored blocks of that type unconverted."""

    @abstractmethod
    def load_weight(self, value, *args, **kwargs) -> str:
        """Fill from a float tensor or StoredBlocks; returns what was done (for the report).
        A whole sink: load_weight(value, absmax=None), absmax [O] each whole row's max |w| when
        value holds only some of the row's inputs; a stacked one: load_weight(value, index)."""

    def prepare_blocks(self, ggml_type: str) -> None:
        """Blocks of `ggml_type` will come (accepts_blocks said yes): set the layout, on meta."""

    def why_not_kept(self, ggml_type: str) -> Optional[str]:
        """Why stored blocks of this type were dequantized for this sink (load report), or None."""
        return None

    def load_row_parts(self, parts: list, dim: int) -> Optional[str]:
        """The whole weight from the StoredBlocks `parts` a rule joins along `dim` (a cat of stored
        block tensors, e.g. gate and up stacks into w13), each written into its own rows without
        the joined copy; returns the report's line, or None where it does not (the loader then
        joins them and calls load_weight). Default: None."""
        return None

    def localize(self, part: Slice, where: str, run: str) -> None:
        """Re-make this sink (on meta, in place) at the local shape of `part`, the part of the
        weight one rank holds (compiler/parallel/plan.py); `where` names the config file and node,
        `run` the parallel settings, for errors. Default: the sink cannot be split."""
        raise ConfigError(f"{where}: a {type(self).__name__} weight cannot be split over ranks ({run})")

    def vocab_parallel(self, rows: tuple[int, int], gather) -> nn.Module:
        """This sink as an output head holding only vocabulary rows [a, b), its local logits
        joined by gather(logits [.., V/P]) -> [.., V] (compiler/parallel/plan.py). Default: the
        sink cannot be a vocab-parallel head."""
        raise ConfigError(f"a {type(self).__name__} cannot be a vocab-parallel head")

    def serves_rows(self) -> bool:
        """Whether `dequantize_rows` reads rows of the weight in its present layout (asked on
        meta, after prepare_blocks). Default: no."""
        return False

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N] int64 -> the weight's rows [N, I] float32, exactly as held. Default: none."""
        raise ContractError(f"{type(self).__name__} does not serve rows of its weight (serves_rows is False)")


class RowTable(ABC):
    """A module whose `weight` [N, D] is only looked up by rows (the token embedding). When a
    weight sink is tied to it (a quantized tied head) and keeps the very blocks the table would be
    dequantized from, the loader's plan calls `read_rows_from(sink)` on meta: the table drops its
    float parameter and its lookups read `sink.dequantize_rows` (the same values, bit for bit), so
    the file's blocks are held once. The sink is a reference, not a child: its owner keeps it."""

    rows_from: Optional[WeightSink] = None  # the sink its rows come from, once read_rows_from ran

    @abstractmethod
    def read_rows_from(self, sink: WeightSink) -> None:
        """From now on look rows up in `sink` (its weight_shape is this table's [N, D])."""
