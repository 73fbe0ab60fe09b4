"""DeepSeek-V3: MLA (latent cache, absorbed decode), DeepSeek MoE, YaRN, MTP, the real preset.

Parity with transformers' DeepseekV3ForCausalLM on tiny random checkpoints it saved (CPU, float32),
for the prefill and every greedy decode step, runs in tests/test_family_parity.py (deepseek_v3/*). transformers drops MTP weights, so the MTP
layer is checked against a hand-written reference built from the same tensors.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zoo
from zoo.compiler.errors import ConfigError
from tests.deepseek_v3_fixtures import (VOCAB, YARN, add_shard, make_mtp_layer, mtp_hub_tensors, mtp_reference,
                                        randomize, tiny_config)
from tests.helpers import assert_logits_close, save_reference

transformers = pytest.importorskip("transformers")

VARIANTS = {
    # name: (config overrides, batch, save kwargs): tests/test_family_parity.py's deepseek_v3/* entries
    # the tiny twin's shape: YaRN with the mscale softmax correction, 4 groups of 2 experts (best 2
    # groups compete), first layer dense, batch 2, sharded
    "main": (dict(), 2, {"max_shard_size": "150KB"}),
    # the other branches: full-rank query, rotate-half rope pairs, biases, plain rope, no groups,
    # unnormalised weights without scaling, 2 shared experts, every layer MoE
    "plain": (dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, n_group=1, topk_group=1,
                   norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2, first_k_dense_replace=0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 1, {}),
    # YaRN without mscale_all_dim (cos/sin scaled, softmax scale untouched), 2 groups, 2 dense layers
    "yarn_cos_sin": (dict(n_group=2, topk_group=1, num_hidden_layers=4, first_k_dense_replace=2,
                          rope_parameters={**YARN, "factor": 8.0, "mscale_all_dim": 0.0}), 3, {}),
}


def make_reference(path, overrides, save_kwargs, seed=0):
    torch.manual_seed(seed)
    ref = transformers.DeepseekV3ForCausalLM(tiny_config(**overrides)).eval()
    randomize(ref)
    save_reference(ref, path, **save_kwargs)
    return ref


@pytest.fixture(scope="module")
def references(families):
    """{variant: (reference, checkpoint dir, batch)}: tests/test_family_parity.py's deepseek_v3/*
    entries (their prefill / decode parity, eager and compiled, runs there), shared for the session."""
    return families.group("deepseek_v3")


# ----------------------------------------------------------------------------- import


def test_imported_config(references):
    """config.json -> the preset's groups: layout from first_k_dense_replace, routing, YaRN."""
    _, path, _ = references["main"]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    assert m.spec.layout_runs() == [("attn+dense", 1), ("attn+moe", 2)]
    moe, mla = m.spec.ffns["moe"], m.spec.mixers["attn"]
    assert (moe.kind, moe.scoring, moe.score_correction_bias, moe.n_group, moe.topk_group) == \
        ("moe", "sigmoid", True, 4, 2)
    assert (mla.kind, mla.kv_lora_rank, mla.qk_rope_dim, mla.rope_interleaved) == ("mla", 32, 8, True)
    assert (m.spec.rope.kind, m.spec.rope.factor, m.spec.rope.mscale_all_dim) == ("yarn", 4.0, 1.0)
    # the softmax scale carries YaRN's mscale^2 (0.1 ln 4 + 1)^2
    mixer = m.module.layers[0].mixer
    assert mixer.scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    _, path, _ = references["plain"]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    assert m.spec.layout_runs() == [("attn+moe", 3)]


def test_unsupported_config_values(references, tmp_path):
    _, path, _ = references["plain"]
    for key, value in (("hidden_act", "gelu"), ("scoring_func", "softmax")):
        bad = tmp_path / key
        bad.mkdir()
        for f in path.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((path / "config.json").read_text())
        cfg[key] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=f"{key}=.*conf/hf/deepseek_v3.yaml"):
            zoo.from_pretrained(str(bad), compile=False)


# ----------------------------------------------------------------------------- MLA


def test_cache_holds_latent_only(references):
    """Exactly kv_lora_rank + qk_rope_dim values per token per layer, never expanded K/V."""
    _, path, _ = references["main"]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=48)
    for layer in m.engine.plan.layers:
        assert {name: f.shape for name, f in layer.items()} == {"kv": (2, 1, 48, 32 + 8)}
    assert m.info.cache_bytes_per_token == 3 * (32 + 8) * 4  # float32
    bf16 = zoo.from_pretrained(str(path), compile=False, max_seq=48, cache_dtype=torch.bfloat16)
    assert bf16.info.cache_bytes_per_token == 3 * (32 + 8) * 2


@torch.no_grad()
def test_absorbed_equals_expanded(references):
    """The decode form (W_UK folded into q, W_UV after attending over the latent) and the prefill
    form (per-head K/V expanded from the latent) on the same projections, causal, 13 tokens."""
    _, path, _ = references["main"]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=48)
    mla = m.module.layers[1].mixer
    x = torch.randn(2, 13, 64)
    cos, sin = m.engine.rope[mla.rope]
    q_nope, q_rope, kv = mla.project(x, cos[:13], sin[:13])
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    expanded = mla.attend_expanded(q_nope, q_rope, kv, mask=causal)
    absorbed = mla.attend_absorbed(q_nope, q_rope, kv, mask=causal)
    assert_logits_close(absorbed, expanded, 1e-5, "absorbed vs expanded")
    assert (expanded - mla.attend_expanded(q_nope, q_rope, kv, causal=True)).abs().max() < 1e-6
    # and they are not trivially equal: a wrong fold (W_UV for W_UK) is far off
    w = mla.wkv_b.weight.view(mla.n_heads, mla.nope + mla.v_dim, mla.rank)
    w_uk, w_uv = w[:, : mla.nope], w[:, mla.nope:]
    wrong = torch.einsum("bhln,hnc->bhlc", q_nope, w_uv)
    assert not torch.allclose(wrong, torch.einsum("bhln,hnc->bhlc", q_nope, w_uk), atol=1e-3)


def test_preset_counts_and_cache_bytes():
    """`zoo build conf=deepseek_v3` on meta: the exact main-model parameter count and the
    per-token cache bytes, both derived here from the shapes in checkpoints.md."""
    D, V, L, dense_layers, H = 7168, 129280, 61, 3, 128
    q_lora, kv_lora, nope, rope, v_dim = 1536, 512, 128, 64, 128
    attn = (D * q_lora + q_lora + q_lora * H * (nope + rope)  # q_a, q_a_layernorm, q_b
            + D * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v_dim)  # kv_a, kv_a_layernorm, kv_b
            + H * v_dim * D)  # o_proj
    dense = 3 * D * 18432
    moe = 256 * 3 * D * 2048 + 3 * D * 2048 + 256 * D + 256  # experts, shared, gate, bias
    norms = 2 * D
    total = 2 * V * D + D + dense_layers * (attn + dense + norms) + (L - dense_layers) * (attn + moe + norms)
    assert total == 671_026_419_200
    m = zoo.build("deepseek_v3", dry=True, dtype=torch.bfloat16)
    assert m.info.dry and m.info.params == total
    assert m.info.cache_bytes_per_token == 70_272 == L * (kv_lora + rope) * 2
    # softmax scale 192^-0.5 * mscale^2, mscale = 0.1 ln 40 + 1 (YaRN mscale_all_dim 1)
    assert m.module.layers[0].mixer.scale == pytest.approx((nope + rope) ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert m.spec.layout_runs() == [("attn+dense", 3), ("attn+moe", 58)]
    # checkpoint.mtp=true adds the MTP layer: a MoE block, eh_proj [D, 2D], enorm, hnorm,
    # shared_head.norm and its own embedding and head copies (671B + 13.5B: the Hub's "685B")
    with_mtp = zoo.build("deepseek_v3", ["checkpoint.mtp=true"], dry=True, dtype=torch.bfloat16)
    mtp = attn + moe + norms + 2 * D * D + 3 * D + 2 * V * D
    assert with_mtp.info.params == total + mtp == 684_489_845_504


def test_cli_dry_build_report(capsys):
    from zoo.cli import main

    assert main(["build", "conf=deepseek_v3", "dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "671,026,419,200" in out and "70,272 B" in out
    assert "attn+dense x3, attn+moe x58" in out


# ----------------------------------------------------------------------------- MoE


def block_ctx(x: torch.Tensor) -> dict:
    """The context a block hands its FFN (token ids [B, L]; learned routing does not read them)."""
    return {"ids": torch.zeros(x.shape[:2], dtype=torch.long)}


def _moe(**spec):
    from zoo.compiler.model import BuildContext
    from zoo.compiler.ffn.moe import MoE

    s = MoE.Spec(**{"n_experts": 8, "top_k": 2, "ffn_dim": 32, **spec}).resolve({})
    assert s.check({}) is None
    ctx = BuildContext(spec=type("S", (), {"dim": 64})(), rope_impl=None)
    torch.manual_seed(1)
    moe = MoE(s, ctx)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@torch.no_grad()
def test_moe_grouped_equals_gathered():
    """The prefill (sorted, grouped matmul) and decode (gathered) formulations agree token by token."""
    moe = _moe(scoring="sigmoid", score_correction_bias=True, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5)
    x = torch.randn(3, 17, 64)
    grouped = moe.prefill(x, block_ctx(x))
    gathered = torch.stack([moe.decode(x[:, t:t + 1], block_ctx(x[:, t:t + 1]))[:, 0] for t in range(17)], dim=1)
    assert_logits_close(gathered, grouped, 1e-5, "gathered vs grouped")


@torch.no_grad()
def test_moe_softmax_shared_gate_matches_qwen3_next():
    """The same module with softmax scoring and a gated shared expert (Qwen3-Next's block)."""
    cfg = transformers.Qwen3NextConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, norm_topk_prob=True)
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    torch.manual_seed(2)
    ref = Qwen3NextSparseMoeBlock(cfg).eval()
    for p in ref.parameters():
        p.normal_(0, 0.3)
    moe = _moe(scoring="softmax", shared_ffn_dim=48, shared_expert_gate=True)
    moe.router.weight.copy_(ref.gate.weight)
    moe.w13.copy_(ref.experts.gate_up_proj)
    moe.w2.copy_(ref.experts.down_proj)
    moe.shared.w13.weight.copy_(torch.cat((ref.shared_expert.gate_proj.weight, ref.shared_expert.up_proj.weight)))
    moe.shared.w2.weight.copy_(ref.shared_expert.down_proj.weight)
    moe.shared_gate.weight.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(2, 9, 64)
    want = ref(x)
    assert_logits_close(moe.prefill(x, block_ctx(x)), want, 1e-5, "prefill")
    assert_logits_close(moe.decode(x[:, :1], block_ctx(x[:, :1])), want[:, :1], 1e-5, "decode")


def test_moe_graph_does_not_grow_with_experts():
    """No per-expert ops in either graph: the traced graphs of 8 and 64 experts have the same
    nodes (a Python loop over experts would unroll into E copies)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def nodes(n_experts, entry, x):
        moe = _moe(n_experts=n_experts, n_group=4, topk_group=2, scoring="sigmoid", score_correction_bias=True)
        gm = make_fx(lambda x: getattr(moe, entry)(x, block_ctx(x)))(x)
        return len(gm.graph.nodes)

    for entry, x in (("decode", torch.randn(4, 1, 64)), ("prefill", torch.randn(1, 12, 64))):
        assert nodes(8, entry, x) == nodes(64, entry, x)


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_moe_routing_brute_force(group_score):
    """route() against a per-token loop: groups scored on the corrected scores, experts chosen
    among the kept groups, weights = uncorrected scores, normalised, scaled."""
    moe = _moe(scoring="sigmoid", score_correction_bias=True, n_group=4, topk_group=2, group_score=group_score,
               routed_scaling_factor=2.5)
    x = torch.randn(40, 64)
    weights, idx = moe.route(x)
    for t in range(40):
        scores = torch.sigmoid(moe.router.weight @ x[t])
        choice = scores + moe.router.score_bias
        groups = choice.view(4, 2)
        group_score_t = groups.sum(-1) if group_score == "top2_sum" else groups.max(-1).values
        kept = group_score_t.argsort(descending=True)[:2].tolist()
        candidates = [e for e in range(8) if e // 2 in kept]
        chosen = sorted(candidates, key=lambda e: -choice[e].item())[:2]
        assert sorted(idx[t].tolist()) == sorted(chosen)
        w = scores[idx[t]] / scores[idx[t]].sum() * 2.5
        torch.testing.assert_close(weights[t], w)


@pytest.mark.parametrize("key,value,match", [
    ("topk_group", 5, "topk_group=5 must be in 1..n_group=4"),
    ("n_group", 3, "n_group=3 must be positive and divide n_experts=8"),
    ("scoring", "relu", "scoring=.relu.: expected one of"),
    ("top_k", 9, "top_k=9 must be in 1..n_experts=8"),
])
def test_moe_config_errors(key, value, match):
    with pytest.raises(ConfigError, match=f"ffns.moe: {match}"):
        zoo.build("deepseek_v3_tiny", [f"ffns.moe.{key}={value}"], dry=True)


# ----------------------------------------------------------------------------- MTP


@pytest.mark.parametrize("override,match", [
    ("mtp.mixer=nope", "mtp.mixer: 'nope' is not one of mixers \\['attn'\\]"),
    ("mtp.ffn=dens", "mtp.ffn: 'dens' is not one of ffns \\['dense', 'moe'\\]"),
    ("mtp.n_layers=-1", "mtp.n_layers: must be >= 0"),
])
def test_mtp_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        zoo.build("deepseek_v3_tiny", [override], dry=True)


@pytest.fixture(scope="module")
def mtp_checkpoint(references, tmp_path_factory):
    """A copy of the main checkpoint (shared with other tests) plus an MTP layer in an extra shard."""
    ref, src, _ = references["main"]
    path = tmp_path_factory.mktemp("v3_mtp")
    shutil.copytree(src, path, dirs_exist_ok=True)
    block, extra = make_mtp_layer(ref.config)
    add_shard(path, "model-mtp.safetensors", mtp_hub_tensors(block, extra, ref.config.num_hidden_layers))
    return ref, path, block, extra


def test_mtp_logits(mtp_checkpoint):
    ref, path, block, extra = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=48, overrides=["checkpoint.mtp=true"])
    assert m.spec.mtp.n_layers == 1 and len(m.module.mtp) == 1
    ids = torch.randint(0, VOCAB, (2, 12))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(logits, ref(ids).logits, 1e-5, "main logits")
    assert mtp.shape == (2, 11, VOCAB)
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, "mtp logits")
    # prefill-only use of the same model still decodes normally
    tok = logits[:, -1].argmax(-1)
    assert_logits_close(m.decode(tok), ref(torch.cat((ids, tok[:, None]), 1)).logits[:, -1], 1e-5, "decode")


def test_mtp_logits_compiled(mtp_checkpoint):
    ref, path, block, extra = mtp_checkpoint
    # the family harness's compiled settings for deepseek_v3/main (one decode bucket): its main-layer
    # graphs come from the compile cache, the MTP block's are this test's own (CI time)
    m = zoo.from_pretrained(str(path), compile=True, max_batch=2, max_seq=48,
                            overrides=["checkpoint.mtp=true", "runtime.aot=false", "runtime.decode_buckets=[2]"])
    for length in (7, 12):
        ids = torch.randint(0, VOCAB, (2, length))
        _, (mtp,) = m.prefill(ids, return_mtp=True)
        assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, f"mtp logits L={length}")


def test_mtp_skipped_and_reported(mtp_checkpoint):
    """checkpoint.mtp=false (the default): the MTP tensors are dropped by an explicit rule whose
    reason the load report and `zoo build` list; no MTP module is built."""
    ref, path, _, _ = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    assert len(m.module.mtp) == 0
    skipped = dict(m.info.load.ignored)
    mtp_names = [k for k in load_file(str(path / "model-mtp.safetensors"))]
    assert sorted(skipped) == sorted(mtp_names)
    assert all("multi-token-prediction" in why and "checkpoint.mtp=false" in why for why in skipped.values())
    with pytest.raises(zoo.InputError, match="no multi-token-prediction layers"):
        m.prefill(torch.randint(0, VOCAB, (1, 5)), return_mtp=True)
    from zoo.report import build_rows

    rows = build_rows(m)
    assert any(k.strip() == "skipped" and "model.layers.3." in v and "checkpoint.mtp=false" in v for k, v in rows)


def test_zoo_build_with_mtp_weights(mtp_checkpoint):
    """The tiny twin conf + the checkpoint: the conf's rule stages load the MTP layer too."""
    ref, path, block, extra = mtp_checkpoint
    overrides = ["ffns.dense.ffn_dim=128", "max_position=256", "checkpoint.mtp=true"]
    m = zoo.build("deepseek_v3_tiny", overrides, weights=str(path), compile=False, max_seq=32)
    ids = torch.randint(0, VOCAB, (1, 9))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(logits, ref(ids).logits, 1e-5, "main logits")
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, "mtp logits")


def test_mtp_shared_embeddings(mtp_checkpoint):
    """mtp.share_embeddings=true (GLM-5's layout): the MTP layer reads the main embedding and head;
    the checkpoint's copies are skipped with a reason."""
    ref, path, block, extra = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32,
                            overrides=["checkpoint.mtp=true", "mtp.share_embeddings=true"])
    assert not hasattr(m.module.mtp[0], "embed") and not hasattr(m.module.mtp[0], "head")
    skipped = dict(m.info.load.ignored)
    assert set(skipped) == {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert all("mtp.share_embeddings=true" in why for why in skipped.values())
    ids = torch.randint(0, VOCAB, (1, 10))
    shared = {**extra, "embed_tokens.weight": ref.model.embed_tokens.weight,
              "shared_head.head.weight": ref.lm_head.weight}
    _, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(mtp, mtp_reference(ref, block, shared, ids), 1e-5, "mtp logits")
