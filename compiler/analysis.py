"""Architecture analysis from a ModelSpec alone (meta device, no weights): parameters, active
parameters, cache growth, FLOPs per token, decode arithmetic intensity, memory plans.

Conventions (stated in every report):
  params_active  parameters a token touches: every layer's mixer, norms, residual weights, the
                 top_k routed experts + shared experts of MoE layers, and the output head; NOT the
                 input embedding table (a lookup reads one row).
  FLOPs          2 per multiply-accumulate. Per token: 2 x active matmul parameters (head
                 included) + each mixer's context-dependent work (`attention_flops(context)`:
                 scores and weighted sums over the cache, recurrent state updates, indexers).
                 Prefill of length T averages the context-dependent part over positions 1..T.
  cache          bytes per token: cache fields that grow with context, at the cache dtype;
                 state per sequence: fields that stay constant (recurrent / window / partial-block).

Modules may refine the defaults: `active_parameters()` (MoE: only the routed top_k) and
`attention_flops(context)` (mixers; context is an int or a numpy array of ints).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from .cache import plan_caches
from .config import conf_dir
from .model import Decoder, build_model, cast, count_parameters
from .spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BIG_SEQ = 1 << 20  # cache plans are exact per token at a length every compression ratio divides


def devices() -> dict[str, dict]:
    """Device profiles (conf/devices.yaml): peak dense FLOP/s, memory bandwidth, memory."""
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / "devices.yaml"))


def active_parameters(module: torch.nn.Module, matmul_only: bool = False, skip: frozenset = frozenset()) -> int:
    """Parameters one token touches below `module` (each tensor once; ids in `skip` excluded).
    matmul_only: only weights that are multiplied (>= 2-D), the ones that cost FLOPs."""
    seen: set[int] = set(skip)

    def walk(m: torch.nn.Module) -> int:
        fn = getattr(m, "active_parameters", None)
        if fn is not None:
            ps = list(m.parameters())
            if any(id(p) in seen for p in ps):
                raise ValueError(f"{type(m).__name__} shares parameters; cannot refine its active count")
            seen.update(id(p) for p in ps)
            return fn(matmul_only=matmul_only)
        n = 0
        for p in m.parameters(recurse=False):
            if id(p) not in seen and (p.dim() >= 2 or not matmul_only):
                seen.add(id(p))
                n += p.numel()
        return n + sum(walk(c) for c in m.children())

    return walk(module)


def _attention_flops(mixer, context):
    fn = getattr(mixer, "attention_flops", None)
    return fn(context) if fn is not None else 0 * np.asarray(context)


@dataclass
class KindSummary:
    name: str  # "mixer+ffn"
    layers: int
    params_per_layer: int
    active_per_layer: int
    cache_bytes_per_token: float
    state_bytes_per_sequence: int


def analyze(spec: ModelSpec, context: int = 4096, batch: int = 1, cache_dtype: str = "bfloat16",
            weight_dtype: str = "bfloat16", device: str | None = None) -> dict[str, Any]:
    """Every figure of `zoo report` for one config, as plain data."""
    model: Decoder = cast(build_model(spec), DTYPES[weight_dtype])
    cdt = DTYPES[cache_dtype]
    plan = plan_caches(model, 1, _BIG_SEQ, cdt)
    plan_at = plan_caches(model, 1, max(context, 1), cdt)

    def layer_cache(i: int) -> tuple[float, int]:
        fields = plan.layers[i].values()
        grow = sum(f.nbytes for f in fields if f.grows) / _BIG_SEQ
        return grow, sum(f.nbytes for f in fields if not f.grows)

    total = count_parameters(model)
    embed_params = model.embed.weight.numel()
    # the embedding table is a lookup; the head multiplies every token even when tied to it
    no_embed = frozenset({id(model.embed.weight)})
    head = model.head.weight.numel() if spec.tie_embeddings else 0
    active = active_parameters(model, skip=no_embed) + head

    kinds: dict[str, KindSummary] = {}
    decode_ctx = np.asarray(context)
    prefill_ctx = np.arange(1, context + 1)
    decode_attn = prefill_attn = 0.0
    for i, block in enumerate(model.layers):
        name = f"{spec.layers[i].mixer_name}+{spec.layers[i].ffn_name}"
        grow, state = layer_cache(i)
        if name not in kinds:
            kinds[name] = KindSummary(name, 0, count_parameters(block), _block_active(block), grow, state)
        kinds[name].layers += 1
        decode_attn += float(_attention_flops(block.mixer, decode_ctx))
        prefill_attn += float(np.mean(_attention_flops(block.mixer, prefill_ctx)))
    matmul = active_parameters(model, matmul_only=True, skip=no_embed) + head
    decode_flops = 2 * matmul + decode_attn
    prefill_flops = 2 * matmul + prefill_attn

    cache_per_token = sum(k.cache_bytes_per_token * k.layers for k in kinds.values())
    state_per_seq = sum(k.state_bytes_per_sequence * k.layers for k in kinds.values())
    cache_at_context = sum(f.nbytes for layer in plan_at.layers for f in layer.values() if f.grows)
    weight_bytes = sum(p.numel() * p.element_size() for p in _unique(model.parameters()))
    active_bytes = active * torch.empty((), dtype=DTYPES[weight_dtype]).element_size()

    out: dict[str, Any] = {
        "name": spec.name, "source": spec.source, "n_layers": spec.n_layers,
        "layout": [[kind, n] for kind, n in spec.layout_runs()],
        "params_total": total, "params_active": active,
        "params_active_convention": "excludes the input embedding table; includes the output head, "
                                    "top_k routed + shared experts",
        "params_embedding": embed_params,
        "residual_streams": getattr(spec.residual, "streams", 1),
        "kinds": [k.__dict__ for k in kinds.values()],
        "cache_dtype": cache_dtype, "weight_dtype": weight_dtype,
        "cache_bytes_per_token": int(round(cache_per_token)),
        "state_bytes_per_sequence": state_per_seq,
        "context": context, "batch": batch,
        "cache_bytes_at_context": cache_at_context,
        "weight_bytes": weight_bytes,
        "decode_flops_per_token": int(decode_flops),
        "prefill_flops_per_token": int(prefill_flops),
    }
    # decode step at batch B and context T: FLOPs vs bytes that must move
    step_flops = batch * decode_flops
    step_bytes = _decode_weight_bytes(model, batch, weight_dtype) + batch * (cache_at_context + state_per_seq)
    out["decode_bytes_per_step"] = int(step_bytes)
    out["decode_arithmetic_intensity"] = step_flops / step_bytes
    if device is not None:
        prof = devices().get(device)
        if prof is None:
            raise ValueError(f"unknown device {device!r}; known: {sorted(devices())}")
        ridge = prof["flops"][weight_dtype] / prof["bandwidth"]
        need = weight_bytes + batch * (cache_at_context + state_per_seq)
        out["device"] = {"name": device, **prof, "ridge_point": ridge,
                         "decode_bound": "memory" if out["decode_arithmetic_intensity"] < ridge else "compute",
                         "decode_step_seconds_at_roofline": max(step_bytes / prof["bandwidth"],
                                                                step_flops / prof["flops"][weight_dtype]),
                         "memory_needed": need, "fits": need <= prof["memory"]}
    return out


def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _block_active(block) -> int:
    return active_parameters(block)


def _decode_weight_bytes(model: Decoder, batch: int, weight_dtype: str) -> float:
    """Weight bytes one decode step reads: all dense weights, the head, one embedding row per
    token, and for MoE the experts that `batch` tokens are expected to hit."""
    size = torch.empty((), dtype=DTYPES[weight_dtype]).element_size()
    total = 0.0
    for p in _unique(model.parameters()):
        total += p.numel() * p.element_size()
    total -= model.embed.weight.numel() * size * (0 if model.spec.tie_embeddings else 1)
    total += batch * model.embed.weight.shape[1] * size
    for block in model.layers:
        fn = getattr(block.ffn, "decode_weight_fraction", None)
        if fn is not None:  # MoE: only the experts the batch routes to are read
            routed = getattr(block.ffn, "routed_parameters")()
            total -= routed * size * (1 - fn(batch))
    return total


def cache_curve(spec: ModelSpec, contexts, cache_dtype: str = "bfloat16") -> list[int]:
    """Cache bytes (growing fields + constant state) of one sequence at each context length."""
    model = build_model(spec)
    out = []
    for t in contexts:
        plan = plan_caches(model, 1, int(t), DTYPES[cache_dtype])
        out.append(plan.total_bytes())
    return out
