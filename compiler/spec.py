"""The spec tree: a composed config, validated and resolved into plain dataclasses.

    conf/ (Hydra YAML) --compose--> DictConfig --validate--> ModelSpec --build--> modules

Top-level keys are checked by `ConfigSchema`; each `kind:` node (mixers, ffns, norm, rope,
residual) by the `Spec` dataclass of the class registered for that kind. The compiler reads the
resolved `ModelSpec` (per-layer kinds, dims) before building anything: to size caches, count
parameters, plan graphs and pick checkpoint rules.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .registry import lookup
from .resolvers import register_resolvers


# ---------------------------------------------------------------------------- schema (YAML)


@dataclass
class LayerKindSchema:
    mixer: str = "???"
    ffn: str = "???"


@dataclass
class RunSchema:
    """A run of layers in the layout.

    Either one layer kind (`mixer`, `ffn`) repeated `repeat` times, or a `pattern` of layer kinds
    repeated `repeat` times. `repeat: null` fills the layers left to `n_layers` (one run at most).
    """

    repeat: Optional[int] = None
    mixer: Optional[str] = None
    ffn: Optional[str] = None
    pattern: Optional[List[LayerKindSchema]] = None


@dataclass
class ParallelSchema:
    """Tensor / expert parallelism over the ranks of a torchrun launch (compiler/parallel/)."""

    tp: int = 1  # attention heads and dense FFN columns split over the ranks (1 or the world size)
    ep: int = 1  # routed experts split this many ways (dividing the world size)


@dataclass
class SpeculativeSchema:
    """Speculative decoding in generate and zoo serve (compiler/engine/speculative.py): a drafter
    proposes draft_tokens tokens per step, the model verifies them in one step over
    draft_tokens + 1 positions. drafter: null (off) | ngram (prompt lookup of the history's last
    ngram_max..ngram_min tokens; any family) | mtp (the model's MTP layer; checkpoint.mtp=true)."""

    drafter: Optional[str] = None
    draft_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1


DRAFTERS = ("ngram", "mtp")  # runtime.speculative.drafter (compiler/engine/drafters.py)


@dataclass
class RuntimeSchema:
    device: str = "cpu"
    dtype: str = "float32"
    cache_dtype: Optional[str] = None  # None: same as dtype
    max_batch: int = 1
    max_seq: int = 2048
    # the batch sizes decode steps are made for, each its own static step; a step runs the
    # smallest that holds its rows (compiler/engine/buckets.py). null: 1, 2, 4, ... and max_batch
    decode_buckets: Optional[List[int]] = None
    # zoo serve's chunked prefill: the tokens one scheduler step may spend (one per decoding row,
    # the rest on a prompt's chunk; zoo/serve/scheduler.py). null: prompts are prefilled whole
    step_tokens: Optional[int] = None
    compile: bool = True
    cuda_graph: bool = True  # capture the decode step as a CUDA graph (CUDA only)
    # CPU: the steps' layers (prefill, decode, extend) as AOTInductor packages run by torch's C++
    # runner instead of compiled functions entered through dynamo (compiler/engine/aot.py).
    # false | true (needs device=cpu, compile, one process) | auto (true where that holds, else
    # false: the default)
    aot: str = "auto"
    parallel: ParallelSchema = field(default_factory=ParallelSchema)
    # weight-only quantization of the linears (compiler/quant): null (the checkpoint's own: a GGUF
    # file's blocks kept as stored on the CPU, float otherwise), none (float: the blocks
    # dequantized), int8 (per output channel) or int4 (groups of quant_group inputs, asymmetric)
    quant: Optional[str] = None
    quant_group: int = 32  # 32 | 64 | 128 (int4 only); 32 keeps GGUF Q4_0/Q4_1 blocks as stored
    # how zoo's quantized CPU kernels take many rows (prefill): int8 (activations rounded to int8 per
    # 32 inputs at every row count, one order of sums per row: a row's logits are the same bits
    # whatever path its cache took) | float (calls of more than 16 rows dequantize the weights and
    # run the float GEMM: gives that invariance up)
    quant_prefill: str = "int8"
    # the bytes a build may hold (weights + caches), checked before anything is allocated
    # (compiler/memory.py); null: $ZOO_MEMORY_LIMIT when set, else the device's available memory
    # (the CPU's MemAvailable, capped by the cgroup's limit)
    memory_limit: Optional[int] = None
    force_load: bool = False  # build even when the weights and caches exceed that budget
    speculative: SpeculativeSchema = field(default_factory=SpeculativeSchema)


@dataclass
class CheckpointSchema:
    rules: List[str] = field(default_factory=list)  # rule files under conf/rules, applied in order
    mtp: bool = False  # load multi-token-prediction layers when the checkpoint has them
    # weights `zoo build/generate conf=NAME` load when the command line gives no weights=: a path,
    # Hub repo id, or pkg://PACKAGE/FILE (a file shipped inside an installed Python package)
    weights: Optional[str] = None


@dataclass
class MTPSchema:
    """Multi-token-prediction layers after the main stack (DeepSeek-V3 MTP, see mtp.py): each is
    one more decoder block of the named mixer and ffn. Built (and loaded) only when
    `checkpoint.mtp` is true; their checkpoint tensors are skipped by a reported rule otherwise."""

    n_layers: int = 0
    mixer: Optional[str] = None  # a name in `mixers`
    ffn: Optional[str] = None  # a name in `ffns`
    share_embeddings: bool = False  # use the main embed/head instead of the layer's own copies


@dataclass
class ConfigSchema:
    name: str = "???"
    n_layers: int = "???"  # type: ignore[assignment]
    dim: int = "???"  # type: ignore[assignment]
    vocab_size: int = "???"  # type: ignore[assignment]
    tie_embeddings: bool = False
    max_position: int = "???"  # type: ignore[assignment]  # context length the model was trained for
    norm: Any = "???"
    rope: Any = "???"
    # extra rope schedules by name; a mixer reads `rope` unless its spec names one of these
    # (`rope_slot`), e.g. DeepSeek-V4's compressed layers use their own YaRN schedule
    ropes: Dict[str, Any] = field(default_factory=dict)
    residual: Any = "???"
    # where each block normalises: pre (x + f(norm(x))), sandwich (x + norm(f(norm(x))), Gemma),
    # post (x + norm(f(x)), OLMo 2), post_residual (norm(x + f(x)), GPT-1: the last block's norm
    # is the final one, so the model has no separate final norm); see block.py
    sublayer_norms: str = "pre"
    # embeddings * embed_scale, the scale rounded to their dtype (Gemma: sqrt(dim); Granite's
    # embedding_multiplier); None: unscaled
    embed_scale: Optional[float] = None
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    logit_softcap: Optional[float] = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
    # learned absolute position embeddings added to the token embeddings (GPT-2, OPT):
    # pos_embed [max_position + position_offset, D], position p reads row p + position_offset (OPT: 2)
    learned_positions: bool = False
    position_offset: int = 0
    # fixed sinusoidal positions added the same way (position/sinusoidal.py): null, tensor2tensor
    # (XGLM, with position_offset 2) or transformer (CTRL)
    sinusoidal_positions: Optional[str] = None
    embed_norm: bool = False  # a norm (the model's kind) right after the embedding (Bloom)
    head_bias: bool = False  # the output projection has a bias (GPT-J, Phi-1/2)
    # KV shared across layers (Gemma 3n / 4): the last kv_shared_layers layers compute no keys or
    # values; each reads the cache of the last earlier layer of its own mixer entry (kv_sources)
    kv_shared_layers: int = 0
    # per-layer input embeddings of this width (residual/per_layer_input.py; Gemma 3n / 4), from a
    # table of per_layer_vocab rows (null: vocab_size); null: none
    per_layer_dim: Optional[int] = None
    per_layer_vocab: Optional[int] = None
    layer_scalar: bool = False  # each block's output times a stored scalar layers.{i}.layer_scalar (Gemma 4)
    mixers: Dict[str, Any] = field(default_factory=dict)
    ffns: Dict[str, Any] = field(default_factory=dict)
    layout: List[RunSchema] = field(default_factory=list)
    runtime: RuntimeSchema = field(default_factory=RuntimeSchema)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    mtp: MTPSchema = field(default_factory=MTPSchema)


# ---------------------------------------------------------------------------- resolved spec

DTYPES = ("float32", "bfloat16", "float16")
SUBLAYER_NORMS = ("pre", "sandwich", "post", "post_residual")
SINUSOID_STYLES = ("tensor2tensor", "transformer")  # position/sinusoidal.py's frequency schedules
QUANT_MODES = ("int8", "int4")  # compiler/quant/linear.py
QUANT_FLOAT = "none"  # runtime.quant=none: float weights, a GGUF file's blocks dequantized
QUANT_GROUPS = (32, 64, 128)
QUANT_PREFILL = ("int8", "float")  # runtime.quant_prefill (compiler/quant/cpu_kernels.py)
AOT_MODES = ("false", "true", "auto")  # runtime.aot (compiler/engine/aot.py)


def aot_applies(rt: RuntimeSchema) -> bool:
    """Whether the graphs can be AOTInductor packages: CPU, compiled, one process (a package
    holds no collectives)."""
    return rt.device == "cpu" and rt.compile and rt.parallel.tp * rt.parallel.ep == 1


def use_aot(rt: RuntimeSchema) -> bool:
    """runtime.aot resolved: true, or auto where the packages apply."""
    return rt.aot == "true" or (rt.aot == "auto" and aot_applies(rt))


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: which named mixer and ffn it uses, and their resolved specs."""

    index: int
    mixer_name: str
    mixer: Any
    ffn_name: str
    ffn: Any


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dim: int
    vocab_size: int
    tie_embeddings: bool
    max_position: int
    norm: Any
    rope: Any
    residual: Any
    mixers: Dict[str, Any]
    ffns: Dict[str, Any]
    layers: tuple[LayerSpec, ...]
    runtime: RuntimeSchema
    checkpoint: CheckpointSchema
    source: str  # where the config came from, for error messages
    config: Any = None  # the resolved DictConfig (read-only), for reports, rules and diffs
    mtp: Optional[MTPSchema] = None
    mtp_layers: tuple[LayerSpec, ...] = ()  # the MTP blocks (indices n_layers..), per `mtp`
    ropes: Dict[str, Any] = field(default_factory=dict)  # extra rope slots (see ConfigSchema.ropes)
    sublayer_norms: str = "pre"  # see ConfigSchema
    embed_scale: Optional[float] = None
    logits_scaling: float = 1.0
    logit_softcap: Optional[float] = None
    learned_positions: bool = False
    position_offset: int = 0
    sinusoidal_positions: Optional[str] = None
    embed_norm: bool = False
    head_bias: bool = False
    # consumer layer -> the producer layer whose KV cache it reads (ConfigSchema.kv_shared_layers)
    kv_sources: Dict[int, int] = field(default_factory=dict)
    per_layer_dim: Optional[int] = None
    per_layer_vocab: Optional[int] = None
    layer_scalar: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def layout_runs(self) -> list[tuple[str, int]]:
        """Runs of identical layer kinds, e.g. [("attn+dense", 3), ("attn+moe", 58)]."""
        runs: list[tuple[str, int]] = []
        for layer in self.layers:
            name = f"{layer.mixer_name}+{layer.ffn_name}"
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1] + 1)
            else:
                runs.append((name, 1))
        return runs


def _fail(source: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {msg}")


def _validate_kind(slot: str, node: Any, path: str, source: str, model: dict) -> Any:
    """Validate one `kind:` node against the Spec of its registered class; resolve defaults."""
    if not isinstance(node, (DictConfig, dict)):
        raise _fail(source, f"{path}: expected a mapping with a 'kind' key, got {node!r}")
    kind = node.get("kind")
    cls = lookup(slot, kind, f"{source}: {path}")
    schema = OmegaConf.structured(cls.Spec)
    try:
        merged = OmegaConf.merge(schema, node)
    except OmegaConfBaseException as e:
        # reflection: which of these an OmegaConf error carries depends on where it was raised
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
        raise _fail(source, f"{path}.{key}: {_short(e)} (valid keys for {slot} kind {kind!r}: "
                            f"{sorted(f.name for f in dataclasses.fields(cls.Spec))})") from None
    missing = OmegaConf.missing_keys(merged)
    if missing:
        raise _fail(source, f"{path}: missing required keys {sorted(missing)} for {slot} kind {kind!r}")
    spec = OmegaConf.to_object(merged)
    spec = spec.resolve(model)  # contracts.KindSpec: a new, fully resolved spec (derived dims filled in)
    problem = spec.check(model)
    if problem:
        raise _fail(source, f"{path}: {problem}")
    return spec


def _short(e: Exception) -> str:
    return str(e).split("\n")[0]


def validate(cfg: DictConfig | dict, source: str) -> ModelSpec:
    """Check a composed config node by node and resolve it into a ModelSpec.

    Raises ConfigError naming the key path and `source` (the conf name or checkpoint dir).
    """
    register_resolvers()
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _fail(source, f"cannot resolve interpolation: {_short(e)}") from None
    schema = OmegaConf.structured(ConfigSchema)
    try:
        top = OmegaConf.merge(schema, cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"  # reflection, as in _validate_kind
        raise _fail(source, f"{key}: {_short(e)} (valid top-level keys: "
                            f"{sorted(f.name for f in dataclasses.fields(ConfigSchema))})") from None
    missing = sorted(k for k in OmegaConf.missing_keys(top))
    if missing:
        raise _fail(source, f"missing required keys {missing}")

    model = {"dim": top.dim, "vocab_size": top.vocab_size, "n_layers": top.n_layers,
             "max_position": top.max_position}
    for key in ("dim", "vocab_size", "n_layers", "max_position", "logits_scaling"):
        if top[key] <= 0:
            raise _fail(source, f"{key}: must be positive, got {top[key]}")
    rt = OmegaConf.to_object(top.runtime)
    for key in ("dtype", "cache_dtype"):
        value = getattr(rt, key)
        if value is not None and value not in DTYPES:
            raise _fail(source, f"runtime.{key}: expected one of {list(DTYPES)}, got {value!r}")
    if rt.quant is not None and rt.quant not in (*QUANT_MODES, QUANT_FLOAT):
        raise _fail(source, f"runtime.quant: expected one of {[*QUANT_MODES, QUANT_FLOAT]} or null (a GGUF file's "
                            f"blocks as stored), got {rt.quant!r}")
    if rt.quant_group not in QUANT_GROUPS:
        raise _fail(source, f"runtime.quant_group: expected one of {list(QUANT_GROUPS)}, got {rt.quant_group!r}")
    if rt.quant_prefill not in QUANT_PREFILL:
        raise _fail(source, f"runtime.quant_prefill: expected one of {list(QUANT_PREFILL)}, got {rt.quant_prefill!r}")
    rt.aot = str(rt.aot).lower()  # yaml and the command line give booleans, `auto` a string
    if rt.aot not in AOT_MODES:
        raise _fail(source, f"runtime.aot: expected one of {list(AOT_MODES)}, got {rt.aot!r}")
    if rt.aot == "true" and not aot_applies(rt):
        raise _fail(source, f"runtime.aot=true needs runtime.device=cpu, runtime.compile=true and one "
                            f"process (got device={rt.device!r}, compile={rt.compile}, "
                            f"parallel tp={rt.parallel.tp} ep={rt.parallel.ep}); runtime.aot=auto uses "
                            f"packages only where they apply")
    if rt.memory_limit is not None and rt.memory_limit < 1:
        raise _fail(source, f"runtime.memory_limit={rt.memory_limit}: expected a positive number of bytes or null "
                            f"(the device's available memory)")
    if rt.max_batch <= 0 or rt.max_seq <= 0:
        raise _fail(source, f"runtime.max_batch and runtime.max_seq must be positive, "
                            f"got {rt.max_batch} and {rt.max_seq}")
    if rt.decode_buckets is not None:
        sizes = list(rt.decode_buckets)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] != rt.max_batch:
            raise _fail(source, f"runtime.decode_buckets={sizes}: expected increasing batch sizes in "
                                f"1..max_batch={rt.max_batch} ending with max_batch (e.g. [1, {rt.max_batch}]), "
                                f"or null for 1, 2, 4, ... and max_batch")
    if rt.step_tokens is not None and rt.step_tokens < rt.max_batch:
        raise _fail(source, f"runtime.step_tokens={rt.step_tokens}: a step may hold max_batch - 1 decoding rows "
                            f"besides a prompt's chunk; expected >= max_batch={rt.max_batch}, or null (no chunked "
                            f"prefill)")
    sp = rt.speculative
    if sp.drafter is not None and sp.drafter not in DRAFTERS:
        raise _fail(source, f"runtime.speculative.drafter: expected one of {list(DRAFTERS)} or null, "
                            f"got {sp.drafter!r}")
    if sp.draft_tokens < 1:
        raise _fail(source, f"runtime.speculative.draft_tokens: must be >= 1, got {sp.draft_tokens}")
    if not 1 <= sp.ngram_min <= sp.ngram_max:
        raise _fail(source, f"runtime.speculative: ngram_min={sp.ngram_min}, ngram_max={sp.ngram_max}; "
                            f"expected 1 <= ngram_min <= ngram_max")
    if sp.drafter == "mtp" and not (top.checkpoint.mtp and top.mtp.n_layers > 0):
        raise _fail(source, f"runtime.speculative.drafter=mtp needs the model's multi-token-prediction layers: "
                            f"checkpoint.mtp=true and mtp.n_layers > 0 (got checkpoint.mtp={top.checkpoint.mtp}, "
                            f"mtp.n_layers={top.mtp.n_layers})")

    if top.sublayer_norms not in SUBLAYER_NORMS:
        raise _fail(source, f"sublayer_norms: expected one of {list(SUBLAYER_NORMS)}, got {top.sublayer_norms!r}")
    if top.sublayer_norms == "post_residual" and OmegaConf.select(top, "residual.parallel") is not None:
        raise _fail(source, f"sublayer_norms: post_residual normalises after each residual add, which a parallel "
                            f"residual (residual.parallel={OmegaConf.select(top, 'residual.parallel')!r}) does not have")
    if top.position_offset < 0:
        raise _fail(source, f"position_offset: must be >= 0, got {top.position_offset}")
    if top.sinusoidal_positions is not None and (top.sinusoidal_positions not in SINUSOID_STYLES
                                                 or top.learned_positions or top.dim % 2):
        raise _fail(source, f"sinusoidal_positions={top.sinusoidal_positions!r}: expected one of "
                            f"{list(SINUSOID_STYLES)} or null, without learned_positions, over an even dim "
                            f"(got learned_positions={top.learned_positions}, dim={top.dim})")
    if top.learned_positions and rt.max_seq > top.max_position:
        raise _fail(source, f"runtime.max_seq={rt.max_seq}: learned_positions has rows for max_position="
                            f"{top.max_position} positions only; expected runtime.max_seq <= {top.max_position}")
    for key in ("per_layer_dim", "per_layer_vocab"):
        if top[key] is not None and top[key] <= 0:
            raise _fail(source, f"{key}: must be a positive size (or null), got {top[key]}")
    if top.per_layer_dim is not None and top.per_layer_vocab is not None and top.per_layer_vocab < top.vocab_size:
        raise _fail(source, f"per_layer_vocab={top.per_layer_vocab}: the per-layer table needs a row for every "
                            f"token id, expected >= vocab_size={top.vocab_size}")
    for key in ("embed_scale", "logit_softcap"):
        if top[key] is not None and top[key] <= 0:
            raise _fail(source, f"{key}: must be positive (or null), got {top[key]}")
    norm = _validate_kind("norm", top.norm, "norm", source, model)
    rope = _validate_kind("rope", top.rope, "rope", source, model)
    residual = _validate_kind("residual", top.residual, "residual", source, model)
    if "rope" in top.ropes:
        raise _fail(source, "ropes.rope: the name 'rope' is the top-level `rope`; give the extra slot another name")
    ropes = {name: _validate_kind("rope", node, f"ropes.{name}", source, model) for name, node in top.ropes.items()}
    model_with = {**model, "norm": norm, "rope": rope, "rope_slots": ["rope", *ropes],
                  "mixer_names": list(top.mixers)}  # a summed mixer names its members
    mixers = {name: _validate_kind("mixer", node, f"mixers.{name}", source, model_with)
              for name, node in top.mixers.items()}
    ffns = {name: _validate_kind("ffn", node, f"ffns.{name}", source, model_with)
            for name, node in top.ffns.items()}

    kinds = _expand_layout(top.layout, top.n_layers, source)
    layers = []
    for i, (mixer_name, ffn_name) in enumerate(kinds):
        if mixer_name not in mixers:
            raise _fail(source, f"layout: layer {i} uses mixer {mixer_name!r}, "
                                f"not one of mixers {sorted(mixers)}")
        if ffn_name not in ffns:
            raise _fail(source, f"layout: layer {i} uses ffn {ffn_name!r}, not one of ffns {sorted(ffns)}")
        layers.append(LayerSpec(i, mixer_name, mixers[mixer_name], ffn_name, ffns[ffn_name]))
    kv_sources = _kv_sources(layers, top.kv_shared_layers, source)
    mtp = OmegaConf.to_object(top.mtp)
    mtp_layers = _mtp_layers(mtp, mixers, ffns, len(layers), source)

    OmegaConf.set_readonly(top, True)
    return ModelSpec(
        name=top.name, dim=top.dim, vocab_size=top.vocab_size, tie_embeddings=top.tie_embeddings,
        max_position=top.max_position, norm=norm, rope=rope, residual=residual, mixers=mixers,
        ffns=ffns, layers=tuple(layers), runtime=rt, checkpoint=OmegaConf.to_object(top.checkpoint),
        source=source, config=top, mtp=mtp, mtp_layers=mtp_layers, ropes=ropes,
        sublayer_norms=top.sublayer_norms, embed_scale=top.embed_scale, logits_scaling=top.logits_scaling,
        logit_softcap=top.logit_softcap, learned_positions=top.learned_positions,
        sinusoidal_positions=top.sinusoidal_positions,
        position_offset=top.position_offset, embed_norm=top.embed_norm, head_bias=top.head_bias,
        kv_sources=kv_sources, per_layer_dim=top.per_layer_dim,
        per_layer_vocab=top.per_layer_vocab if top.per_layer_vocab is not None else top.vocab_size,
        layer_scalar=top.layer_scalar,
    )


def _kv_sources(layers: list[LayerSpec], shared: int, source: str) -> dict[int, int]:
    """kv_shared_layers N -> {consumer i: producer j}: each of the last N layers reads the KV
    cache of the last layer before them (j < n - N) that uses the same mixer entry (Gemma 3n / 4:
    the last sliding and the last global layer before the shared ones)."""
    n = len(layers)
    if not 0 <= shared < max(n, 1):
        raise _fail(source, f"kv_shared_layers: expected 0..{n - 1} (n_layers={n}; at least one layer "
                            f"computes its own keys and values), got {shared}")
    first = n - shared
    last_of = {layers[j].mixer_name: j for j in range(first)}
    out = {}
    for i in range(first, n):
        name = layers[i].mixer_name
        if name not in last_of:
            raise _fail(source, f"kv_shared_layers={shared}: layer {i} (mixer {name!r}) shares the KV cache of "
                                f"an earlier {name!r} layer, but layers 0..{first - 1} have none (their mixers: "
                                f"{sorted(last_of)})")
        out[i] = last_of[name]
    return out


def _mtp_layers(mtp: MTPSchema, mixers: dict, ffns: dict, first: int, source: str) -> tuple[LayerSpec, ...]:
    if mtp.n_layers < 0:
        raise _fail(source, f"mtp.n_layers: must be >= 0, got {mtp.n_layers}")
    if mtp.n_layers == 0:
        return ()
    if mtp.mixer not in mixers:
        raise _fail(source, f"mtp.mixer: {mtp.mixer!r} is not one of mixers {sorted(mixers)}")
    if mtp.ffn not in ffns:
        raise _fail(source, f"mtp.ffn: {mtp.ffn!r} is not one of ffns {sorted(ffns)}")
    return tuple(LayerSpec(first + k, mtp.mixer, mixers[mtp.mixer], mtp.ffn, ffns[mtp.ffn])
                 for k in range(mtp.n_layers))


def _expand_layout(layout: ListConfig, n_layers: int, source: str) -> list[tuple[str, str]]:
    """Runs -> one (mixer name, ffn name) per layer; checks the total against n_layers."""
    if not layout:
        raise _fail(source, "layout: empty; expected a list of runs like [{mixer: attn, ffn: mlp}]")
    fixed, fill_at = 0, None
    for i, run in enumerate(layout):
        has_kind = run.mixer is not None or run.ffn is not None
        if has_kind == (run.pattern is not None):
            raise _fail(source, f"layout[{i}]: give either mixer+ffn or a pattern, not both or neither")
        if has_kind and (run.mixer is None or run.ffn is None):
            raise _fail(source, f"layout[{i}]: both mixer and ffn are required, got mixer={run.mixer!r} "
                                f"ffn={run.ffn!r}")
        if run.repeat is None:
            if fill_at is not None:
                raise _fail(source, f"layout[{i}]: only one run may omit 'repeat' (layout[{fill_at}] does too)")
            fill_at = i
        else:
            if run.repeat < 0:
                raise _fail(source, f"layout[{i}].repeat: must be >= 0, got {run.repeat}")
            fixed += run.repeat * _run_width(run)
    if fill_at is not None:
        rest, width = n_layers - fixed, _run_width(layout[fill_at])
        if rest < 0 or rest % width:
            raise _fail(source, f"layout[{fill_at}]: cannot fill the {rest} layers left of n_layers="
                                f"{n_layers} with a pattern of {width}")
    kinds: list[tuple[str, str]] = []
    for i, run in enumerate(layout):
        pattern = [(run.mixer, run.ffn)] if run.pattern is None else [(k.mixer, k.ffn) for k in run.pattern]
        repeat = run.repeat if i != fill_at else (n_layers - fixed) // len(pattern)
        kinds.extend(pattern * repeat)
    if len(kinds) != n_layers:
        raise _fail(source, f"layout: runs add up to {len(kinds)} layers but n_layers={n_layers}")
    return kinds


def _run_width(run: Any) -> int:
    return 1 if run.pattern is None else len(run.pattern)
