"""Architecture analysis from a ModelSpec alone (meta device, no weights): parameters, active
parameters, cache growth, FLOPs per token, decode arithmetic intensity, memory plans.

Conventions (stated in every report):
  params_total   every parameter of the main model, tied weights once. The multi-token-prediction
                 layers (a speculative-decoding extra the checkpoint ships) are reported apart, as
                 `params_mtp`, and left out of every other figure.
  params_active  parameters one token touches: every layer's mixer, norms, residual weights, the
                 top_k routed + shared experts and the router of MoE layers, the final norm and
                 the output head; NOT the input embedding table (a lookup reads one row). A tied
                 head counts once, as the head.
  FLOPs          2 per multiply-accumulate of contractions (matmuls, convolutions, dot products,
                 weighted sums); elementwise maps, norms, softmax, activations and gates are not
                 counted. Per token: 2 x active matmul parameters (>= 2-D weights, head included)
                 + each module's `token_flops()` (contractions its parameters do not show: mHC's
                 stream mixing) + each mixer's context-dependent work at the context it sees.
                 Decode at context T: `attention_flops(T)`. Prefill of length T: the mean over the
                 prompt's positions t = 1..T of `prefill_attention_flops(t)` (the algorithm the
                 prefill entry point runs, e.g. MLA's expanded form; default `attention_flops`).
  cache          bytes per token: cache fields that grow with context, at the cache dtype (fields
                 a module keeps in float32, such as recurrent states, stay float32);
                 state per sequence: fields that stay constant (recurrent / conv / window state).
  decode step    bytes moved at batch B: every weight but the embedding table (one row per token),
                 MoE experts only as many as B tokens are expected to hit (uniform routing), plus
                 each sequence's cache reads at context T (`decode_cache_bytes`: DSA reads every
                 indexer key but only top-k latents).

The hooks these figures read are the contracts' (compiler/contracts/): every mixer's `attention_flops`,
`prefill_attention_flops` and `decode_cache_bytes`, every FFN's `routed_parameters` and
`decode_weight_fraction`, and the module protocols `RefinesActiveParameters` (MoE, hash tables)
and `ExtraTokenFlops` (mHC, compressors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from .contracts import ExtraTokenFlops, RefinesActiveParameters
from . import build as stages
from .config import conf_dir
from .engine.cache import plan_caches
from .model import Decoder, build_model, count_parameters, parameter_bytes, torch_dtype
from .residual.prenorm import residual_kind
from .spec import ModelSpec

_BIG_SEQ = 1 << 20  # cache plans are exact per token at a length every compression ratio divides

ACTIVE_CONVENTION = ("excludes the input embedding table (a lookup) and the MTP layers; includes the "
                     "output head, the final norm, top_k routed + shared experts and the router")
FLOPS_CONVENTION = ("2 per multiply-accumulate of contractions; 2 x active matmul parameters + attention "
                    "over the context (decode at T; prefill: mean over positions 1..T); elementwise ops "
                    "not counted")


def devices() -> dict[str, dict]:
    """Device profiles (conf/hardware/devices.yaml): peak dense FLOP/s, memory bandwidth, memory."""
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / "hardware" / "devices.yaml"))


def active_parameters(module: torch.nn.Module, matmul_only: bool = False, skip: frozenset = frozenset()) -> int:
    """Parameters one token touches below `module` (each tensor once; ids in `skip` excluded).
    matmul_only: only weights that are multiplied (>= 2-D), the ones that cost FLOPs."""
    seen: set[int] = set(skip)

    def walk(m: torch.nn.Module) -> int:
        if isinstance(m, RefinesActiveParameters):
            ps = list(m.parameters())
            if any(id(p) in seen for p in ps):
                raise ValueError(f"{type(m).__name__} shares parameters; cannot refine its active count")
            seen.update(id(p) for p in ps)
            return m.active_parameters(matmul_only=matmul_only)
        n = 0
        for p in m.parameters(recurse=False):
            if id(p) not in seen and (p.dim() >= 2 or not matmul_only):
                seen.add(id(p))
                n += p.numel()
        return n + sum(walk(c) for c in m.children())

    return walk(module)


def token_flops(module: torch.nn.Module) -> int:
    """Context-independent FLOPs per token below `module` that its parameters do not show."""
    return sum(m.token_flops() for m in module.modules() if isinstance(m, ExtraTokenFlops))


@dataclass
class KindSummary:
    name: str  # "mixer+ffn" (the names in `mixers` / `ffns`)
    mixer: str  # the mixer's kind, e.g. "mla"
    ffn: str  # the ffn's kind, e.g. "moe"
    layers: int
    params_per_layer: int
    active_per_layer: int
    cache_bytes_per_token: float
    state_bytes_per_sequence: int
    decode_flops_per_layer: int  # per token at the report's context
    prefill_flops_per_layer: int


def mtp_parameters(spec: ModelSpec) -> int:
    """Parameters of the spec's MTP layers (their own embedding/head copies included), 0 if none:
    the model built with them (stages.cast_stage(mtp=True)), their blocks counted."""
    if not spec.mtp_layers:
        return 0
    return count_parameters(stages.cast_stage(spec, torch.float32, mtp=True).module.mtp)


def analyze(spec: ModelSpec, context: int = 4096, batch: int = 1, cache_dtype: str = "bfloat16",
            weight_dtype: str = "bfloat16", device: str | None = None) -> dict[str, Any]:
    """Every figure of `zoo report` for one config, as plain data (see the module docstring)."""
    if context < 1 or batch < 1:
        raise ValueError(f"context={context} and batch={batch} must be >= 1")
    params_mtp = mtp_parameters(spec)
    # the stages of a dry build (compiler/build.py), without the MTP layers (reported apart)
    model: Decoder = stages.cast_stage(spec, torch_dtype(weight_dtype), mtp=False).module
    cdt, wsize = torch_dtype(cache_dtype), torch_dtype(weight_dtype).itemsize
    plan = stages.cache_stage(model, 1, _BIG_SEQ, cdt).plan

    counted = stages.count_stage(model)
    total = counted.params
    embed_params = model.embed.weight.numel()
    # the embedding table is a lookup; the head multiplies every token even when tied to it
    no_embed = frozenset({id(model.embed.weight)})
    head = model.head.weight.numel() if spec.tie_embeddings else 0
    active = active_parameters(model, skip=no_embed) + head
    matmul = active_parameters(model, matmul_only=True, skip=no_embed) + head
    extra = token_flops(model)

    kinds: dict[str, KindSummary] = {}
    fields: dict[str, dict] = {}
    decode_ctx, prefill_ctx = np.asarray(context), np.arange(1, context + 1)
    decode_attn = prefill_attn = 0.0
    layers_active = 0
    cache_read = 0
    for i, block in enumerate(model.layers):
        layer = spec.layers[i]
        name = f"{layer.mixer_name}+{layer.ffn_name}"
        d_attn = int(block.mixer.attention_flops(decode_ctx))
        p_attn = float(np.mean(block.mixer.prefill_attention_flops(prefill_ctx)))
        decode_attn += d_attn
        prefill_attn += p_attn
        block_active = active_parameters(block)
        layers_active += block_active
        cache_read += int(block.mixer.decode_cache_bytes(context, cdt))
        for field, f in plan.layers[i].items():
            row = fields.setdefault(f"{layer.mixer_name}.{field}", {
                "field": f"{layer.mixer_name}.{field}", "mixer": layer.mixer.kind, "layers": 0,
                "dtype": str(f.dtype).removeprefix("torch."), "bytes_per_token": 0.0,
                "state_bytes_per_sequence": 0})
            row["layers"] += 1
            if f.grows:
                row["bytes_per_token"] += f.nbytes / _BIG_SEQ
            else:
                row["state_bytes_per_sequence"] += f.nbytes
        if name not in kinds:
            grow = sum(f.nbytes for f in plan.layers[i].values() if f.grows) / _BIG_SEQ
            state = sum(f.nbytes for f in plan.layers[i].values() if not f.grows)
            dense = 2 * active_parameters(block, matmul_only=True) + token_flops(block)
            kinds[name] = KindSummary(name, layer.mixer.kind, layer.ffn.kind, 0, count_parameters(block),
                                      block_active, grow, state, int(dense + d_attn), int(round(dense + p_attn)))
        kinds[name].layers += 1
    for row in fields.values():
        row["bytes_per_token"] = int(round(row["bytes_per_token"]))
    decode_flops = 2 * matmul + extra + decode_attn
    prefill_flops = 2 * matmul + extra + prefill_attn

    cache_per_token = sum(k.cache_bytes_per_token * k.layers for k in kinds.values())
    state_per_seq = sum(k.state_bytes_per_sequence * k.layers for k in kinds.values())
    cache_at_context = sum(f.nbytes for layer in stages.cache_stage(model, 1, context, cdt).plan.layers
                           for f in layer.values() if f.grows)
    weight_bytes = counted.param_bytes

    out: dict[str, Any] = {
        "name": spec.name, "source": spec.source, "n_layers": spec.n_layers,
        "layout": [[kind, n] for kind, n in spec.layout_runs()],
        "params_total": total, "params_active": active,
        "params_active_convention": ACTIVE_CONVENTION,
        "params_active_layers": layers_active,  # the decoder blocks only: no embedding, head, final norm
        "params_embedding": embed_params,
        "params_head": model.head.weight.numel(),
        "params_mtp": params_mtp,
        "residual_streams": residual_kind(spec.residual).n_streams(spec.residual),
        "rope_slots": sorted({slot for slot, _ in model.rope_slots()}),  # the rope schedules the layers read
        "kinds": [k.__dict__ for k in kinds.values()],
        "cache_dtype": cache_dtype, "weight_dtype": weight_dtype,
        "cache_bytes_per_token": int(round(cache_per_token)),
        "state_bytes_per_sequence": state_per_seq,
        "cache_fields": list(fields.values()),
        "context": context, "batch": batch,
        "cache_bytes_at_context": cache_at_context,
        "weight_bytes": weight_bytes,
        "flops_convention": FLOPS_CONVENTION,
        "decode_flops_per_token": int(round(decode_flops)),
        "prefill_flops_per_token": int(round(prefill_flops)),
    }
    # decode step at batch B and context T: FLOPs vs bytes that must move
    step_flops = batch * decode_flops
    step_bytes = _decode_weight_bytes(model, batch, wsize) + batch * cache_read
    out["decode_cache_bytes_read_per_sequence"] = cache_read
    out["decode_bytes_per_step"] = int(step_bytes)
    out["decode_arithmetic_intensity"] = step_flops / step_bytes
    if device is not None:
        prof = devices().get(device)
        if prof is None:
            raise ValueError(f"unknown device {device!r}; known: {sorted(devices())}")
        ridge = prof["flops"][weight_dtype] / prof["bandwidth"]
        per_seq = cache_at_context + state_per_seq
        need = weight_bytes + batch * per_seq
        out["device"] = {"name": device, **prof, "ridge_point": ridge,
                         "decode_bound": "memory" if out["decode_arithmetic_intensity"] < ridge else "compute",
                         "decode_step_seconds_at_roofline": max(step_bytes / prof["bandwidth"],
                                                                step_flops / prof["flops"][weight_dtype]),
                         "memory_needed": need, "fits": need <= prof["memory"],
                         "max_batch_at_context": max(0, int((prof["memory"] - weight_bytes) // per_seq))
                         if per_seq else None}
    return out


def _decode_weight_bytes(model: Decoder, batch: int, size: int) -> float:
    """Weight bytes one decode step reads: all weights but the embedding table (one row per
    token; all of it when tied, as the head), and of each MoE's routed experts the share that
    `batch` tokens are expected to hit (`decode_weight_fraction`)."""
    total = float(parameter_bytes(model))
    if not model.spec.tie_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    total += batch * model.embed.weight.shape[1] * size
    for block in model.layers:
        total -= block.ffn.routed_parameters() * size * (1 - block.ffn.decode_weight_fraction(batch))
    return total


def cache_curve(spec: ModelSpec, contexts, cache_dtype: str = "bfloat16") -> list[int]:
    """Cache bytes (growing fields + constant state) of one sequence at each context length."""
    model = stages.cast_stage(spec, torch_dtype(cache_dtype), mtp=False).module
    return [stages.cache_stage(model, 1, int(t), torch_dtype(cache_dtype)).total_bytes for t in contexts]


# ---------------------------------------------------------------------------- parallel plans

QUANT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}  # bytes per weight at each storage width


def _rank_model(spec: ModelSpec, tp: int, ep: int, weight_dtype: str):
    """Rank 0's share of the model on meta under tp / ep (every rank holds the same shapes)."""
    from .parallel.mesh import Mesh
    from .parallel.plan import shard_model

    model = stages.cast_stage(spec, torch_dtype(weight_dtype), mtp=False).module
    size = max(tp, ep)
    report = shard_model(model, Mesh(size=size, rank=0, tp=tp, ep=ep, group_name="analysis",
                                     device=torch.device("meta")))
    return model, report


def parallel_plan(spec: ModelSpec, tp: int, ep: int, context: int = 4096, batch: int = 1,
                  cache_dtype: str = "bfloat16", weight_dtype: str = "bfloat16",
                  device: str | None = None) -> dict[str, Any]:
    """Per-rank weight, cache and state bytes under runtime.parallel tp / ep, what fits one device
    of `device` (the largest batch at `context`, the largest context at `batch`), and how many
    devices the model needs at bf16 / fp8 / int4 weights (with batch x context of cache)."""
    model, report = _rank_model(spec, tp, ep, weight_dtype)
    cdt = torch_dtype(cache_dtype)
    plan = plan_caches(model, 1, _BIG_SEQ, cdt)
    per_token = plan.bytes_per_token()
    state = plan.state_bytes_per_sequence()
    weights = parameter_bytes(model)
    out: dict[str, Any] = {"tp": tp, "ep": ep, "ranks": max(tp, ep), "head": report.head,
                           "params_per_rank": count_parameters(model), "weight_bytes_per_rank": weights,
                           "cache_bytes_per_token_per_rank": per_token, "state_bytes_per_sequence_per_rank": state,
                           "cache_bytes_per_rank_at_context": batch * (per_token * context + state)}
    if device is not None:
        prof = devices()[device]
        free = prof["memory"] - weights
        seq = per_token * context + state
        out["fits_per_rank"] = weights + batch * seq <= prof["memory"]
        out["max_batch_at_context"] = max(0, int(free // seq)) if free > 0 and seq else 0
        out["max_context_at_batch"] = max(0, int((free / batch - state) // per_token)) if free > 0 and per_token else 0
        out["devices_needed"] = devices_needed(spec, prof["memory"], context, batch, cache_dtype)
    return out


def devices_needed(spec: ModelSpec, memory: float, context: int, batch: int, cache_dtype: str = "bfloat16",
                   max_devices: int = 1024) -> dict[str, Any]:
    """The fewest devices (powers of two, tp = ep = N where the heads and experts divide) whose
    per-rank weights (every parameter at the width: norms and routers are a rounding error) plus
    batch x context of cache fit `memory`, for each width in QUANT_BYTES; None past max_devices
    or where no valid split fits."""
    from .errors import ConfigError

    cdt = torch_dtype(cache_dtype)
    found: dict[str, Any] = {w: None for w in QUANT_BYTES}
    n = 1
    while n <= max_devices and any(v is None for v in found.values()):
        try:
            if n == 1:
                model = build_model(spec, mtp=False)
            else:
                model, _ = _rank_model(spec, n, n, "bfloat16")
        except ConfigError:
            n *= 2
            continue
        params = count_parameters(model)
        plan = plan_caches(model, 1, _BIG_SEQ, cdt)
        cache = batch * (plan.bytes_per_token() * context + plan.state_bytes_per_sequence())
        for width, nbytes in QUANT_BYTES.items():
            if found[width] is None and params * nbytes + cache <= memory:
                found[width] = n
        n *= 2
    return found
