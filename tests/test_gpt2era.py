"""The GPT-2-era families (LayerNorm, learned positions, non-gated MLPs, fused and Conv1D QKV,
ALiBi, multi-query, partial rotary of either pairing, parallel residuals, q/k norms) from
configuration alone: tiny random transformers checkpoints with odd sizes (their prefill / decode
parity, eager and compiled: tests/test_family_parity.py's gpt2era/* entries), exact parameter
counts of the flagship presets against transformers on the meta device, and what the import
refuses."""
from __future__ import annotations


import pytest
import torch

import zoo
from tests.helpers import auto_reference, check_flagship_count, check_import_refused

transformers = pytest.importorskip("transformers")

VOCAB = 301
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name: (transformers config class prefix, the tiny config.json values); odd sizes throughout
FAMILIES = {
    "gpt2": ("GPT2", dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=3, n_head=4, n_inner=100)),
    # rotary on 3/8 of each 16-wide head, parallel attention + MLP with a norm each
    "gpt_neox": ("GPTNeoX", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=100, max_position_embeddings=64,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.375})),
    "gpt_neox/sequential": ("GPTNeoX", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=100, max_position_embeddings=64,
                                            use_parallel_residual=False, hidden_act="relu", attention_bias=False)),
    # rotary on 6 of 16 channels per head in interleaved pairs; one shared norm, parallel
    "gptj": ("GPTJ", dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=3, n_head=4, rotary_dim=6,
                          n_inner=100)),
    # positions two rows down the learned table, ReLU MLP
    "opt": ("OPT", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, ffn_dim=100,
                        max_position_embeddings=64, word_embed_proj_dim=48)),
    # one shared norm, parallel; rotary on 10 of 16 channels (rotate-half); GQA; per-head q/k LayerNorm
    "phi": ("Phi", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64, qk_layernorm=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.625})),
    # LayerNorm + biases everywhere, GQA, a sliding window shorter than the prompts
    "starcoder2": ("Starcoder2", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64,
                                      sliding_window=7)),
    # multi-query attention (one key/value head), GPT-2's blocks; and its multi-head variant
    "gpt_bigcode": ("GPTBigCode", dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                       n_inner=100)),
    "gpt_bigcode/mha": ("GPTBigCode", dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                                           n_inner=100, multi_query=False, activation_function="gelu")),
    # ALiBi over 6 heads (not a power of two: the second slope series), a norm after the embedding
    "bloom": ("Bloom", dict(vocab_size=VOCAB, hidden_size=48, n_layer=3, n_head=6)),
    # Falcon-7B's block: multi-query, one shared norm, parallel, no biases
    "falcon": ("Falcon", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              max_position_embeddings=64)),
    # the new architecture: 6 query heads over 2 kv heads, a norm each, biases
    "falcon/new": ("Falcon", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                  num_kv_heads=2, new_decoder_architecture=True, bias=True, ffn_hidden_size=100,
                                  max_position_embeddings=64)),
    # the old multi-head layout, sequential block
    "falcon/sequential": ("Falcon", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                         multi_query=False, parallel_attn=False, max_position_embeddings=64)),
    # squared ReLU, per-head q/k LayerNorm before a rotary over 6 of 16 channels
    "persimmon": ("Persimmon", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                    intermediate_size=100, max_position_embeddings=64,
                                    rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                     "partial_rotary_factor": 0.375})),
    # non-parametric LayerNorm, SwiGLU, q/k/v clamped (OLMo 1.7's clip_qkv, low enough to bind)
    "olmo": ("Olmo", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                          intermediate_size=100, max_position_embeddings=64, clip_qkv=0.2)),
    # LayerNorm + SwiGLU, rotary on a quarter of 16 channels, q/k/v biases; and its parallel variant
    "stablelm": ("StableLm", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64,
                                  use_qkv_bias=True)),
    "stablelm/parallel": ("StableLm", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, intermediate_size=100,
                                           max_position_embeddings=64, use_parallel_residual=True)),
    # bias-free LayerNorm shared by the parallel block, interleaved rotary, scaled logits
    "cohere": ("Cohere", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64,
                              logit_scale=0.3)),
    # GPT-J's block with the fused qkv_proj of 4 training shards, each [q | v | k]
    "codegen": ("CodeGen", dict(vocab_size=VOCAB, n_positions=64, n_ctx=64, n_embd=64, n_layer=3, n_head=4,
                                rotary_dim=6, n_inner=100)),
}


def make_config(family: str, **kw):
    prefix, values = FAMILIES[family]
    return getattr(transformers, f"{prefix}Config")(**{**values, **NO_TOKENS, **kw})


def reference(family: str, seed: int = 0):
    return auto_reference(make_config(family), seed)


# Flagship config.json values (the published configs of the checkpoints each preset names)
FLAGSHIPS = {
    "gpt2": ("GPT2", dict()),  # GPT2Config's defaults are openai-community/gpt2's
    "gpt_neox_20b": ("GPTNeoX", dict()),  # GPTNeoXConfig's defaults are EleutherAI/gpt-neox-20b's
    "gptj_6b": ("GPTJ", dict()),  # GPTJConfig's defaults are EleutherAI/gpt-j-6b's
    "phi2": ("Phi", dict(vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                         num_attention_heads=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.4})),
    "starcoder2_3b": ("Starcoder2", dict(sliding_window=4096, max_position_embeddings=16384,
                                         rope_parameters={"rope_type": "default", "rope_theta": 999999.4420358813})),
    "gpt_bigcode_santacoder": ("GPTBigCode", dict(vocab_size=49280, n_positions=2048, n_embd=2048, n_layer=24,
                                                  n_head=16, n_inner=8192)),
    "bloom_7b1": ("Bloom", dict(vocab_size=250880, hidden_size=4096, n_layer=30, n_head=32)),
    "falcon_7b": ("Falcon", dict()),  # FalconConfig's defaults are tiiuae/falcon-7b's
    "persimmon_8b": ("Persimmon", dict(rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                         "partial_rotary_factor": 0.5})),
    "olmo_7b": ("Olmo", dict()),  # OlmoConfig's defaults are allenai/OLMo-7B-hf's
    "stablelm_3b": ("StableLm", dict()),  # StableLmConfig's defaults are stabilityai/stablelm-3b-4e1t's
    "command_r": ("Cohere", dict(max_position_embeddings=131072,
                                 rope_parameters={"rope_type": "default", "rope_theta": 8000000.0})),
    "codegen_6b": ("CodeGen", dict(n_layer=33, vocab_size=51200, rotary_dim=64)),  # Salesforce/codegen-6B-mono
    "opt_6_7b": ("OPT", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                             word_embed_proj_dim=4096)),
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' for the published config (meta
    device), and importing that config gives the preset's layers (helpers.check_flagship_count)."""
    prefix, values = FLAGSHIPS[preset]
    check_flagship_count(preset, getattr(transformers, f"{prefix}Config")(**values))


@pytest.mark.parametrize("family, change, words", [
    ("falcon", {"alibi": True}, ["alibi=True", "conf/hf/falcon.yaml"]),
    ("opt", {"do_layer_norm_before": False}, ["do_layer_norm_before=False", "conf/hf/opt.yaml"]),
    ("opt", {"word_embed_proj_dim": 32}, ["word_embed_proj_dim=32", "OPT-350m", "conf/hf/opt.yaml"]),
    ("stablelm", {"qk_layernorm": True}, ["qk_layernorm=True", "conf/hf/stablelm.yaml"]),
    ("cohere", {"use_qk_norm": True}, ["use_qk_norm=True", "conf/hf/cohere.yaml"]),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx=True", "conf/hf/gpt2.yaml"]),
    ("gpt2", {"activation_function": "quick_gelu"}, ["quick_gelu", "conf/hf/gpt2.yaml"]),
])
def test_what_cannot_be_expressed_is_refused(family, change, words):
    check_import_refused({**make_config(family).to_dict(), **change}, words)


@pytest.mark.parametrize("override, words", [
    ("mixers.attn.alibi=true", ["alibi=true takes no rotary", "rotary_fraction=0.25"]),
    ("mixers.attn.qk_norm_at=middle", ["qk_norm_at='middle'", "before_rope", "after_rope"]),
    ("mixers.attn.clip_qkv=0", ["clip_qkv must be positive"]),
    ("ffns.mlp.activation=swish", ["activation='swish'", "relu2"]),
    ("norm.affine=false", ["bias=true needs affine=true"]),
    ("residual.parallel=both", ["parallel='both'", "shared_norm", "two_norms"]),
    ("runtime.max_seq=4096", ["runtime.max_seq=4096", "max_position=1024"]),
    ("position_offset=-1", ["position_offset: must be >= 0"]),
])
def test_bad_options_are_refused(override, words):
    """Each new option's bad value is a ConfigError naming the key, the value and what was expected."""
    base = "gpt2" if not override.startswith("mixers.attn.alibi") else "gptj_6b"
    with pytest.raises(zoo.ConfigError) as e:
        zoo.build(base, dry=True, overrides=[override])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_qk_norm_after_rope_is_not_before():
    """q/k norm after RoPE: the same weights give other logits than before it (a per-head norm
    over the rotated channels), and both positions build and run."""
    ids = torch.randint(0, 256, (1, 7))
    out = {}
    for at in ("before_rope", "after_rope"):
        m = zoo.build("gptj_6b_tiny", compile=False, overrides=["mixers.attn.qk_norm=true",
                                                                 f"mixers.attn.qk_norm_at={at}"])
        torch.manual_seed(0)
        for p in m.module.parameters():
            p.data.normal_(0.0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
        out[at] = m.prefill(ids)
    assert not torch.allclose(out["before_rope"], out["after_rope"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["bloom", "gpt2", "persimmon"])
def test_attention_probe_matches_transformers(families, family):
    """`zoo patterns`' probe (contracts.AttentionProbe) of the new options, ALiBi, learned positions
    (added in the first block) and q/k LayerNorm before a partial rotary, against transformers'
    eager attention weights."""
    from tests.test_patterns import assert_maps_close, eager_attentions
    from zoo.compiler.patterns import attention_maps

    ref, path = families.reference(f"gpt2era/{family}")
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    ids = torch.randint(0, VOCAB, (2, 23))
    assert_maps_close(attention_maps(m.engine, ids), eager_attentions(ref, ids))
