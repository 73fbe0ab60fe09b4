"""Gemma 2, Gemma 3 (text), OLMo 2, gpt-oss and Mistral against transformers (CPU, float32).

Sliding-window layers with ring caches (prompts longer than the window, decode past it),
local/global alternation with a rope per layer kind (Gemma 3), attention- and final-logit
soft-capping (Gemma 2), learned sinks and a biased MoE with clamped SwiGLU (gpt-oss), sandwich
and post-only norms, q/k norm over the whole projection (OLMo 2), embedding scaling.

Each family: a tiny random transformers model with odd sizes, saved by save_pretrained; its
prefill and every greedy decode step at batch 2, eager and compiled (one graph per layer kind, no
recompiles across prompt lengths), decode == a full prefill run in tests/test_family_parity.py
(the attn/* entries), as does the load of each from a Hub id in an offline local cache. Here:
the flagship preset's exact parameter count against transformers on meta; its config.json
imports to the preset; `zoo import` round-trips each.
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
from tests.helpers import assert_logits_close

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, PROMPT, STEPS = 301, 6, 11, 8  # the prompt is longer than the window; decode goes past it
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)

# model_type: (transformers config class, tiny config kwargs, flagship preset, flagship config.json);
# the tiny ones are tests/test_family_parity.py's attn/* entries
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True),
               "gemma2_9b",
               dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-6)),
    "gemma3_text": ("Gemma3TextConfig",
                    dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 1000000.0}}),
                    "gemma3_12b",
                    # google/gemma-3-12b's text config in its older form: rope_theta + rope_scaling
                    # (global layers), rope_local_base_freq (local), sliding_window_pattern
                    dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
                         rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                         max_position_embeddings=131072, rms_norm_eps=1e-6)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=3, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
              "olmo2_7b",
              dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                   rms_norm_eps=1e-6, rope_theta=500000.0)),
    "gpt_oss": ("GptOssConfig",
                dict(num_hidden_layers=4, sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=40, max_position_embeddings=4096, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 64,
                                      "rope_theta": 150000.0}),
                "gpt_oss_20b",
                dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                     num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096,
                                      "rope_theta": 150000.0})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW, rms_norm_eps=1e-5),
                "mistral_7b",
                dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                     rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None)),
}


def hf_config(model_type: str, **kw):
    cls = getattr(transformers, FAMILIES[model_type][0])
    return cls(**{**COMMON, **FAMILIES[model_type][1], **kw})


@torch.no_grad()
def randomize(model) -> None:
    """Weights transformers initialises to constants made random, so that a misplaced one shows."""
    for name, p in model.named_parameters():
        if "norm" in name:
            # Gemma stores w - 1 (zero-centred: initialised to 0), the others w (initialised to 1)
            p.normal_(0.0, 0.3) if (p == 0).all() else p.uniform_(0.5, 1.5)
        elif name.endswith("sinks"):
            p.normal_(0.0, 1.0)
        elif name.endswith(("router.bias", "proj_bias")):
            p.normal_(0.0, 0.3)


@pytest.fixture(scope="module")
def references(families):
    """{model_type: (reference, checkpoint dir)}: tests/test_family_parity.py's attn/* entries
    (their prefill / decode parity, eager and compiled, runs there), shared for the session."""
    return families.group("attn", with_batch=False)


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- presets and imports


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_flagship_parameter_count(model_type):
    """The preset's exact parameter count equals transformers' model of the flagship config.json
    (built on meta), and that config.json imports to the preset's architecture."""
    cls_name, _, preset, flagship = FAMILIES[model_type]
    config = getattr(transformers, cls_name)(**flagship)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(config)
    assert zoo.build(preset, dry=True).info.params == sum(p.numel() for p in ref.parameters())
    imported = validate(import_config({**flagship, "model_type": model_type}, "config.json"), "config.json")
    spec = load_config(preset)
    for field in ("dim", "vocab_size", "tie_embeddings", "max_position", "norm", "rope", "ropes", "residual",
                  "layers", "sublayer_norms", "embed_scale", "logit_softcap"):
        assert getattr(imported, field) == getattr(spec, field), field


def test_layer_kinds_and_ropes():
    """Gemma 3: 5 local + 1 global; local layers read their own rope slot, a ring of `window` slots."""
    spec = load_config("gemma3_12b")
    assert [x.mixer_name for x in spec.layers] == (["local"] * 5 + ["global"]) * 8
    assert spec.layers[0].mixer.window == 1024 and spec.layers[5].mixer.window is None
    assert spec.ropes["local"].theta == 1e4 and (spec.rope.kind, spec.rope.factor) == ("linear", 8.0)
    m = zoo.build("gemma3_12b", dry=True)
    # 40 local layers keep 1024 slots whatever the context; only the 8 global ones grow
    assert m.info.cache_bytes_per_token == 8 * 2 * 8 * 256 * 4  # float32 K and V
    assert m.info.state_bytes_per_sequence == 40 * 2 * 8 * 1024 * 256 * 4


@pytest.mark.parametrize("change, match", [
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 3}, "unsupported layer kind.*chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1.0}}},
     "rope_parameters has no entry 'sliding_attention'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
])
def test_unsupported_config_values(references, change, match):
    config = json.loads((references["gemma3_text"][1] / "config.json").read_text())
    with pytest.raises(ConfigError, match=match):
        validate(import_config({**config, **change}, "config.json"), "config.json")


def test_mxfp4_checkpoints_are_refused(references):
    config = json.loads((references["gpt_oss"][1] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    with pytest.raises(ConfigError, match="quant_method='mxfp4' is not supported"):
        import_config(config, "config.json")


# ----------------------------------------------------------------------------- caches


def test_ring_cache_is_window_sized(families):
    """A sliding layer's cache holds `window` slots, not max_seq; a global layer's max_seq."""
    m = families.eager("attn/gpt_oss")
    local, glob = m.engine.caches[0]["k"], m.engine.caches[1]["k"]
    assert local.shape == (2, 2, WINDOW, 16) and glob.shape == (2, 2, 48, 16)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_zoo_import_round_trip(references, model_type, tmp_path, monkeypatch, capsys):
    from zoo.cli import main

    ref, path = references[model_type]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), f"name={model_type}_imported"]) == 0
    built = zoo.build(f"{model_type}_imported", weights=str(path), compile=False, max_seq=24, max_batch=2)
    x = ids(2, 9, seed=3)
    with torch.no_grad():
        assert_logits_close(built.prefill(x), ref(x).logits, 1e-4, model_type)
