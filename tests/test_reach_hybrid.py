"""Hybrid families whose layers hold more than one mixer (Falcon-H1: attention and Mamba2 side by
side, summed) from configuration alone: tiny random transformers checkpoints with odd sizes (their
prefill / decode parity, eager, plus one compiled sample per new concept: tests/test_family_parity.py's
reach_hybrid/* entries), the flagship preset's exact parameter count against transformers on the
meta device, and what the import, `zoo patterns` and tensor parallelism do with a summed mixer."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import auto_reference, check_flagship_count, check_import_refused
from tests.test_reach_ssm import randomize

transformers = pytest.importorskip("transformers")

VOCAB = 301
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Falcon-H1's µP multipliers, every one off 1 (a missing or misplaced one shows)
FALCON_H1_MUP = dict(embedding_multiplier=1.5, lm_head_multiplier=0.6, key_multiplier=0.8,
                     attention_in_multiplier=0.7, attention_out_multiplier=1.2, ssm_in_multiplier=1.1,
                     ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], mlp_multipliers=[0.8, 1.2])
FALCON_H1 = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64, mamba_n_heads=6,
                 mamba_d_head=16, mamba_d_ssm=96, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=5,
                 **FALCON_H1_MUP)

# name: (transformers config class prefix, the tiny config.json values); odd sizes throughout
FAMILIES = {
    # attention + Mamba2 (6 heads of 16, 2 groups, chunks of 5, no output norm) summed on every layer
    "falcon_h1": ("FalconH1", FALCON_H1),
    # the same with the Mamba2 output norm (grouped, after the gate) and every bias
    "falcon_h1/norm_bias": ("FalconH1", dict(FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                             mamba_proj_bias=True, projectors_bias=True, attention_bias=True,
                                             mlp_bias=True)),
}
COMPILED = {"falcon_h1": 1}  # one compiled sample: every layer the same summed mixer, one graph


def make_config(family: str, **kw):
    prefix, values = FAMILIES[family]
    return getattr(transformers, f"{prefix}Config")(**{**values, **NO_TOKENS, **kw})


def reference(family: str, seed: int = 0):
    return auto_reference(make_config(family), seed, randomize)


# Flagship config.json values (no published config is at hand: the config class's defaults, as
# the preset says)
FLAGSHIPS = {
    "falcon_h1": ("FalconH1", dict()),
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' (meta device), and importing that
    config gives the preset's layers (helpers.check_flagship_count)."""
    prefix, values = FLAGSHIPS[preset]
    check_flagship_count(preset, getattr(transformers, f"{prefix}Config")(**values))


@pytest.mark.parametrize("change, words", [
    ({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, ["mamba_norm_before_gate", "not built yet",
                                                                 "conf/hf/falcon_h1.yaml"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "conf/hf/falcon_h1.yaml"]),
])
def test_what_cannot_be_expressed_is_refused(change, words):
    check_import_refused({**make_config("falcon_h1").to_dict(), **change}, words)


def test_summed_mixer_members_are_checked():
    """A member that is not in `mixers`, or scales that do not match the members, is a ConfigError
    naming the key."""
    with pytest.raises(zoo.ConfigError, match=r"mixers.hybrid: members \['nope'\] are not in mixers"):
        zoo.build("falcon_h1_tiny", dry=True, overrides=["mixers.hybrid.members=[attn,nope]",
                                                        "mixers.hybrid.in_scales=null",
                                                        "mixers.hybrid.out_scales=null"])
    with pytest.raises(zoo.ConfigError, match=r"mixers.hybrid: in_scales=\[1.0\]: expected one per member"):
        zoo.build("falcon_h1_tiny", dry=True, overrides=["mixers.hybrid.in_scales=[1.0]"])


def test_patterns_reads_the_attention_member(capsys):
    """`zoo patterns` on summed layers: the attention member's maps are the layer's (scores per
    head); the text report runs through."""
    import json

    from zoo.cli import main as zoo_main

    assert zoo_main(["patterns", "conf=falcon_h1_tiny", "repeat=8", "output=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kinds"] == ["summed"] * 3
    for row in out["induction"]:
        assert row is not None and len(row) == 4  # the 4 query heads of the attention member


@pytest.mark.parametrize("conf, kind", [("falcon_h1_tiny", "summed"), ("mamba_2_8b_tiny", "mamba"),
                                        ("mamba_codestral_7b_tiny", "mamba2"), ("lfm2_1_2b_tiny", "short_conv")])
def test_tensor_parallelism_is_refused_naming_the_kind_and_layer(conf, kind):
    """The summed mixer and the state-space kinds declare no sharding plan
    (contracts.no_sharding_plan): tp=2 is a ConfigError naming the mixer entry, the first layer
    that has it and the kind."""
    from tests.test_parallel import _mesh, _meta
    from zoo.compiler.parallel.plan import shard_model

    model = _meta(conf)
    first = next(layer for layer in model.spec.layers if layer.mixer.kind == kind)
    with pytest.raises(zoo.ConfigError, match=rf"mixers\.{first.mixer_name} \(layers\.{first.index}\): "
                                               rf"kind '{kind}' declares no sharding plan"):
        shard_model(model, _mesh(2, 0, 2, 1))


def test_extend_from_the_cached_state(families):
    """The summed mixer's extend (each member's own, on its own cache fields): a prompt prefilled
    in chunks, 1-token chunks included, == one prefill and the decode steps after; rolled back with
    save_state / restore_state == never extended (tests/test_extend.py's checks, on the twin)."""
    from tests import test_extend

    test_extend.test_chunked_prefill_equals_whole(families, "reach_hybrid/falcon_h1")
    test_extend.test_rollback_equals_never_extended(families, "reach_hybrid/falcon_h1")


def test_summed_extend_is_parallel_when_every_member_is():
    """contracts.extends_by_decode sees through the summed mixer: attention and Mamba2 both extend
    over the chunk at once, so the compiled runner compiles its extend (no per-length loop)."""
    from zoo.compiler.contracts import extends_by_decode

    mixer = zoo.build("falcon_h1_tiny", dry=True).module.layers[0].mixer
    assert mixer.kind == "summed" and not extends_by_decode(mixer)
    assert not any(extends_by_decode(m) for m in mixer.members())
