"""Kimi Linear: Kimi Delta Attention (per-channel gated delta rule) layers with NoPE MLA layers,
a dense first layer then DeepSeek-V3-style MoE; the flagship preset and its exact size.

Parity with transformers' KimiLinearForCausalLM on a tiny random checkpoint it saved (CPU,
float32; its torch fallbacks for the KDA kernels), for the prefill and every greedy decode step,
eager and compiled, runs in tests/test_family_parity.py (the kimi_linear entry); here it is also
loaded from a Hub id in a local cache and through `zoo import`. The KDA kernels themselves are checked against a naive reference in
tests/test_gated_deltanet.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zoo
from zoo.compiler.config import load_config
from zoo.compiler.errors import ConfigError
from zoo.compiler.hf_import import import_config
from zoo.compiler.mixers.kda import KimiDeltaAttention
from zoo.compiler.mixers.mla import MLA
from zoo.compiler.model import build_model, count_parameters
from zoo.compiler.spec import validate
from tests.helpers import check_parity, populate_hub_cache
from tests.test_qwen3_next import CHUNK

transformers = pytest.importorskip("transformers")

VOCAB = 256
MAX_SEQ = 128  # as the shared eager model (tests/test_family_parity.py)
FULL_ATTN = [4, 8, 12, 16, 20, 24, 27]  # 1-based, as the checkpoint's linear_attn_config lists them

# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (architecture keys)
REAL_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": FULL_ATTN, "head_dim": 128,
                           "kda_layers": [i for i in range(1, 28) if i not in FULL_ATTN], "num_heads": 32,
                           "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-5, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128,
    "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
}


def tiny_config(**kw):
    """transformers' config of the tiny twin's shape (conf/kimi_linear_tiny.yaml)."""
    base = dict(vocab_size=VOCAB, hidden_size=56, intermediate_size=72, moe_intermediate_size=24,
                num_hidden_layers=5, num_attention_heads=3, kv_lora_rank=24, q_lora_rank=None,
                qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, num_local_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
                linear_num_heads=3, linear_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                             "full_attention"],
                pad_token_id=None, bos_token_id=None, eos_token_id=None)
    base.update(kw)
    return transformers.KimiLinearConfig(**base)


@torch.no_grad()
def randomize(module: torch.nn.Module) -> None:
    """Weights transformers initialises to constants made random, so that a misplaced one shows:
    norms away from 1, a strong conv, a per-channel spread of dt_bias, the selection bias."""
    for name, p in module.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0)
        elif "conv1d" in name:
            p.normal_(0.0, 0.3)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def reference(families):
    """(reference, checkpoint dir): tests/test_family_parity.py's kimi_linear entry (its prefill /
    decode parity, eager and compiled, runs there), shared for the session."""
    return families.reference("kimi_linear")


@pytest.fixture(scope="module")
def eager(families):
    """The shared eager model (max_batch 2, max_seq 128, chunk 16)."""
    return families.eager("kimi_linear")


# ----------------------------------------------------------------------------- preset and import


def transformers_parameters(config) -> int:
    """Parameters of transformers' model on the meta device, plus the router's selection bias,
    which transformers keeps as a buffer (a stored checkpoint tensor zoo holds as a parameter)."""
    with torch.device("meta"):
        model = transformers.KimiLinearForCausalLM(config)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + bias


def test_flagship_exact_parameter_count():
    m = zoo.build("kimi_linear", dry=True)
    config = transformers.KimiLinearConfig(**{k: v for k, v in REAL_CONFIG.items() if k != "torch_dtype"})
    assert m.info.params == transformers_parameters(config) == 49_122_681_728
    # 7 MLA layers grow by one latent + k_rope per token; 20 KDA layers hold a constant state
    assert m.info.cache_bytes_per_token == 7 * (512 + 64) * 4
    assert m.info.state_bytes_per_sequence == 20 * (3 * 32 * 128 * 3 * 4 + 32 * 128 * 128 * 4)


def test_import_real_config_is_the_preset():
    """config.json of the real checkpoint (nested linear_attn_config, 1-based MLA layer list)
    -> the same layers as conf/kimi_linear.yaml; transformers' flat spelling -> the same."""
    imported = validate(import_config(REAL_CONFIG, "config.json"), "config.json")
    preset = load_config("kimi_linear")
    assert [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in imported.layers] == \
           [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in preset.layers]
    assert [x.mixer_name for x in preset.layers] == \
           ["attn" if i + 1 in FULL_ATTN else "linear" for i in range(27)]
    assert [x.ffn_name for x in preset.layers] == ["dense"] + ["moe"] * 26
    assert (imported.norm, imported.dim, imported.vocab_size, imported.max_position) == \
           (preset.norm, preset.dim, preset.vocab_size, preset.max_position)
    assert imported.checkpoint.rules == preset.checkpoint.rules
    flat = transformers.KimiLinearConfig(**{k: v for k, v in REAL_CONFIG.items() if k != "torch_dtype"}).to_dict()
    again = validate(import_config(flat, "config.json"), "config.json")
    assert again.layers == imported.layers


@pytest.mark.parametrize("change, match", [
    ({"mla_use_nope": False}, "mla_use_nope=False is not supported"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func='softmax' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"linear_attn_config": {**REAL_CONFIG["linear_attn_config"], "full_attn_layers": [0, 4]}},
     "full_attn_layers=\\[0, 4\\]: expected a list of layer indices 1..27"),
])
def test_unsupported_config_values(change, match):
    with pytest.raises(ConfigError, match=match):
        validate(import_config({**REAL_CONFIG, **change}, "config.json"), "config.json")


def test_tiny_twin_layers(reference):
    model = build_model(load_config("kimi_linear_tiny"), mtp=False)
    kinds = [type(b.mixer) for b in model.layers]
    assert kinds == [KimiDeltaAttention, KimiDeltaAttention, MLA, KimiDeltaAttention, MLA]
    assert all(b.mixer.rope_dims() == [] for b in model.layers)  # NoPE: no rope table is built
    config = json.loads((reference[1] / "config.json").read_text())
    imported = build_model(validate(import_config(config, "tiny"), "tiny"), mtp=False)
    assert count_parameters(imported) == count_parameters(model) == transformers_parameters(tiny_config())


# ----------------------------------------------------------------------------- parity


def test_state_cache_is_constant_per_sequence(eager):
    plan = eager.engine.plan
    for i, fields in enumerate(plan.layers):
        if i in (2, 4):
            assert set(fields) == {"kv"} and fields["kv"].grows
            assert fields["kv"].shape == (2, 1, MAX_SEQ, 24 + 6)
        else:
            assert set(fields) == {"conv", "state"} and not any(f.grows for f in fields.values())
            assert fields["conv"].shape == (2, 3 * 3 * 12, 3)
            assert fields["state"].shape == (2, 3, 12, 12) and fields["state"].dtype == torch.float32


# ----------------------------------------------------------------------------- the ways a user loads it

HUB_SCRIPT = """
import sys, torch, zoo
m = zoo.from_pretrained(sys.argv[1], compile=False, max_seq=64, overrides=["mixers.linear.chunk_size=16"])
ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 31, 2, 200, 14, 90, 66, 1, 45, 13]])
out = [m.prefill(ids)[:, -1]] + [m.decode(torch.tensor([t])) for t in (9, 250, 4)]
torch.save(torch.stack(out), sys.argv[2])
"""
HUB_IDS = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 31, 2, 200, 14, 90, 66, 1, 45, 13]


def check_hub_and_import(ref, path, repo: str, tmp_path, monkeypatch, capsys, max_seq: int = 64):
    """A Hub id from a local cache in a fresh process (HF_HUB_OFFLINE=1), and `zoo import DIR`
    then `zoo build conf=NAME weights=DIR`: both match transformers on the last prompt position
    and three decode steps."""
    populate_hub_cache(path, tmp_path / "hf" / "hub", repo)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "hub_logits.pt"
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, repo, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    seq = torch.tensor([HUB_IDS + [9, 250, 4]])
    with torch.no_grad():
        full = ref(seq).logits[0]
    expected = full[len(HUB_IDS) - 1:len(HUB_IDS) + 3]
    torch.testing.assert_close(torch.load(out)[:, 0], expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())

    from zoo.cli import main

    name = repo.split("/")[-1].replace("-", "_") + "_imported"
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), f"name={name}"]) == 0
    capsys.readouterr()
    built = zoo.build(name, weights=str(path), compile=False, max_seq=max_seq,
                      overrides=CHUNK)
    ids = torch.tensor([HUB_IDS])
    got = torch.stack([built.prefill(ids)[0, -1]] + [built.decode(torch.tensor([t]))[0] for t in (9, 250, 4)])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_hub_id_and_zoo_import(reference, tmp_path, monkeypatch, capsys):
    ref, path = reference
    check_hub_and_import(ref, path, "zoo-test/tiny-kimi-linear", tmp_path, monkeypatch, capsys)


def test_original_checkpoint_names_load(reference, tmp_path):
    """The original checkpoints keep the dense first layer under mlp.* (transformers writes
    block_sparse_moe.*): the rename stage takes both."""
    from safetensors.torch import load_file, save_file

    ref, path = reference
    renamed = tmp_path / "orig"
    renamed.mkdir()
    tensors = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v
               for k, v in load_file(path / "model.safetensors").items()}
    assert any(k.startswith("model.layers.0.mlp.") for k in tensors)
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps(config))
    m = zoo.from_pretrained(str(renamed), compile=False, max_seq=32, overrides=CHUNK)
    check_parity(ref, m, torch.randint(0, VOCAB, (1, 9)), steps=1)


# ----------------------------------------------------------------------------- zoo patterns


@pytest.mark.parametrize("absorbed", [False, True])
def test_nope_mla_probe_rebuilds_the_prefill(eager, absorbed):
    """The MLA layers keep no RoPE (`rope: false`): their probe (zoo patterns) reads no rope table,
    and weighting the layer's expanded values by its probabilities (either form) gives the layer's
    own prefill output. (transformers' eager attention path fails on this family's MLA, so the
    layer itself is the oracle, as for DeepSeek-V4's kinds in test_patterns.py.)"""
    from zoo.compiler.mixers.mla import expanded_qkv
    from zoo.compiler.patterns import _observe

    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    seen = []

    def check(i, mixer, x, cache, ctx):
        if mixer.kind != "mla":
            return
        maps = mixer.attention_probe(x, ctx, absorbed=absorbed)
        torch.testing.assert_close(maps.probs.sum(-1), torch.ones(maps.probs.shape[:-1]), rtol=0, atol=1e-5)
        q_nope, q_rope, kv = mixer.project(x, None, None)
        _, _, v = expanded_qkv(q_nope, q_rope, kv, mixer.wkv_b.weight)
        o = torch.matmul(maps.probs, v).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        want = type(mixer).prefill(mixer, x, {n: torch.zeros_like(t) for n, t in cache.items()}, ctx)
        torch.testing.assert_close(mixer.wo(o), want, rtol=1e-5, atol=1e-6)
        seen.append(i)

    _observe(eager.engine, ids, check)
    assert seen == [2, 4]
