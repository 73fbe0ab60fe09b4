"""MoE families (and their dense relatives) added by data alone (issue 26): an import map, rules
and a preset each, their routings options of the one MoE kind (compiler/ffn/moe.py). Tiny random
transformers checkpoints with odd sizes (FAMILIES): their prefill / decode parity, eager, runs in
tests/test_family_parity.py's reach_moe/* entries; here the flagship presets' exact parameter
counts against transformers on the meta device, and what the imports refuse."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import check_flagship_count, check_import_refused
from zoo.compiler.hf_import import import_config
from zoo.compiler.spec import validate

transformers = pytest.importorskip("transformers")

VOCAB = 211
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=1.7)

# name ("model_type" or "model_type/variant"): the tiny config.json values; odd sizes throughout
FAMILIES = {
    # a gated shared expert, softmax weights as is; a dense layer from mlp_only_layers
    "qwen2_moe": dict(COMMON, intermediate_size=72, moe_intermediate_size=20, shared_expert_intermediate_size=28,
                      num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1]),
    # q/k RMSNorm over the whole projection, renormalised top-k
    "olmoe": dict(COMMON, intermediate_size=20, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    # Granite's multipliers, softmax over the chosen logits
    "granitemoe": dict(COMMON, **GRANITE, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3),
    "granitemoeshared": dict(COMMON, **GRANITE, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3,
                             shared_intermediate_size=28),
    # a window of 5 on the sliding layers, sinks everywhere
    "granite_swa": dict(COMMON, **GRANITE, num_hidden_layers=4, intermediate_size=72, sliding_window=5,
                        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                        layer_rope_theta=[10000.0] * 4),
    "granitemoe_swa": dict(COMMON, **GRANITE, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3,
                           shared_intermediate_size=28, sliding_window=5,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                           layer_rope_theta=[10000.0] * 3),
    # OLMo 2's post-sub-layer norms around a MoE
    "flex_olmo": dict(COMMON, intermediate_size=20, num_experts=7, num_experts_per_tok=3),
    # sigmoid + selection bias over 2 groups, a shared expert
    "solar_open": dict(COMMON, head_dim=12, moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=3,
                       n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5),
    # sliding layers with RoPE, full layers NoPE, per-head q/k norms; a dense first layer
    "exaone_moe": dict(COMMON, num_hidden_layers=4, head_dim=12, intermediate_size=72, moe_intermediate_size=20,
                       num_experts=8, num_experts_per_tok=3, num_shared_experts=1, n_group=2, topk_group=1,
                       sliding_window=5, sliding_window_pattern=2, first_k_dense_replace=1),
    # MLA (q LoRA, interleaved RoPE) + DeepSeek-V3 routing, the first layer dense
    "glm4_moe_lite": dict(COMMON, num_key_value_heads=4, intermediate_size=72, moe_intermediate_size=20,
                          n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1,
                          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14,
                          routed_scaling_factor=1.8),
    # q/k norms after RoPE, an always-on SwiGLU beside the experts
    "hunyuan_v1_moe": dict(COMMON, head_dim=12, intermediate_size=20, num_experts=8, moe_topk=3),
    # per-head q/k norms, a sliding layer from max_window_layers on, dense first layer, 2 shared experts
    "dots1": dict(COMMON, intermediate_size=72, moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=3,
                  n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5, sliding_window=5, max_window_layers=2),
    # Qwen3.5's Gated DeltaNet + gated attention layers with a MoE and a gated shared expert
    "qwen3_5_moe_text": dict(COMMON, num_hidden_layers=4, head_dim=16, moe_intermediate_size=20,
                             shared_expert_intermediate_size=28, num_experts=8, num_experts_per_tok=3,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
                             linear_value_head_dim=10,
                             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    # MLA with a dense SwiGLU on every layer, tied
    "youtu": dict(COMMON, num_key_value_heads=4, intermediate_size=72, q_lora_rank=24, kv_lora_rank=16,
                  qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14, tie_word_embeddings=True),
    # MLA with RoPE on halves, embeddings / residual branches / logits scaled (sqrt in the import map)
    "minicpm3": dict(COMMON, num_key_value_heads=4, intermediate_size=72, q_lora_rank=24, kv_lora_rank=16,
                     qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14, scale_emb=2.5, scale_depth=1.4,
                     dim_model_base=16),
    # partial rotary (half of 16 channels), q/k norm over the projection, sigmoid + bias routing
    "minimax_m2": dict(COMMON, head_dim=16, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # GLM-4.5's code under Sarvam's own tensor names (fused query_key_value, expert_bias), a dense first layer
    "sarvam_moe": dict(COMMON, head_dim=12, intermediate_size=72, moe_intermediate_size=20, n_routed_experts=8,
                       num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=1.5),
    # DeepSeek-V3's code: MLA with a full-rank q_proj, one group of experts, a dense first layer
    "sarvam_mla": dict(COMMON, num_key_value_heads=4, intermediate_size=72, moe_intermediate_size=20,
                       n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16, qk_nope_head_dim=12,
                       qk_rope_head_dim=8, v_head_dim=14, routed_scaling_factor=1.5),
    # interleaved RoPE; softmax scores selected with a [1, E] bias; MoE on layers 1..3 every 2nd: 1, 3
    "ernie4_5_moe": dict(COMMON, num_hidden_layers=4, head_dim=12, intermediate_size=72, moe_intermediate_size=20,
                         moe_num_experts=8, moe_k=3, moe_num_shared_experts=1, moe_layer_start_index=1,
                         moe_layer_end_index=3, moe_layer_interval=2),
    # a window of 5 with RoPE, NoPE full layers, a gate_proj output gate joined to q per head, sandwich
    # norms, a dense first layer, sigmoid + selection bias x route_scale, embeddings * sqrt(d)
    "afmoe": dict(COMMON, num_hidden_layers=4, num_key_value_heads=4, head_dim=12, intermediate_size=72,
                  moe_intermediate_size=20, num_experts=8, num_experts_per_tok=3, num_shared_experts=1,
                  num_dense_layers=1, route_scale=1.7, mup_enabled=True, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # fused Wqkv clamped (0.02: the clamp bites), bias-free LayerNorm, every expert in one [E * F, D] tensor
    "dbrx": dict(vocab_size=VOCAB, d_model=48, n_heads=4, n_layers=3, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, clip_qkv=0.02, rope_theta=10000.0),
                 ffn_config=dict(ffn_hidden_size=20, moe_num_experts=7, moe_top_k=3)),
    # Cohere's parallel block; a dense full-attention first layer with forced RoPE, then sliding (window 5,
    # RoPE) / full (NoPE) MoE layers; softmax over the chosen logits, a shared expert averaged in
    "cohere2_moe": dict(COMMON, num_hidden_layers=4, head_dim=12, intermediate_size=20, num_experts=7,
                        num_experts_per_tok=3, num_shared_experts=1, first_k_dense_replace=1,
                        prefix_dense_intermediate_size=72, sliding_window=5, sliding_window_pattern=2),
    # sigmoid scores renormalised, the shared expert summed
    "cohere2_moe/sigmoid_sum": dict(COMMON, head_dim=12, intermediate_size=20, num_experts=7, num_experts_per_tok=3,
                                    num_shared_experts=1, expert_selection_fn="sigmoid",
                                    shared_expert_combination_strategy="sum", sliding_window=5,
                                    sliding_window_pattern=2),
    # SparseMixer routing (Phi-3.5-MoE), its masks wide (jitter 0.3: most tokens' second softmax leaves
    # out experts); LayerNorms with biases, q/k/v/o and head biases
    "phimoe": dict(COMMON, intermediate_size=20, num_local_experts=7, num_experts_per_tok=2, attention_bias=True,
                   lm_head_bias=True, router_jitter_noise=0.3),
    # Llama 4: RoPE layers chunked (8 positions: the prompts cross chunks) with a weightless q/k L2 norm after
    # RoPE, NoPE layers global with the position temperature (floor_scale 4: it grows within the prompt); a MoE
    # whose experts take sigmoid(logit) * x, plus a shared expert, on layers 1 and 2, dense SwiGLUs on 0 and 3
    "llama4_text": dict(COMMON, num_hidden_layers=4, head_dim=12, intermediate_size=20, intermediate_size_mlp=72,
                        num_local_experts=7, num_experts_per_tok=2, attention_chunk_size=8, floor_scale=4,
                        no_rope_layer_interval=2, moe_layers=[1, 2]),
    # the compiled sample of those concepts: a chunked RoPE layer and a NoPE one, both with the MoE (2 graphs)
    "llama4_text/compiled": dict(COMMON, num_hidden_layers=2, head_dim=12, intermediate_size=20,
                                 num_local_experts=7, num_experts_per_tok=2, attention_chunk_size=8, floor_scale=4,
                                 no_rope_layer_interval=2),
}


SELECTION_BIAS = "e_score_correction_bias"


def make_config(name: str, **kw):
    return transformers.CONFIG_MAPPING[name.split("/")[0]](**{**FAMILIES[name], **NO_TOKENS, **kw})


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Every constant-initialised vector (norm weights at 1, biases and sinks at 0) and the
    selection biases made random, so that a misplaced or missing one shows."""
    for name, p in model.named_parameters():
        if SELECTION_BIAS in name:  # a [E] or [1, E] parameter (ERNIE's moe_statics)
            p.uniform_(-0.3, 0.3)
        elif "norm" in name and p.dim() == 1:  # a norm's own vector: DBRX's whole attention (Wqkv,
            # out_proj) lives under norm_attn_norm, and U(0.5, 1.5) matrices made that twin a float32
            # stress test (every projection a near-total cancellation) instead of a model
            p.uniform_(0.5, 1.5)
        elif p.dim() == 1 and torch.all(p == p.flatten()[0]):
            p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():
        if SELECTION_BIAS in name:
            b.uniform_(-0.3, 0.3)


def reference(name: str, seed: int = 0):
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(make_config(name)).eval().float()
    randomize(ref)
    return ref


# Flagship config.json values: the published configs of the checkpoints each preset names, or the
# config class's defaults where the preset says it is sized so
FLAGSHIPS = {
    "qwen1_5_moe_a2_7b": ("qwen2_moe", dict()),  # Qwen2MoeConfig's defaults are Qwen/Qwen1.5-MoE-A2.7B's
    "olmoe_1b_7b": ("olmoe", dict(intermediate_size=1024)),  # allenai/OLMoE-1B-7B-0924
    "granite_3_moe_1b": ("granitemoe", dict(  # ibm-granite/granite-3.0-1b-a400m-base
        vocab_size=49155, hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8, tie_word_embeddings=True,
        max_position_embeddings=4096, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
        attention_multiplier=0.015625)),
    "granite_swa": ("granite_swa", dict()),
    "granitemoe_swa": ("granitemoe_swa", dict()),
    "flex_olmo_7x7b": ("flex_olmo", dict()),
    "solar_open_100b": ("solar_open", dict()),
    "k_exaone_236b": ("exaone_moe", dict()),
    "glm4_7_flash": ("glm4_moe_lite", dict()),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(head_dim=128)),  # the class default null does not build
    "qwen3_5_35b_a3b": ("qwen3_5_moe_text", dict()),
    "youtu_llm": ("youtu", dict()),
    "minicpm3_4b": ("minicpm3", dict()),  # MiniCPM3Config's defaults are openbmb/MiniCPM3-4B's
    "minimax_m2": ("minimax_m2", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                        "partial_rotary_factor": 0.5})),
    "sarvam_30b": ("sarvam_moe", dict()),  # SarvamMoEConfig's defaults ("a Sarvam-30B style configuration")
    "sarvam_mla": ("sarvam_mla", dict()),
    "ernie4_5_21b_a3b": ("ernie4_5_moe", dict()),
    "afmoe": ("afmoe", dict()),
    "cohere2_moe": ("cohere2_moe", dict()),
    "phi3_5_moe": ("phimoe", dict(attention_bias=True, lm_head_bias=True)),  # Phi-3.5-MoE-instruct's sizes
    "llama4_scout": ("llama4_text", dict()),  # Llama4TextConfig's defaults are Llama-4-Scout-17B-16E's text part
    "dbrx": ("dbrx", dict(  # databricks/dbrx-base
        d_model=6144, n_heads=48, n_layers=40, max_seq_len=32768, vocab_size=100352,
        attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0),
        ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),  # Ernie4_5_MoeConfig's defaults are ERNIE-4.5-21B-A3B's
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' for its config (meta device), and
    importing that config gives the preset's layers (helpers.check_flagship_count)."""
    model_type, values = FLAGSHIPS[preset]
    config = transformers.CONFIG_MAPPING[model_type](**values)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(config)
    if not any("e_score_correction_bias" in n for n, _ in ref.named_buffers()):
        check_flagship_count(preset, config)
        return
    # the selection bias is a stored buffer in transformers, a parameter in zoo
    state = set(ref.state_dict())
    want = sum(p.numel() for p in ref.parameters()) + sum(b.numel() for n, b in ref.named_buffers() if n in state)
    m = zoo.build(preset, dry=True)
    assert m.info.params == want
    imported = validate(import_config(config.to_dict(), preset), preset)
    assert imported.layers == m.spec.layers and imported.dim == m.spec.dim


@pytest.mark.parametrize("name, change, words", [
    ("qwen2_moe", {"use_sliding_window": True}, ["use_sliding_window=True", "conf/hf/qwen2_moe.yaml"]),
    ("olmoe", {"clip_qkv": 8.0}, ["clip_qkv", "after its q/k norms", "conf/hf/olmoe.yaml"]),
    ("granite_swa", {"layer_rope_theta": [10000.0, 0.0, 10000.0, 10000.0]},
     ["layer_rope_theta", "NoPE", "conf/hf/granite_swa.yaml"]),
    # transformers' SparseMixer picks exactly two experts, whatever num_experts_per_tok says
    ("phimoe", {"num_experts_per_tok": 3}, ["num_experts_per_tok=3", "expected 2", "conf/hf/phimoe.yaml"]),
])
def test_what_cannot_be_expressed_is_refused(name, change, words):
    check_import_refused({**make_config(name).to_dict(), **change}, words)


def test_deepseek_v4_loads_what_transformers_saves(tmp_path):
    """A DeepSeek-V4 checkpoint written by transformers' save_pretrained (its own names: a
    `model.` prefix, model.hc_head.*, attn.norm) loads through the rename stage
    deepseek_v4_names.yaml like the Hub layout, and matches transformers: the prefill of 20
    tokens (compressed entries of both kinds) and 8 greedy decode steps, batch 2."""
    from tests import test_deepseek_v4 as v4
    from tests.helpers import check_parity

    ref = v4.make_reference(seed=1)
    ref.save_pretrained(tmp_path)
    m = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=2, max_seq=v4.MAX_SEQ)
    ids = torch.randint(0, v4.VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        check_parity(ref, m, ids, steps=8, rtol=1e-4)


def test_join_groups_inverts_split_groups():
    """join_groups (conf/rules/afmoe.yaml, dbrx.yaml) puts part-major rows back group-major:
    split_groups of its output gives the inputs back; stack / transpose give an expert stack."""
    from zoo.compiler.checkpoint.ops import get_op

    join, split = get_op("join_groups", "test"), get_op("split_groups", "test")
    q, gate, k = torch.randn(6, 5), torch.randn(6, 5), torch.randn(4, 5)  # 3 heads of 2 rows; k whole
    out = join.apply([q, gate, k], groups=3, whole=[2])
    assert join.shape([(6, 5), (6, 5), (4, 5)], groups=3, whole=[2]) == tuple(out.shape) == (16, 5)
    assert torch.equal(split.apply([out[:12]], groups=3, sizes=[2, 2]), torch.cat([q, gate]))
    assert torch.equal(out[12:], k)
    w1, v1, w2 = torch.randn(8, 5), torch.randn(8, 5), torch.randn(8, 5)  # 2 experts of 4 rows
    w13 = join.apply([w1, v1], groups=2, stack=True)
    assert w13.shape == join.shape([(8, 5), (8, 5)], groups=2, stack=True) == (2, 8, 5)
    assert torch.equal(w13[1], torch.cat([w1[4:], v1[4:]]))
    down = join.apply([w2], groups=2, stack=True, transpose=True)
    assert down.shape == join.shape([(8, 5)], groups=2, stack=True, transpose=True) == (2, 5, 4)
    assert torch.equal(down[1], w2[4:].t())
    with pytest.raises(ValueError, match="not 3 equal groups"):
        join.shape([(7, 5)], groups=3)


def test_llama4_chunked_layers_keep_a_ring_of_one_chunk():
    """A chunked layer's cache is the window's ring of min(C, max_seq) slots (constant per
    sequence); the NoPE layer's grows one slot per position. A chunk beside a window is refused,
    naming the mixer and both values."""
    from zoo.compiler.errors import ConfigError

    m = zoo.build("llama4_scout_tiny", dry=True)
    rope, nope = m.module.layers[0].mixer, m.module.layers[1].mixer
    k = rope.cache_fields(2, 48, torch.float32)["k"]
    assert tuple(k.shape) == (2, 2, 8, 16) and not k.grows
    assert tuple(rope.cache_fields(2, 5, torch.float32)["k"].shape) == (2, 2, 5, 16)  # max_seq under a chunk
    k = nope.cache_fields(2, 48, torch.float32)["k"]
    assert tuple(k.shape) == (2, 2, 48, 16) and k.grows
    with pytest.raises(ConfigError, match=r"mixers\.rope: chunk=8: .*no window \(window=4\)"):
        zoo.build("llama4_scout_tiny", dry=True, overrides=["mixers.rope.window=4"])


def test_sparsemixer_route_is_transformers():
    """zoo's SparseMixer routing (compiler/ffn/moe.py sparsemixer_route) against transformers'
    inference path, on logits close enough that its masks leave experts out of each softmax; and
    the options it cannot combine with are refused by name."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from zoo.compiler.ffn.moe import sparsemixer_route

    torch.manual_seed(0)
    logits = torch.randn(400, 9) * torch.rand(400, 1)
    for eps in (0.01, 0.3):
        want, want_idx = sparsemixer(logits, jitter_eps=eps, training=False)
        weights, idx = sparsemixer_route(logits, 2, eps)
        assert torch.equal(idx, want_idx)
        torch.testing.assert_close(weights, want, rtol=0, atol=0)
        plain = logits.softmax(-1).gather(-1, idx[:, :1])  # round one without its mask
        assert (weights[:, :1] > plain + 1e-6).float().mean() > 0.3  # the masks change most weights
    with pytest.raises(zoo.ConfigError, match=r"routing=sparsemixer .* norm_topk_prob"):
        zoo.build("phi3_5_moe_tiny", dry=True, overrides=["ffns.moe.norm_topk_prob=true"])
