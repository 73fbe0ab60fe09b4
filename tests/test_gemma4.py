"""Gemma 4 (gemma4_text): what its parity entries (tests/test_family_parity.py, "gemma4/...")
do not show by themselves. The tiny twins: 7 layers (sliding, sliding, global, sliding x3,
global), a window of 5 (the prompts run past it), global head_dim 24 against the local 16, the
last 3 layers reading the KV cache of layers 3 (sliding) and 2 (global), per-layer inputs of
width 8, double-wide MLPs on the sharing layers, final logit soft-capping, layer scalars and norm
weights away from 1. Checked here: the cache plan shares the producer's tensors (no bytes of the
consumers' own), chunked prefill / rows at other positions / prefix export+import / speculative
rollback through the shared caches, the proportional rope against transformers', and the
import map's refusals."""
from __future__ import annotations

import pytest
import torch

from zoo.compiler.errors import ConfigError

transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
BASE = dict(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=24, layer_types=LAYER_TYPES, sliding_window=5,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=3,
            use_double_wide_mlp=True, final_logit_softcapping=30.0, tie_word_embeddings=True)
# variant -> config overrides: the E2B-like stack, and one without per-layer inputs, sharing or soft-cap
VARIANTS = {
    "shared": {},
    "plain": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                  final_logit_softcapping=None, tie_word_embeddings=False),
}


def tiny_config(**overrides):
    return transformers.Gemma4TextConfig(**{**BASE, **overrides})


@torch.no_grad()
def randomize(model) -> None:
    """Norm weights and the layer scalars (buffers, ones at init) away from 1."""
    from tests.family_harness import randomize_norms
    randomize_norms(model)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.uniform_(0.5, 1.5)


def test_cache_plan_shares_the_producers_fields(families):
    """Layers 4..6 read layers 3 (sliding) and 2 (global): their k/v are the producers' tensors,
    counted once; the producer of a sliding layer keeps one slot per position (no ring)."""
    e = families.eager("gemma4/shared").engine
    plan = e.plan
    assert e.model.spec.kv_sources == {4: 3, 5: 3, 6: 2}
    for consumer, producer in ((4, 3), (5, 3), (6, 2)):
        for name in ("k", "v"):
            assert plan.layers[consumer][name].alias_of == producer
            assert plan.layers[consumer][name].nbytes == 0
            assert e.caches[consumer][name] is e.caches[producer][name]
    assert plan.layers[3]["k"].shape[2] == e.max_seq and plan.layers[3]["k"].grows  # a window, no ring
    assert plan.layers[0]["k"].shape[2] == 5 and not plan.layers[0]["k"].grows  # an unshared sliding layer
    own = sum(f.nbytes for i in range(4) for f in plan.layers[i].values())
    assert plan.total_bytes() == own
    # the consumers compute no keys or values: q rows only, and no k norm
    assert e.model.layers[4].mixer.wqkv.out_features == 4 * 16
    assert not hasattr(e.model.layers[4].mixer, "k_norm")


def test_chunked_prefill_rows_and_prefix_through_shared_caches(families):
    """Chunks (1-token ones too), rows extended out of order from other positions (the engine's
    gathered row copies keep a shared field one tensor), and a row exported and imported elsewhere:
    each equals one whole prefill."""
    from tests.test_extend import close, sequence, whole
    model, rtol = families.eager("gemma4/shared"), 1e-4
    e = model.engine
    seq = sequence(model, 2, 30, 0)
    want = whole(model, seq)
    for split in ([11, 9, 6], [1, 1, 1, 4, 19], [5, 1, 20]):
        e.reset()
        for r in range(2):
            e.prefill_row(r, seq[r, :split[0]])
        at = split[0]
        for c in split[1:]:
            close(e.extend_rows([0, 1], seq[:, at:at + c]), want[:, at:at + c], rtol, f"{split}: chunk at {at}")
            at += c
    e.reset()
    held = [7, 15]
    for r in (0, 1):
        e.prefill_row(r, seq[r, :held[r]])
    got = e.extend_rows([1, 0], torch.stack([seq[1, 15:21], seq[0, 7:13]]))
    close(got[0], want[1, 15:21], rtol, "row 1 from 15")
    close(got[1], want[0, 7:13], rtol, "row 0 from 7")
    snap = e.export_row(0)
    e.release_row(1)
    e.import_row(1, snap, 13)
    close(e.extend_rows([1], seq[:1, 13:20])[0], want[0, 13:20], rtol, "imported row")


def test_speculative_rollback_through_shared_caches(families):
    """save_state / extend a draft / restore_state: the kept tokens then give the logits of never
    having held the draft (the unshared sliding layers keep rings, so truncate_row is refused)."""
    from zoo.compiler.errors import InputError
    from tests.test_extend import close, sequence, whole
    model = families.eager("gemma4/shared")
    e = model.engine
    seq, draft = sequence(model, 2, 30, 2), sequence(model, 2, 7, 3)
    want = whole(model, seq)
    e.reset()
    for r in range(2):
        e.prefill_row(r, seq[r, :12])
    handle = e.save_state([0, 1])
    e.extend_rows([0, 1], draft)
    with pytest.raises(InputError, match=r"layers.0 \(gqa\): k, v"):
        e.truncate_row(0, 12)
    e.restore_state([0, 1], handle)
    close(e.extend_rows([0, 1], seq[:, 12:30]), want[:, 12:30], 1e-4, "after restore_state")


def test_greedy_generate_matches_transformers(families):
    """generate (prefill + decode loop), and with n-gram speculation, through the shared caches:
    transformers' greedy tokens."""
    ref, _ = families.reference("gemma4/shared")
    model = families.eager("gemma4/shared")
    ids = torch.tensor([[5, 17, 99, 3, 150, 41, 7, 8, 9]])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    model.engine.reset()
    assert model.generate(ids, max_new_tokens=12)[0, ids.shape[1]:].tolist() == want
    # speculative: drafts verified in one extend, rejected ones rolled back in the shared caches
    model.engine.reset()
    assert model.generate(ids, max_new_tokens=12, speculative="ngram", draft_tokens=3)[0, ids.shape[1]:].tolist() == want


def test_proportional_rope_matches_transformers():
    """The proportional schedule: theta ** (-2i / R) for the first fraction * R / 2 pairs, 0 after,
    divided by factor (transformers' _compute_proportional_rope_parameters)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from zoo.compiler.position.rope import make_rope
    from zoo.compiler.registry import lookup
    config = tiny_config(rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                             "partial_rotary_factor": 0.25, "factor": 2.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    spec = lookup("rope", "proportional", "test").Spec(theta=1e6, fraction=0.25, factor=2.0)
    got = make_rope(spec).inv_freq(24)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[3:] == 0).all() and (got[:3] > 0).all()


@pytest.mark.parametrize("change, match", [
    ({"attention_k_eq_v": True}, "attention_k_eq_v"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
     "enable_moe_block"),
    ({"per_layer_config": {"2": {"head_dim": 24}, "6": {"head_dim": 32}}}, "common"),
    ({"per_layer_config": {"2": {"head_dim": 24, "num_key_value_heads": 1}}}, "per-layer overrides"),
])
def test_import_refusals(change, match):
    """What the modules do not build is refused, naming the key: keys equal to values (the 31B /
    26B checkpoints), the MoE block, per-layer head sizes that differ between global layers."""
    from zoo.compiler.hf_import import import_config
    config = tiny_config().to_dict()
    config.pop("global_head_dim", None)
    config.update(change)
    with pytest.raises(ConfigError, match=match):
        import_config(config, "test config.json")


def test_kv_sharing_needs_a_producer_of_the_same_kind():
    """kv_shared_layers over layers whose mixer no earlier layer uses: a ConfigError naming it."""
    import zoo
    with pytest.raises(ConfigError, match=r"kv_shared_layers=2: layer 5 \(mixer 'global'\)"):
        zoo.build("gemma4_text_tiny", overrides=["kv_shared_layers=2", "n_layers=6",
                                                       "layout=[{pattern: [{mixer: local, ffn: mlp}], repeat: 5}, "
                                                       "{pattern: [{mixer: global, ffn: mlp}]}]"], dry=True)


def test_flagship_preset_counts_and_imports():
    """gemma4_text at the config class's defaults: transformers' parameters plus its layer scalars
    (buffers there, one parameter per layer here), and the imported config gives the preset's layers."""
    import zoo
    from zoo.compiler.hf_import import import_config
    from zoo.compiler.spec import validate
    config = transformers.Gemma4TextConfig()
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(config)
    want = sum(p.numel() for p in ref.parameters()) + sum(
        b.numel() for n, b in ref.named_buffers() if n.endswith("layer_scalar"))
    m = zoo.build("gemma4_text", dry=True)
    assert m.info.params == want
    imported = validate(import_config(config.to_dict(), "gemma4_text"), "gemma4_text")
    assert imported.layers == m.spec.layers and imported.dim == m.spec.dim
