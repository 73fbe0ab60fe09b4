"""Optional hooks a module inside a kind (or the kind itself) may declare, each written once here
with its default. A module takes part by subclassing the hook (a declared marker or mixin, so
`isinstance` asks the class, never the presence of an attribute) or by defining the methods of a
protocol; a hook declared wrongly is refused when its class is defined (ContractError).

    dtype and quantization (model.cast, compiler/quant)
      KeepFloat32      its parameters stay float32 whatever the model dtype (routing, stream mixing)
      Float32Linear    an nn.Linear that is KeepFloat32
      FloatLinears     names the nn.Linear children that stay floating point under runtime.quant
      QuantStacks      names the stacked expert parameters [E, O, I] runtime.quant may quantize
    analysis and initialisation (compiler/analysis.py, model.Decoder.init_weights)
      RefinesActiveParameters, ExtraTokenFlops, OwnInit
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ContractError


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class KeepFloat32:
    """Marker: this module's parameters stay float32 under any runtime.dtype (model.cast), and
    the nn.Linear modules inside it are not quantized (compiler/quant/apply.py), as the
    checkpoints keep routing and stream-mixing weights."""


class Float32Linear(nn.Linear, KeepFloat32):
    """An nn.Linear that stays float32 (KeepFloat32), e.g. DSA's indexer weights_proj."""


class FloatLinears:
    """Mixin: the nn.Linear children named in `float_linears` stay floating point under
    `runtime.quant` (compiler/quant), because the module reads their `.weight` directly (MLA's
    absorbed wkv_b) instead of calling them. Any other nn.Linear of any kind may become a
    QuantLinear, which computes the same forward(x) [..., I] -> [..., O] and has no float
    `.weight`. compiler/quant/apply.py refuses a name that is no nn.Linear child of the module."""

    float_linears: dict[str, str] = {}  # child name -> why it stays float (shown in the build report)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = cls.float_linears
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
            raise ContractError(f"{_where(cls)}.float_linears = {names!r}: expected a dict child name -> reason "
                                f"(contracts.FloatLinears)")


class QuantStacks:
    """Mixin: the stacked expert parameters named in `quant_stacks` ([E, O, I] each) may become
    QuantExperts under `runtime.quant` (compiler/quant/experts.py), which refuses a name that is
    no 3-D parameter of the module."""

    quant_stacks: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = cls.quant_stacks
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise ContractError(f"{_where(cls)}.quant_stacks = {names!r}: expected a tuple of parameter names "
                                f"(contracts.QuantStacks)")


@runtime_checkable
class RefinesActiveParameters(Protocol):
    """A module whose parameters one token does not all touch (MoE experts, a hash table, ...)."""

    def active_parameters(self, matmul_only: bool = False) -> int:
        """Parameters one token touches below this module (matmul_only: >= 2-D weights only)."""


@runtime_checkable
class ExtraTokenFlops(Protocol):
    """A module doing contractions its parameters do not show (mHC stream mixing, a compressor's
    pooling)."""

    def token_flops(self) -> int:
        """Context-independent FLOPs per token beyond 2 x its matmul parameters."""


@runtime_checkable
class OwnInit(Protocol):
    """A module with its own random/neutral initialisation (norms, gates, stream projections)."""

    def init_weights(self, generator: torch.Generator | None = None) -> None: ...
