"""The contracts: every type the kinds, quant, parallel, checkpoint and engine share, written once.

This package stands at the bottom of zoo: it imports torch, the standard library and
compiler/errors.py only (tests/test_contracts.py checks), and everything else stands above it.

    slots.py     the slots' ABCs (Mixer, FFN, Norm, Rope, Residual), KindSpec, contract_problems
    context.py   the step context the engine hands every entry point (StepContext)
    cache.py     what a mixer keeps between steps (CacheField, CachePlan)
    parallel.py  a rank's part of a tensor (Slice) and rows of a range of heads (span)
    weights.py   checkpoint sources (Source, TensorInfo), stored blocks, weight sinks, row tables
    hooks.py     optional module hooks: KeepFloat32, FloatLinears, QuantStacks, analysis protocols
    probes.py    optional `zoo patterns` hooks: AttentionProbe, MixerStatistics, StreamMixing
"""
from .cache import CacheField, CachePlan
from .context import StepContext
from .hooks import (ExtraTokenFlops, Float32Linear, FloatLinears, KeepFloat32, OwnInit, QuantStacks,
                    RefinesActiveParameters)
from .parallel import Ranges, Slice, span
from .probes import AttentionMaps, AttentionProbe, MixerStatistics, StreamMixing
from .slots import (CONTRACTS, FFN, KindSpec, Mixer, Norm, Residual, Rope, contract_problems,
                    extends_by_decode, no_sharding_plan)
from .weights import RowTable, Source, StoredBlocks, TensorInfo, WeightSink

__all__ = ["CacheField", "CachePlan", "StepContext", "ExtraTokenFlops", "Float32Linear", "FloatLinears",
           "KeepFloat32", "OwnInit", "QuantStacks", "RefinesActiveParameters", "Ranges", "Slice", "span",
           "AttentionMaps", "AttentionProbe", "MixerStatistics", "StreamMixing", "CONTRACTS", "FFN", "KindSpec",
           "Mixer", "Norm", "Residual", "Rope", "contract_problems", "extends_by_decode", "no_sharding_plan",
           "RowTable", "Source", "StoredBlocks", "TensorInfo", "WeightSink"]
