"""Every registered kind meets its slot's written contract (zoo/compiler/contracts/), is built by
a shipped config, and answers the hooks the engine and the analysis call; a kind that lacks a hook
is refused when it registers, naming the hook; an optional hook declared wrongly is refused too.
The contracts package stands at the bottom: it imports nothing else of zoo's."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from zoo.compiler import contracts
from zoo.compiler.config import available_configs, load_config
from zoo.compiler.contracts import CacheField
from zoo.compiler.errors import ContractError
from zoo.compiler.model import build_model
from zoo.compiler.position.rope import make_rope
from zoo.compiler.registry import SLOTS, register, registered
from zoo.compiler.residual.prenorm import residual_kind


# "linear" rope (position interpolation) and "longrope" (its factors are per checkpoint) are reached
# from config.json imports only
REACHED_BY_IMPORT_ONLY = {"rope": {"linear", "longrope"}}


@pytest.fixture(scope="module")
def built() -> dict:
    """slot -> kind -> (one built module or spec, its model) from the shipped configs (meta device):
    tiny twins first, until every registered kind has one (CI time: composing and building every
    preset took a minute)."""
    out: dict = {slot: {} for slot in SLOTS}
    wanted = {slot: set(registered(slot)) - REACHED_BY_IMPORT_ONLY.get(slot, set()) for slot in SLOTS}
    for name in sorted(available_configs(), key=lambda n: not n.endswith("_tiny")):
        if all(wanted[slot] <= set(out[slot]) for slot in SLOTS):
            break
        spec = load_config(name)
        model = build_model(spec, mtp=spec.checkpoint.mtp)
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
        assert contracts.contract_problems(slot, cls, kind) == [], kind
        assert issubclass(cls, contracts.CONTRACTS[slot]) and cls.kind == kind


@pytest.mark.parametrize("slot", SLOTS)
def test_every_kind_is_built_by_a_shipped_config(built, slot):
    assert set(registered(slot)) - REACHED_BY_IMPORT_ONLY.get(slot, set()) <= set(built[slot])


def test_mixer_hooks(built):
    for kind, (mixer, model) in built["mixer"].items():
        assert isinstance(mixer, contracts.Mixer), kind
        assert mixer.rope_slot in model.rope_impls, kind
        assert all(r > 0 and r % 2 == 0 for r in mixer.rope_dims()), kind
        fields = mixer.cache_fields(2, 64, torch.bfloat16)
        absent = getattr(mixer, "absent", False)  # the mixer kind `none` (an FFN-only layer) caches nothing
        assert (absent and fields == {}) or (not absent and fields), kind
        assert all(isinstance(f, CacheField) and f.shape[0] == 2 for f in fields.values()), kind
        flops = np.asarray(mixer.attention_flops(np.array([1, 64, 4096])))
        assert flops.shape == (3,) and (flops >= 0).all() and np.all(np.diff(flops) >= 0), kind
        assert np.asarray(mixer.prefill_attention_flops(np.array([1, 64]))).shape == (2,), kind
        assert mixer.decode_cache_bytes(64, torch.bfloat16) > 0 or absent, kind
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
            class Spec(contracts.KindSpec):
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


def test_a_spec_outside_the_contract_is_refused():
    with pytest.raises(ContractError, match=r"norm kind 'bare_spec' .* its Spec does not subclass "
                                            r"zoo.compiler.contracts.KindSpec"):
        @register("norm", "bare_spec")
        class BareSpec(contracts.Norm):
            @dataclass
            class Spec:
                kind: str = "bare_spec"

            def forward(self, x):
                return x

            def init_weights(self, generator=None):
                pass
    assert "bare_spec" not in registered("norm")


def test_contracts_import_nothing_else_of_zoo():
    """Every module of compiler/contracts/ imports only torch, the standard library, its own
    package, and compiler/errors.py / glossary.py (which import nothing)."""
    folder = Path(contracts.__file__).parent
    allowed_up = {"errors", "glossary"}
    modules = sorted(folder.glob("*.py"))
    assert {m.stem for m in modules} >= {"__init__", "slots", "cache", "parallel", "weights", "hooks", "context"}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in ("zoo", "compiler"), f"{path.name}: import {alias.name}"
            elif isinstance(node, ast.ImportFrom):
                where = f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''}"
                if node.level == 0:
                    assert node.module.split(".")[0] not in ("zoo", "compiler"), where
                elif node.level == 2:
                    assert node.module in allowed_up, where
                else:
                    assert node.level == 1, where


def test_an_optional_hook_claimed_without_its_method_is_refused():
    from zoo.compiler.contracts import Source

    with pytest.raises(ContractError, match=r"HalfSource sets reads_blocks = True but does not define read_blocks\(\)"):
        class HalfSource(Source):
            reads_blocks = True
    with pytest.raises(ContractError, match=r"BadStacks.quant_stacks = 'w13': expected a tuple"):
        class BadStacks(torch.nn.Module, contracts.QuantStacks):
            quant_stacks = "w13"
    with pytest.raises(ContractError, match=r"BadFloat.float_linears = \['wkv_b'\]: expected a dict"):
        class BadFloat(torch.nn.Module, contracts.FloatLinears):
            float_linears = ["wkv_b"]


def test_a_weight_sink_without_load_weight_cannot_be_built():
    class NoLoad(torch.nn.Module, contracts.WeightSink):
        def accepts_blocks(self, ggml_type):
            return False

    with pytest.raises(TypeError, match="load_weight"):
        NoLoad()


def test_hooks_that_name_missing_children_are_refused_when_quantizing():
    """quant_stacks / float_linears name children the module must have: a wrong name is refused
    with the module, the name and what was expected, not skipped."""
    from zoo.compiler.quant.apply import quantize_linears

    spec = load_config("deepseek_v3_tiny")
    model = build_model(spec, mtp=False)
    moe = next(b.ffn for b in model.layers if isinstance(b.ffn, contracts.QuantStacks))
    moe.quant_stacks = ("w13", "w_missing")
    with pytest.raises(ContractError, match=r"MoE.quant_stacks names 'w_missing', which is no parameter of "
                                            r"layers\.\d+\.ffn \(expected a stacked \[E, O, I\] parameter"):
        quantize_linears(model, "int8", 32, torch.float32)
    model = build_model(spec, mtp=False)
    mla = next(b.mixer for b in model.layers if isinstance(b.mixer, contracts.FloatLinears))
    mla.float_linears = {"wkv_missing": "a test"}
    with pytest.raises(ContractError, match=r"float_linears names 'wkv_missing', which is no nn.Linear child of "
                                            r"layers\.0\.mixer"):
        quantize_linears(model, "int8", 32, torch.float32)
