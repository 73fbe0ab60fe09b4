"""The build pipeline as named stages. Each stage is one function that returns a frozen record of
what it decided; `run_build` runs them in order, once each, and `BuildReport` is assembled from
the records. The Python API (zoo/runtime.py), the CLI, `zoo report` / `zoo diff` (analysis.py:
spec, cast, count and cache stages on meta) and the server (through zoo.build) all go through here.

    spec_stage      config -> ModelSpec, the torch device and dtypes           SpecStage
    cast_stage      modules on meta in the weight dtype; MTP layers or not     CastStage
    quant_stage     linears / expert stacks -> quantized (runtime.quant)       QuantStage
    shard_stage     this rank's share under runtime.parallel                   ShardStage
    precision_stage bfloat16 CPU linears whose many-token products run float32 PrecisionStage
    load_stage      the checkpoint mapped from headers (before allocating)     LoadStage
    count_stage     exact parameters and bytes (quantized weights included)    CountStage
    cache_stage     every mixer's cache fields at max_batch x max_seq          CacheStage
    fit_stage       needed vs available bytes; dry or real (or an error)        FitStage
    weights_stage   storage allocated on the device, weights loaded or drawn   WeightsStage
    runner_stage    which runner the engine uses, from runtime and device      RunnerStage
    engine_stage    the Engine (made here only), warmed up when it compiles    EngineStage

The stages cast .. precision refine one meta module in place (quantized and sharded submodules
replace float ones); their records hold what each decided, never a copy of the module's state.
The load plan comes before the count because it may change what is held: buffers take the kept
blocks' layout, and a tied table reads its rows from the head's blocks (contracts.RowTable), so
the fit check counts the bytes the model will really hold.
What changes the model's structure and is no part of the architecture is an explicit input of the
stage that needs it: whether the MTP layers are built (`cast_stage(mtp=)`), the checkpoint whose
headers every rank must share (`shard_stage(source=)`), the device the quantized kernels run on.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from .checkpoint.loader import LoadPlan, LoadReport
from .contracts import CachePlan, RowTable, Source
from .engine.cache import plan_caches
from .errors import ConfigError, ContractError, InputError, ZooError
from .memory import memory_budget
from .model import Decoder, build_model, cast, count_parameters, materialize, parameter_bytes, torch_dtype
from .spec import QUANT_FLOAT, ModelSpec, use_aot, validate

# every stage function, in the order run_build calls them (tests count calls through this list)
STAGES = ("spec_stage", "cast_stage", "quant_stage", "shard_stage", "precision_stage", "load_stage",
          "count_stage", "cache_stage", "fit_stage", "weights_stage", "runner_stage", "engine_stage")


def check_source(weights: Any, where: str):
    """`weights` as a checkpoint Source: a path or repo id (str / os.PathLike) is opened; any
    other object must be a contracts.Source, else InputError naming its type."""
    from .checkpoint.hub import open_source

    if isinstance(weights, (str, os.PathLike)):
        return open_source(str(weights))
    if not isinstance(weights, Source):
        raise InputError(f"{where}: weights={weights!r} is neither a path / repo id nor a checkpoint source "
                         f"(a {type(weights).__name__}, not a zoo.compiler.contracts.Source)")
    return weights


# ---------------------------------------------------------------------------------- records

@dataclass(frozen=True)
class SpecStage:
    spec: ModelSpec
    device: torch.device  # runtime.device (a parallel run's rank device comes from shard_stage)
    dtype: torch.dtype  # runtime.dtype: the weights
    cache_dtype: torch.dtype  # runtime.cache_dtype, or dtype
    mtp: bool  # build the MTP layers: checkpoint.mtp, checked against the spec's mtp node


@dataclass(frozen=True)
class CastStage:
    module: Decoder  # on meta, refined in place by the quant / shard / precision stages
    dtype: torch.dtype
    mtp: bool  # whether module.mtp holds the spec's MTP layers


@dataclass(frozen=True)
class QuantStage:
    report: Any  # quant.apply.QuantReport: which linears are quantized and why others are not; None: float


@dataclass(frozen=True)
class ShardStage:
    """This rank's share under runtime.parallel; mesh None for one process."""

    mesh: Any  # parallel.mesh.Mesh | None
    slices: Optional[dict]  # {parameter: parallel.plan.Slice}: what this rank holds (the loader reads them)
    head: Optional[str]  # "vocab-parallel" or "replicated (why)"

    @property
    def parallel(self) -> Optional[dict]:
        """tp, ep, rank, size, head (what reports and rank-0-only output read); None for one process."""
        if self.mesh is None:
            return None
        m = self.mesh
        return {"tp": m.tp, "ep": m.ep, "rank": m.rank, "size": m.size, "head": self.head}


@dataclass(frozen=True)
class PrecisionStage:
    float32_products: int  # bfloat16 linears whose many-token products run in float32 (matmul_precision)
    device: torch.device  # where the model runs: runtime.device, or this rank's device


@dataclass(frozen=True)
class CountStage:
    params: int  # per rank under runtime.parallel; quantized weights counted as weights
    param_bytes: int  # everything held: float parameters and the quantized / kept blocks' buffers
    quantized_bytes: int = 0  # of which quantized weights and GGUF blocks kept as stored


@dataclass(frozen=True)
class CacheStage:
    plan: CachePlan
    total_bytes: int
    bytes_per_token: int
    state_bytes_per_sequence: int


@dataclass(frozen=True)
class FitStage:
    needed_bytes: int
    available_bytes: int  # what the build may hold (compiler/memory.py: measured, or a limit given)
    fits: bool
    dry: bool  # built on the meta device (report + shape check only)
    available_from: str = ""  # where available_bytes came from (MemAvailable, the cgroup's limit, a setting)
    forced: bool = False  # runtime.force_load: built for real although it does not fit


@dataclass(frozen=True)
class LoadStage:
    source: Any  # the checkpoint Source, or None for random weights
    plan: Optional[LoadPlan]


@dataclass(frozen=True)
class WeightsStage:
    module: Decoder  # the model on its device (the meta module for dry builds)
    load: Optional[LoadReport]  # None: random weights (or dry)
    seconds: float


@dataclass(frozen=True)
class RunnerStage:
    """How the engine runs the layers: `runner` is a registered runner's kind (engine/runners/), from the flags below.
    eager: plain PyTorch; compiled: regions compiled with torch.compile; aot: AOTInductor
    packages run by torch's C++ runner (CPU); cuda_graph: the decode step replayed as a CUDA
    graph (of compiled regions when compile)."""

    runner: str
    compile: bool
    cuda_graph: bool
    aot: bool

    @property
    def warmup(self) -> bool:
        """Whether the engine compiles or captures before the first call."""
        return self.compile or self.cuda_graph


@dataclass(frozen=True)
class EngineStage:
    engine: Any  # engine.core.Engine
    compile_seconds: dict  # per graph, from warmup ({} when nothing compiles)


# ---------------------------------------------------------------------------------- stages

def spec_stage(cfg: DictConfig | dict, source: str) -> SpecStage:
    """Validate the composed config; resolve the runtime's device and dtypes and whether the MTP
    layers are built."""
    spec = validate(cfg, source=source)
    rt = spec.runtime
    if spec.checkpoint.mtp and not spec.mtp_layers:
        raise ConfigError(f"{source}: checkpoint.mtp=true but the config declares no multi-token-prediction "
                          f"layers (mtp.n_layers={spec.mtp.n_layers}); expected checkpoint.mtp=false")
    return SpecStage(spec, torch.device(rt.device), torch_dtype(rt.dtype), torch_dtype(rt.cache_dtype or rt.dtype),
                     mtp=bool(spec.checkpoint.mtp))


def cast_stage(spec: ModelSpec, dtype: torch.dtype, *, mtp: bool) -> CastStage:
    """The module tree on meta in `dtype` (float32-kept modules aside); mtp: build the spec's
    multi-token-prediction layers."""
    return CastStage(cast(build_model(spec, mtp=mtp), dtype), dtype, mtp)


def keeps_stored_blocks(spec: ModelSpec, source, device: torch.device) -> bool:
    """runtime.quant=null keeps a checkpoint's blocks as stored: a source that reads them (GGUF),
    on the CPU (zoo's kernels), in one process (a rank's cut of stored blocks along their inputs
    is not read yet: under runtime.parallel the default stays float)."""
    par = spec.runtime.parallel
    return (spec.runtime.quant is None and source is not None and source.reads_blocks and device.type == "cpu"
            and par.tp == 1 and par.ep == 1)


def quant_stage(module: Decoder, quant: Optional[str], group: int, device: torch.device,
                dtype: torch.dtype, spec: Optional[ModelSpec] = None, source=None, prefill: str = "int8") -> QuantStage:
    """runtime.quant: the eligible linears and expert stacks become quantized modules (before
    sharding: every rank quantizes the linears one process would); device picks their kernels.
    null with a GGUF file (keeps_stored_blocks): the linears, stacks, head and embedding whose
    stored tensors are blocks keep them as stored, read off the headers by a plan made on the
    float model (quant.apply.keep_stored_blocks); none: float. prefill: runtime.quant_prefill
    (how zoo's CPU kernels take many rows)."""
    if spec is not None and keeps_stored_blocks(spec, source, device):
        from .checkpoint.loader import block_formats, plan_load
        from .checkpoint.rules import checkpoint_stages
        from .quant.apply import keep_stored_blocks

        plan = plan_load(module, source, checkpoint_stages(source, spec), strict=False)
        return QuantStage(keep_stored_blocks(module, block_formats(plan, source, module), prefill=prefill))
    if quant is None or quant == QUANT_FLOAT:
        return QuantStage(None)
    from .quant.apply import compute_dtype_for, quantize_linears

    return QuantStage(quantize_linears(module, quant, group, compute_dtype_for(device, dtype), device=device,
                                       prefill=prefill))


def shard_stage(spec: ModelSpec, module: Decoder, source) -> ShardStage:
    """Under runtime.parallel: the mesh (the process group from torchrun's environment), a check
    that every rank builds the same config from the same checkpoint (`source`'s headers; None:
    random weights), and `module` cut to this rank's share."""
    from .parallel.mesh import check_same_on_all_ranks, setup
    from .parallel.plan import shard_model

    par = spec.runtime.parallel
    mesh = setup(par.tp, par.ep, spec.runtime.device, spec.source)
    if mesh is None:
        return ShardStage(None, None, None)
    check_same_on_all_ranks(mesh, "the config", OmegaConf.to_yaml(spec.config, resolve=True))
    if source is not None:
        headers = sorted((n, tuple(i.shape), i.dtype, i.nbytes) for n, i in source.entries().items())
        check_same_on_all_ranks(mesh, f"the checkpoint ({source.description})", repr(headers))
    report = shard_model(module, mesh)
    return ShardStage(mesh, report.slices, report.head)


def precision_stage(module: Decoder, dtype: torch.dtype, device: torch.device) -> PrecisionStage:
    """bfloat16 on a CPU without native bfloat16 GEMMs: many-token products in float32."""
    from .matmul_precision import upcast_products

    return PrecisionStage(upcast_products(module, dtype, device), device)


def count_stage(module: Decoder) -> CountStage:
    """Exact parameters (tied weights once; a quantized linear or expert stack counts its
    weights, a quantized tied head none) and their bytes as stored."""
    from .quant.apply import quantized_bytes
    from .quant.experts import QuantExperts
    from .quant.linear import QuantLinear

    params = count_parameters(module) \
        + sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, QuantLinear) and not m.tied_to) \
        + sum(m.numel() for m in module.modules() if isinstance(m, QuantExperts)) \
        + sum(m.num_embeddings * m.embedding_dim for m in module.modules()  # a table read from its tied head
              if isinstance(m, RowTable) and m.rows_from is not None)
    held = quantized_bytes(module)
    return CountStage(params, parameter_bytes(module) + held, held)


def cache_stage(module: Decoder, max_batch: int, max_seq: int, cache_dtype: torch.dtype) -> CacheStage:
    """Every layer's cache fields at max_batch x max_seq (declared by the mixers, on meta)."""
    plan = plan_caches(module, max_batch, max_seq, cache_dtype)
    return CacheStage(plan, plan.total_bytes(), plan.bytes_per_token(), plan.state_bytes_per_sequence())


def fit_stage(spec: ModelSpec, count: CountStage, caches: CacheStage, device: torch.device,
              dry: Optional[bool], has_weights: bool, source=None) -> FitStage:
    """Weights + caches against what the build may hold (compiler/memory.py: the device's free
    memory, or runtime.memory_limit / $ZOO_MEMORY_LIMIT). dry: None builds for real when it fits
    and on meta when it does not and no weights are given (a checkpoint that does not fit is an
    error); True always builds on meta; False raises when it does not fit. runtime.force_load
    builds for real whatever the check says. Every figure comes from the meta model (the
    checkpoint's headers), so a refusal comes before anything is read or allocated."""
    rt = spec.runtime
    budget = memory_budget(device, rt.memory_limit)
    needed, available = count.param_bytes + caches.total_bytes, budget.bytes
    fits = needed <= available
    if dry is None:
        dry = not fits and not has_weights and not rt.force_load
    if not dry and not fits and not rt.force_load:
        raise ZooError(_misfit(spec, count, caches, device, budget.bytes, budget.source, source))
    return FitStage(needed, available, fits, bool(dry), budget.source, forced=not dry and not fits)


def _misfit(spec: ModelSpec, count: CountStage, caches: CacheStage, device: torch.device, available: int,
            available_from: str, source) -> str:
    """The refusal of a model that does not fit: the file, the weights and caches it needs, what is
    available and from where, and what would fit."""
    rt, size = spec.runtime, _size
    weights = count.param_bytes
    held = (f": {size(count.quantized_bytes)} of quantized or kept GGUF blocks, "
            f"{size(weights - count.quantized_bytes)} float" if count.quantized_bytes else "")
    where = source.description if source is not None else spec.source
    text = (f"{where}: {spec.name} needs {size(weights + caches.total_bytes)}: {size(weights)} of weights "
            f"({count.params:,} parameters in {rt.dtype}{held}) + {size(caches.total_bytes)} of caches (max_batch="
            f"{rt.max_batch} x max_seq={rt.max_seq}), but {device} has {size(available)} available; nothing was "
            f"allocated (available is {available_from})")
    tries = []
    growing = sum(f.nbytes for layer in caches.plan.layers for f in layer.values() if f.grows)
    fixed = caches.total_bytes - growing  # per-row state: does not shrink with max_seq
    # the growing fields are linear in max_seq at a fixed max_batch
    seq = (available - weights - fixed) * rt.max_seq // growing if growing else 0
    if weights + fixed >= available:
        tries.append(f"the weights alone ({size(weights)}) exceed what is available: a smaller max_seq or "
                     f"max_batch does not help")
    elif 1 <= seq < rt.max_seq:
        tries.append(f"max_seq={seq} (the most that fits at max_batch={rt.max_batch})"
                     + (" or a smaller max_batch" if rt.max_batch > 1 else ""))
    if source is not None and source.reads_blocks:
        tries.append("quant= unset: the file's blocks kept as stored" if rt.quant == QUANT_FLOAT else
                     "a file of a smaller quant type (e.g. Q4_K_M -> Q3_K_M, IQ3_XXS or IQ2_XXS)")
    elif rt.quant != "int4":
        tries.append("quant=int4 or quant=int8 (weight-only, quantized at load)")
    tries.append("force_load=true to load anyway (the system may swap or kill the process); "
                 "runtime.memory_limit=BYTES or $ZOO_MEMORY_LIMIT sets the budget instead")
    return text + ". To fit: " + "; ".join(tries)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def load_stage(spec: ModelSpec, module: Decoder, source, shard: ShardStage) -> LoadStage:
    """Map the checkpoint onto `module` from headers alone (every check before allocating);
    under runtime.parallel only this rank's slices are read. The plan is lenient: what does not
    fit is raised by weights_stage before it allocates, after the fit check (a model too large
    for the device is refused first, whatever its checkpoint holds)."""
    if source is None:
        return LoadStage(None, None)
    from .checkpoint.loader import plan_load
    from .checkpoint.rules import checkpoint_stages

    plan = plan_load(module, source, checkpoint_stages(source, spec), strict=False, slices=shard.slices)
    if plan.refusal is None:
        _check_blocks_only(module, plan, source)
    return LoadStage(source, plan)


def _check_blocks_only(module: Decoder, plan: LoadPlan, source) -> None:
    """Every sink made to keep stored blocks (quant.apply.keep_stored_blocks) is planned blocks:
    the quant stage's read of the headers and the load plan agree (a ContractError otherwise,
    before anything is allocated)."""
    from .checkpoint.loader import weight_sinks

    given = {a.param for a in plan.assignments if a.blocks is not None}
    missing = [name for name, sink in weight_sinks(module).items()
               if getattr(sink, "blocks_only", False) and name not in given]
    if missing:
        raise ContractError(f"{source.description}: the quant stage kept {missing[:8]} as stored blocks, but the "
                            f"load plan hands them other values")


def quant_mode(quant: Optional[str], report) -> Optional[str]:
    """The mode a build ran: runtime.quant, or the quant report's ("stored": a GGUF file's blocks
    kept by default); None for float."""
    if report is not None:
        return report.mode
    return None if quant == QUANT_FLOAT else quant


def weights_stage(spec: ModelSpec, module: Decoder, load: LoadStage, shard: ShardStage, device: torch.device,
                  dtype: torch.dtype, seed: int, progress: Optional[Callable[[int], Any]] = None,
                  quant_report=None) -> WeightsStage:
    """Allocate storage once on `device`, then load the planned checkpoint (through the weight
    cache for converted weights, one process only) or draw random weights from `seed`.
    progress: a factory taking the bytes to read and returning a callback for bytes read."""
    from .quant.apply import fill_tied

    if load.plan is not None:
        load.plan.check()  # the checkpoint's misfits, before anything is allocated
    t0 = time.perf_counter()
    module = materialize(module, device, dtype)
    report = None
    if load.source is not None:
        from .checkpoint.weight_cache import cached_execute

        rt = spec.runtime
        # converted weights (GGUF dequantized or repacked, quantized at load) come from the
        # weight cache after the first load (checkpoint/weight_cache.py); not per rank
        settings = {"dtype": rt.dtype, "quant": quant_mode(rt.quant, quant_report), "quant_group": rt.quant_group,
                    "device": str(device)}
        report = cached_execute(load.plan, module, load.source, settings, enabled=shard.mesh is None,
                                progress=None if progress is None else progress(load.plan.bytes_to_read),
                                row_absmax=None if shard.mesh is None else shard.mesh.max_over_ranks)
    else:
        # drawn where the weights live: an 8B model on a GPU never passes through host memory
        # (the numbers depend on the device's generator; the same seed repeats on one device)
        module.init_weights(torch.Generator(device=device).manual_seed(seed))
        fill_tied(module)
    return WeightsStage(module, report, time.perf_counter() - t0)


def runner_stage(spec: ModelSpec, device: torch.device, dry: bool) -> RunnerStage:
    """Which runner the engine uses: the engine's runner registry (engine/runners/) asked once
    with runtime.compile / cuda_graph / aot and the device; a dry build runs eagerly on meta (a
    shape check of both graphs)."""
    from .engine.runners import RunnerOptions, runner_class

    rt = spec.runtime
    if dry:
        return RunnerStage("eager", compile=False, cuda_graph=False, aot=False)
    options = RunnerOptions(device, compile=rt.compile, cuda_graph=rt.cuda_graph, aot=use_aot(rt))
    try:
        kind = runner_class(options).kind
    except ValueError as e:  # options no runner serves (aot off a CPU, ...)
        raise ConfigError(f"{spec.source}: runtime settings {options}: {e}") from None
    return RunnerStage(kind, compile=rt.compile, cuda_graph=kind == "cuda_graph", aot=kind == "aot")


def engine_stage(module: Decoder, spec: ModelSpec, runner: RunnerStage, cache: CacheStage,
                 cache_dtype: torch.dtype) -> EngineStage:
    """The Engine (the one place one is made) over the cache stage's plan: caches allocated,
    graphs compiled or captured when the runner does."""
    from .engine.core import Engine

    rt = spec.runtime
    buckets = None if rt.decode_buckets is None else [int(b) for b in rt.decode_buckets]
    engine = Engine(module, max_batch=rt.max_batch, max_seq=rt.max_seq, cache_dtype=cache_dtype,
                    compile=runner.compile, cuda_graph=runner.cuda_graph, aot=runner.aot, plan=cache.plan,
                    decode_buckets=buckets)
    if engine.runner_kind != runner.runner:
        raise RuntimeError(f"the engine chose runner {engine.runner_kind!r}, not the runner stage's {runner}")
    return EngineStage(engine, engine.warmup() if runner.warmup else {})


# ---------------------------------------------------------------------------------- driver

@dataclass(frozen=True)
class BuildRecords:
    """Every stage's record of one build, in pipeline order."""

    spec: SpecStage
    cast: CastStage
    quant: QuantStage
    shard: ShardStage
    precision: PrecisionStage
    count: CountStage
    cache: CacheStage
    fit: FitStage
    load: LoadStage
    weights: WeightsStage
    runner: RunnerStage
    engine: EngineStage


@dataclass(frozen=True)
class BuildReport:
    """What `zoo build` reports, assembled from the records (`report_from`)."""

    params: int
    param_bytes: int
    cache_bytes: int
    cache_bytes_per_token: int
    state_bytes_per_sequence: int
    available_bytes: int
    device: str  # "meta" for dry builds
    dry: bool
    runner: str  # a registered runner's kind (engine/runners/)
    compile_seconds: dict  # per graph ({} when nothing compiles)
    load: Optional[LoadReport]  # None: random weights (or dry)
    load_seconds: float
    parallel: Optional[dict]  # tp, ep, rank, size, head: this rank's share (params are per rank)
    quant: Any  # quant.apply.QuantReport: which linears are quantized, what stays float and why; None: float
    float32_products: int  # bfloat16 linears whose many-token products run in float32 (matmul_precision)

    @property
    def needed_bytes(self) -> int:
        return self.param_bytes + self.cache_bytes


def report_from(r: BuildRecords) -> BuildReport:
    """The build report, every figure read from the stage that decided it."""
    return BuildReport(params=r.count.params, param_bytes=r.count.param_bytes, cache_bytes=r.cache.total_bytes,
                       cache_bytes_per_token=r.cache.bytes_per_token,
                       state_bytes_per_sequence=r.cache.state_bytes_per_sequence,
                       available_bytes=r.fit.available_bytes,
                       device="meta" if r.fit.dry else str(r.precision.device), dry=r.fit.dry,
                       runner=r.runner.runner, compile_seconds=r.engine.compile_seconds, load=r.weights.load,
                       load_seconds=r.weights.seconds, parallel=r.shard.parallel, quant=r.quant.report,
                       float32_products=r.precision.float32_products)


def run_build(cfg: DictConfig | dict, source_desc: str, source=None, *, seed: int = 0, dry: Optional[bool] = None,
              progress: Optional[Callable[[int], Any]] = None) -> BuildRecords:
    """Every stage once, in order. source: the checkpoint (a Source; None: random weights).
    dry: see fit_stage; a dry build stops before allocating and runs eagerly on meta."""
    s = spec_stage(cfg, source_desc)
    spec = s.spec
    c = cast_stage(spec, s.dtype, mtp=s.mtp)
    module = c.module
    q = quant_stage(module, spec.runtime.quant, spec.runtime.quant_group, s.device, s.dtype, spec=spec, source=source,
                    prefill=spec.runtime.quant_prefill)
    sh = shard_stage(spec, module, source)
    p = precision_stage(module, s.dtype, sh.mesh.device if sh.mesh is not None else s.device)
    # planned before counting: the plan may change what is held (a tied table read from its head's blocks)
    ld = load_stage(spec, module, source, sh)
    n = count_stage(module)
    ca = cache_stage(module, spec.runtime.max_batch, spec.runtime.max_seq, s.cache_dtype)
    f = fit_stage(spec, n, ca, p.device, dry, source is not None, source)
    if f.dry:
        w = WeightsStage(module, None, 0.0)
    else:
        w = weights_stage(spec, module, ld, sh, p.device, s.dtype, seed, progress, quant_report=q.report)
    ru = runner_stage(spec, p.device, f.dry)
    e = engine_stage(w.module, spec, ru, ca, s.cache_dtype)
    return BuildRecords(s, c, q, sh, p, n, ca, f, ld, w, ru, e)
