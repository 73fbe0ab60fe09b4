"""Qwen3-Next: hybrid Gated DeltaNet + gated attention in a 3:1 layout, MoE with a gated shared
expert, zero-centred norms, per-kind caches, checkpoint rules (incl. MTP), the real preset.

Parity with transformers' Qwen3NextForCausalLM on a tiny random checkpoint it saved (CPU, float32;
its torch fallbacks for the DeltaNet kernels), for the prefill and every greedy decode step, eager
and compiled, runs in tests/test_family_parity.py (the qwen3_next entry; tiny_config and randomize
below). transformers drops MTP weights, so the MTP layer is checked against a hand-written reference
built from the same tensors.
"""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zoo
from zoo.compiler.config import load_config
from zoo.compiler.errors import CheckpointError, ConfigError
from zoo.compiler.mixers.gated_deltanet import GatedDeltaNet
from zoo.compiler.mixers.attention import Attention
from zoo.compiler.hf_import import compress_layout, import_config
from zoo.compiler.model import build_model, count_parameters
from zoo.compiler.ffn.moe import MoE
from zoo.compiler.spec import validate
from tests.deepseek_v3_fixtures import add_shard, hub_tensors
from tests.helpers import assert_logits_close
from tests.test_gated_deltanet import peak_cpu_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 256
CHUNK = ["mixers.linear.chunk_size=16"]  # the tiny twin's chunk: prompts below span several chunks

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (architecture keys): no layer_types, the older
# full_attention_interval; rope_theta + partial_rotary_factor at the top level.
REAL_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def real_parameter_count() -> int:
    """Qwen3-Next-80B-A3B's parameters, from the checkpoint shapes (checkpoints.md)."""
    D, V = 2048, 151936
    attn = (16 * 256 * 2) * D + 2 * (2 * 256) * D + D * (16 * 256) + 2 * 256  # q_proj [query|gate], k/v, o, q/k_norm
    linear = (12288 * D + 64 * D + 8192 * 4 + 32 + 32 + 128   # in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm
              + D * 4096)                                    # out_proj
    moe = 512 * D + 512 * 3 * 512 * D + 3 * 512 * D + D      # router, 512 experts, shared expert, shared gate
    norms = 2 * D
    return 2 * V * D + D + 12 * (attn + moe + norms) + 36 * (linear + moe + norms)


def tiny_config(**kw):
    """transformers' config of the tiny twin's shape (conf/qwen3_next_tiny.yaml)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=48,
                max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None,
                pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                    "partial_rotary_factor": 0.25})
    base.update(kw)
    return transformers.Qwen3NextConfig(**base)


@torch.no_grad()
def randomize(module: torch.nn.Module) -> None:
    """Weights transformers initialises to constants made random, so that a misplaced one shows:
    zero-centred norms away from 0, the gated norm away from 1, dt_bias, a strong conv."""
    for name, p in module.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.uniform_(0.5, 1.5)
        elif "norm" in name:
            p.normal_(0.0, 0.2)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 0.3)


@pytest.fixture(scope="module")
def reference(families):
    """(reference, checkpoint dir): tests/test_family_parity.py's qwen3_next entry (its prefill /
    decode parity, eager and compiled, runs there), shared for the session."""
    return families.reference("qwen3_next")


@pytest.fixture(scope="module")
def eager(families):
    """The shared eager model (max_batch 2, max_seq 128, chunk 16)."""
    return families.eager("qwen3_next")


# ----------------------------------------------------------------------------- layout and preset


def test_hybrid_layout_one_slot_name():
    """48 layers as 12 x (3 linear + 1 attention) from one pattern; every block has the same
    attribute names whatever its mixer kind."""
    spec = load_config("qwen3_next")
    assert spec.n_layers == 48
    assert [layer.mixer_name for layer in spec.layers] == ["linear", "linear", "linear", "attn"] * 12
    assert {layer.ffn_name for layer in spec.layers} == {"moe"}
    model = build_model(load_config("qwen3_next_tiny"), mtp=False)
    assert len(model.layers) == 8
    for i, block in enumerate(model.layers):
        names = [n for n, _ in block.named_children()]
        assert names == ["mixer_norm", "mixer", "ffn_norm", "ffn", "mixer_residual", "ffn_residual"]
        assert isinstance(block.mixer, Attention if i % 4 == 3 else GatedDeltaNet)
        assert isinstance(block.ffn, MoE) and block.ffn.shared_gate is not None


def test_dry_build_exact_parameter_count(capsys):
    m = zoo.build("qwen3_next", dry=True)
    assert m.info.params == real_parameter_count() == 79_674_391_296
    # bytes that grow per token (12 attention layers' K and V) apart from the constant state
    # (36 DeltaNet layers' conv inputs and float32 recurrent state)
    assert m.info.cache_bytes_per_token == 12 * 2 * 2 * 256 * 4
    assert m.info.state_bytes_per_sequence == 36 * (8192 * 3 * 4 + 32 * 128 * 128 * 4)
    from zoo.cli import main

    assert main(["build", "conf=qwen3_next", "dry=true"]) == 0
    out = capsys.readouterr().out
    assert "79,674,391,296" in out and "12 x (linear+moe x3, attn+moe x1)" in out
    assert "49,152 B" in out and "79,036,416 B" in out


def test_import_real_config():
    """config.json of the real checkpoint -> the same spec as conf/qwen3_next.yaml."""
    imported = validate(import_config(REAL_CONFIG, "config.json"), "config.json")
    preset = load_config("qwen3_next")
    assert [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in imported.layers] == \
           [(x.mixer_name, x.mixer, x.ffn_name, x.ffn) for x in preset.layers]
    assert (imported.norm, imported.rope, imported.dim, imported.vocab_size, imported.max_position) == \
           (preset.norm, preset.rope, preset.dim, preset.vocab_size, preset.max_position)
    assert imported.mtp == preset.mtp and imported.checkpoint.rules == preset.checkpoint.rules
    assert count_parameters(build_model(imported, mtp=False)) == real_parameter_count()
    # the transformers 5 form: a per-layer list and rope_parameters
    new = {k: v for k, v in REAL_CONFIG.items() if k not in ("full_attention_interval", "rope_theta",
                                                             "partial_rotary_factor")}
    new["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    assert validate(import_config(new, "config.json"), "config.json").layers == imported.layers


def test_layout_from_layer_types():
    lin, attn = {"mixer": "linear", "ffn": "moe"}, {"mixer": "attn", "ffn": "moe"}
    assert compress_layout([lin] * 5) == [lin]
    assert compress_layout([lin, attn] * 3) == [{"pattern": [lin, attn]}]
    assert compress_layout([lin, lin, attn, lin, lin, lin, lin, attn]) == [
        {**lin, "repeat": 2}, {**attn, "repeat": 1}, {**lin, "repeat": 4}, {**attn, "repeat": 1}]
    irregular = {**REAL_CONFIG, "num_hidden_layers": 8,
                 "layer_types": ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 4
                 + ["full_attention"]}
    spec = validate(import_config(irregular, "config.json"), "config.json")
    assert [x.mixer_name for x in spec.layers] == ["linear"] * 2 + ["attn"] + ["linear"] * 4 + ["attn"]
    every2 = validate(import_config({**REAL_CONFIG, "full_attention_interval": 2}, "c"), "c")
    assert [x.mixer_name for x in every2.layers] == ["linear", "attn"] * 24


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["sliding_attention"] * 48}, "unsupported layer kind.*sliding_attention"),
    ({"layer_types": ["linear_attention"] * 47}, "layer_types has 47 entries but the model has 48 layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\] is not supported"),
    ({"linear_num_value_heads": 24, "linear_num_key_heads": 16}, "n_v_heads=24 must be a multiple"),
])
def test_unsupported_config_values(change, match):
    with pytest.raises(ConfigError, match=match):
        validate(import_config({**REAL_CONFIG, **change}, "config.json"), "config.json")


def test_imported_tiny_is_the_tiny_twin(reference):
    config = json.loads((reference[1] / "config.json").read_text())
    imported = validate(import_config(config, "tiny", CHUNK), "tiny")
    twin = load_config("qwen3_next_tiny")
    assert [(x.mixer, x.ffn) for x in imported.layers] == [(x.mixer, x.ffn) for x in twin.layers]
    assert count_parameters(build_model(imported, mtp=False)) == count_parameters(build_model(twin, mtp=False))


# ----------------------------------------------------------------------------- caches


def test_caches_per_layer_kind(eager):
    plan = eager.engine.plan
    for i, fields in enumerate(plan.layers):
        if i % 4 == 3:
            assert set(fields) == {"k", "v"} and all(f.grows for f in fields.values())
            assert fields["k"].shape == (2, 2, 128, 16)
        else:
            assert set(fields) == {"conv", "state"} and not any(f.grows for f in fields.values())
            assert fields["conv"].shape == (2, 2 * 2 * 16 + 4 * 16, 3)  # [B, Cc, W-1]
            assert fields["state"].shape == (2, 4, 16, 16) and fields["state"].dtype == torch.float32
    assert eager.info.cache_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert eager.info.state_bytes_per_sequence == 6 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    # a bf16 cache keeps the recurrent state in float32
    bf16 = zoo.build("qwen3_next_tiny", dry=True, cache_dtype=torch.bfloat16).engine.plan.layers[0]
    assert bf16["conv"].dtype == torch.bfloat16 and bf16["state"].dtype == torch.float32


def test_prefill_starts_from_zero_state_and_reset_clears(eager):
    a, b = torch.randint(0, VOCAB, (2, 29)), torch.randint(0, VOCAB, (2, 19))
    fresh = eager.prefill(b)
    eager.prefill(a)
    for _ in range(3):
        eager.decode(torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(eager.prefill(b), fresh, rtol=0, atol=0)
    caches = eager.engine.caches
    assert caches[0]["state"].abs().sum() > 0 and caches[0]["conv"].abs().sum() > 0
    eager.reset()
    assert all(t.abs().sum() == 0 for layer in caches for t in layer.values())


def test_long_prefill_linear_memory():
    """A 2k-token prefill of the tiny twin completes, and its peak allocation grows linearly with
    the prompt, far below one [L, L] score matrix per head."""
    m = zoo.build("qwen3_next_tiny", compile=False, max_seq=2048)
    peaks, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # a memory measurement: spare the shared CPUs the thread barriers
    try:
        for L in (1024, 2048):
            ids = torch.randint(0, VOCAB, (1, L))
            peaks[L] = peak_cpu_bytes(lambda: m.prefill(ids))
            assert m.engine.length == L
    finally:
        torch.set_num_threads(threads)
    L, H = 2048, 4
    assert peaks[L] < L * L * H * 4 / 4, peaks
    assert peaks[L] < 2.3 * peaks[1024], peaks


# ----------------------------------------------------------------------------- checkpoint rules


def test_rule_regroups_in_proj(reference, eager):
    """in_proj_qkvz (per key head [q|k|v|z]) and in_proj_ba (per key head [b|a]) land in the
    fused in_proj as [q | k | v | z | b | a]; q_proj's per-head [query|gate] rows stay as stored."""
    ref, _ = reference
    la = ref.model.layers[0].linear_attn
    qkvz = la.in_proj_qkvz.weight.view(2, 16 + 16 + 32 + 32, 64)
    ba = la.in_proj_ba.weight.view(2, 2 + 2, 64)
    parts = [qkvz[:, :16], qkvz[:, 16:32], qkvz[:, 32:64], qkvz[:, 64:], ba[:, :2], ba[:, 2:]]
    want = torch.cat([p.reshape(-1, 64) for p in parts])
    torch.testing.assert_close(eager.module.layers[0].mixer.in_proj.weight, want, rtol=0, atol=0)
    attn = ref.model.layers[3].self_attn
    want = torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    torch.testing.assert_close(eager.module.layers[3].mixer.wqkv.weight, want, rtol=0, atol=0)


def real_checkpoint_headers(mtp: bool = True) -> dict:
    """Names, shapes and dtypes of the real Qwen3-Next-80B-A3B checkpoint (checkpoints.md): 48
    layers (every 4th full attention), 512 experts each, and the MTP tensors."""
    from zoo.compiler.contracts import TensorInfo

    D, E = 2048, 512
    shapes = {"model.embed_tokens.weight": (151936, D), "lm_head.weight": (151936, D), "model.norm.weight": (D,)}

    def block(p: str, full_attention: bool) -> None:
        if full_attention:
            a = f"{p}.self_attn"
            shapes.update({f"{a}.q_proj.weight": (16 * 256 * 2, D), f"{a}.k_proj.weight": (512, D),
                           f"{a}.v_proj.weight": (512, D), f"{a}.o_proj.weight": (D, 4096),
                           f"{a}.q_norm.weight": (256,), f"{a}.k_norm.weight": (256,)})
        else:
            a = f"{p}.linear_attn"
            shapes.update({f"{a}.in_proj_qkvz.weight": (12288, D), f"{a}.in_proj_ba.weight": (64, D),
                           f"{a}.conv1d.weight": (8192, 1, 4), f"{a}.A_log": (32,), f"{a}.dt_bias": (32,),
                           f"{a}.norm.weight": (128,), f"{a}.out_proj.weight": (D, 4096)})
        m = f"{p}.mlp"
        shapes.update({f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight": (D,),
                       f"{m}.gate.weight": (E, D), f"{m}.shared_expert_gate.weight": (1, D),
                       f"{m}.shared_expert.gate_proj.weight": (512, D), f"{m}.shared_expert.up_proj.weight": (512, D),
                       f"{m}.shared_expert.down_proj.weight": (D, 512)})
        for e in range(E):
            shapes.update({f"{m}.experts.{e}.gate_proj.weight": (512, D), f"{m}.experts.{e}.up_proj.weight": (512, D),
                           f"{m}.experts.{e}.down_proj.weight": (D, 512)})

    for i in range(48):
        block(f"model.layers.{i}", i % 4 == 3)
    if mtp:
        block("mtp.layers.0", True)
        shapes.update({"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
                       "mtp.pre_fc_norm_hidden.weight": (D,), "mtp.norm.weight": (D,)})
    return {n: TensorInfo(s, "BF16", "model.safetensors", 2 * torch.Size(s).numel()) for n, s in shapes.items()}


class HeaderSource:
    description = "Qwen3-Next-80B-A3B (headers)"

    def __init__(self, entries):
        self._entries = entries

    def entries(self):
        return self._entries

    def read_order(self):
        return [list(self._entries)]


@pytest.mark.parametrize("mtp", [False, True])
def test_rules_plan_the_real_checkpoint(mtp):
    """The rule stages account for every tensor of the real checkpoint's layout (shapes checked
    from headers): mtp.* skipped by a reported rule, or loaded into the MTP layer."""
    from zoo.compiler.checkpoint.loader import plan_load
    from zoo.compiler.checkpoint.rules import load_stage

    spec = load_config("qwen3_next", [f"checkpoint.mtp={str(mtp).lower()}"])
    entries = real_checkpoint_headers()
    plan = plan_load(build_model(spec, mtp=mtp), HeaderSource(entries),
                     [load_stage(name, spec.config) for name in spec.checkpoint.rules])
    mtp_names = sorted(n for n in entries if n.startswith("mtp."))
    assert len(mtp_names) == 4 + 6 + 2 + 2 + 3 + 3 * 512  # fc+norms, attn, norms, gates, shared, experts
    if mtp:
        assert plan.ignored == [] and sum(a.param.startswith("mtp.0.") for a in plan.assignments) > 0
    else:
        assert sorted(n for n, _ in plan.ignored) == mtp_names
        assert {why for _, why in plan.ignored} == {"multi-token-prediction weights, not loaded (checkpoint.mtp=false)"}


def test_checkpoint_that_does_not_fit(reference):
    with pytest.raises(CheckpointError, match=r"in_proj_qkvz.*192 rows are not 1 groups"):
        zoo.from_pretrained(str(reference[1]), compile=False, max_seq=16,
                            overrides=["mixers.linear.n_k_heads=1"])


# ----------------------------------------------------------------------------- MTP


def _zc_rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@pytest.fixture(scope="module")
def mtp_checkpoint(reference, tmp_path_factory):
    """The reference checkpoint plus random Hub-layout MTP tensors (mtp.fc, mtp.pre_fc_norm_*,
    mtp.norm and a full-attention MoE layer mtp.layers.0.*) in an extra shard."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    ref, src = reference
    path = tmp_path_factory.mktemp("qwen3_next_mtp")  # a copy: the shared checkpoint stays as it is
    shutil.copytree(src, path, dirs_exist_ok=True)
    config = copy.deepcopy(ref.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(5)
    block = Qwen3NextDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.2) if "norm" in name else p.normal_(0, 0.05)
    D = config.hidden_size
    extra = {"mtp.fc.weight": torch.randn(D, 2 * D) * 0.05, "mtp.pre_fc_norm_embedding.weight": torch.randn(D) * 0.2,
             "mtp.pre_fc_norm_hidden.weight": torch.randn(D) * 0.2, "mtp.norm.weight": torch.randn(D) * 0.2}
    add_shard(path, "model-mtp.safetensors", {**hub_tensors(block.state_dict(), "mtp.layers.0."), **extra})
    return ref, path, block, extra


@torch.no_grad()
def mtp_reference(ref, block, extra, ids):
    """Hand-written Qwen3-Next MTP over ids [B, L]: logits [B, L-1, V] for token t + 2 at t."""
    L = ids.shape[1]
    hidden = ref.model(ids).last_hidden_state  # the final-normed state the head reads
    e = ref.model.embed_tokens(ids[:, 1:])
    x = torch.cat((_zc_rms(e, extra["mtp.pre_fc_norm_embedding.weight"]),
                   _zc_rms(hidden[:, :-1], extra["mtp.pre_fc_norm_hidden.weight"])), -1) @ extra["mtp.fc.weight"].T
    pos = torch.arange(L - 1)[None]
    mask = torch.full((L - 1, L - 1), float("-inf")).triu(1)[None, None]
    y = block(x, position_embeddings=ref.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
    return ref.lm_head(_zc_rms(y, extra["mtp.norm.weight"]))


def test_mtp_skipped_by_reported_rule(mtp_checkpoint):
    ref, path, _, _ = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16, overrides=CHUNK)
    assert len(m.module.mtp) == 0
    skipped = dict(m.info.load.ignored)
    assert sorted(skipped) == sorted(load_file(str(path / "model-mtp.safetensors")))
    assert all(why == "multi-token-prediction weights, not loaded (checkpoint.mtp=false)" for why in skipped.values())
    from zoo.report import build_rows

    assert any(k.strip() == "skipped" and v.startswith("mtp.") for k, v in build_rows(m))
    ids = torch.randint(0, VOCAB, (1, 9))
    assert_logits_close(m.prefill(ids), ref(ids).logits, 1e-5, "main logits")


def test_mtp_loaded(mtp_checkpoint):
    ref, path, block, extra = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=48,
                            overrides=CHUNK + ["checkpoint.mtp=true"])
    assert len(m.module.mtp) == 1 and not m.info.load.ignored
    ids = torch.randint(0, VOCAB, (2, 13))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(logits, ref(ids).logits, 1e-5, "main logits")
    assert mtp.shape == (2, 12, VOCAB)
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, "mtp logits")
