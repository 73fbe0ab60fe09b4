"""FP8 Hub checkpoints (DeepSeek-V3 layout): e4m3 weights with a float32 `weight_scale_inv` per
128x128 block, on dims that are not multiples of 128, mixed with bf16/fp32 tensors, sharded, with
an MTP layer; and a checkpoint too large for the device.

The checkpoints are written here in the real Hub layout (config.json with quantization_config and
the older rope_theta + rope_scaling keys, model.safetensors.index.json, one tensor per expert).
Dequantized parameters are checked against a dequant written out block by block in this file, not
against transformers' (which derives the block size from the shapes: wrong for partial blocks).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

import zoo
from zoo.compiler.errors import CheckpointError, ConfigError, ZooError
from tests.deepseek_v3_fixtures import hub_tensors, make_mtp_layer, mtp_hub_tensors, mtp_reference, randomize
from tests.helpers import assert_logits_close, check_parity

transformers = pytest.importorskip("transformers")

BLOCK = 128
FP8_MAX = 448.0
# dims chosen so that most weights end in a partial 128-block (200, 300, 136, 88, ...)
DIMS = dict(vocab_size=160, hidden_size=200, intermediate_size=300, moe_intermediate_size=136, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=144, kv_lora_rank=72, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
# FP8 in DeepSeek-V3: every linear weight of the decoder blocks; BF16: norms, router, embeddings,
# lm_head, MTP eh_proj / shared_head; F32: the selection bias
FP8_PARTS = ("_proj.weight",)
NOT_FP8 = ("eh_proj.weight", "shared_head", "embed_tokens", "lm_head", "mlp.gate.weight")


def is_fp8(name: str) -> bool:
    return name.endswith(FP8_PARTS) and not any(p in name for p in NOT_FP8)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float32 -> (e4m3 codes [out, in], scale_inv [ceil(out/128), ceil(in/128)] f32)."""
    out, inp = w.shape
    rows, cols = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
    codes = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_by_hand(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Every 128x128 block (partial at the edges) times its own scale, block by block."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = codes[rows, cols].float() * scale[i, j]
    return out


def to_hub_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub storage: FP8 codes + weight_scale_inv for block linears, BF16 for the rest, F32 bias."""
    out = {}
    for name, t in tensors.items():
        if is_fp8(name):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize(t.float())
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def stored_values(hub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 values the Hub tensors stand for (dequantized by hand, bf16 upcast)."""
    out = {}
    for name, t in hub.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = hub.get(name.removesuffix("weight") + "weight_scale_inv")
        out[name] = dequantize_by_hand(t, scale) if scale is not None else t.float()
    return out


def write_sharded(path, shards: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


def hub_config(config) -> dict:
    """config.json as the Hub has it: quantization_config, rope_theta + rope_scaling (pre-5 keys)."""
    cfg = config.to_dict()
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    cfg.update(quantization_config=QUANT, scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1)
    return cfg


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A 2-layer model (1 dense, 1 MoE) + an MTP layer, FP8, in 3 shards; and its values."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**DIMS)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize(model)
    block, extra = make_mtp_layer(config, seed=5)
    hub = to_hub_fp8({**hub_tensors(model.state_dict()), **mtp_hub_tensors(block, extra, 2)})
    shards = {"model-00001-of-00003.safetensors": {}, "model-00002-of-00003.safetensors": {},
              "model-00003-of-00003.safetensors": {}}
    for name, t in hub.items():
        n = 0 if name.startswith(("model.embed", "model.layers.0.")) else 2 if name.startswith("model.layers.2.") else 1
        shards[list(shards)[n]][name] = t
    path = tmp_path_factory.mktemp("fp8")
    write_sharded(path, shards, hub_config(config))
    values = stored_values(hub)

    # the reference: transformers on the dequantized values (saved without quantization)
    plain = tmp_path_factory.mktemp("dequantized")
    main = {k: v for k, v in values.items() if not k.startswith("model.layers.2.")}
    save_file(main, str(plain / "model.safetensors"), metadata={"format": "pt"})
    plain_cfg = config.to_dict()
    (plain / "config.json").write_text(json.dumps(plain_cfg))
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(plain).eval()
    # the MTP block with the dequantized values
    mtp_values = {k.removeprefix("model.layers.2."): v for k, v in values.items() if k.startswith("model.layers.2.")}
    state = block.state_dict()
    for e in range(config.n_routed_experts):
        state["mlp.experts.gate_up_proj"][e] = torch.cat((mtp_values[f"mlp.experts.{e}.gate_proj.weight"],
                                                          mtp_values[f"mlp.experts.{e}.up_proj.weight"]))
        state["mlp.experts.down_proj"][e] = mtp_values[f"mlp.experts.{e}.down_proj.weight"]
    block.load_state_dict({**state, **{k: v for k, v in mtp_values.items() if k in state}})
    mtp_extra = {k: mtp_values[k] for k in extra}
    return path, hub, values, ref, block, mtp_extra


def test_checkpoint_layout(fp8_checkpoint):
    """The fixture is what the issue asks for: FP8 blocks on partial dims, mixed dtypes, 3 shards."""
    path, hub, *_ = fp8_checkpoint
    dtypes = {t.dtype for t in hub.values()}
    assert dtypes == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    w = hub["model.layers.0.mlp.gate_proj.weight"]
    assert w.shape == (300, 200) and hub["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert any(k.startswith("model.layers.2.") and k.endswith("weight_scale_inv") for k in index["weight_map"])


def test_dequantized_parameters(fp8_checkpoint):
    path, hub, values, *_ = fp8_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32, overrides=["checkpoint.mtp=true"])
    p = dict(m.module.named_parameters())
    checks = {
        "layers.0.mixer.wq_a.weight": values["model.layers.0.self_attn.q_a_proj.weight"],
        "layers.0.mixer.wkv_a.weight": values["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
        "layers.1.mixer.wkv_b.weight": values["model.layers.1.self_attn.kv_b_proj.weight"],
        "layers.1.mixer.wo.weight": values["model.layers.1.self_attn.o_proj.weight"],
        "layers.0.ffn.w13.weight": torch.cat((values["model.layers.0.mlp.gate_proj.weight"],
                                              values["model.layers.0.mlp.up_proj.weight"])),
        "layers.0.ffn.w2.weight": values["model.layers.0.mlp.down_proj.weight"],
        "layers.1.ffn.shared.w2.weight": values["model.layers.1.mlp.shared_experts.down_proj.weight"],
        "mtp.0.mixer.wq_b.weight": values["model.layers.2.self_attn.q_b_proj.weight"],
        "mtp.0.eh_proj.weight": values["model.layers.2.eh_proj.weight"],  # bf16, not fp8
        "layers.1.mixer_norm.weight": values["model.layers.1.input_layernorm.weight"],  # bf16
        "layers.1.ffn.router.score_bias": values["model.layers.1.mlp.gate.e_score_correction_bias"],  # f32
        "embed.weight": values["model.embed_tokens.weight"],
    }
    for e in range(4):
        checks[f"layers.1.ffn.w13[{e}]"] = torch.cat((values[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
                                                      values[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]))
        checks[f"mtp.0.ffn.w2[{e}]"] = values[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
    for name, want in checks.items():
        base, _, row = name.partition("[")
        got = p[base] if not row else p[base][int(row[:-1])]
        assert torch.equal(got, want), name
    # transformers' rule (block = rows // scale_rows) gives other values on these partial blocks
    codes, scale = hub["model.layers.0.mlp.gate_proj.weight"], hub["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    bo, bi = codes.shape[0] // scale.shape[0], codes.shape[1] // scale.shape[1]
    derived = codes.float() * scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    assert (derived - p["layers.0.ffn.w13.weight"][:300]).abs().max() > 1e-3


def test_fp8_logits_and_mtp(fp8_checkpoint):
    """The loaded FP8 model = transformers on the dequantized values; MTP = the hand reference."""
    path, _, _, ref, block, extra = fp8_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, overrides=["checkpoint.mtp=true"])
    ids = torch.randint(0, 160, (2, 9))
    check_parity(ref, m, ids, steps=4)
    _, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, "mtp logits")


def test_fp8_mtp_skipped_by_default(fp8_checkpoint):
    """Every stored tensor of the MTP layer (codes and scales) is reported as skipped, by name."""
    path, hub, *_ = fp8_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32)
    assert len(m.module.mtp) == 0
    skipped = dict(m.info.load.ignored)
    assert set(skipped) == {k for k in hub if k.startswith("model.layers.2.")}
    assert "model.layers.2.self_attn.q_a_proj.weight_scale_inv" in skipped
    assert all("checkpoint.mtp=false" in why for why in skipped.values())


def _copy_with(src, dst, config_update=None, tensors_update=None):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if config_update:
        cfg = json.loads((src / "config.json").read_text())
        for key, value in config_update.items():
            cfg["quantization_config"][key] = value
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_update:
        fname, tensors = tensors_update
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("key,value,match", [
    ("weight_block_size", [64, 64], "quantization_config.weight_block_size=\\[64, 64\\] is not supported"),
    ("fmt", "e5m2", "quantization_config.fmt='e5m2' is not supported"),
    ("quant_method", "gptq", "quant_method='gptq' is not supported"),
])
def test_quantization_config_checked(fp8_checkpoint, tmp_path, key, value, match):
    path, *_ = fp8_checkpoint
    bad = _copy_with(path, tmp_path / "bad", config_update={key: value})
    with pytest.raises(ConfigError, match=match):
        zoo.from_pretrained(str(bad), compile=False)


def test_bad_scale_shape(fp8_checkpoint, tmp_path):
    path, hub, *_ = fp8_checkpoint
    fname = "model-00001-of-00003.safetensors"
    shard = {k: v for k, v in hub.items() if k.startswith(("model.embed", "model.layers.0."))}
    shard["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(2, 2)  # should be [3, 2]
    bad = _copy_with(path, tmp_path / "bad", tensors_update=(fname, shard))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.gate_proj.weight_scale_inv.*needs a scale of "
                                              r"shape \[3, 2\], got \[2, 2\]"):
        zoo.from_pretrained(str(bad), compile=False)


# ----------------------------------------------------------------------------- too large

# deepseek-ai/DeepSeek-V3 config.json (the architecture keys)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1,
    "quantization_config": QUANT, "bos_token_id": 0, "eos_token_id": 1,
}


def test_too_large_fails_before_allocating(tmp_path):
    """The real DeepSeek-V3 config.json with an index over placeholder shards: the build plan
    (671B parameters, ~1.25 TiB in bf16) is refused before anything is allocated or read."""
    psutil = pytest.importorskip("psutil")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    for name, fname in weight_map.items():
        save_file({name: torch.zeros(2, 2, dtype=torch.bfloat16)}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ZooError, match=r"needs [\d.]+ GiB: [\d.]+ GiB of weights \(671,026,419,200 parameters in "
                                       r"bfloat16.*nothing was allocated"):
        zoo.from_pretrained(str(tmp_path), dtype=torch.bfloat16, compile=False)
    assert psutil.Process().memory_info().rss - rss < 256 * 2**20
    # the same config on meta: the exact plan
    from zoo.runtime import from_pretrained_config

    m = from_pretrained_config(str(tmp_path), dry=True, dtype=torch.bfloat16)
    assert m.info.params == 671_026_419_200 and m.info.cache_bytes_per_token == 70_272
    assert m.spec.checkpoint.rules == ["fp8_block", "fp8_e8m0", "deepseek_mtp", "deepseek_v3"]
