"""MoE families from configuration alone: Qwen3-MoE, Mixtral, DeepSeek-V2 (and V2-Lite), GLM-4.5
(and GLM-4.5-Air). Their routings are options of the one MoE kind: softmax top-k renormalised
(Mixtral, Qwen3-MoE norm_topk_prob) or not (Qwen3-MoE's default, DeepSeek-V2), group-limited
softmax (DeepSeek-V2 group_limited_greedy: a group scores its best expert), sigmoid with a
selection bias and shared experts (GLM-4.5, DeepSeek-V3's path).

Parity with transformers' *ForCausalLM on tiny random checkpoints it saved (CPU, float32, odd
sizes), for the prefill and every greedy decode step, runs in tests/test_family_parity.py (the
moe/* entries); here the routing, MTP, Hub and import checks on the same checkpoints, and the
presets' parameter counts against transformers' models of the flagship configs built on meta.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import zoo
from zoo.compiler.config import load_config
from zoo.compiler.errors import ConfigError
from zoo.compiler.hf_import import import_config
from zoo.compiler.spec import validate
from tests.deepseek_v3_fixtures import add_shard, make_mtp_layer, mtp_hub_tensors, mtp_reference
from tests.deepseek_v3_fixtures import randomize as randomize_v3
from tests.helpers import assert_logits_close

transformers = pytest.importorskip("transformers")

VOCAB = 211
# odd sizes shared by every family: d 48, 4 heads of 12, 8 experts of 20, dense FFN 72, 3 layers
COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


def _qwen3_moe(**kw):
    return transformers.Qwen3MoeConfig(**{**COMMON, **dict(
        num_key_value_heads=2, head_dim=12, intermediate_size=72, moe_intermediate_size=20, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), **kw})


def _mixtral(**kw):
    return transformers.MixtralConfig(**{**COMMON, **dict(
        num_key_value_heads=2, intermediate_size=20, num_local_experts=8, num_experts_per_tok=2), **kw})


def _deepseek_v2(**kw):
    return transformers.DeepseekV2Config(**{**COMMON, **dict(
        intermediate_size=72, moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.0, rope_parameters=YARN), **kw})


def _glm4_moe(**kw):
    return transformers.Glm4MoeConfig(**{**COMMON, **dict(
        num_key_value_heads=2, head_dim=12, intermediate_size=72, moe_intermediate_size=20, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.5}), **kw})


VARIANTS = {
    # name: (config, overrides, batch, save kwargs): tests/test_family_parity.py's moe/* entries
    "qwen3_moe": (_qwen3_moe, {}, 2, {}),
    "qwen3_moe_unnormalised": (_qwen3_moe, dict(norm_topk_prob=False, attention_bias=True), 1, {}),
    "mixtral": (_mixtral, {}, 2, {}),
    "deepseek_v2": (_deepseek_v2, {}, 2, {}),
    "deepseek_v2_lite": (_deepseek_v2, dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                                            routed_scaling_factor=1.0), 2, {}),
    "glm4_moe": (_glm4_moe, {}, 2, {"max_shard_size": "100KB"}),  # sharded: the MTP test adds a shard
    "glm4_moe_air": (_glm4_moe, dict(use_qk_norm=False, routed_scaling_factor=1.0), 1, {}),
}


@torch.no_grad()
def randomize(ref) -> None:
    """Norms away from 1, a non-zero selection bias (deepseek_v3_fixtures), and the attention
    biases transformers zeroes made random."""
    randomize_v3(ref)
    for p_name, p in ref.named_parameters():
        if p_name.endswith("proj.bias"):
            p.normal_(0.0, 0.3)


@pytest.fixture(scope="module")
def references(families):
    """{variant: (reference, checkpoint dir, batch)}: tests/test_family_parity.py's moe/* entries
    (their prefill / decode parity, eager and compiled, runs there), shared for the session."""
    return families.group("moe")


# ----------------------------------------------------------------------------- routing


def test_group_limit_matters(references):
    """The tiny DeepSeek-V2 really exercises group-limited routing: the same weights routed
    greedily over all experts give other logits (so the parity above can fail)."""
    ref, path, _ = references["deepseek_v2"]
    greedy = zoo.from_pretrained(str(path), compile=False, max_seq=64,
                                 overrides=["ffns.moe.n_group=1", "ffns.moe.topk_group=1"])
    ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        assert (greedy.prefill(ids) - ref(ids).logits).abs().max() > 1e-3


def test_mixtral_checkpoint_keeps_hub_names(references):
    """transformers 5 renames Mixtral's block_sparse_moe.* in memory but writes the Hub names back."""
    from safetensors import safe_open

    _, path, _ = references["mixtral"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in k for k in keys)


@pytest.fixture(scope="module")
def glm_mtp(references, tmp_path_factory):
    """The glm4_moe checkpoint plus the MTP layer GLM-4.5 stores as model.layers.{n_layers}
    (transformers builds none): a MoE decoder block, enorm, hnorm, eh_proj, shared_head.norm; it
    reads the main embedding and lm_head (mtp.share_embeddings), so none of its own are stored."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    ref, src, _ = references["glm4_moe"]
    path = tmp_path_factory.mktemp("glm4_moe_mtp")
    shutil.copytree(src, path, dirs_exist_ok=True)
    block, extra = make_mtp_layer(ref.config, layer_cls=Glm4MoeDecoderLayer)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.3)
    extra.update({"embed_tokens.weight": ref.model.embed_tokens.weight.detach(),
                  "shared_head.head.weight": ref.lm_head.weight.detach()})
    tensors = {k: v for k, v in mtp_hub_tensors(block, extra, ref.config.num_hidden_layers).items()
               if not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    add_shard(path, "model-mtp.safetensors", tensors)
    return ref, path, block, extra, sorted(tensors)


def test_glm_mtp_layer(glm_mtp):
    """checkpoint.mtp=true fills the MTP layer from model.layers.{n} (its logits for token t + 2
    match a hand-written reference over the same tensors); the default skips it with a reason."""
    ref, path, block, extra, names = glm_mtp
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=48, overrides=["checkpoint.mtp=true"])
    ids = torch.randint(0, VOCAB, (2, 12))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(logits, ref(ids).logits, 1e-4, "main logits")
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-4, "mtp logits")
    plain = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    skipped = dict(plain.info.load.ignored)
    assert len(plain.module.mtp) == 0 and sorted(skipped) == names
    assert all("multi-token-prediction" in why for why in skipped.values())


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "deepseek_v2_lite", "glm4_moe"])
def test_zoo_import_round_trip(references, variant, tmp_path, monkeypatch, capsys):
    """`zoo import DIR name=X`, then `zoo.build(X, weights=DIR)`: the same model as from_pretrained,
    bit for bit; `zoo check` accounts for every tensor."""
    from zoo.cli import main

    _, path, _ = references[variant]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), f"name={variant}_imported"]) == 0
    built = zoo.build(f"{variant}_imported", weights=str(path), compile=False, max_seq=24)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=24)
    assert built.spec.layers == direct.spec.layers and built.spec.ffns == direct.spec.ffns
    ids = torch.randint(0, VOCAB, (1, 13))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    torch.testing.assert_close(built.decode(torch.tensor([5])), direct.decode(torch.tensor([5])), rtol=0, atol=0)
    capsys.readouterr()
    assert main(["check", f"weights={path}"]) == 0
    assert "OK: every tensor accounted for" in capsys.readouterr().out


# ----------------------------------------------------------------------------- presets


# The flagships' config.json (as published on the Hub: older transformers, rope_theta +
# rope_scaling at the top level) and the transformers config of the same model for the meta count.
REAL_CONFIGS = {
    "qwen3_30b_a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "mixtral_8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
        "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"},
        "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
        "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1536, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 160,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 128, "num_experts_per_tok": 6,
        "num_hidden_layers": 60, "num_key_value_heads": 128, "pretraining_tp": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 3, "topk_method": "group_limited_greedy",
        "torch_dtype": "bfloat16", "transformers_version": "4.39.3", "use_cache": True, "v_head_dim": 128,
        "vocab_size": 102400},
    "glm4_5": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
        "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0",
        "use_cache": True, "use_qk_norm": True, "vocab_size": 151552},
}
REAL_CONFIGS["deepseek_v2_lite"] = {**REAL_CONFIGS["deepseek_v2"], "hidden_size": 2048, "intermediate_size": 10944,
                                    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
                                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27,
                                    "q_lora_rank": None, "routed_scaling_factor": 1.0, "topk_group": 1,
                                    "topk_method": "greedy"}
REAL_CONFIGS["glm4_5_air"] = {**REAL_CONFIGS["glm4_5"], "hidden_size": 4096, "intermediate_size": 10944,
                              "moe_intermediate_size": 1408, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
                              "first_k_dense_replace": 1, "num_hidden_layers": 46, "use_qk_norm": False}


def _hf_config(real: dict):
    """transformers' config object of a Hub config.json (its own legacy-key handling)."""
    d = {k: v for k, v in real.items() if k not in ("architectures", "auto_map", "torch_dtype", "transformers_version")}
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def _stored_tensors(model) -> int:
    """Parameters plus the persistent buffers a checkpoint stores (the selection bias
    e_score_correction_bias is a buffer in transformers, a parameter in zoo)."""
    state = set(model.state_dict())
    return sum(p.numel() for p in model.parameters()) + \
        sum(b.numel() for n, b in model.named_buffers() if n in state)


@pytest.mark.parametrize("preset", list(REAL_CONFIGS))
def test_preset_exact_parameter_count(preset):
    """The preset's dry build counts exactly what transformers builds from the flagship config."""
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(_hf_config(REAL_CONFIGS[preset]))
    assert zoo.build(preset, dry=True).info.params == _stored_tensors(ref)


@pytest.mark.parametrize("preset", list(REAL_CONFIGS))
def test_import_real_config_is_the_preset(preset):
    """The flagship's config.json imports to exactly the preset's architecture."""
    imported = validate(import_config(REAL_CONFIGS[preset], "config.json"), "config.json")
    want = load_config(preset)
    for field in ("dim", "vocab_size", "tie_embeddings", "max_position", "norm", "rope", "mixers", "ffns",
                  "layers", "mtp"):
        assert getattr(imported, field) == getattr(want, field), field
    assert imported.checkpoint.rules == want.checkpoint.rules


@pytest.mark.parametrize("twin", ["qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v2", "deepseek_v2_lite", "glm4_5",
                                  "glm4_5_air"])
def test_tiny_twin_is_the_preset_shrunk(twin):
    """Each *_tiny twin keeps its preset's layer kinds (dense first layers, then MoE), routing
    options, rope kind and checkpoint rules, at small dims."""
    big, tiny = load_config(twin), load_config(f"{twin}_tiny")
    kinds = lambda s: [(x.mixer_name, x.mixer.kind, x.ffn_name, x.ffn.kind) for x in s.layers]
    dedup = lambda seq: [k for i, k in enumerate(seq) if i == 0 or seq[i - 1] != k]
    assert dedup(kinds(tiny)) == dedup(kinds(big))
    moe = lambda s: {k: v for k, v in vars(s.ffns["moe"]).items() if k in (
        "scoring", "score_correction_bias", "group_score", "norm_topk_prob", "shared_expert_gate")}
    assert moe(tiny) == moe(big) and tiny.rope.kind == big.rope.kind
    assert tiny.checkpoint.rules == big.checkpoint.rules and tiny.dim < 128


# ----------------------------------------------------------------------------- honest errors


@pytest.mark.parametrize("preset, change, match", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc' is not supported \(expected one of "
                                                 r"\['greedy', 'group_limited_greedy'\]; see conf/hf/deepseek_v2.yaml"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True is not supported"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
    ("mixtral_8x7b", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),  # sliding_window imports
    ("qwen3_30b_a3b", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("qwen3_30b_a3b", {"mlp_only_layers": [3]}, r"mlp_only_layers=\[3\] is not supported"),
    ("glm4_5", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_unsupported_values_are_errors(preset, change, match):
    with pytest.raises(ConfigError, match=match):
        import_config({**REAL_CONFIGS[preset], **change}, "config.json")


def test_greedy_ignores_groups_as_transformers_does():
    """topk_method greedy with n_group > 1 in config.json: transformers' router ignores the
    groups, so the imported MoE is ungrouped too (not a silently different routing)."""
    cfg = {**REAL_CONFIGS["deepseek_v2"], "topk_method": "greedy"}
    moe = validate(import_config(cfg, "config.json"), "config.json").ffns["moe"]
    assert (moe.n_group, moe.topk_group) == (1, 1)
    limited = validate(import_config(REAL_CONFIGS["deepseek_v2"], "c"), "c").ffns["moe"]
    assert (limited.n_group, limited.topk_group, limited.group_score) == (8, 3, "max")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v2", "glm4_moe", "deepseek_v3"])
def test_import_defaults_are_the_config_class_defaults(model_type):
    """A config.json that leaves out every key the import map gives a default for imports to the
    same model as one that spells out the config class's defaults."""
    from omegaconf import OmegaConf
    from zoo.compiler.config import conf_dir

    full = transformers.AutoConfig.for_model(model_type).to_dict()
    full["num_attention_heads"] = 32  # Glm4MoeConfig's 96 heads do not divide its hidden_size 4096
    full["num_experts_per_tok"] = full["num_experts_per_tok"] or 6  # DeepseekV2Config leaves it None
    spec = OmegaConf.to_container(OmegaConf.load(conf_dir() / "hf" / f"{model_type}.yaml"))
    sparse = json.loads(json.dumps(full))
    for rule in spec["fields"].values():
        if not (isinstance(rule, dict) and "default" in rule):
            continue
        for key in rule["key"] if isinstance(rule["key"], list) else [rule["key"]]:
            *parents, leaf = key.split(".")
            node = sparse
            for p in parents:
                node = node.get(p) or {}
            node.pop(leaf, None)
    for key in (spec.get("cases") or {}):
        sparse.pop(key, None)
    a, b = (validate(import_config(c, "config.json"), "config.json") for c in (full, sparse))
    assert (a.mixers, a.ffns, a.layers, a.rope, a.norm, a.max_position, a.tie_embeddings, a.mtp) == \
           (b.mixers, b.ffns, b.layers, b.rope, b.norm, b.max_position, b.tie_embeddings, b.mtp)
