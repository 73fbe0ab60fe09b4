"""Every registered kind meets its slot's written contract (zoo/compiler/contracts.py), is built by
a shipped config, and answers the hooks the engine and the analysis call; a kind that lacks a hook
is refused when it registers, naming the hook."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from zoo.compiler import contracts
from zoo.compiler.config import available_configs, load_config
from zoo.compiler.engine.cache import CacheField
from zoo.compiler.errors import ContractError
from zoo.compiler.model import build_model
from zoo.compiler.position.rope import make_rope
from zoo.compiler.registry import SLOTS, register, registered
from zoo.compiler.residual.prenorm import residual_kind


@pytest.fixture(scope="module")
def built() -> dict:
    """slot -> kind -> (one built module or spec, its model) from the shipped configs (meta device)."""
    out: dict = {slot: {} for slot in SLOTS}
    for name in available_configs():
        spec = load_config(name)
        model = build_model(spec)
        for i, layer in enumerate(spec.layers):
            block = model.layers[i]
            out["mixer"].setdefault(layer.mixer.kind, (block.mixer, model))
            out["ffn"].setdefault(layer.ffn.kind, (block.ffn, model))
        for module in model.modules():  # the model's norm kind, and norms inside kinds (DSA's LayerNorm)
            if isinstance(module, contracts.Norm):
                out["norm"].setdefault(module.kind, (module, model))
        for rope in (spec.rope, *spec.ropes.values()):
            out["rope"].setdefault(rope.kind, (make_rope(rope), model))
        out["residual"].setdefault(spec.residual.kind, (spec.residual, model))
    return out


@pytest.mark.parametrize("slot", SLOTS)
def test_every_kind_meets_its_contract(slot):
    kinds = registered(slot)
    assert kinds
    for kind, cls in kinds.items():
        assert contracts.contract_problems(slot, cls) == [], kind
        assert issubclass(cls, contracts.CONTRACTS[slot]) and cls.kind == kind


@pytest.mark.parametrize("slot", SLOTS)
def test_every_kind_is_built_by_a_shipped_config(built, slot):
    # "linear" rope (position interpolation) is reached from config.json imports only
    reached_by_import_only = {"rope": {"linear"}}.get(slot, set())
    assert set(registered(slot)) - reached_by_import_only <= set(built[slot])


def test_mixer_hooks(built):
    for kind, (mixer, model) in built["mixer"].items():
        assert isinstance(mixer, contracts.Mixer), kind
        assert mixer.rope_slot in model.rope_impls, kind
        assert all(r > 0 and r % 2 == 0 for r in mixer.rope_dims()), kind
        fields = mixer.cache_fields(2, 64, torch.bfloat16)
        assert fields and all(isinstance(f, CacheField) and f.shape[0] == 2 for f in fields.values()), kind
        flops = np.asarray(mixer.attention_flops(np.array([1, 64, 4096])))
        assert flops.shape == (3,) and (flops >= 0).all() and np.all(np.diff(flops) >= 0), kind
        assert np.asarray(mixer.prefill_attention_flops(np.array([1, 64]))).shape == (2,), kind
        assert mixer.decode_cache_bytes(64, torch.bfloat16) > 0, kind
        extra = mixer.decode_context(torch.device("meta"))  # the engine's fixed decode-context entries
        assert isinstance(extra, dict) and not set(extra) & {"ids", "pos", "rope"}, kind


def test_ffn_norm_rope_residual_hooks(built):
    for kind, (ffn, _) in built["ffn"].items():
        assert isinstance(ffn, contracts.FFN), kind
        assert 0 < ffn.decode_weight_fraction(1) <= ffn.decode_weight_fraction(64) <= 1.0, kind
        assert 0 <= ffn.routed_parameters() <= sum(p.numel() for p in ffn.parameters()), kind
    for kind, (norm, model) in built["norm"].items():
        assert isinstance(norm, contracts.Norm), kind
        width = norm.weight.shape[0]
        assert norm(torch.empty(2, 3, width, device="meta")).shape == (2, 3, width)
    for kind, (rope, _) in built["rope"].items():
        assert isinstance(rope, contracts.Rope), kind
        cos, sin = rope.table(8, 16, "cpu")
        assert cos.shape == sin.shape == (16, 4) and cos.dtype == torch.float32, kind
        assert rope.softmax_scale_factor() > 0, kind
    for kind, (spec, _) in built["residual"].items():
        assert residual_kind(spec).n_streams(spec) >= 1, kind


def test_a_kind_without_a_hook_is_refused():
    with pytest.raises(ContractError, match=r"mixer kind 'half_done' .* does not implement \['attention_flops'\]"):
        @register("mixer", "half_done")
        class HalfDone(contracts.Mixer):
            @dataclass
            class Spec:
                kind: str = "half_done"

            def rope_dims(self):
                return []

            def cache_fields(self, max_batch, max_seq, dtype):
                return {}

            def prefill(self, x, cache, ctx):
                return x

            def decode(self, x, cache, ctx):
                return x
    with pytest.raises(ContractError, match="is not a subclass of zoo.compiler.contracts.FFN"):
        @register("ffn", "not_an_ffn")
        class NotAnFFN(torch.nn.Module):
            @dataclass
            class Spec:
                kind: str = "not_an_ffn"
    assert "half_done" not in registered("mixer") and "not_an_ffn" not in registered("ffn")
