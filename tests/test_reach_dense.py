"""Dense decoder families added by data alone (issue 26): tiny random transformers checkpoints
with odd sizes (their prefill / decode parity, eager: tests/test_family_parity.py's reach_dense/*
entries), exact parameter counts of the flagship presets against transformers on the meta device,
and the new options' refusals. Each family is an import map, rules and presets under conf/; the
options they needed: LayerNorm's `zero_centered` (Nemotron's LayerNorm1P) and the MLP's learned
xIELU activation (Apertus)."""
from __future__ import annotations

import pytest

import zoo
from tests.helpers import auto_reference, check_flagship_count, check_import_refused

transformers = pytest.importorskip("transformers")

VOCAB = 301
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
DIMS = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, intermediate_size=100, max_position_embeddings=64)

# name: (transformers config class, the tiny config.json values); odd sizes throughout
FAMILIES = {
    # Llama's attention, non-gated squared-ReLU MLP (up_proj, down_proj)
    "arcee": ("ArceeConfig", dict(DIMS)),
    # Llama under GPT-2-style tensor names (transformer.h.N.attn.attention.*, c_fc_0/1)
    "exaone": ("ExaoneConfig", dict(DIMS)),
    # Llama with q/k/v/o and MLP biases (InternLM3 requires them equal)
    "internlm3": ("InternLM3Config", dict(DIMS, attention_bias=True, mlp_bias=True)),
    "iquestcoder": ("IQuestCoderConfig", dict(DIMS)),
    # GeGLU, (1 + w) RMSNorm, embeddings * sqrt(d), tied, MHA
    "gemma": ("GemmaConfig", dict(DIMS, num_key_value_heads=4)),
    # rotary on half of each 12-wide head in interleaved pairs, q/k/v biases, fused gate_up_proj
    "glm": ("GlmConfig", dict(DIMS)),
    # GLM with sandwich norms
    "glm4": ("Glm4Config", dict(DIMS)),
    # q/k/v biases, o_proj's bias of its own (attention_out_bias)
    "seed_oss": ("SeedOssConfig", dict(DIMS, attention_bias=True, attention_out_bias=True)),
    # sliding-window (7, shorter than the prompts) and full layers
    "ministral": ("MinistralConfig", dict(DIMS, sliding_window=7,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # llama3 rope; full attention on layer 0, sliding windows of 7 on layers 1-3
    "cwm": ("CwmConfig", dict(DIMS, num_hidden_layers=4, sliding_window=7, bos_token_id=1,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16})),
    # LayerNorm1P (1 + w, with bias), squared-ReLU MLP, rotary on half of each head
    "nemotron": ("NemotronConfig", dict(DIMS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5})),
    # LayerNorms with bias, biases everywhere, squared-ReLU MLP
    "jais2": ("Jais2Config", dict(DIMS)),
    # Granite's multipliers (logits multiplied) and a norm after each sub-layer
    "hyperclovax": ("HyperCLOVAXConfig", dict(DIMS, embedding_multiplier=1.7, residual_multiplier=0.6,
                                              attention_multiplier=0.09, logits_scaling=0.4)),
    # OLMo 2's blocks, three sliding-window layers (window 7) per full one, a rope per layer type
    "olmo3": ("Olmo3Config", dict(DIMS, num_hidden_layers=4, sliding_window=7,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 50000.0}})),
    # OLMo 2's norm placement, per-head q/k norms; RoPE on the sliding layers only (NoPE global layers)
    "exaone4": ("Exaone4Config", dict(DIMS, num_hidden_layers=4, sliding_window=7, sliding_window_pattern=4)),
    # rotary in interleaved pairs, biases on every projection
    "ernie4_5": ("Ernie4_5Config", dict(DIMS, use_bias=True, tie_word_embeddings=False)),
    # per-head q/k norms after RoPE
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(DIMS)),
    # Command R's parallel block; sliding layers with interleaved RoPE, NoPE full layers, scaled logits
    "cohere2": ("Cohere2Config", dict(DIMS, num_hidden_layers=4, sliding_window=7, logit_scale=0.3)),
    # Gemma 2 without its post-sub-layer norms: soft-capping, sliding (7) / global alternation
    "vaultgemma": ("VaultGemmaConfig", dict(DIMS, sliding_window=7, query_pre_attn_scalar=20,
                                            attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    # unscaled attention logits, global / local (window 7) layers, learned positions
    "gpt_neo": ("GPTNeoConfig", dict(vocab_size=VOCAB, hidden_size=48, num_layers=3, num_heads=4,
                                     intermediate_size=100, max_position_embeddings=64, window_size=7,
                                     attention_types=[[["global", "local"], 1], [["local"], 1]])),
    # BART decoder blocks, embeddings * sqrt(d), learned positions at offset 2
    "biogpt": ("BioGptConfig", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                    intermediate_size=100, max_position_embeddings=64)),
    # ALiBi over 4 heads, fused bias-free Wqkv, bias-free LayerNorms, q/k/v clamped low enough to bind
    "mpt": ("MptConfig", dict(vocab_size=VOCAB, d_model=48, n_layers=3, n_heads=4, max_seq_len=64,
                              attn_config={"clip_qkv": 0.3})),
    # per-head q/k norms, llama3 rope, a non-gated MLP with the learned xIELU activation
    "apertus": ("ApertusConfig", dict(DIMS, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16})),
    # fused per-head qkv without biases, rotary on half of each head, an output bias on the last layer only
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3,
                                                        num_attention_heads=4, intermediate_multiple_size=2,
                                                        max_position_embeddings=64,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                         "partial_rotary_factor": 0.5})),
    # Mistral with YaRN and Llama 4's attention temperature: period 4, so it grows within the prompt
    "ministral3": ("Ministral3Config", dict(DIMS, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.3})),
    # weightless RMSNorms (also on the embeddings), RoPE by the negative angle then q/k norms, relu2 MLP,
    # soft-capped logits
    "nanochat": ("NanoChatConfig", dict(DIMS, num_key_value_heads=4, final_logit_softcapping=3.0)),
    # GPT-1: post-LN blocks (norm after each residual add, no final norm), learned positions, Conv1D layout
    "openai-gpt": ("OpenAIGPTConfig", dict(vocab_size=VOCAB, n_embd=48, n_layer=3, n_head=4, n_positions=64)),
    # BART decoder blocks, embeddings * sqrt(d), fixed sinusoidal positions (fairseq's, offset 2)
    "xglm": ("XGLMConfig", dict(vocab_size=VOCAB, d_model=48, num_layers=3, attention_heads=4, ffn_dim=100,
                                max_position_embeddings=64)),
    # sinusoidal positions ("Attention Is All You Need"'s), embeddings * sqrt(d), ReLU MLP, a biased tied head
    "ctrl": ("CTRLConfig", dict(vocab_size=VOCAB, n_embd=48, n_layer=3, n_head=4, dff=100, n_positions=64)),
    # differential attention (mixer diff_attn): head pairs subtract, lambda per layer (3 layers: 3 lambda_init)
    "diffllama": ("DiffLlamaConfig", dict(DIMS, attention_bias=True)),
    # Llama with its rotary in interleaved pairs, q/k/v biases, an o_proj [D, D] (heads * head_dim == D)
    "helium": ("HeliumConfig", dict(DIMS, attention_bias=True)),
    # Qwen3-MoE blocks; sliding (7, its own rope theta) / full layers and dense / sparse MLPs, each per layer
    "mellum": ("MellumConfig", dict(DIMS, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=36,
                                    sliding_window=7, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"],
                                    mlp_layer_types=["dense", "sparse", "sparse"])),
}


def make_config(family: str, **kw):
    cls, values = FAMILIES[family]
    return getattr(transformers, cls)(**{**NO_TOKENS, **values, **kw})


def reference(family: str, seed: int = 0):
    return auto_reference(make_config(family), seed)


# Flagship config.json values (the published configs of the checkpoints each preset names)
FLAGSHIPS = {
    "exaone3_7_8b": ("ExaoneConfig", dict()),  # ExaoneConfig's defaults are EXAONE-3.0-7.8B's
    "internlm3_8b": ("InternLM3Config", dict()),  # InternLM3Config's defaults are internlm3-8b-instruct's
    "iquest_coder_40b": ("IQuestCoderConfig", dict()),  # IQuestCoderConfig's defaults are IQuest-Coder-V1-40B's
    "gemma_7b": ("GemmaConfig", dict()),  # GemmaConfig's defaults are google/gemma-7b's
    "glm_4_9b": ("GlmConfig", dict()),  # GlmConfig's defaults are THUDM/glm-4-9b-chat-hf's
    "glm4_9b": ("Glm4Config", dict(max_position_embeddings=32768, rms_norm_eps=1e-5)),  # GLM-4-9B-0414
    "cwm_32b": ("CwmConfig", dict()),  # CwmConfig's defaults are facebook/cwm's
    "jais2_8b": ("Jais2Config", dict()),  # Jais2Config's defaults are inceptionai/Jais-2-8B-Chat's
    "ernie4_5_0_3b": ("Ernie4_5Config", dict()),  # Ernie4_5Config's defaults are baidu/ERNIE-4.5-0.3B-PT's
    "gpt_neo_1_3b": ("GPTNeoConfig", dict()),  # GPTNeoConfig's defaults are EleutherAI/gpt-neo-1.3B's
    "biogpt": ("BioGptConfig", dict()),  # BioGptConfig's defaults are microsoft/biogpt's
    "gpt_neox_japanese_2_7b": ("GPTNeoXJapaneseConfig", dict()),  # the defaults are abeja/gpt-neox-japanese-2.7b's
    "ministral3_8b": ("Ministral3Config", dict()),  # the defaults are Ministral-3-8B-Base-2512's text model
    "nanochat_d12": ("NanoChatConfig", dict()),  # NanoChatConfig's defaults (the preset's sizes)
    "openai_gpt": ("OpenAIGPTConfig", dict()),  # OpenAIGPTConfig's defaults are openai-community/openai-gpt's
    "xglm_564m": ("XGLMConfig", dict()),  # XGLMConfig's defaults are facebook/xglm-564M's
    "ctrl": ("CTRLConfig", dict()),  # CTRLConfig's defaults are Salesforce/ctrl's
    "mellum_12b": ("MellumConfig", dict()),  # MellumConfig's defaults are Mellum2-12B-A2.5B-Base's
    "diffllama": ("DiffLlamaConfig", dict()),  # DiffLlamaConfig's defaults (the preset's sizes)
    "helium_2b": ("HeliumConfig", dict()),  # HeliumConfig's defaults are kyutai/helium-1-2b's
    "mpt_7b": ("MptConfig", dict(d_model=4096, n_heads=32, n_layers=32, vocab_size=50432)),  # mosaicml/mpt-7b
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' for the published config (meta
    device), and importing that config gives the preset's layers (helpers.check_flagship_count)."""
    cls, values = FLAGSHIPS[preset]
    check_flagship_count(preset, getattr(transformers, cls)(**values))


@pytest.mark.parametrize("family, change, words", [
    ("mpt", {"n_heads": 6, "d_model": 48}, ["n_heads", "power-of-two", "conf/hf/mpt.yaml"]),
    ("mpt", {"attn_config": {"qk_ln": True}}, ["qk_ln", "conf/hf/mpt.yaml"]),
    ("hunyuan_v1_dense", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0,
                                              "alpha": 1000.0}}, ["dynamic", "conf/hf/hunyuan_v1_dense.yaml"]),
    ("nemotron", {"hidden_act": "swish"}, ["hidden_act='swish'", "conf/hf/nemotron.yaml"]),
    # Helium's o_proj is [hidden, hidden]: heads * head_dim must be hidden_size
    ("helium", {"head_dim": 16}, ["num_attention_heads * default(head_dim, 128) == hidden_size",
                                  "num_attention_heads=4", "conf/hf/helium.yaml"]),
])
def test_what_cannot_be_expressed_is_refused(family, change, words):
    check_import_refused({**make_config(family).to_dict(), **change}, words)


@pytest.mark.parametrize("override, words", [
    ("ffns.mlp.activation=xielu2", ["activation='xielu2'", "xielu"]),
    ("norm.zero_centered=true", ["zero_centered=true needs affine=true"]),
])
def test_bad_options_are_refused(override, words):
    """The new options' bad values are ConfigErrors naming the key, the value and what was expected."""
    extra = ["norm.affine=false", "norm.bias=false"] if override.startswith("norm.") else []
    with pytest.raises(zoo.ConfigError) as e:
        zoo.build("nemotron_tiny", dry=True, overrides=[override, *extra])
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("conf, overrides, words", [
    ("openai_gpt", ["residual.parallel=shared_norm"], ["post_residual", "residual.parallel='shared_norm'"]),
    ("xglm_564m", ["sinusoidal_positions=fairseq"], ["sinusoidal_positions='fairseq'", "tensor2tensor"]),
    ("xglm_564m", ["learned_positions=true"], ["without learned_positions", "learned_positions=True"]),
    ("ministral3_8b", ["mixers.attn.temperature_period=null"], ["temperature_beta=0.1", "give both"]),
    ("nanochat_d12", ["norm.zero_centered=true"], ["zero_centered=true needs affine=true"]),
])
def test_new_options_bad_values_are_refused(conf, overrides, words):
    """post_residual, sinusoidal_positions, the attention temperature and the weightless RMSNorm:
    a bad combination is a ConfigError naming the key and the value."""
    with pytest.raises(zoo.ConfigError) as e:
        zoo.build(conf, dry=True, overrides=overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_differential_attention_is_its_naive_reference():
    """diff_attn's prefill (gqa's batched path with doubled values, pairs combined after) against
    the naive head-by-head (softmax_1 - lambda softmax_2) V of compiler/mixers/differential_attention.py,
    float64, on every layer of a tiny twin (lambda_init differs per layer); odd kv-head counts refused."""
    import torch

    from zoo.compiler.mixers.differential_attention import lambda_init, reference

    reference_model = globals()["reference"]("diffllama", 3)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        reference_model.save_pretrained(Path(d))
        m = zoo.from_pretrained(d, compile=False, max_batch=2, max_seq=24)
    decoder = m.engine.model
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(0))
    for i, block in enumerate(decoder.layers):
        mixer = block.mixer
        assert mixer.lambda_init == lambda_init(i)
        cos, sin = decoder.rope_impl.table(mixer.rot_dim, 9, "cpu")
        fields = mixer.cache_fields(2, 24, torch.float32)
        cache = {k: torch.zeros(f.shape, dtype=f.dtype) for k, f in fields.items()}
        with torch.no_grad():
            got = mixer.prefill(x, cache, {"rope": {mixer.rope: (cos, sin)}})
        torch.testing.assert_close(got, reference(mixer, x, cos, sin), rtol=1e-5, atol=1e-6)
    with pytest.raises(zoo.ConfigError, match="n_kv_heads=3 must be even"):
        zoo.build("diffllama_tiny", dry=True, overrides=["mixers.attn.n_heads=6", "mixers.attn.n_kv_heads=3"])
