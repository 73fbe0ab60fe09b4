"""Qwen3.5 text (model_type qwen3_5_text): Qwen3-Next's Gated DeltaNet and gated attention in a
3:1 layout with a dense SwiGLU FFN, from the existing kinds through an import map and rules;
the flagship preset (Qwen3.5-27B's text model) and its exact size.

Parity with transformers' Qwen3_5ForCausalLM on a tiny random checkpoint it saved (CPU, float32),
for the prefill and every greedy decode step, eager and compiled, runs in
tests/test_family_parity.py (the qwen3_5 entry); here it is also loaded from a Hub id in a local
cache and through `zoo import`. Its rope_parameters carry
mrope_section / mrope_interleaved: for text (one position id on all three axes) this is the
plain partial rope, which the parity checks.
"""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from zoo.compiler.config import load_config
from zoo.compiler.errors import ConfigError
from zoo.compiler.hf_import import import_config
from zoo.compiler.model import build_model, count_parameters
from zoo.compiler.spec import validate
from tests.helpers import check_parity
from tests.test_kimi_linear import check_hub_and_import
# the same constant-initialised weights made random
from tests.test_qwen3_next import CHUNK, randomize  # noqa: F401

transformers = pytest.importorskip("transformers")

VOCAB = 256

# Qwen/Qwen3.5-27B's text_config (architecture keys)
REAL_CONFIG = {
    "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 17408, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
    "mlp_only_layers": [], "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4, "output_gate_type": "swish",
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    "eos_token_id": 248044, "pad_token_id": None, "bos_token_id": None,
}
FLAGSHIP = {k: REAL_CONFIG[k] for k in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "tie_word_embeddings")}


def tiny_config(**kw):
    """transformers' config of the tiny twin's shape (conf/qwen3_5_text_tiny.yaml)."""
    base = dict(vocab_size=VOCAB, hidden_size=56, intermediate_size=72, num_hidden_layers=8, num_attention_heads=6,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                max_position_embeddings=4096, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    base.update(kw)
    return transformers.Qwen3_5TextConfig(**base)


@pytest.fixture(scope="module")
def reference(families):
    """(reference, checkpoint dir): tests/test_family_parity.py's qwen3_5 entry (its prefill /
    decode parity, eager and compiled, runs there), shared for the session."""
    return families.reference("qwen3_5")


def test_flagship_exact_parameter_count():
    m = zoo.build("qwen3_5_text", dry=True)
    with torch.device("meta"):
        ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**FLAGSHIP))
    assert m.info.params == sum(p.numel() for p in ref.parameters()) == 26_895_998_464
    assert m.info.cache_bytes_per_token == 16 * 2 * 4 * 256 * 4  # 16 attention layers' K and V


def test_import_real_config_is_the_preset():
    imported = validate(import_config(REAL_CONFIG, "config.json"), "config.json")
    preset = load_config("qwen3_5_text")
    assert [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in imported.layers] == \
           [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in preset.layers]
    assert [x.mixer_name for x in preset.layers] == ["linear", "linear", "linear", "attn"] * 16
    assert (imported.norm, imported.rope, imported.dim, imported.vocab_size, imported.max_position) == \
           (preset.norm, preset.rope, preset.dim, preset.vocab_size, preset.max_position)
    assert imported.checkpoint.rules == preset.checkpoint.rules
    older = {k: v for k, v in REAL_CONFIG.items() if k != "layer_types"}  # full_attention_interval only
    assert validate(import_config(older, "config.json"), "config.json").layers == imported.layers


@pytest.mark.parametrize("change, match", [
    ({"attn_output_gate": False}, "attn_output_gate=False is not supported"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers=\\[3\\] is not supported"),
    ({"layer_types": ["sliding_attention"] * 64}, "unsupported layer kind.*sliding_attention"),
])
def test_unsupported_config_values(change, match):
    with pytest.raises(ConfigError, match=match):
        validate(import_config({**REAL_CONFIG, **change}, "config.json"), "config.json")


def test_imported_tiny_is_the_tiny_twin(reference):
    config = json.loads((reference[1] / "config.json").read_text())
    imported = validate(import_config(config, "tiny", CHUNK), "tiny")
    twin = load_config("qwen3_5_text_tiny")
    assert [(x.mixer, x.ffn) for x in imported.layers] == [(x.mixer, x.ffn) for x in twin.layers]
    assert count_parameters(build_model(imported, mtp=False)) == count_parameters(build_model(twin, mtp=False)) == \
        sum(p.numel() for p in reference[0].parameters())


def test_hub_id_and_zoo_import(reference, tmp_path, monkeypatch, capsys):
    ref, path = reference
    check_hub_and_import(ref, path, "zoo-test/tiny-qwen3-5", tmp_path, monkeypatch, capsys)


def test_image_text_checkpoint_names_load(reference, tmp_path):
    """Published Qwen3.5 checkpoints keep the text model under model.language_model.* beside a
    vision tower and an MTP head: the rename stage maps the first and skips the others."""
    from safetensors.torch import load_file, save_file

    ref, path = reference
    published = tmp_path / "published"
    published.mkdir()
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(path / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    (published / "config.json").write_text((path / "config.json").read_text())
    m = zoo.from_pretrained(str(published), compile=False, max_seq=32, overrides=CHUNK)
    assert {n for n, _ in m.info.load.ignored} == {"model.visual.patch_embed.proj.weight", "mtp.fc.weight"}
    check_parity(ref, m, torch.randint(0, VOCAB, (1, 9)), steps=1)
