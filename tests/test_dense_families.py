"""Llama-shaped families from configuration alone: qwen2, qwen3 (q/k norms), smollm3 (NoPE
layers), granite (scalar multipliers), phi3 (fused checkpoint projections, partial rotary).
Tiny random checkpoints with odd sizes (CPU, float32) loaded through `zoo import`; exact parameter
counts of the flagship presets against transformers on the meta device. Their prefill / decode
parity, eager and compiled, and their load by Hub id: tests/test_family_parity.py."""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from tests.helpers import check_flagship_count

transformers = pytest.importorskip("transformers")

VOCAB = 301
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)

# name: (transformers model class name, config overrides); tests/test_family_parity.py's dense/* entries
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", dict(model_type="qwen2")),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=20, attention_bias=True)),
    # NoPE on an irregular set of layers (config.json's list, not the every-4th default)
    "smollm3": ("SmolLM3ForCausalLM", dict(num_hidden_layers=5, no_rope_layers=[1, 0, 1, 1, 0],
                                           tie_word_embeddings=True)),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=3.0, residual_multiplier=0.45,
                                           attention_multiplier=0.21, logits_scaling=2.5, attention_bias=True)),
    "phi3": ("Phi3ForCausalLM", dict(num_key_value_heads=4,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5})),
}
CONFIGS = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "smollm3": "SmolLM3Config",
           "granite": "GraniteConfig", "phi3": "Phi3Config"}


def make_config(family: str, **kw):
    overrides = {k: v for k, v in {**FAMILIES[family][1], **kw}.items() if k != "model_type"}
    return getattr(transformers, CONFIGS[family])(**{**BASE, **overrides})


@pytest.fixture(scope="module")
def references(families):
    """{family: (reference, checkpoint dir)}: tests/test_family_parity.py's dense/* entries (their
    prefill / decode parity, eager and compiled, runs there), shared for the session."""
    return families.group("dense", with_batch=False)


def test_structure(references):
    """What the import builds: NoPE layers where config.json says, Granite's scalars in place."""
    smol = zoo.from_pretrained(str(references["smollm3"][1]), compile=False, max_seq=16)
    assert [layer.mixer_name for layer in smol.spec.layers] == ["attn", "nope", "attn", "attn", "nope"]
    assert [layer.mixer.rope_dims() for layer in smol.module.layers] == [[12], [], [12], [12], []]
    granite = zoo.from_pretrained(str(references["granite"][1]), compile=False, max_seq=16)
    assert granite.module.embed.scale == 3.0 and granite.spec.logits_scaling == 2.5
    assert granite.module.layers[0].mixer.scale == pytest.approx(0.21)
    assert granite.spec.residual.scale == 0.45
    phi = zoo.from_pretrained(str(references["phi3"][1]), compile=False, max_seq=16)
    assert phi.module.layers[0].mixer.rot_dim == 6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zoo_import(references, family, tmp_path, monkeypatch, capsys):
    """`zoo import DIR name=X` writes a conf that builds the same model, bit for bit."""
    from zoo.cli import main

    _, path = references[family]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), f"name={family}_imported"]) == 0
    built = zoo.build(f"{family}_imported", weights=str(path), compile=False, max_seq=24)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=24)
    ids = torch.randint(0, VOCAB, (1, 11))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    torch.testing.assert_close(built.decode(torch.tensor([5])), direct.decode(torch.tensor([5])), rtol=0, atol=0)


# Flagship config.json values (published configs of the Hub checkpoints named by each preset)
FLAGSHIPS = {
    "qwen2_5_7b": ("Qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                                 tie_word_embeddings=False)),
    "qwen3_8b": ("Qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, tie_word_embeddings=False)),
    "smollm3_3b": ("SmolLM3", dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                                   num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                                   max_position_embeddings=65536, tie_word_embeddings=True)),
    "granite_3_8b": ("Granite", dict(vocab_size=49155, hidden_size=4096, intermediate_size=12800,
                                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                                     max_position_embeddings=131072, tie_word_embeddings=True,
                                     embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.0078125, logits_scaling=16.0)),
    "phi3_mini_4k": ("Phi3", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                  tie_word_embeddings=False, sliding_window=2047)),
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' for the published config (meta
    device), and importing that config gives the preset's layers (helpers.check_flagship_count)."""
    prefix, values = FLAGSHIPS[preset]
    check_flagship_count(preset, getattr(transformers, f"{prefix}Config")(**values))


@pytest.mark.parametrize("family, change, words", [
    # Phi-3's longrope and sliding_window import now: tests/test_published_configs.py
    ("phi3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     ["'dynamic'", "conf/hf/phi3.yaml"]),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     ["use_sliding_window=True", "conf/hf/qwen2.yaml"]),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     ["sliding_attention", "not yet supported", "conf/hf/qwen3.yaml"]),
    ("granite", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "conf/hf/granite.yaml"]),
    ("smollm3", {"no_rope_layers": [1, 1]}, ["no_rope_layers", "2", "5 layers"]),
])
def test_what_cannot_be_expressed_is_refused(references, family, change, words):
    from zoo.compiler.hf_import import import_config

    config = {**json.loads((references[family][1] / "config.json").read_text()), **change}
    with pytest.raises(zoo.ConfigError) as e:
        import_config(config, "config.json")
    assert all(w in str(e.value) for w in words), str(e.value)
