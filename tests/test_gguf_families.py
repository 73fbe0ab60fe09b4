"""Every GGUF architecture map (conf/gguf/<arch>.yaml + conf/rules/gguf_<arch>.yaml) against
transformers: a tiny random twin of the family is written the way llama.cpp's converter writes it
(tests/gguf_writer.py: gguf-py's tensor names, the q/k permutation, the metadata keys, one tensor
block-quantized), loaded with zoo.from_pretrained(file.gguf), and must give the twin's logits at
prefill and at every decode step (float32, eager, batch 2). Also the errors for files no map can
express."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.errors import CheckpointError, ConfigError  # noqa: E402
from tests.gguf_writer import LAYOUTS, write_gguf  # noqa: E402
from tests.helpers import check_parity  # noqa: E402

Q = gguf.GGMLQuantizationType

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Qwen3.5-MoE's twin (two FAMILIES cases: experts stored per kind, and fused)
QWEN3_5_MOE = dict({k: v for k, v in SMALL.items() if k != "intermediate_size"}, num_hidden_layers=4,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})

# Kimi Linear's twin: a Hub-style config (linear_attn_config), as the converter reads it (two
# FAMILIES cases: a full-rank query with kv_b split, a low-rank one with kv_b whole)
KIMI_LINEAR = dict(SMALL, num_key_value_heads=4, num_hidden_layers=4, moe_intermediate_size=32, kv_lora_rank=32,
                   q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
                   num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.446,
                   moe_renormalize=True, moe_router_activation_func="sigmoid", num_expert_group=1, topk_group=1,
                   use_grouped_topk=True, mla_use_nope=True, moe_layer_freq=1, num_nextn_predict_layers=0,
                   model_max_length=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 4,
                                       "short_conv_kernel_size": 4})
# Falcon-H1's µP multipliers, every one off 1, and its Mamba2 sizes
FALCON_H1 = dict(embedding_multiplier=1.5, lm_head_multiplier=0.6, key_multiplier=0.8, attention_in_multiplier=0.7,
                 attention_out_multiplier=1.2, ssm_in_multiplier=1.1, ssm_out_multiplier=0.9,
                 ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], mlp_multipliers=[0.8, 1.2], mamba_d_ssm=128,
                 mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})

# family -> (layout in tests/gguf_writer.py, transformers config class, config kwargs, the
# rules zoo must pick, {tensor: block type} stored quantized)
FAMILIES = {
    "mistral_as_llama": ("llama", "MistralConfig",
                         dict(SMALL, head_dim=16, sliding_window=None, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                         ["llama"], {"blk.1.ffn_down.weight": Q.Q8_0}),
    "qwen2": ("qwen2", "Qwen2Config",
              dict(SMALL, tie_word_embeddings=True, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
              ["qwen2"], {"blk.0.attn_v.weight": Q.Q8_0}),
    "qwen3": ("qwen3", "Qwen3Config",
              dict(SMALL, head_dim=32, tie_word_embeddings=False, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
              ["qwen3"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    "qwen3_yarn": ("qwen3", "Qwen3Config",
                   dict(SMALL, head_dim=32, tie_word_embeddings=True, use_sliding_window=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 16.0,
                                         "beta_slow": 2.0}),
                   ["qwen3"], {}),
    "granite": ("granite", "GraniteConfig",
                dict(SMALL, tie_word_embeddings=True, attention_multiplier=0.2, embedding_multiplier=3.0,
                     residual_multiplier=0.5, logits_scaling=4.0,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                ["granite"], {"blk.0.ffn_gate.weight": Q.Q8_0}),
    # four layers: llama.cpp's fixed NoPE schedule makes the 4th one NoPE
    "smollm3": ("smollm3", "SmolLM3Config",
                dict(SMALL, num_hidden_layers=4, tie_word_embeddings=True, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 2e6}),
                ["smollm3"], {"blk.2.ffn_down.weight": Q.Q8_0}),
    "olmo2": ("olmo2", "Olmo2Config",
              dict(SMALL, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
              ["olmo2"], {"blk.1.attn_output.weight": Q.Q8_0}),
    "phi3": ("phi3", "Phi3Config",
             dict(SMALL, sliding_window=4, tie_word_embeddings=False, original_max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}),
             ["phi3"], {"blk.1.attn_qkv.weight": Q.Q8_0}),
    "phi4": ("phi3", "Phi3Config",
             dict(SMALL, sliding_window=None, tie_word_embeddings=False, original_max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 2.5e5, "partial_rotary_factor": 1.0}),
             ["phi3"], {}),
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig",
                 dict(SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, tie_word_embeddings=False, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                 ["qwen3_moe"], {"blk.0.attn_output.weight": Q.Q8_0, "blk.1.ffn_gate_exps.weight": Q.Q8_0,
                                 "blk.1.ffn_up_exps.weight": Q.Q4_0}),
    "mixtral_as_llama": ("mixtral", "MixtralConfig",
                         dict(SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                              tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                         ["mixtral"], {"blk.1.attn_v.weight": Q.Q8_0}),
    # window 4 < the 11 positions checked, so the sliding layers really slide
    "gemma2": ("gemma2", "Gemma2Config",
               dict(SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               ["gemma2"], {"blk.0.ffn_up.weight": Q.Q8_0}),
    "gemma3": ("gemma3", "Gemma3TextConfig",
               dict(SMALL, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                    tie_word_embeddings=True,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
               ["gemma3"], {"blk.5.ffn_gate.weight": Q.Q8_0}),
    # MLA with q_lora, sigmoid routing in groups with a selection bias, yarn with mscale: the
    # deepseek2_v3 variant; attn_kv_b whole, as older converters wrote it
    "deepseek_v3": ("deepseek2_kv_b", "DeepseekV3Config",
                    dict(SMALL, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                         kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
                    ["deepseek_mtp", "deepseek_v3"], {"blk.1.ffn_up_exps.weight": Q.Q8_0,
                                                      "blk.1.attn_kv_a_mqa.weight": Q.Q8_0}),
    # GLM-4.5: partial rotary, q/k/v biases, q/k norms, sigmoid routing with shared experts; the
    # file's block_count counts the (absent) MTP layer
    "glm4_moe": ("glm4moe", "Glm4MoeConfig",
                 dict(SMALL, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                      routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
                      tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
                 ["deepseek_mtp", "glm4_moe"], {"blk.1.ffn_gate_exps.weight": Q.Q8_0,
                                                "blk.0.attn_output.weight": Q.Q8_0}),
    # sinks, biases, sliding / full layers (window 4 < the positions checked), yarn; the experts
    # stored MXFP4 as released files have them
    "gpt_oss": ("gpt-oss", "GptOssConfig",
                dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0,
                                      "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}),
                ["gpt_oss"], {f"blk.{i}.ffn_{k}_exps.weight": Q.MXFP4 for i in (0, 1) for k in ("gate", "up", "down")}),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig",
                  dict(SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False, use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                  ["qwen2_moe"], {"blk.1.ffn_down_exps.weight": Q.Q8_0, "blk.0.ffn_up_shexp.weight": Q.Q4_0}),
    "olmoe": ("olmoe", "OlmoeConfig",
              dict(SMALL, intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                   tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["olmoe"], {"blk.0.ffn_gate_exps.weight": Q.Q8_0}),
    # Gated DeltaNet (2 value heads per key head) and gated attention every 4th layer, MoE with a
    # gated shared expert; llama.cpp's A, conv, norm and in_proj layouts
    "qwen3_next": ("qwen3next", "Qwen3NextConfig",
                   dict(SMALL, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                        norm_topk_prob=True, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
                   ["qwen3_next_mtp", "qwen3_next"], {"blk.3.attn_q.weight": Q.Q8_0, "blk.1.ssm_out.weight": Q.Q8_0,
                                                      "blk.2.ffn_up_exps.weight": Q.Q8_0}),
    # Qwen3.5: Gated DeltaNet (3 value heads per key head, which llama.cpp stores tiled) and gated
    # attention every 4th layer, a dense FFN; llama.cpp's A, conv, norm and value-head layouts
    "qwen3_5": ("qwen35", "Qwen3_5TextConfig",
                dict(SMALL, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                     linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
                ["qwen3_5_names", "qwen3_5_text"], {"blk.3.attn_q.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q8_0}),
    # Qwen3.5-MoE: Qwen3.5's layers with softmax top-k experts and a sigmoid-gated shared expert
    "qwen3_5_moe": ("qwen35moe", "Qwen3_5MoeTextConfig", QWEN3_5_MOE, ["qwen3_5_names", "qwen3_5_moe_text"],
                    {"blk.3.attn_v.weight": Q.Q8_0, "blk.0.ffn_down_exps.weight": Q.Q8_0,
                     "blk.2.ffn_up_shexp.weight": Q.Q4_0}),
    # the same with gate and up experts fused (the converter's --fuse-gate-up-exps)
    "qwen3_5_moe_fused_experts": ("qwen35moe_fused", "Qwen3_5MoeTextConfig", QWEN3_5_MOE,
                                  ["qwen3_5_names", "qwen3_5_moe_text"], {"blk.1.ffn_gate_up_exps.weight": Q.Q8_0}),
    # Kimi Linear: KDA and NoPE MLA layers (told by head_count_kv per layer), a dense first layer,
    # then sigmoid routing with a selection bias and a shared expert
    "kimi_linear": ("kimi-linear", "KimiLinearConfig", KIMI_LINEAR, ["kimi_linear_names", "kimi_linear"],
                    {"blk.1.attn_output.weight": Q.Q8_0, "blk.2.ffn_up_exps.weight": Q.Q8_0}),
    # a low-rank query (attn_q_a / attn_q_b), kv_b_proj whole as older converters wrote it
    "kimi_linear_q_lora": ("kimi-linear_kv_b", "KimiLinearConfig", dict(KIMI_LINEAR, q_lora_rank=32),
                           ["kimi_linear_names", "kimi_linear"], {"blk.3.attn_q_b.weight": Q.Q8_0}),
    # V2-Lite: full-rank q, softmax routing (no gating key: llama.cpp's default), attn_k_b / attn_v_b
    "deepseek_v2_lite": ("deepseek2", "DeepseekV2Config",
                         dict(SMALL, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                              n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.5,
                              tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                         ["deepseek_v3"], {"blk.0.ffn_down.weight": Q.Q8_0}),
    # reach families (docs/coverage.md) that llama.cpp converts
    "gemma": ("gemma", "GemmaConfig",
              dict(SMALL, head_dim=32, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
              ["llama"], {"blk.1.ffn_gate.weight": Q.Q8_0}),
    "seed_oss": ("seed_oss", "SeedOssConfig",
                 dict(SMALL, head_dim=32, attention_bias=True, attention_out_bias=True, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
                 ["llama"], {"blk.0.ffn_down.weight": Q.Q8_0}),
    # general.architecture olmo2 with a window and its per-layer pattern (window 4 < the positions
    # checked; layer 1 full, against config.json's every-4th default)
    "olmo3": ("olmo3", "Olmo3Config",
              dict(SMALL, num_hidden_layers=3, sliding_window=4, tie_word_embeddings=False,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
              ["olmo2"], {"blk.2.ffn_up.weight": Q.Q8_0}),
    # window 4 < the positions checked; full layers without RoPE
    "exaone4": ("exaone4", "Exaone4Config",
                dict(SMALL, num_hidden_layers=4, head_dim=16, sliding_window=4, sliding_window_pattern=2,
                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                ["olmo2"], {"blk.1.ffn_down.weight": Q.Q8_0}),
    "ernie4_5": ("ernie4_5", "Ernie4_5Config",
                 dict(SMALL, head_dim=16, use_bias=True, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                 ["llama"], {"blk.0.attn_output.weight": Q.Q8_0}),
    "arcee": ("arcee", "ArceeConfig",
              dict(SMALL, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["arcee"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    "hunyuan_dense": ("hunyuan-dense", "HunYuanDenseV1Config",
                      dict(SMALL, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                      ["hunyuan_v1_dense"], {"blk.0.ffn_up.weight": Q.Q8_0}),
    # partial rotary (half the head), sandwich norms, the fused gate_up as ffn_up
    "glm4": ("glm4", "Glm4Config",
             dict(SMALL, head_dim=32, attention_bias=True, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
             ["glm4"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    # LayerNorm, learned positions, Conv1D weights stored transposed
    "gpt2": ("gpt2", "GPT2Config",
             dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None),
             ["gpt2"], {"blk.1.attn_output.weight": Q.Q8_0}),
    # partial rotary, parallel residual, query_key_value stored part-major
    "gpt_neox": ("gptneox", "GPTNeoXConfig",
                 dict(SMALL, tie_word_embeddings=False, use_parallel_residual=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                 ["gpt_neox"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    "starcoder2": ("starcoder2", "Starcoder2Config",
                   dict(SMALL, use_bias=True, sliding_window=None, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
                   ["starcoder2"], {"blk.0.ffn_down.weight": Q.Q8_0}),
    # StableLM 2 1.6B's form: sequential residual, q/k/v biases, a quarter of each head rotated
    "stablelm": ("stablelm", "StableLmConfig",
                 dict(SMALL, use_parallel_residual=False, use_qkv_bias=True, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
                 ["stablelm"], {"blk.1.ffn_gate.weight": Q.Q8_0}),
    # every 4th layer full and without RoPE (no pattern in the file), window 4 < the positions checked
    "cohere2": ("cohere2", "Cohere2Config",
                dict(SMALL, num_hidden_layers=4, sliding_window=4, logit_scale=0.25, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
                ["cohere"], {"blk.3.ffn_up.weight": Q.Q8_0}),
    # layernorm1p stored as 1 + w, partial rotary, ReLU^2 up / down
    "nemotron": ("nemotron", "NemotronConfig",
                 dict(SMALL, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                 ["nemotron"], {"blk.0.ffn_down.weight": Q.Q8_0}),
    "mamba": ("mamba", "MambaConfig",
              dict(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                   time_step_rank=8, use_conv_bias=True, use_bias=False, tie_word_embeddings=True,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None),
              ["mamba"], {"blk.1.ssm_in.weight": Q.Q8_0}),
    # one epsilon in the file: llama.cpp's dt / B / C norms use it too
    "falcon_mamba": ("mamba", "FalconMambaConfig",
                     dict(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                          time_step_rank=8, use_conv_bias=True, use_bias=False, tie_word_embeddings=False,
                          layer_norm_epsilon=1e-5, mixer_rms_eps=1e-5,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None),
                     ["mamba"], {"blk.0.ssm_out.weight": Q.Q8_0}),
    "mamba2": ("mamba2", "Mamba2Config",
               dict(vocab_size=128, hidden_size=64, num_heads=8, head_dim=16, state_size=8, n_groups=2, expand=2,
                    num_hidden_layers=2, conv_kernel=4, chunk_size=4, use_conv_bias=True, use_bias=False,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None),
               ["mamba2"], {"blk.1.ssm_out.weight": Q.Q8_0}),
    # parameter-free LayerNorms, q/k/v clamped
    "olmo": ("olmo", "OlmoConfig",
             dict(SMALL, clip_qkv=0.5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
             ["olmo"], {"blk.1.ffn_gate.weight": Q.Q8_0}),
    # ALiBi, a LayerNorm on the embeddings, query_key_value stored part-major
    "bloom": ("bloom", "BloomConfig",
              dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, tie_word_embeddings=True,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None),
              ["bloom"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    # ALiBi, bias-free LayerNorms, Wqkv as it is, q/k/v clamped
    "mpt": ("mpt", "MptConfig",
            dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=256, tie_word_embeddings=True,
                 attn_config={"clip_qkv": 0.5}, bos_token_id=None, eos_token_id=None, pad_token_id=None),
            ["mpt"], {"blk.0.ffn_down.weight": Q.Q8_0}),
    # Falcon-40B's form: grouped kv heads, parallel attention and MLP with a norm each
    "falcon_40b": ("falcon", "FalconConfig",
                   dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                        new_decoder_architecture=True, parallel_attn=True, bias=False, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None),
                   ["falcon"], {"blk.0.ffn_up.weight": Q.Q8_0}),
    # Falcon-7B's: multi-query, one shared norm (read back as the new architecture's one-group case)
    "falcon_7b": ("falcon", "FalconConfig",
                  dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None),
                  ["falcon"], {"blk.1.attn_output.weight": Q.Q8_0}),
    # one shared LayerNorm, parallel attention and MLP, partial rotary, a head with a bias
    "phi2": ("phi2", "PhiConfig",
             dict(SMALL, num_key_value_heads=4, intermediate_size=256, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
             ["phi"], {"blk.1.ffn_down.weight": Q.Q8_0}),
    # multi-query c_attn [q | k | v], learned positions, nn.Linear weights as they are
    "gpt_bigcode": ("starcoder", "GPTBigCodeConfig",
                    dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None),
                    ["gpt_bigcode"], {"blk.0.ffn_up.weight": Q.Q8_0}),
    # Command R: one bias-free LayerNorm, parallel attention and MLP, rotary in interleaved pairs
    "cohere": ("command-r", "CohereConfig",
               dict(SMALL, logit_scale=0.25, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 8e6}),
               ["cohere"], {"blk.1.attn_v.weight": Q.Q8_0}),
    # EXAONE 3: Llama under GPT-2-style names, not permuted
    "exaone": ("exaone", "ExaoneConfig",
               dict(SMALL, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
               ["exaone_names", "llama"], {"blk.0.ffn_gate.weight": Q.Q8_0}),
    # Granite's multipliers over experts whose fused input_linear the converter splits
    "granitemoe": ("granitemoe", "GraniteMoeConfig",
                   dict(SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                        tie_word_embeddings=True, attention_multiplier=0.2, embedding_multiplier=3.0,
                        residual_multiplier=0.5, logits_scaling=4.0,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                   ["granitemoe"], {"blk.1.ffn_up_exps.weight": Q.Q8_0}),
    "granitemoeshared": ("granitemoe", "GraniteMoeSharedConfig",
                         dict(SMALL, intermediate_size=32, shared_intermediate_size=48, num_local_experts=4,
                              num_experts_per_tok=2, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                         ["granitemoe"], {"blk.0.ffn_gate_shexp.weight": Q.Q8_0}),
    # q/k norms, a dense first layer, sigmoid routing with a selection bias and a shared expert
    "dots1": ("dots1", "Dots1Config",
              dict(SMALL, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["dots1"], {"blk.1.ffn_gate_exps.weight": Q.Q8_0}),
    # q/k norms after RoPE, softmax top-k experts beside an always-on shared MLP
    "hunyuan_moe": ("hunyuan-moe", "HunYuanMoEV1Config",
                    dict(SMALL, intermediate_size=32, head_dim=16, num_experts=4, moe_topk=2, attention_bias=False,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                    ["hunyuan_v1_moe"], {"blk.1.ffn_down_exps.weight": Q.Q8_0}),
    # a dense first layer, then MoE every layer: softmax routing chosen with a selection bias,
    # a shared expert
    "ernie4_5_moe": ("ernie4_5-moe", "Ernie4_5_MoeConfig",
                     dict(SMALL, num_hidden_layers=3, moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
                          moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1,
                          moe_layer_end_index=2, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                     ["ernie4_5_moe"], {"blk.2.ffn_up_exps.weight": Q.Q8_0}),
    # LayerNorms with biases, biased projections, ReLU^2 up / down
    "jais2": ("jais2", "Jais2Config",
              dict(SMALL, head_dim=16, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["nemotron"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    # q/k norms over the whole projection, partial rotary, sigmoid routing with a selection bias
    "minimax_m2": ("minimax-m2", "MiniMaxM2Config",
                   dict(SMALL, intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}),
                   ["minimax_m2"], {"blk.0.ffn_gate_exps.weight": Q.Q8_0}),
    # short-conv and attention layers told by head_count_kv per layer, the auto-adjusted FFN width
    "lfm2": ("lfm2", "Lfm2Config",
             dict(SMALL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], block_multiple_of=32,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
             ["lfm2"], {"blk.1.ffn_down.weight": Q.Q8_0}),
    # sliding layers with RoPE, full ones without (window 4 < the positions checked); a dense first
    # layer, then sigmoid routing with a selection bias and a shared expert
    "exaone_moe": ("exaone-moe", "ExaoneMoeConfig",
                   dict(SMALL, num_hidden_layers=4, head_dim=16, moe_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, sliding_window=4,
                        sliding_window_pattern=2, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                   ["exaone_moe"], {"blk.2.ffn_up_exps.weight": Q.Q8_0}),
    # LFM2's layout with a dense first layer, then sigmoid routing with a selection bias
    "lfm2_moe": ("lfm2moe", "Lfm2MoeConfig",
                 dict(SMALL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_dense_layers=1,
                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                 ["lfm2_moe"], {"blk.2.ffn_up_exps.weight": Q.Q8_0}),
    # Granite-4.0-H: Mamba2 (8 heads of 16, 2 groups) around NoPE attention, MoE + shared MLP on
    # every layer, Granite's multipliers; head_count_kv per layer tells the pattern
    "granitemoehybrid": ("granitehybrid", "GraniteMoeHybridConfig",
                         dict(SMALL, num_hidden_layers=3, intermediate_size=32, shared_intermediate_size=48,
                              num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
                              mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4,
                              embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2,
                              logits_scaling=3.0, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                         ["granitemoehybrid"], {"blk.0.ssm_in.weight": Q.Q8_0, "blk.1.ffn_down_exps.weight": Q.Q8_0}),
    # Bamba (the same architecture, rope.scaling.finetuned): Mamba2 around GQA attention rotating
    # half of each head, a dense SwiGLU on every layer
    "bamba": ("granitehybrid", "BambaConfig",
              dict(SMALL, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                   mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["bamba"], {"blk.2.ssm_out.weight": Q.Q8_0}),
    # one sub-layer per layer: Mamba2 (8 heads of 16, 2 groups), NoPE attention, squared-ReLU MLP,
    # Mamba2; the pattern from head_count_kv and feed_forward_length per layer
    "nemotron_h": ("nemotron_h", "NemotronHConfig",
                   dict(SMALL, layers_block_type=["mamba", "attention", "mlp", "mamba"], head_dim=16,
                        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=4,
                        tie_word_embeddings=False),
                   ["nemotron_h"], {"blk.2.ffn_up.weight": Q.Q8_0, "blk.3.ssm_in.weight": Q.Q8_0}),
    # attention and Mamba2 (8 heads of 16, 2 groups) summed on every layer; every µP multiplier off
    # 1, folded into the weights by the converter
    "falcon_h1": ("falcon-h1", "FalconH1Config", dict(SMALL, **FALCON_H1), ["falcon_h1"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    # the same with the grouped Mamba2 output norm (after the gate, as llama.cpp runs it)
    "falcon_h1_norm": ("falcon-h1", "FalconH1Config", dict(SMALL, **FALCON_H1, mamba_rms_norm=True,
                                                           mamba_norm_before_gate=False),
                       ["falcon_h1"], {"blk.0.ffn_up.weight": Q.Q4_0}),
    # Mamba-1 with dt / B / C norms, NoPE attention on layer 2, 4 experts on layers 1 and 3 (told by
    # their routers), a SwiGLU MLP on 0 and 2
    "jamba": ("jamba", "JambaConfig",
              dict(SMALL, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                   expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_dt_rank=8, mamba_d_state=8,
                   tie_word_embeddings=False),
              ["jamba"], {"blk.3.ffn_up_exps.weight": Q.Q8_0, "blk.0.ssm_x.weight": Q.Q8_0}),
    # fused Wqkv clamped (0.05: the clamp bites), bias-free LayerNorms, the expert matrices stored
    # as llama.cpp's stacks; the converter writes attn_config's rope_theta, which transformers'
    # rotary ignores for rope_parameters: the twin has both the same
    "dbrx": ("dbrx", "DbrxConfig",
             dict(vocab_size=128, d_model=64, n_heads=4, n_layers=2, max_seq_len=256, tie_word_embeddings=False,
                  attn_config=dict(kv_n_heads=2, clip_qkv=0.05, rope_theta=5e5),
                  rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                  ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                  bos_token_id=None, eos_token_id=None, pad_token_id=None),
             ["dbrx"], {"blk.1.ffn_gate_exps.weight": Q.Q8_0, "blk.0.ffn_down_exps.weight": Q.Q8_0},
             1e-4),  # transformers' DBRX is 2e-5 from zoo's through safetensors too (reach_moe/dbrx's rtol)
    # MLA with q_lora and a whole kv_b (no split), RoPE on halves, llama.cpp's fixed µP multipliers
    "minicpm3": ("minicpm3", "MiniCPM3Config",
                 dict(SMALL, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=16, scale_emb=12, scale_depth=1.4, dim_model_base=256,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                 ["minicpm3"], {"blk.1.attn_kv_a_mqa.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q8_0}),
    # per-head q/k norms, a non-gated xIELU MLP whose learned scalars llama.cpp stores as metadata
    "apertus": ("apertus", "ApertusConfig",
                dict(SMALL, head_dim=16, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                ["apertus"], {"blk.1.ffn_up.weight": Q.Q8_0}),
    # three sliding layers with RoPE (window 4 < the positions checked), one full without; q/k
    # norms, a sigmoid output gate, sandwich norms; a dense first layer, then sigmoid routing with a
    # selection bias, renormalised (route_norm: Trinity's config.json key the converter reads) x
    # route_scale, a shared expert; embeddings x sqrt(d)
    "afmoe": ("afmoe", "AfmoeConfig",
              dict(SMALL, num_hidden_layers=4, head_dim=16, moe_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, route_scale=1.7, route_norm=True,
                   mup_enabled=True, sliding_window=4, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
              ["afmoe"], {"blk.2.ffn_up_exps.weight": Q.Q8_0, "blk.0.attn_gate.weight": Q.Q8_0}),
}


def twin(config_class: str, kwargs: dict):
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek-V3's, LFM2-MoE's selection bias
                b.uniform_(-0.3, 0.3)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_family_matches_transformers(tmp_path, family):
    layout, config_class, kwargs, rules, quantized, *rtol = FAMILIES[family]  # rtol: as the family harness's
    ref = twin(config_class, kwargs)
    path = write_gguf(tmp_path / f"{family}.gguf", ref, LAYOUTS[layout], quantize=quantized)
    # the float path (quant=none: the blocks dequantized), tight; the kept default: test_gguf_moe_kept_by_default
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, quant="none")
    assert m.spec.checkpoint.rules == rules
    # every tensor of the file is read, and those the map makes of metadata (Apertus's xIELU scalars)
    assert m.info.load.tensors_read == len(GGUFSource(str(path)).entries()) >= len(gguf.GGUFReader(str(path)).tensors)
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=4, rtol=rtol[0] if rtol else 1e-5)


# ------------------------------------------------------------------------------ bad input


def test_unknown_architecture_names_it_and_the_file(tmp_path):
    ref = twin("Qwen2Config", FAMILIES["qwen2"][2])
    path = write_gguf(tmp_path / "odd.gguf", ref, LAYOUTS["qwen2"], arch="qwen9")
    with pytest.raises(CheckpointError, match=rf"{path}.*unsupported GGUF architecture 'qwen9' \(supported: .*qwen2"):
        zoo.from_pretrained(str(path), compile=False)


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_rope_scaling_the_map_cannot_express(tmp_path, kind):
    ref = twin("Qwen2Config", FAMILIES["qwen2"][2])
    path = write_gguf(tmp_path / "rope.gguf", ref, LAYOUTS["qwen2"],
                      extra={"{arch}.rope.scaling.type": kind, "{arch}.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match=rf"{path} \(GGUF, general.architecture='qwen2'\): "
                                              rf"unsupported RoPE scaling type '{kind}'"):
        zoo.from_pretrained(str(path), compile=False)


def test_yarn_knob_without_a_config_counterpart(tmp_path):
    ref = twin("Qwen3Config", FAMILIES["qwen3_yarn"][2])
    path = write_gguf(tmp_path / "yarn.gguf", ref, LAYOUTS["qwen3"], extra={"{arch}.rope.scaling.yarn_ext_factor": 0.5})
    with pytest.raises(CheckpointError, match=rf"{path}.*qwen3.rope.scaling.yarn_ext_factor = 0.5 is not supported"):
        zoo.from_pretrained(str(path), compile=False)


def test_size_dependent_scale_is_refused(tmp_path):
    """A Gemma 2 file with the 27B's layer count: llama.cpp would scale its scores differently."""
    ref = twin("Gemma2Config", dict(FAMILIES["gemma2"][2], num_hidden_layers=46, hidden_size=32,
                                    intermediate_size=32, vocab_size=32))
    path = write_gguf(tmp_path / "g27.gguf", ref, LAYOUTS["gemma2"])
    with pytest.raises(CheckpointError, match=r"size-dependent attention scale.*gemma2.block_count = 46"):
        zoo.from_pretrained(str(path), compile=False)


def test_tensor_shape_disagreeing_with_metadata(tmp_path):
    ref = twin("Qwen2Config", FAMILIES["qwen2"][2])
    ref.config.intermediate_size = 96  # the file says 96; its ffn tensors are 128 wide
    path = write_gguf(tmp_path / "shape.gguf", ref, LAYOUTS["qwen2"])
    with pytest.raises(CheckpointError, match=r"shape") as err:
        zoo.from_pretrained(str(path), compile=False)
    assert str(path) in str(err.value) and "ffn" in str(err.value)


def test_olmo3_sliding_rope_base_of_its_own_is_refused(tmp_path):
    """llama.cpp rotates Olmo 3's sliding layers with rope.freq_base: a file whose freq_base_swa
    differs would be another model in transformers, so it is refused, naming both keys."""
    ref = twin("Olmo3Config", FAMILIES["olmo3"][2])
    path = write_gguf(tmp_path / "o3.gguf", ref, LAYOUTS["olmo3"], extra={"{arch}.rope.freq_base_swa": 1e4})
    with pytest.raises(CheckpointError, match=rf"{path}.*separate rope base for the sliding layers is not supported "
                                              rf"\(olmo2.rope.freq_base_swa = 10000.0, olmo2.rope.freq_base = 500000.0\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_llama_moe_file_with_a_window_is_refused(tmp_path):
    """The llama_moe variant refuses what its map cannot express, instead of dropping it."""
    ref = twin("MixtralConfig", FAMILIES["mixtral_as_llama"][2])
    path = write_gguf(tmp_path / "moe.gguf", ref, LAYOUTS["mixtral"],
                      extra={"{arch}.attention.sliding_window": 4})
    with pytest.raises(CheckpointError, match=r"sliding-window attention is not supported for llama GGUF"):
        zoo.from_pretrained(str(path), compile=False)


def test_routing_the_maps_cannot_express(tmp_path):
    """DeepSeek-V2's group-limited softmax routing (llama.cpp scores a group by its best two
    experts, transformers' V2 by its best one) and a glm4moe file routed by softmax are refused,
    naming the key, its value and the file."""
    v2 = twin("DeepseekV2Config", dict(FAMILIES["deepseek_v2_lite"][2], topk_method="group_limited_greedy",
                                       n_group=2, topk_group=1))
    path = write_gguf(tmp_path / "v2.gguf", v2, LAYOUTS["deepseek2"])
    with pytest.raises(CheckpointError, match=rf"{path}.*group-limited softmax routing .*is not supported "
                                              rf"\(deepseek2.expert_group_count = 2\)"):
        zoo.from_pretrained(str(path), compile=False)
    glm = twin("Glm4MoeConfig", FAMILIES["glm4_moe"][2])
    path = write_gguf(tmp_path / "glm.gguf", glm, LAYOUTS["glm4moe"], extra={"{arch}.expert_gating_func": 1})
    with pytest.raises(CheckpointError, match=rf"{path}.*softmax routing is not supported for glm4moe "
                                              rf"\(glm4moe.expert_gating_func = 1\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_deepseek_yarn_needs_its_log_multiplier(tmp_path):
    """Without yarn_log_multiplier (DeepSeek's mscale_all_dim) the attention scale is unknown."""
    ref = twin("DeepseekV3Config", FAMILIES["deepseek_v3"][2])
    ref.config.rope_parameters = {k: v for k, v in ref.config.rope_parameters.items() if not k.startswith("mscale")}
    path = write_gguf(tmp_path / "yarn.gguf", ref, LAYOUTS["deepseek2"])
    with pytest.raises(CheckpointError, match=rf"{path}.*yarn RoPE without deepseek2.rope.scaling.yarn_log_multiplier"):
        zoo.from_pretrained(str(path), compile=False)


def test_glm_mtp_block_is_skipped_with_its_reason(tmp_path):
    """GLM-4.5 files carry the MTP layer as the last block (blk.{n_layers}: a decoder block plus
    its nextn.* parts): with checkpoint.mtp=false every tensor of it is skipped, with the reason in
    the load report, and the model is the twin."""
    ref = twin("Glm4MoeConfig", FAMILIES["glm4_moe"][2])
    D, n = ref.config.hidden_size, ref.config.num_hidden_layers
    mtp = {f"blk.{n}.nextn.eh_proj.weight": torch.randn(D, 2 * D), f"blk.{n}.nextn.enorm.weight": torch.ones(D),
           f"blk.{n}.nextn.hnorm.weight": torch.ones(D), f"blk.{n}.nextn.shared_head_norm.weight": torch.ones(D),
           f"blk.{n}.attn_norm.weight": torch.ones(D), f"blk.{n}.attn_q.weight": torch.randn(64, D)}
    path = write_gguf(tmp_path / "glm_mtp.gguf", ref, LAYOUTS["glm4moe"], extra_tensors=mtp)
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    skipped = dict(m.info.load.ignored)
    assert all("multi-token-prediction" in skipped[name] for name in mtp), skipped
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=1)


def test_qwen35_mtp_block_is_skipped_with_its_reason(tmp_path):
    """Qwen3.5 files count the MTP layer in block_count (nextn_predict_layers of them) and store it
    as the last block, blk.{n_layers}.*: the map reads the main layers' count, every tensor of the
    block is skipped with the reason in the load report, and the model is the twin."""
    ref = twin("Qwen3_5TextConfig", FAMILIES["qwen3_5"][2])
    ref.config.mtp_num_hidden_layers = 1  # what a Qwen3.5 config.json says; the twin has no MTP weights
    D, n = ref.config.hidden_size, ref.config.num_hidden_layers
    mtp = {f"blk.{n}.nextn.eh_proj.weight": torch.randn(D, 2 * D), f"blk.{n}.nextn.enorm.weight": torch.ones(D),
           f"blk.{n}.attn_norm.weight": torch.ones(D), f"blk.{n}.attn_q.weight": torch.randn(128, D)}
    path = write_gguf(tmp_path / "q35_mtp.gguf", ref, LAYOUTS["qwen35"], extra_tensors=mtp)
    reader = gguf.GGUFReader(str(path))
    assert reader.get_field("qwen35.block_count").contents() == n + 1
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    skipped = dict(m.info.load.ignored)
    assert all("multi-token-prediction" in skipped[name] for name in mtp), skipped
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=1)


def test_kimi_linear_softmax_routing_is_refused(tmp_path):
    """A kimi-linear file routed by softmax (expert_gating_func 1; llama.cpp follows the file) is not
    Kimi Linear's sigmoid router: refused, naming the key, its value and the file."""
    ref = twin("KimiLinearConfig", FAMILIES["kimi_linear"][2])
    ref.config.moe_router_activation_func = "softmax"
    path = write_gguf(tmp_path / "kimi.gguf", ref, LAYOUTS["kimi-linear"])
    with pytest.raises(CheckpointError, match=rf"{path}.*softmax routing is not supported for kimi-linear "
                                              rf"\(kimi-linear.expert_gating_func = 1\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_what_the_new_maps_cannot_express(tmp_path):
    """MPT without ALiBi, dots.llm1 routed by softmax and Command R+'s per-head q/k LayerNorms are
    refused, each naming the file and what it has, never loaded as another model."""
    mpt = twin("MptConfig", FAMILIES["mpt"][2])
    mpt.config.attn_config.alibi = False  # the converter then writes max_alibi_bias 0
    path = write_gguf(tmp_path / "mpt.gguf", mpt, LAYOUTS["mpt"])
    with pytest.raises(CheckpointError, match=rf"{path}.*MPT without ALiBi .*mpt.attention.max_alibi_bias = 0.0"):
        zoo.from_pretrained(str(path), compile=False)
    dots = twin("Dots1Config", FAMILIES["dots1"][2])
    path = write_gguf(tmp_path / "dots.gguf", dots, LAYOUTS["dots1"], extra={"{arch}.expert_gating_func": 1})
    with pytest.raises(CheckpointError, match=rf"{path}.*softmax routing is not supported for dots1 "
                                              rf"\(dots1.expert_gating_func = 1\)"):
        zoo.from_pretrained(str(path), compile=False)
    cohere = twin("CohereConfig", FAMILIES["cohere"][2])
    path = write_gguf(tmp_path / "rplus.gguf", cohere, LAYOUTS["command-r"],
                      extra_tensors={f"blk.{i}.attn_{k}_norm.weight": torch.ones(4, 16) for i in (0, 1) for k in "qk"})
    with pytest.raises(ConfigError, match=rf"{path}.*use_qk_norm=True is not supported for model_type 'cohere'"):
        zoo.from_pretrained(str(path), compile=False)


def test_granitehybrid_files_the_maps_refuse_or_read(tmp_path):
    """granitehybrid: a q/k bias only on the attention layer is found ({layer} in tensor_present);
    a file without experts (the dense Granite-4.0-H) is refused by the granitemoehybrid import, and
    a rotating (Bamba) file with Granite's multipliers by the bamba variant, each naming what it has."""
    from zoo.compiler.checkpoint.gguf import GGUFSource

    bamba = twin("BambaConfig", dict(FAMILIES["bamba"][2], attention_bias=True))
    path = write_gguf(tmp_path / "bias.gguf", bamba, LAYOUTS["granitehybrid"])
    source = GGUFSource(path)
    assert "blk.0.attn_q.bias" not in source.entries() and source.config()["attention_bias"] is True
    source.close()
    path = write_gguf(tmp_path / "mult.gguf", bamba, LAYOUTS["granitehybrid"], extra={"{arch}.embedding_scale": 2.0})
    with pytest.raises(CheckpointError, match=rf"{path}.*Granite's multipliers in a granitehybrid file with RoPE "
                                              rf".*\(granitehybrid.embedding_scale is set\)"):
        zoo.from_pretrained(str(path), compile=False)
    moe = twin("GraniteMoeHybridConfig", FAMILIES["granitemoehybrid"][2])
    path = write_gguf(tmp_path / "dense.gguf", moe, LAYOUTS["granitehybrid"], extra={"{arch}.expert_count": 0})
    with pytest.raises(ConfigError, match=r"num_local_experts > 0.*MoE plus the shared MLP"):
        zoo.from_pretrained(str(path), compile=False)


def test_nemotron_h_layer_claimed_by_two_arrays_is_refused(tmp_path):
    """A nemotron_h file whose feed_forward_length is one width for every layer (not the per-layer
    array the converter writes) sets the attention layer twice: refused, naming the layer and keys."""
    ref = twin("NemotronHConfig", FAMILIES["nemotron_h"][2])
    path = write_gguf(tmp_path / "nh.gguf", ref, LAYOUTS["nemotron_h"], extra={"{arch}.feed_forward_length": 128})
    with pytest.raises(CheckpointError, match=rf"{path}.*layer 1 is set in both nemotron_h.attention.head_count_kv "
                                              rf"and nemotron_h.feed_forward_length; expected one of attention, mlp"):
        zoo.from_pretrained(str(path), compile=False)


def test_jamba_schedule_no_period_states_is_refused(tmp_path):
    """Jamba's layers come back as layer % period == offset: a file whose routers sit on layers
    no such schedule gives (here 1, 2 and 3 of 4) is refused, naming the tensor and the layers."""
    ref = twin("JambaConfig", FAMILIES["jamba"][2])
    D, E = ref.config.hidden_size, ref.config.num_experts
    path = write_gguf(tmp_path / "j.gguf", ref, LAYOUTS["jamba"],
                      extra_tensors={"blk.2.ffn_gate_inp.weight": torch.zeros(E, D)})
    with pytest.raises(CheckpointError, match=rf"{path}.*blk.{{layer}}.ffn_gate_inp.weight is set on layers \[1, 2, 3\] "
                                              rf"of 4; expected the layers i % period == offset"):
        zoo.from_pretrained(str(path), compile=False)


def test_falcon_h1_file_with_multipliers_as_metadata_is_refused(tmp_path):
    """Falcon-H1 GGUFs from TII's pre-upstream fork keep µP multipliers as metadata (ssm.has_mup,
    mlp_gate_multiplier, ...): whether their weights hold them cannot be told, so they are refused."""
    ref = twin("FalconH1Config", FAMILIES["falcon_h1"][2])
    path = write_gguf(tmp_path / "fh1.gguf", ref, LAYOUTS["falcon-h1"], extra={"{arch}.mlp_gate_multiplier": 0.5})
    with pytest.raises(CheckpointError, match=rf"{path}.*µP multipliers kept as metadata .*are not supported "
                                              rf"\(falcon-h1.mlp_gate_multiplier is set\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_minicpm3_longrope_factors_are_read_from_their_tensors(tmp_path):
    """MiniCPM3's converter stores LongRoPE's factors as rope_factors_long / rope_factors_short
    tensors (no metadata): the map reads them back as the rope's lists (the short ones below the
    pre-training length, context_length, as transformers and llama.cpp pick), the tensors skipped
    as config; and a file stating µP multipliers of its own is refused (llama.cpp fixes them)."""
    long, short = [1.0, 2.0, 3.5, 5.0], [1.5, 1.0, 2.0, 1.25]
    ref = twin("MiniCPM3Config", dict(FAMILIES["minicpm3"][2], rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "long_factor": long, "short_factor": short,
        "original_max_position_embeddings": 256}))
    path = write_gguf(tmp_path / "longrope.gguf", ref, LAYOUTS["minicpm3"])
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    rope = m.spec.rope
    assert (rope.kind, list(rope.long_factor), list(rope.short_factor)) == ("longrope", long, short)
    skipped = dict(m.info.load.ignored)
    assert "LongRoPE" in skipped["rope_factors_long.weight"] and "LongRoPE" in skipped["rope_factors_short.weight"]
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=4)
    path = write_gguf(tmp_path / "mup.gguf", ref, LAYOUTS["minicpm3"], extra={"{arch}.embedding_scale": 10.0})
    with pytest.raises(CheckpointError, match=rf"{path}.*µP multipliers of a file's own are not supported for "
                                              rf"minicpm3 .*\(minicpm3.embedding_scale is set\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_apertus_xielu_scalars_and_llama3_rope_from_the_file(tmp_path):
    """Apertus's converter writes xIELU's per-layer scalars as metadata arrays and Llama 3 rope
    scaling as rope_freqs.weight: both are read back (alpha_p / alpha_n made random per layer, so a
    swapped or dropped one shows; the divisors as a LongRoPE without attention factor), and a file
    whose beta differs from transformers' constant is refused."""
    ref = twin("ApertusConfig", dict(FAMILIES["apertus"][2], rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}))
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.act_fn.alpha_p.uniform_(-1.0, 1.0)
            layer.mlp.act_fn.alpha_n.uniform_(-1.0, 1.0)
    path = write_gguf(tmp_path / "apertus.gguf", ref, LAYOUTS["apertus"], quantize={"blk.0.attn_q.weight": Q.Q8_0})
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, quant="none")  # the float path, tight
    assert m.spec.rope.kind == "longrope" and "rope config" in dict(m.info.load.ignored)["rope_freqs.weight"]
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=4)
    path = write_gguf(tmp_path / "beta.gguf", ref, LAYOUTS["apertus"])
    src = GGUFSource(path)
    assert src.metadata("xielu.beta") == [0.5, 0.5]
    src.close()
    bad = twin("ApertusConfig", FAMILIES["apertus"][2])
    bad.model.layers[1].mlp.act_fn.beta.fill_(0.25)
    path = write_gguf(tmp_path / "beta.gguf", bad, LAYOUTS["apertus"])
    with pytest.raises(CheckpointError, match=rf"{path}.*xIELU with a beta other than transformers' 0.5 is not "
                                              rf"supported \(xielu.beta = \[0.5, 0.25\], expected 0.5\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_afmoe_files_llama_cpp_runs_otherwise_are_refused(tmp_path):
    """llama.cpp leaves AFMoE's top-k weights as they are without expert_weights_norm (the
    converter writes it only from config.json's route_norm) and routes by softmax when the file
    says so; transformers' AFMoE always renormalises sigmoid scores: both files are refused,
    naming the key and the file."""
    kwargs = {k: v for k, v in FAMILIES["afmoe"][2].items() if k != "route_norm"}
    path = write_gguf(tmp_path / "no_norm.gguf", twin("AfmoeConfig", kwargs), LAYOUTS["afmoe"])
    with pytest.raises(CheckpointError, match=rf"{path}.*top-k weights not renormalised .*not supported for afmoe "
                                              rf"\(afmoe.expert_weights_norm is not set\)"):
        zoo.from_pretrained(str(path), compile=False)
    path = write_gguf(tmp_path / "softmax.gguf", twin("AfmoeConfig", FAMILIES["afmoe"][2]), LAYOUTS["afmoe"],
                      extra={"{arch}.expert_gating_func": 1})
    with pytest.raises(CheckpointError, match=rf"{path}.*softmax routing is not supported for afmoe "
                                              rf"\(afmoe.expert_gating_func = 1\)"):
        zoo.from_pretrained(str(path), compile=False)


def test_dbrx_norm_epsilon_is_the_fixed_one(tmp_path):
    """transformers' DBRX norms use nn.LayerNorm's 1e-5 whatever the file says (the converter
    always writes 1e-5): a file with another epsilon is refused, naming the key, its value and
    the one expected."""
    ref = twin("DbrxConfig", FAMILIES["dbrx"][2])
    path = write_gguf(tmp_path / "eps.gguf", ref, LAYOUTS["dbrx"], extra={"{arch}.attention.layer_norm_epsilon": 1e-6})
    with pytest.raises(CheckpointError, match=rf"{path}.*LayerNorm epsilon other than DBRX's fixed 1e-5 is not "
                                              rf"supported \(dbrx.attention.layer_norm_epsilon = 9.99.*e-07, expected 1e-05\)"):
        zoo.from_pretrained(str(path), compile=False)


# ------------------------------------------------------------------------------ expert stacks as stored

# qwen3moe: layer 0's gate / up Q4_0 (joined by the rule's cat, one type: int4) and down Q8_0;
# layer 1's gate Q8_0 with up Q4_1 (joined across types: int8 through ZQ8) and down Q4_1
EXPERT_BLOCKS = {"blk.0.ffn_gate_exps.weight": Q.Q4_0, "blk.0.ffn_up_exps.weight": Q.Q4_0,
                 "blk.0.ffn_down_exps.weight": Q.Q8_0, "blk.1.ffn_gate_exps.weight": Q.Q8_0,
                 "blk.1.ffn_up_exps.weight": Q.Q4_1, "blk.1.ffn_down_exps.weight": Q.Q4_1}


def _exps(layers, types: dict) -> dict:
    return {f"blk.{i}.ffn_{k}_exps.weight": getattr(Q, t) for i in layers for k, t in types.items()}


# the kept default on MoE twins: every expert stack of a file in a block type (each kept type of
# QuantExperts: Q4_0 / Q4_1 as int4, Q5_0 / Q5_1 as int5, Q8_0 / MXFP4 as int8 codes), next to F32 linears
MOE_KEPT = {
    "qwen3moe": {**_exps((0, 1), dict(gate="Q4_0", up="Q4_0", down="Q8_0")), "blk.0.attn_output.weight": Q.Q5_1},
    "olmoe": _exps((0, 1), dict(gate="Q4_1", up="Q4_1", down="Q5_0")),
    "deepseek_v2_lite": {**_exps((1,), dict(gate="Q5_1", up="Q5_1", down="Q4_0")), "blk.1.ffn_down_shexp.weight": Q.Q8_0},
    "gpt_oss": _exps((0, 1), dict(gate="MXFP4", up="MXFP4", down="MXFP4")),
}


@pytest.mark.parametrize("family", list(MOE_KEPT))
def test_gguf_moe_kept_by_default(tmp_path, family):
    """No quant=: a MoE file's expert stacks (and any block-quantized linear) keep their blocks as
    stored (QuantExperts taking blocks only, each expert the file's values exactly), the F32
    tensors stay float (no quantization of them, no float copy of a kept one: the float
    parameters are the F32 tensors' bytes), the load report counts them per type, and the logits
    of the prefill and of every decode step equal transformers' (its own dequantization of the
    file) within the int8 rounding of activations that zoo's kernels do on few rows, as llama.cpp."""
    from zoo.compiler.quant.experts import QuantExperts

    layout, config_class, kwargs, *_ = FAMILIES[family]
    ref = twin(config_class, kwargs)
    path = write_gguf(tmp_path / f"{family}.gguf", ref, LAYOUTS[layout], quantize=dict(MOE_KEPT[family]))
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    assert m.info.quant.mode == "stored"
    held = m.info.load.held
    assert set(held) == {"kept", "float"}, held
    assert set(held["kept"]) == {t.name for t in MOE_KEPT[family].values()}
    assert sum(n for n, _ in held["kept"].values()) == len(MOE_KEPT[family])
    floats = sum(p.numel() * p.element_size() for p in m.module.parameters())
    assert floats == held["float"]["F32"][1]  # every float parameter is an F32 tensor of the file, once
    stacks = [q for q in m.module.modules() if isinstance(q, QuantExperts)]
    assert stacks and all(q.blocks_only and q.layout in ("q4", "int5", "int8g") for q in stacks)
    assert len(stacks) == len([n for n in MOE_KEPT[family] if "_exps" in n]) - sum(
        "ffn_up_exps" in n for n in MOE_KEPT[family])  # gate and up join in w13
    for name, how in m.info.load.tensors.items():
        assert ("kept" in how) == (name in MOE_KEPT[family]) and "quantized ->" not in how, (name, how)
    torch.manual_seed(1)  # (measured: at most 0.025 of the largest logit, qwen3moe's prefill)
    check_parity(ref, m, torch.randint(0, SMALL["vocab_size"], (2, 7)), steps=4, rtol=5e-2)


@pytest.mark.parametrize("quant", ["none", "int4", "int8"])
def test_gguf_expert_stacks_are_kept_as_stored(tmp_path, quant):
    """A GGUF MoE's 3-D expert stacks: float with quant=none (transformers' logits, tight), and under
    runtime.quant kept as the file stores them (no float copy, no requantizing): the report says so
    per tensor, and each expert's weight is the file's (the twin's) values exactly."""
    from zoo.compiler.quant.experts import QuantExperts

    layout, config_class, kwargs, *_ = FAMILIES["qwen3moe"]
    ref = twin(config_class, kwargs)
    path = write_gguf(tmp_path / "moe.gguf", ref, LAYOUTS[layout], quantize=dict(EXPERT_BLOCKS))
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, quant=quant)
    torch.manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7))
    report = m.info.load.tensors
    if quant == "none":
        assert report["blk.0.ffn_gate_exps.weight"] == "dequantized Q4_0 -> float32"
        check_parity(ref, m, ids, steps=4)
        return
    int4, int8 = "int4 g32 (float16 scales), 4 experts", "int8 g32 (float32 scales), 4 experts"
    assert {n: report[n] for n in EXPERT_BLOCKS} == {
        "blk.0.ffn_gate_exps.weight": f"kept Q4_0 blocks as {int4}", "blk.0.ffn_up_exps.weight": f"kept Q4_0 blocks as {int4}",
        "blk.0.ffn_down_exps.weight": f"kept Q8_0 blocks as {int8}",
        "blk.1.ffn_gate_exps.weight": f"Q8_0 kept (with parts of other types) as {int8}",
        "blk.1.ffn_up_exps.weight": f"Q4_1 kept (with parts of other types) as {int8}",
        "blk.1.ffn_down_exps.weight": f"kept Q4_1 blocks as {int4}"}
    for layer in range(2):
        experts = ref.model.layers[layer].mlp.experts
        for stack, want in (("w13", experts.gate_up_proj), ("w2", experts.down_proj)):
            q = m.module.get_submodule(f"layers.{layer}.ffn.{stack}")
            assert isinstance(q, QuantExperts)
            for e in range(q.n_experts):
                torch.testing.assert_close(q.dequantize(e), want[e].detach(), rtol=0, atol=0)
    # the F32 linears are quantized from float, and zoo's kernels round decode activations to int8
    # per 32 inputs, so the logits are near, not equal (measured: int4 0.17 of the largest logit
    # at a decode step, int8 under 0.02)
    check_parity(ref, m, ids, steps=4, rtol={"int4": 0.2, "int8": 2e-2}[quant])
