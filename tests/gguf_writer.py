"""Write a tiny transformers twin as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays
it out, for the GGUF family tests (tests/test_gguf_families.py).

Tensor names come from gguf-py's own converter table (`gguf.get_tensor_name_map`), so a name
this file gets wrong is one the converter gets wrong too. What the converter does on top of the
table is a `Layout` per architecture: the q/k row permutation of its Llama-family classes, and the
metadata keys its `set_gguf_parameters` writes. Weights are F32 except the tensors named in
`quantize`, which are stored block-quantized and written back into the twin rounded the same way,
so that the twin stays the exact reference for the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import torch

Q = gguf.GGMLQuantizationType

# general.architecture values with a conf/gguf map of their own, as errors list them (a variant
# map such as llama_moe is not one); a new map adds its architecture here
MAPPED_ARCHITECTURES = "afmoe, apertus, arcee, bloom, cohere2, command-r, dbrx, deepseek2, dots1, ernie4_5, ernie4_5-moe, exaone, exaone-moe, exaone4, falcon, falcon-h1, gemma, gemma2, gemma3, glm4, glm4moe, gpt-oss, gpt2, gptneox, granite, granitehybrid, granitemoe, hunyuan-dense, hunyuan-moe, jais2, jamba, kimi-linear, lfm2, lfm2moe, llama, mamba, mamba2, minicpm3, minimax-m2, mpt, nemotron, nemotron_h, nemotron_h_moe, olmo, olmo2, olmoe, phi2, phi3, qwen2, qwen2moe, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next, seed_oss, smollm3, stablelm, starcoder, starcoder2"


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The converter's LlamaModel.permute: per head, HF (rotate-half) row h*hd/2 + i -> 2i + h."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _text_metadata(w: gguf.GGUFWriter, cfg, head_dim_key: bool = True) -> None:
    """TextModel.set_gguf_parameters: the keys every text architecture gets."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if (ff := getattr(cfg, "intermediate_size", None)) is not None:  # MoE-only configs may lack it
        w.add_feed_forward_length(ff)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta")  # per layer kind: the global layers'
    if theta is not None:
        w.add_rope_freq_base(theta)
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if rope.get("rope_type") == "yarn":  # the converter's yarn keys
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    # the converter's find_hparam lists: an RMSNorm epsilon, a LayerNorm one, or both
    if (eps := next((getattr(cfg, k) for k in ("rms_norm_eps", "norm_eps") if hasattr(cfg, k)), None)) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := next((getattr(cfg, k) for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
                     if hasattr(cfg, k)), None)) is not None:
        w.add_layer_norm_eps(eps)
    if head_dim_key and (head_dim := getattr(cfg, "head_dim", None)) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)  # the converter's vocabulary comes from the tokenizer; none here


@dataclass(frozen=True)
class Layout:
    """How the converter writes one architecture.

    arch: gguf-py's MODEL_ARCH; permute_qk: the LlamaModel q/k row permutation;
    metadata: extra `set_gguf_parameters` keys after TextModel's; head_dim_key: whether it
    writes attention.key_length / value_length from config.json's head_dim.
    """

    arch: gguf.MODEL_ARCH
    permute_qk: bool = False
    metadata: Callable[[gguf.GGUFWriter, object], None] | None = None
    head_dim_key: bool = True
    norm_shift: float = 0.0  # Gemma's converters store every norm weight as 1 + w
    text_metadata: bool = True  # False: the converter's set_gguf_parameters writes its own keys only
    skip: tuple[str, ...] = field(default=("rotary_emb.inv_freq",))
    # the converter's modify_tensors where it is more than a rename: (HF name, tensor, config) ->
    # [(HF name, tensor)] (names gguf-py's table knows) or None (the tensor as it is)
    tensors: Callable[[str, torch.Tensor, object], list | None] | None = None
    # the converter's generate_extra_tensors: config -> {GGUF name: tensor} (MiniCPM3's LongRoPE factors)
    extra_tensors: Callable[[object], dict] | None = None
    # metadata its modify_tensors writes from weights: (writer, model) (Apertus's xIELU arrays)
    weight_metadata: Callable[[gguf.GGUFWriter, object], None] | None = None

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


def _granite(w: gguf.GGUFWriter, cfg) -> None:
    """GraniteModel: config.json's *_multiplier / logits_scaling as *_scale, when set."""
    if cfg.attention_multiplier:
        w.add_attention_scale(cfg.attention_multiplier)
    if cfg.embedding_multiplier:
        w.add_embedding_scale(cfg.embedding_multiplier)
    if cfg.residual_multiplier:
        w.add_residual_scale(cfg.residual_multiplier)
    if cfg.logits_scaling:
        w.add_logit_scale(cfg.logits_scaling)


def _granitemoe(w: gguf.GGUFWriter, cfg) -> None:
    """GraniteMoeModel: Granite's keys, TextModel's expert keys, the shared MLP's width when set."""
    _granite(w, cfg)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "shared_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)


def _granitemoe_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """GraniteMoeModel.modify_tensors (on the checkpoint's names, which transformers 5 renames):
    input_linear [E, 2F, D] (the twin's experts.gate_up_proj) split into gate / up, the shared
    MLP's input_linear [2S, D] likewise; output_linear (experts.down_proj) and the router as they are."""
    bid = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("block_sparse_moe.router.weight"):
        return [(f"blk.{bid}.ffn_gate_inp.weight", t)]
    if name.endswith("block_sparse_moe.experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        return [(f"blk.{bid}.ffn_gate_exps.weight", gate), (f"blk.{bid}.ffn_up_exps.weight", up)]
    if name.endswith("block_sparse_moe.experts.down_proj"):
        return [(f"blk.{bid}.ffn_down_exps.weight", t)]
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.chunk(2, dim=0)
        return [(f"blk.{bid}.ffn_gate_shexp.weight", gate), (f"blk.{bid}.ffn_up_shexp.weight", up)]
    return None


def _gemma2(w: gguf.GGUFWriter, cfg) -> None:
    """Gemma2Model: the soft-caps and the window; no rope base (llama.cpp's default)."""
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _gemma3(w: gguf.GGUFWriter, cfg) -> None:
    """Gemma3Model: the window (the global rope base is TextModel's key)."""
    w.add_sliding_window(cfg.sliding_window)


def _phi3(w: gguf.GGUFWriter, cfg) -> None:
    """Phi3MiniModel: the rotated dims, the original context and the window (0: none)."""
    rope = cfg.rope_parameters
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    rot = rope.get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(int(rot * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_sliding_window(cfg.sliding_window or 0)


def _experts(w: gguf.GGUFWriter, cfg) -> None:
    """The MoE converters' expert keys (Qwen2MoeModel and its heirs)."""
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _deepseek2(w: gguf.GGUFWriter, cfg) -> None:
    """DeepseekV2Model: MLA written as MQA (one kv head of kv_lora_rank + rope), the true widths
    as *_mla, the MoE keys, and yarn_log_multiplier = 0.1 * mscale_all_dim."""
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if getattr(cfg, "n_group", None) is not None:  # TextModel's expert group keys
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if cfg.model_type == "deepseek_v3":  # TextModel's scoring_func key (V3's config.json: sigmoid)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters or {}
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(name: str, t: torch.Tensor, cfg) -> list | None:
    """DeepseekV2Model.modify_tensors: kv_b_proj [H (nope + v), R] -> k_b_proj [H, R, nope] (each
    head's key part transposed) and v_b_proj [H, v, R]."""
    if not name.endswith("kv_b_proj.weight"):
        return None
    kv_b = t.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, t.shape[-1])
    k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
    return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)), (name.replace("kv_b_proj", "v_b_proj"), v_b)]


def _glm4moe(w: gguf.GGUFWriter, cfg) -> None:
    """Glm4MoeModel: block_count with the MTP layers, the rotated width, DeepSeek-V3's routing keys."""
    w.add_block_count(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_nextn_predict_layers(cfg.num_nextn_predict_layers)


def _dots1(w: gguf.GGUFWriter, cfg) -> None:
    """Dots1Model: Qwen2MoeModel's expert keys and DeepSeek-V3's (dense lead, shared experts,
    the routed weights' scale and normalisation)."""
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)


def _hunyuan_moe(w: gguf.GGUFWriter, cfg) -> None:
    """HunYuanMoEModel: the shared MLP's and the experts' widths (transformers' one
    intermediate_size; config.json's moe_intermediate_size list holds the same), top-k, one shared."""
    w.add_expert_count(cfg.num_experts)
    w.add_expert_shared_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_expert_used_count(cfg.moe_topk)
    w.add_expert_shared_count(1)


def _ernie4_5_moe(w: gguf.GGUFWriter, cfg) -> None:
    """Ernie4_5MoeModel: the expert keys, the MoE layers' step and first index, the shared count."""
    w.add_expert_count(cfg.moe_num_experts)
    w.add_expert_used_count(cfg.moe_k)
    w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
    w.add_leading_dense_block_count(cfg.moe_layer_start_index)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.moe_num_shared_experts)
    if cfg.moe_num_shared_experts > 0:
        w.add_expert_shared_feed_forward_length(cfg.intermediate_size // cfg.num_key_value_heads)


def _ernie4_5_moe_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """The checkpoint's name of the selection bias (transformers 5 moves it under mlp.gate)."""
    if name.endswith("mlp.gate.moe_statics.e_score_correction_bias"):
        return [(name.replace("mlp.gate.moe_statics", "mlp.moe_statics"), t)]
    return None


def _minimax_m2(w: gguf.GGUFWriter, cfg) -> None:
    """MiniMaxM2Model: TextModel's expert keys, sigmoid scoring (config.json's scoring_func), the
    experts' width and the rotated width (config.json's rotary_dim)."""
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))


def _minimax_m2_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """The checkpoint's name of the selection bias (transformers 5 moves it to mlp.)."""
    if name.endswith("mlp.e_score_correction_bias"):
        return [(name.replace("mlp.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"), t)]
    return None


def _lfm2(w: gguf.GGUFWriter, cfg) -> None:
    """LFM2Model: TextModel's keys with head_count_kv per layer (0 on conv layers), the conv's
    cache length, the RMSNorm epsilon and the FFN width as Lfm2MLP adjusts it."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    ff = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", False):  # LFM2-MoE's dense width is as is
        ff = int(2 * ff / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            ff = int(cfg.block_ffn_dim_multiplier * ff)
        ff = cfg.block_multiple_of * ((ff + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    w.add_feed_forward_length(ff)


def _lfm2_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """LFM2Model.modify_tensors: the conv weight [C, 1, K] squeezed to [C, K]."""
    return [(name, t.squeeze(1))] if "conv.conv.weight" in name else None


def _exaone_moe(w: gguf.GGUFWriter, cfg) -> None:
    """ExaoneMoEModel: Exaone4Model's window and pattern, TextModel's expert and group keys, the
    experts' width, shared experts (count and width), scale, normalisation, dense lead, no MTP."""
    _sliding_pattern(w, cfg)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.num_shared_experts)
    w.add_expert_shared_feed_forward_length(cfg.moe_intermediate_size * cfg.num_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_nextn_predict_layers(0)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _exaone_moe_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """The checkpoint's name of the selection bias (transformers 5 moves it under mlp.gate)."""
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return [(name.replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"), t)]
    return None


def _lfm2moe(w: gguf.GGUFWriter, cfg) -> None:
    """LFM2MoeModel: LFM2's keys (the dense FFN width as is), the experts' width and TextModel's
    expert keys, the dense lead, sigmoid routing."""
    _lfm2(w, cfg)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.num_dense_layers)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _feed_forward_experts(name: str, t: torch.Tensor) -> list | None:
    """The experts under feed_forward. (LFM2-MoE, Jamba) stacked per kind, as their converters write
    them: gate_up as the twin holds it, split in two; down as it is."""
    bid = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("feed_forward.experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        return [(f"blk.{bid}.ffn_gate_exps.weight", gate), (f"blk.{bid}.ffn_up_exps.weight", up)]
    if name.endswith("feed_forward.experts.down_proj"):
        return [(f"blk.{bid}.ffn_down_exps.weight", t)]
    return None


def _lfm2moe_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """LFM2MoeModel.modify_tensors: LFM2's conv squeeze, the experts stacked per kind (gate_up as
    the twin holds them, split), expert_bias as exp_probs_b.bias."""
    if (experts := _feed_forward_experts(name, t)) is not None:
        return experts
    if name.endswith("feed_forward.expert_bias"):
        return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", t)]
    return _lfm2_tensors(name, t, cfg)


def _gpt_oss(w: gguf.GGUFWriter, cfg) -> None:
    """GptOssModel: the window and the experts' keys."""
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)


def _gpt_oss_experts(name: str, t: torch.Tensor, cfg) -> list | None:
    """GptOssModel.modify_tensors (float experts): gate_up_proj [E, D, 2F] (gate and up columns
    interleaved) -> gate / up [E, F, D] and their biases [E, F]; down_proj [E, F, D] -> [E, D, F]."""
    base = name.rsplit(".", 1)[0] + "."
    if name.endswith("mlp.experts.gate_up_proj"):
        w = t.transpose(-1, -2)
        return [(base + "gate_proj.weight", w[:, ::2, :]), (base + "up_proj.weight", w[:, 1::2, :])]
    if name.endswith("mlp.experts.gate_up_proj_bias"):
        return [(base + "gate_proj.bias", t[..., ::2]), (base + "up_proj.bias", t[..., 1::2])]
    if name.endswith("mlp.experts.down_proj"):
        return [(base + "down_proj.weight", t.transpose(-1, -2))]
    if name.endswith("mlp.experts.down_proj_bias"):
        return [(base + "down_proj.bias", t)]
    return None


def _qwen2moe(w: gguf.GGUFWriter, cfg) -> None:
    """Qwen2MoeModel: the routed experts' keys and the shared expert's width."""
    _experts(w, cfg)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _olmoe(w: gguf.GGUFWriter, cfg) -> None:
    """OlmoeModel: TextModel's keys (feed_forward_length is the experts' width) and the expert count."""
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)


def _qwen3next(w: gguf.GGUFWriter, cfg) -> None:
    """Qwen3NextModel: Qwen2MoeModel's keys, the Gated DeltaNet sizes as ssm.*, the interval."""
    _qwen2moe(w, cfg)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", None) or 4)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))


def _ssm_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """The SSM converters' modify_tensors (Mamba's and its heirs'): A = -exp(A_log), conv1d
    weights squeezed ([C, 1, K] -> [C, K])."""
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t))]
    if "conv1d.weight" in name:
        return [(name, t.squeeze())]
    return None


def _ssm_header(w: gguf.GGUFWriter, embed: int, blocks: int, conv: int, inner: int, state: int) -> None:
    """The keys MambaModel (and Mamba2Model, its heirs) writes first: no context limit, no FFN or
    attention heads, the ssm.* sizes."""
    w.add_context_length(2 ** 20)
    w.add_embedding_length(embed)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(blocks)
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(state)


def _mamba(w: gguf.GGUFWriter, cfg) -> None:
    """MambaModel: its own keys only (ssm.* sizes; dt_b_c_rms for Falcon-Mamba)."""
    _ssm_header(w, cfg.hidden_size, cfg.num_hidden_layers, cfg.conv_kernel, int(cfg.expand * cfg.hidden_size),
                cfg.state_size)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    if cfg.model_type == "mamba2":
        return
    w.add_ssm_time_step_rank(cfg.time_step_rank)
    w.add_ssm_dt_b_c_rms(cfg.model_type == "falcon_mamba")
    w.add_vocab_size(cfg.vocab_size)


def _mamba2(w: gguf.GGUFWriter, cfg) -> None:
    """Mamba2Model: its own keys only (ssm.* sizes; the head count as time_step_rank)."""
    _mamba(w, cfg)
    w.add_ssm_time_step_rank(cfg.num_heads)
    w.add_ssm_group_count(cfg.n_groups)


def _mamba2_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """Mamba2Model.modify_tensors: Mamba's, plus A and D as [H, 1], the gated norm as
    [n_groups, d_inner / n_groups] and dt_bias as dt_proj.bias."""
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t).reshape(-1, 1))]
    if name.endswith(".D"):
        return [(name, t.reshape(-1, 1))]
    if name.endswith("mixer.norm.weight"):
        return [(name, t.reshape(cfg.n_groups, -1))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    return _ssm_tensors(name, t, cfg)


def _mamba2_mixer(name: str, t: torch.Tensor, n_groups: int) -> list | None:
    """Mamba2Model.modify_tensors on a hybrid's Mamba2 mixer: A = -exp(A_log) and D as [H, 1], the
    gated norm as [n_groups, d_inner / n_groups], dt_bias as dt_proj.bias, conv1d squeezed."""
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t).reshape(-1, 1))]
    if name.endswith(".D"):
        return [(name, t.reshape(-1, 1))]
    if name.endswith(".norm.weight"):
        return [(name, t.reshape(n_groups, -1))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if "conv1d.weight" in name:
        return [(name, t.squeeze())]
    return None


def _granitehybrid_attn_layers(cfg) -> list[int]:
    """GraniteHybridModel.get_attn_layers on the Hub's config.json: layer_types' "attention" layers
    (transformers 5 renames them full_attention), else Bamba's attn_layer_indices."""
    if (types := getattr(cfg, "layer_types", None)) is not None:
        return [i for i, t in enumerate(types) if t in ("attention", "full_attention")]
    return list(cfg.attn_layer_indices)


def _granitehybrid(w: gguf.GGUFWriter, cfg) -> None:
    """GraniteHybridModel: GraniteMoeModel's keys (Granite's multipliers, TextModel's expert keys,
    the shared MLP's width; LlamaModel's whole-head rope.dimension_count), the Mamba2 sizes,
    head_count_kv per layer (0 on Mamba2 layers), the Hub config's attn_rotary_emb (Bamba's
    rotated width) and rope.scaling.finetuned: RoPE only for Bamba, else a context of 2**20."""
    for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if getattr(cfg, key, None):
            add(getattr(cfg, key))
    if getattr(cfg, "num_local_experts", None) is not None:
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "shared_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    attn = _granitehybrid_attn_layers(cfg)
    bamba = cfg.model_type == "bamba"  # the converter's "BambaForCausalLM" in architectures
    if bamba:  # Bamba-9B's config.json has attn_rotary_emb (transformers: partial_rotary_factor 0.5)
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_head_count_kv([cfg.num_key_value_heads if i in attn else 0 for i in range(cfg.num_hidden_layers)])
    w.add_rope_scaling_finetuned(bamba)
    if not bamba:
        w.add_context_length(2 ** 20)


def _granitehybrid_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """GraniteHybridModel.modify_tensors: Mamba2Model's on the Mamba2 mixers (.mamba.), GraniteMoe's
    expert and shared-MLP splits elsewhere."""
    if ".mamba." in name:
        return _mamba2_mixer(name, t, cfg.mamba_n_groups)
    return _granitemoe_tensors(name, t, cfg)


def _nemotron_h_pattern(cfg) -> str:
    """The Hub config.json's hybrid_override_pattern (M: Mamba2, *: attention, -: MLP), which the
    converter reads (transformers 5 gives layers_block_type)."""
    symbols = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-"}
    return "".join(symbols[t] for t in cfg.layers_block_type)


def _nemotron_h(w: gguf.GGUFWriter, cfg) -> None:
    """NemotronHModel (non-MoE: the Hub config.json has no num_experts_per_tok, which transformers 5
    always writes): GraniteHybridModel's keys from the pattern (head_count_kv on attention layers,
    no RoPE, a context of 2**20; mamba_head_dim is its "d_model", so inner_size = mamba_num_heads *
    mamba_head_dim), LlamaModel's whole-head rope.dimension_count, the attention head width as
    key_length / value_length and feed_forward_length on the MLP layers."""
    pattern = _nemotron_h_pattern(cfg)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if c == "*" else 0 for c in pattern])
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_feed_forward_length([cfg.intermediate_size if c == "-" else 0 for c in pattern])


def _nemotron_h_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """NemotronHModel.modify_tensors on the checkpoint's names (backbone.; transformers 5 says
    model.): Mamba2Model's on the Mamba2 layers' mixers, the rest as it is."""
    name = name.replace("model.", "backbone.", 1) if name.startswith("model.") else name
    if ".mixer." in name and _nemotron_h_pattern(cfg)[int(name.split(".")[2])] == "M":
        return _mamba2_mixer(name, t, cfg.n_groups) or [(name, t)]
    return [(name, t)]


def _falcon_h1(w: gguf.GGUFWriter, cfg) -> None:
    """FalconH1Model: Mamba2Model's keys (inner_size mamba_d_ssm, the head count as time_step_rank),
    then the vocabulary, context, FFN width, attention heads, the Hub config's head_dim as
    key_length / value_length, and the rope base."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _ssm_header(w, cfg.hidden_size, cfg.num_hidden_layers, cfg.mamba_d_conv, cfg.mamba_d_ssm, cfg.mamba_d_state)
    w.add_ssm_time_step_rank(cfg.mamba_d_ssm // cfg.mamba_d_head)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])


def _falcon_h1_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """FalconH1Model.modify_tensors: Mamba2Model's on the mixer, then every µP multiplier folded
    into the weight (and bias) its name picks, the SSM's in_proj per slice [z | x | B | C | dt]."""
    if ".mamba." in name and (out := _mamba2_mixer(name, t, cfg.mamba_n_groups)) is not None:
        (name, t), = out
    mlp, attn_in = cfg.mlp_multipliers, cfg.attention_in_multiplier
    scale = next((s for key, s in (("down_proj", mlp[1]), ("gate_proj", mlp[0]),
                                   ("k_proj", cfg.key_multiplier * attn_in), ("q_proj", attn_in), ("v_proj", attn_in),
                                   ("o_proj", cfg.attention_out_multiplier), ("out_proj", cfg.ssm_out_multiplier),
                                   ("in_proj", cfg.ssm_in_multiplier), ("lm_head", cfg.lm_head_multiplier),
                                   ("embed_tokens", cfg.embedding_multiplier)) if key in name), None)
    if scale is None:
        return [(name, t)]
    t = t * scale
    if "in_proj" in name:
        inner, bc = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state
        ends = [0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, t.shape[0]]
        t = torch.cat([t[a:b] * m for a, b, m in zip(ends, ends[1:], cfg.ssm_multipliers)])
    return [(name, t)]


def _jamba(w: gguf.GGUFWriter, cfg) -> None:
    """JambaModel: its own keys only (head_count_kv per layer from attn_layer_offset / period, the
    Mamba-1 sizes as ssm.*, the RMSNorm epsilon, the expert counts; none for the MoE layers)."""
    n, offset, period = cfg.num_hidden_layers, cfg.attn_layer_offset, cfg.attn_layer_period
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([0] * offset + [cfg.num_key_value_heads if (i - offset) % period == 0 else 0
                                        for i in range(offset, n)])
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_time_step_rank(cfg.mamba_dt_rank)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)


def _jamba_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """JambaModel.modify_tensors: the experts stacked per kind (gate_up as the twin holds them,
    split), A = -exp(A_log), conv1d squeezed."""
    return _feed_forward_experts(name, t) or _ssm_tensors(name, t, cfg)


def _qwen3next_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """Qwen3NextModel.modify_tensors: A = -exp(A_log), dt_bias as dt_proj.bias, conv1d squeezed,
    zero-centred norms as 1 + w, in_proj_qkvz (per key head [q | k | v | z]) as part-major
    attn_qkv and attn_gate (GGUF names: the converter writes them itself)."""
    if (out := _ssm_tensors(name, t, cfg)) is not None:
        return out
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    if name.endswith("in_proj_qkvz.weight"):
        nk, hk, hv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        vz = cfg.linear_num_value_heads // nk * hv
        q, k, v, z = t.t().reshape(-1, nk, 2 * hk + 2 * vz).split([hk, hk, vz, vz], dim=-1)
        flat = lambda x: x.reshape(cfg.hidden_size, -1)
        bid = name.split(".")[2]
        return [(f"blk.{bid}.attn_qkv.weight", torch.cat([flat(q), flat(k), flat(v)], dim=-1).t()),
                (f"blk.{bid}.attn_gate.weight", flat(z).t())]
    return None


def _qwen35(w: gguf.GGUFWriter, cfg) -> None:
    """Qwen3_5TextModel / Qwen3_5MoeTextModel: Qwen3NextModel's keys over the config's dict (where
    transformers 5 writes no top-level partial_rotary_factor or full_attention_interval: the
    converter's defaults 0.25 and 4), TextModel's expert keys and Qwen2MoeModel's widths when the
    config has experts, the MRoPE sections padded to 4 ([11, 11, 10, 0] without any), and
    block_count counting the MTP layers."""
    hp = cfg.to_dict()
    if "num_experts" in hp:
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * hp.get("partial_rotary_factor", 0.25)))
    sections = list((hp.get("rope_parameters") or {}).get("mrope_section", [11, 11, 10]))
    w.add_rope_dimension_sections((sections + [0] * 4)[:4])
    if (mtp := hp.get("mtp_num_hidden_layers", 0)) > 0:
        w.add_block_count(hp["num_hidden_layers"] + mtp)
        w.add_nextn_predict_layers(mtp)


def _tile_v_heads(t: torch.Tensor, dim: int, nk: int, per_k: int, width: int) -> torch.Tensor:
    """Value heads grouped per key head ([nk, per_k, width] along `dim`) -> tiled ([per_k, nk,
    width]), as the converter reorders them for ggml's broadcast."""
    dim %= t.ndim
    return t.reshape(*t.shape[:dim], nk, per_k, width, *t.shape[dim + 1:]).transpose(dim, dim + 1).reshape(t.shape)


def _qwen35_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """Qwen3_5TextModel.modify_tensors: with more value heads than key heads, every value-head
    dimension tiled (in_proj_qkv's and the conv's v part, in_proj_z / b / a, A_log, dt_bias,
    out_proj's columns); then Qwen3NextModel's A = -exp(A_log), dt_bias as dt_proj.bias, conv1d
    squeezed, zero-centred norms as 1 + w."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    qk, hv = 2 * nk * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if "conv1d" in name:
        t = t.squeeze()
    if nk != nv and "linear_attn." in name:
        tile = lambda x, dim, width: _tile_v_heads(x, dim, nk, nv // nk, width)  # noqa: E731
        if ".in_proj_qkv." in name or ".conv1d." in name:
            t = torch.cat([t[:qk], tile(t[qk:], 0, hv)])
        elif ".in_proj_z." in name:
            t = tile(t, 0, hv)
        elif name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
            t = tile(t, 0, 1)
        elif ".out_proj." in name:
            t = tile(t, 1, hv)
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    return [(name, t)]


def _kimi_linear(w: gguf.GGUFWriter, cfg) -> None:
    """KimiLinearModel (on a config with the Hub's linear_attn_config): MLA as MQA (one kv head,
    key_length kv_lora_rank + rope, the true widths as *_mla), head_count_kv per layer (0 on KDA
    layers), the KDA conv and head width, the MoE keys; TextModel's keys come from the config's
    dict (model_max_length as the context, config.json's head_dim as value_length, sigmoid
    scoring from moe_router_activation_func, topk_group as the groups used)."""
    hp = cfg.to_dict()
    la = hp["linear_attn_config"]
    w.add_context_length(hp["model_max_length"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_token"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                              "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[hp["moe_router_activation_func"]])
    w.add_head_count_kv([1 if i + 1 in la["full_attn_layers"] else 0 for i in range(hp["num_hidden_layers"])])
    w.add_ssm_conv_kernel(la["short_conv_kernel_size"])
    w.add_kda_head_dim(la["head_dim"])
    if hp["q_lora_rank"] is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["num_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])


def _kimi_linear_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """KimiLinearModel.modify_tensors, on the Hub checkpoint's names (transformers 5 keeps the KDA
    conv fused and the forget gate's parts under forget_gate): each conv [C, 1, K] as [1, C, 1, K],
    A = -exp(A_log), dt_bias as ssm_dt.bias, kv_b_proj split as DeepseekV2Model does (the
    converter counts its heads by num_key_value_heads: the twin has as many as heads)."""
    if not name.startswith("model.layers."):
        return None
    bid = name.split(".")[2]
    if name.endswith("self_attn.conv1d.weight"):
        return [(f"blk.{bid}.ssm_conv1d_{p}.weight", c.reshape(1, c.shape[0], 1, c.shape[-1]))
                for p, c in zip("qkv", t.chunk(3, dim=0))]
    if name.endswith("forget_gate.A_log"):
        return [(f"blk.{bid}.ssm_a", -torch.exp(t))]
    if name.endswith("forget_gate.dt_bias"):
        return [(f"blk.{bid}.ssm_dt.bias", t)]
    if name.endswith(("forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight")):
        return [(f"blk.{bid}.ssm_{name.split('.')[-2][0]}_{name.split('.')[-2][2]}.weight", t)]
    if name.endswith("kv_b_proj.weight"):
        assert cfg.num_key_value_heads == cfg.num_attention_heads, "the converter splits kv_b by num_key_value_heads"
        return _split_kv_b(name, t, cfg)
    return None


def _kimi_linear_kv_b(name: str, t: torch.Tensor, cfg) -> list | None:
    """KimiLinearModel.modify_tensors as older converters ran it: kv_b_proj whole (attn_kv_b)."""
    return None if name.endswith("kv_b_proj.weight") else _kimi_linear_tensors(name, t, cfg)


def _qwen35_fused_experts(name: str, t: torch.Tensor, cfg) -> list | None:
    """Qwen3_5MoeTextModel with --fuse-gate-up-exps: the stacked gate and up experts joined as one
    ffn_gate_up_exps [E, 2F, D] (gate rows first: the twin's gate_up_proj as it is)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        return [(f"blk.{name.split('.')[2]}.ffn_gate_up_exps.weight", t)]
    return _qwen35_tensors(name, t, cfg)


def _sliding_pattern(w: gguf.GGUFWriter, cfg) -> None:
    """Olmo2Model / Exaone4Model with a window: the window and the per-layer pattern (true: sliding)."""
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _exaone(w: gguf.GGUFWriter, cfg) -> None:
    """ExaoneModel (and Jais2Model): the rotated width (the whole head)."""
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _glm4(w: gguf.GGUFWriter, cfg) -> None:
    """Glm4Model: the rotated width."""
    rot = (cfg.rope_parameters or {}).get("partial_rotary_factor", 0.5)
    w.add_rope_dimension_count(int((cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads) * rot))


def _layernorm_header(w: gguf.GGUFWriter, context: int, embed: int, ff: int, blocks: int, heads: int,
                      eps: float, kv: int | None = None) -> None:
    """The keys every GPT-2-era converter class writes (context, widths, blocks, heads, the
    LayerNorm epsilon); head_count_kv only where the class writes one."""
    w.add_context_length(context)
    w.add_embedding_length(embed)
    w.add_feed_forward_length(ff)
    w.add_block_count(blocks)
    w.add_head_count(heads)
    if kv is not None:
        w.add_head_count_kv(kv)
    w.add_layer_norm_eps(eps)


def _gpt2(w: gguf.GGUFWriter, cfg) -> None:
    """GPT2Model: its own keys only (the MLP width as 4 * n_embd, the LayerNorm epsilon)."""
    _layernorm_header(w, cfg.n_positions, cfg.n_embd, 4 * cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)


def _gpt2_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """GPT2Model.modify_tensors: the Conv1D weights ([in, out]) transposed."""
    if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return [(name, t.t())]
    return None


def _gptneox(w: gguf.GGUFWriter, cfg) -> None:
    """GPTNeoXModel: its own keys only (the rotated width per head, the residual form)."""
    _layernorm_header(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                      cfg.num_attention_heads, cfg.layer_norm_eps)
    rot = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(rot * (cfg.hidden_size // cfg.num_attention_heads)))
    w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_vocab_size(cfg.vocab_size)


def _gptneox_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """GPTNeoXModel.modify_tensors: query_key_value per head [q | k | v] -> part-major [q | k | v]."""
    if name.endswith("attention.query_key_value.weight") or name.endswith("attention.query_key_value.bias"):
        h = cfg.num_attention_heads
        qkv = t.reshape(h, 3, cfg.hidden_size // h, *t.shape[1:])
        return [(name, torch.cat([qkv[:, i].reshape(-1, *t.shape[1:]) for i in range(3)]))]
    return None


def _bloom(w: gguf.GGUFWriter, cfg) -> None:
    """BloomModel: its own keys only (4 * n_embed as the MLP width, head_count_kv = head_count)."""
    _layernorm_header(w, getattr(cfg, "seq_length", cfg.hidden_size), cfg.hidden_size, 4 * cfg.hidden_size, cfg.n_layer,
                      cfg.n_head, cfg.layer_norm_epsilon, kv=cfg.n_head)


def _bloom_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """BloomModel.modify_tensors: the `transformer.` prefix dropped (gguf-py's BLOOM names are
    the bare model's), query_key_value per head -> part-major as GPT-NeoX's."""
    name = name.removeprefix("transformer.")
    return _gptneox_tensors(name, t, cfg) or [(name, t)]


def _mpt(w: gguf.GGUFWriter, cfg) -> None:
    """MPTModel: its own keys only (4 * d_model as the MLP width, the fixed LayerNorm epsilon,
    the clamp and the ALiBi bias maximum)."""
    attn = cfg.attn_config
    _layernorm_header(w, cfg.max_seq_len, cfg.d_model, 4 * cfg.d_model, cfg.n_layers, cfg.n_heads, 1e-5)
    if attn.clip_qkv is not None:
        w.add_clamp_kqv(attn.clip_qkv)
    w.add_max_alibi_bias(attn.alibi_bias_max if attn.alibi else 0.0)


def _falcon(w: gguf.GGUFWriter, cfg) -> None:
    """FalconModel: its own keys only (a fixed context of 2048, 4 * n_embd as the MLP width)."""
    w.add_tensor_data_layout("jploski")
    _layernorm_header(w, 2048, cfg.hidden_size, 4 * cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                      cfg.layer_norm_epsilon, kv=_falcon_kv_heads(cfg))


def _falcon_kv_heads(cfg) -> int:
    """The kv heads of transformers' Falcon (what config.json's num_kv_heads gives the converter)."""
    return cfg.num_kv_heads if cfg.new_decoder_architecture or not cfg.multi_query else 1


def _falcon_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """FalconModel.modify_tensors: query_key_value per kv group [its q heads | k | v] -> part-major
    [q of every head | k of every kv head | v ...]."""
    if "query_key_value" not in name:
        return None
    n_head, n_kv = cfg.num_attention_heads, _falcon_kv_heads(cfg)
    hd = cfg.hidden_size // n_head
    qkv = t.reshape(n_kv, n_head // n_kv + 2, hd, *t.shape[1:])
    q, k, v = (qkv[:, :-2], qkv[:, [-2]], qkv[:, [-1]])
    return [(name, torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)]))]


def _phi2(w: gguf.GGUFWriter, cfg) -> None:
    """Phi2Model: its own keys only (4 * n_embd as the MLP width, the rotated width per head)."""
    _layernorm_header(w, cfg.max_position_embeddings, cfg.hidden_size, 4 * cfg.hidden_size, cfg.num_hidden_layers,
                      cfg.num_attention_heads, cfg.layer_norm_eps, kv=cfg.num_attention_heads)
    rot = cfg.rope_parameters["partial_rotary_factor"]
    w.add_rope_dimension_count(int(rot * cfg.hidden_size) // cfg.num_attention_heads)


def _starcoder(w: gguf.GGUFWriter, cfg) -> None:
    """StarCoderModel: its own keys only (4 * n_embd as the MLP width, one kv head)."""
    _layernorm_header(w, cfg.n_positions, cfg.n_embd, 4 * cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.layer_norm_epsilon, kv=1)


def _stablelm(w: gguf.GGUFWriter, cfg) -> None:
    """StableLMModel: its own keys only (the rotated width per head, the residual form)."""
    _gptneox(w, cfg)
    w.add_head_count_kv(cfg.num_key_value_heads)


def _cohere2(w: gguf.GGUFWriter, cfg) -> None:
    """Cohere2Model: the logit scale, the window, the rotated width (the whole head), no scaling."""
    w.add_logit_scale(cfg.logit_scale)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _command_r(w: gguf.GGUFWriter, cfg) -> None:
    """CommandR2Model: the logit scale, no scaling."""
    w.add_logit_scale(cfg.logit_scale)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _nemotron(w: gguf.GGUFWriter, cfg) -> None:
    """NemotronModel: the LayerNorm epsilon, the rotated width per head, no scaling."""
    w.add_layer_norm_eps(cfg.norm_eps)
    w.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _olmo(w: gguf.GGUFWriter, cfg) -> None:
    """OlmoModel: the LayerNorm epsilon and the q/k/v clamp."""
    w.add_layer_norm_eps(1e-5)
    if cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)


def _dbrx(w: gguf.GGUFWriter, cfg) -> None:
    """DbrxModel: its own keys only (the sizes, the rope base, the clamp, the experts' count and
    top-k, the fixed LayerNorm epsilon)."""
    attn, ffn = cfg.attn_config, cfg.ffn_config
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(ffn.ffn_hidden_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(attn.kv_n_heads)
    w.add_rope_freq_base(attn.rope_theta)
    w.add_clamp_kqv(attn.clip_qkv)
    w.add_expert_count(ffn.moe_num_experts)
    w.add_expert_used_count(ffn.moe_top_k)
    w.add_layer_norm_eps(1e-5)


def _dbrx_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """DbrxModel.modify_tensors: each expert matrix [E * F, D] viewed as [E, F, D]; w2's
    permuted to [E, D, F] (views: quantizing one writes the twin)."""
    ffn = cfg.ffn_config
    if name.endswith(("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2")):
        stack = t.view(ffn.moe_num_experts, ffn.ffn_hidden_size, cfg.d_model)
        return [(name, stack.permute(0, 2, 1) if name.endswith("w2") else stack)]
    return None


def _minicpm3(w: gguf.GGUFWriter, cfg) -> None:
    """MiniCPM3Model: its own keys only (no rope base, no value_length, no µP scales: llama.cpp
    fixes those), the MLA ranks, key_length = nope + rope and the rotated width."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def _minicpm3_rope_factors(cfg) -> dict:
    """MiniCPM3Model.generate_extra_tensors: LongRoPE's factor lists as two F32 tensors."""
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") != "longrope":
        return {}
    return {"rope_factors_long.weight": torch.tensor(rope["long_factor"], dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(rope["short_factor"], dtype=torch.float32)}


def _llama3_rope_freqs(cfg) -> dict:
    """LlamaModel.generate_extra_tensors: Llama 3 rope scaling as per-pair frequency divisors
    (rope_freqs.weight: 1 for short wavelengths, factor for long ones, smoothed between)."""
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") != "llama3":
        return {}
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * torch.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(out, dtype=torch.float32)}


def _apertus(w: gguf.GGUFWriter, cfg) -> None:
    """LlamaModel.set_gguf_parameters' own keys: the vocabulary and the rotated width."""
    w.add_rope_dimension_count(cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)


def _apertus_xielu(w: gguf.GGUFWriter, model) -> None:
    """ApertusModel.modify_tensors: each layer's xIELU scalars (alpha_p / alpha_n raw, before
    softplus) gathered into per-layer arrays; the tensors themselves are not written."""
    for key, add in (("alpha_n", w.add_xielu_alpha_n), ("alpha_p", w.add_xielu_alpha_p),
                     ("beta", w.add_xielu_beta), ("eps", w.add_xielu_eps)):
        add([getattr(layer.mlp.act_fn, key).float().item() for layer in model.model.layers])


def _afmoe(w: gguf.GGUFWriter, cfg) -> None:
    """AfmoeModel: LlamaModel's rotated width, TextModel's expert keys, then its own: shared
    experts, the experts' width, the dense lead, route_norm (where config.json has it: Trinity's
    do) and route_scale, the window."""
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.num_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.num_dense_layers)
    if getattr(cfg, "route_norm", None) is not None:
        w.add_expert_weights_norm(cfg.route_norm)
    w.add_expert_weights_scale(cfg.route_scale)
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)


def _afmoe_tensors(name: str, t: torch.Tensor, cfg) -> list | None:
    """AfmoeModel.filter_tensors: the selection bias as expert_bias.bias (exp_probs_b.bias)."""
    return [(name + ".bias", t)] if name.endswith("mlp.expert_bias") else None


def _mixtral(w: gguf.GGUFWriter, cfg) -> None:
    """LlamaModel on a Mixtral config: the expert count and top-k."""
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)


LAYOUTS = {
    "llama": Layout(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "mixtral": Layout(gguf.MODEL_ARCH.LLAMA, permute_qk=True, metadata=_mixtral),
    "qwen2": Layout(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Layout(gguf.MODEL_ARCH.QWEN3),
    "granite": Layout(gguf.MODEL_ARCH.GRANITE, permute_qk=True, metadata=_granite, head_dim_key=False),
    "smollm3": Layout(gguf.MODEL_ARCH.SMOLLM3, permute_qk=True),
    "olmo2": Layout(gguf.MODEL_ARCH.OLMO2),
    "qwen3moe": Layout(gguf.MODEL_ARCH.QWEN3MOE, metadata=_experts),
    "phi3": Layout(gguf.MODEL_ARCH.PHI3, metadata=_phi3, head_dim_key=False),
    "gemma2": Layout(gguf.MODEL_ARCH.GEMMA2, metadata=_gemma2, norm_shift=1.0),
    "gemma3": Layout(gguf.MODEL_ARCH.GEMMA3, metadata=_gemma3, norm_shift=1.0),
    "glm4moe": Layout(gguf.MODEL_ARCH.GLM4_MOE, metadata=_glm4moe),
    "qwen2moe": Layout(gguf.MODEL_ARCH.QWEN2MOE, metadata=_qwen2moe),
    "olmoe": Layout(gguf.MODEL_ARCH.OLMOE, metadata=_olmoe),
    "qwen3next": Layout(gguf.MODEL_ARCH.QWEN3NEXT, metadata=_qwen3next, tensors=_qwen3next_tensors),
    "gpt-oss": Layout(gguf.MODEL_ARCH.GPT_OSS, metadata=_gpt_oss, tensors=_gpt_oss_experts),
    # recent converters split MLA's kv_b; older files keep attn_kv_b
    "deepseek2": Layout(gguf.MODEL_ARCH.DEEPSEEK2, metadata=_deepseek2, head_dim_key=False, tensors=_split_kv_b),
    "deepseek2_kv_b": Layout(gguf.MODEL_ARCH.DEEPSEEK2, metadata=_deepseek2, head_dim_key=False),
    "gemma": Layout(gguf.MODEL_ARCH.GEMMA, norm_shift=1.0),
    "seed_oss": Layout(gguf.MODEL_ARCH.SEED_OSS),
    "olmo3": Layout(gguf.MODEL_ARCH.OLMO2, metadata=_sliding_pattern),
    "exaone4": Layout(gguf.MODEL_ARCH.EXAONE4, metadata=_sliding_pattern),
    "ernie4_5": Layout(gguf.MODEL_ARCH.ERNIE4_5),
    "arcee": Layout(gguf.MODEL_ARCH.ARCEE, permute_qk=True),
    "hunyuan-dense": Layout(gguf.MODEL_ARCH.HUNYUAN_DENSE),
    "glm4": Layout(gguf.MODEL_ARCH.GLM4, metadata=_glm4),
    "gptneox": Layout(gguf.MODEL_ARCH.GPTNEOX, metadata=_gptneox, text_metadata=False, tensors=_gptneox_tensors),
    "starcoder2": Layout(gguf.MODEL_ARCH.STARCODER2),
    "stablelm": Layout(gguf.MODEL_ARCH.STABLELM, metadata=_stablelm, text_metadata=False),
    "cohere2": Layout(gguf.MODEL_ARCH.COHERE2, metadata=_cohere2),
    "nemotron": Layout(gguf.MODEL_ARCH.NEMOTRON, metadata=_nemotron, norm_shift=1.0),
    "mamba": Layout(gguf.MODEL_ARCH.MAMBA, metadata=_mamba, text_metadata=False, tensors=_ssm_tensors),
    "mamba2": Layout(gguf.MODEL_ARCH.MAMBA2, metadata=_mamba2, text_metadata=False, tensors=_mamba2_tensors),
    "olmo": Layout(gguf.MODEL_ARCH.OLMO, permute_qk=True, metadata=_olmo),
    "gpt2": Layout(gguf.MODEL_ARCH.GPT2, metadata=_gpt2, text_metadata=False, tensors=_gpt2_tensors),
    "mpt": Layout(gguf.MODEL_ARCH.MPT, metadata=_mpt, text_metadata=False),
    "falcon": Layout(gguf.MODEL_ARCH.FALCON, metadata=_falcon, text_metadata=False, tensors=_falcon_tensors),
    "phi2": Layout(gguf.MODEL_ARCH.PHI2, metadata=_phi2, text_metadata=False),
    "starcoder": Layout(gguf.MODEL_ARCH.STARCODER, metadata=_starcoder, text_metadata=False),
    "command-r": Layout(gguf.MODEL_ARCH.COMMAND_R, metadata=_command_r),
    "exaone": Layout(gguf.MODEL_ARCH.EXAONE, metadata=_exaone),
    "granitemoe": Layout(gguf.MODEL_ARCH.GRANITE_MOE, permute_qk=True, metadata=_granitemoe, head_dim_key=False,
                         tensors=_granitemoe_tensors),
    "dots1": Layout(gguf.MODEL_ARCH.DOTS1, metadata=_dots1),
    "hunyuan-moe": Layout(gguf.MODEL_ARCH.HUNYUAN_MOE, metadata=_hunyuan_moe),
    "ernie4_5-moe": Layout(gguf.MODEL_ARCH.ERNIE4_5_MOE, metadata=_ernie4_5_moe, tensors=_ernie4_5_moe_tensors),
    "jais2": Layout(gguf.MODEL_ARCH.JAIS2, metadata=_exaone),  # the rotated width: the whole head
    "minimax-m2": Layout(gguf.MODEL_ARCH.MINIMAXM2, metadata=_minimax_m2, tensors=_minimax_m2_tensors),
    "lfm2": Layout(gguf.MODEL_ARCH.LFM2, metadata=_lfm2, text_metadata=False, tensors=_lfm2_tensors),
    "exaone-moe": Layout(gguf.MODEL_ARCH.EXAONE_MOE, metadata=_exaone_moe, tensors=_exaone_moe_tensors),
    "lfm2moe": Layout(gguf.MODEL_ARCH.LFM2MOE, metadata=_lfm2moe, text_metadata=False, tensors=_lfm2moe_tensors),
    "bloom": Layout(gguf.MODEL_ARCH.BLOOM, metadata=_bloom, text_metadata=False, tensors=_bloom_tensors),
    # the converter's own keys on top of TextModel's (block count, widths, head count, epsilon)
    "kimi-linear": Layout(gguf.MODEL_ARCH.KIMI_LINEAR, metadata=_kimi_linear, head_dim_key=False,
                          tensors=_kimi_linear_tensors),
    "kimi-linear_kv_b": Layout(gguf.MODEL_ARCH.KIMI_LINEAR, metadata=_kimi_linear, head_dim_key=False,
                               tensors=_kimi_linear_kv_b),
    "qwen35": Layout(gguf.MODEL_ARCH.QWEN35, metadata=_qwen35, tensors=_qwen35_tensors),
    "qwen35moe": Layout(gguf.MODEL_ARCH.QWEN35MOE, metadata=_qwen35, tensors=_qwen35_tensors),
    "qwen35moe_fused": Layout(gguf.MODEL_ARCH.QWEN35MOE, metadata=_qwen35, tensors=_qwen35_fused_experts),
    "granitehybrid": Layout(gguf.MODEL_ARCH.GRANITE_HYBRID, permute_qk=True, metadata=_granitehybrid, head_dim_key=False,
                            tensors=_granitehybrid_tensors),
    "nemotron_h": Layout(gguf.MODEL_ARCH.NEMOTRON_H, permute_qk=True, metadata=_nemotron_h, head_dim_key=False,
                         tensors=_nemotron_h_tensors),
    "falcon-h1": Layout(gguf.MODEL_ARCH.FALCON_H1, metadata=_falcon_h1, text_metadata=False, tensors=_falcon_h1_tensors),
    "jamba": Layout(gguf.MODEL_ARCH.JAMBA, metadata=_jamba, text_metadata=False, tensors=_jamba_tensors),
    "minicpm3": Layout(gguf.MODEL_ARCH.MINICPM3, metadata=_minicpm3, text_metadata=False,
                       extra_tensors=_minicpm3_rope_factors),
    "afmoe": Layout(gguf.MODEL_ARCH.AFMOE, metadata=_afmoe, tensors=_afmoe_tensors),
    "apertus": Layout(gguf.MODEL_ARCH.APERTUS, metadata=_apertus, weight_metadata=_apertus_xielu,
                      extra_tensors=_llama3_rope_freqs, skip=("rotary_emb.inv_freq", "mlp.act_fn.")),
    "dbrx": Layout(gguf.MODEL_ARCH.DBRX, metadata=_dbrx, text_metadata=False, tensors=_dbrx_tensors),
}


def _converter_tensors(sd: dict):
    """(HF name, tensor) as the converter reads a checkpoint: transformers 5 keeps the experts
    stacked as gate_up_proj [E, 2F, D]; on disk (and so to the converter, which stacks them per
    kind) they are gate [E, F, D] and up [E, F, D]. Views: writing into them writes the twin."""
    for name, t in sd.items():
        if name.endswith("e_score_correction_bias"):  # the converter's rename, so the table finds it
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, t


def write_gguf(path: Path, model, layout: Layout, quantize: dict[str, Q] | None = None,
               arch: str | None = None, extra: dict | None = None, extra_tensors: dict | None = None) -> Path:
    """`model` (a transformers *ForCausalLM) as a GGUF file at `path`, llama.cpp's way.

    quantize: {GGUF tensor name: block type}; those tensors are stored quantized and `model`'s
    weights are replaced by their dequantized values (the file and the twin stay equal). A value
    (blocks uint8 [..., bytes per row], block type) stores those blocks instead (the K-quants,
    which gguf-py does not quantize), the twin taking their values.
    arch: another general.architecture; extra: more metadata {key ("{arch}." expanded): str,
    int or float value} (bad-input tests); extra_tensors: more F32 tensors {GGUF name: tensor}
    (parts of the file the twin does not have, e.g. an MTP block).
    """
    cfg = model.config
    quantize = dict(quantize or {})
    names = gguf.get_tensor_name_map(layout.arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch or layout.name)
    if layout.text_metadata:
        _text_metadata(w, cfg, layout.head_dim_key)
    if layout.metadata is not None:
        layout.metadata(w, cfg)
    if layout.weight_metadata is not None:
        layout.weight_metadata(w, model)
    for key, value in (extra or {}).items():
        key = key.format(arch=arch or layout.name)
        {str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)](key, value)
    heads = {"attn_q": getattr(cfg, "num_attention_heads", None), "attn_k": getattr(cfg, "num_key_value_heads", None)}
    tensors = list(model.state_dict().items())
    storages = {t.untyped_storage().data_ptr() for _, t in tensors}  # the twin's own weights
    if layout.tensors is not None:  # before the generic expert split: the layout's own comes first
        tensors = [out for hf_name, p in tensors
                   for out in (layout.tensors(hf_name, p, cfg) or [(hf_name, p)])]
    tensors = list(_converter_tensors(dict(tensors)))
    for hf_name, p in tensors:
        if any(s in hf_name for s in layout.skip):
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the converter writes no output.weight for tied embeddings
        # a layout's own tensors may come GGUF-named already
        name = hf_name if hf_name.startswith("blk.") else names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"gguf-py's {layout.name} tensor map has no name for {hf_name}")
        if not name.endswith((".weight", ".bias", ".ssm_a", ".ssm_d")):
            # transformers' stacked experts are bare parameters; GGUF names are not (but A_log's
            # ssm_a and D's ssm_d, as in llama.cpp's own tensor names)
            name += ".weight"
        t = p.detach().float()
        if hf_name.endswith("norm.weight"):
            t = t + layout.norm_shift
        kind = name.split(".")[-2]
        if name in quantize:
            if layout.permute_qk and kind in heads:
                raise ValueError(f"quantize a tensor the converter does not permute, not {name}")
            if p.untyped_storage().data_ptr() not in storages:
                raise ValueError(f"{name} is computed from the twin's weights, so its rounded values cannot be "
                                 f"written back: quantize another tensor")
            qtype = quantize.pop(name)
            if isinstance(qtype, tuple):  # the caller's blocks
                blocks, qtype = qtype
                if blocks.shape[:-1] != tuple(t.shape[:-1]):
                    raise ValueError(f"{name}: blocks {blocks.shape} for a tensor of shape {tuple(t.shape)}")
            else:
                blocks = gguf.quants.quantize(t.numpy(), qtype)
            t = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy()).reshape(t.shape)
            with torch.no_grad():
                p.copy_(t)  # the twin now holds exactly the file's values
        else:
            blocks, qtype = None, None
        if layout.permute_qk and kind in heads:
            t = llama_cpp_permute(t, heads[kind])
        if blocks is not None:
            w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(name, t.numpy())
    for name, t in {**(layout.extra_tensors(cfg) if layout.extra_tensors else {}), **(extra_tensors or {})}.items():
        w.add_tensor(name, t.detach().float().numpy())
    if quantize:
        raise KeyError(f"no tensors named {sorted(quantize)} in the twin")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
