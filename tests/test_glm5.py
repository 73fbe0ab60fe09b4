"""GLM-5 / DeepSeek-V3.2: DeepSeek Sparse Attention (lightning indexer + top-k sparse MLA), the
indexer key cache, checkpoint rules (indexer tensors, FP8, the tied MTP layer), the real preset.

Parity with transformers' GlmMoeDsaForCausalLM and DeepseekV32ForCausalLM on tiny random
checkpoints they saved (CPU, float32), for the prefill and every greedy decode step, with prompts
longer than index_topk (where sparsity changes the result), eager and compiled, runs in
tests/test_family_parity.py (the glm5/* entries, guarded by `tie_free`). transformers drops MTP weights, so the
MTP layer is checked against a hand-written reference built from the same tensors.

Ties: the indexer scores are weighted sums of ReLUs, so two keys can score exactly alike and two
correct top-k's may keep different ones. Every sequence compared here is first checked to have a
clear gap between the Ks-th and (Ks+1)-th score of every query in every layer (`tie_free`).
"""
from __future__ import annotations

import copy
import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.compiler.mixers import dsa
from zoo.compiler.mixers.dsa import DSA, choice_mask
from zoo.compiler.errors import ConfigError
from zoo.compiler.mixers.mla import MLA
from tests.family_harness import greedy
from tests.deepseek_v3_fixtures import YARN, add_shard, make_mtp_layer, mtp_hub_tensors, mtp_reference, randomize
from tests.helpers import assert_logits_close, check_parity, save_reference
from tests.test_fp8 import QUANT, is_fp8, quantize, stored_values

transformers = pytest.importorskip("transformers")

VOCAB, TOPK = 256, 8
# conf/glm5_tiny.yaml's dims: index_topk 8 < the prompts below, index_head_dim 16 > qk_rope 8
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            index_n_heads=16, index_head_dim=16, index_topk=TOPK, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
VARIANTS = {
    # name: (transformers class, config class, config overrides, batch, prompt seed):
    # tests/test_family_parity.py's glm5/* entries
    # GLM-5: plain RoPE theta 1e6, interleaved indexer RoPE, one expert group; sharded
    "glm": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 2, 11),
    # DeepSeek-V3.2: YaRN (mscale softmax correction, scaled cos/sin in the indexer too), 4 groups
    # of 2 experts, rotate-half indexer RoPE
    "v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(rope_parameters=YARN, n_group=4, topk_group=2), 3, 12),
}
PROMPT, STEPS, MAX_SEQ = 19, 8, 48


def make_reference(name: str, path):
    cls, cfg_cls, overrides, _, _ = VARIANTS[name]
    torch.manual_seed(0)
    ref = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**DIMS, **overrides)).eval()
    randomize(ref)
    save_reference(ref, path, max_shard_size="200KB" if name == "glm" else None)
    return ref


@pytest.fixture(scope="module")
def references(families):
    """{variant: (reference, checkpoint dir, prompt ids)}: tests/test_family_parity.py's glm5/*
    entries (their prefill / decode parity, eager and compiled, runs there), shared for the session."""
    out = {}
    for name, (*_, batch, seed) in VARIANTS.items():
        ref, path = families.reference(f"glm5/{name}")
        ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))
        out[name] = (ref, path, ids)
    return out


@pytest.fixture(scope="module")
def models(families):
    """One eager zoo model per variant (max_batch its batch, max_seq 48), shared for the session."""
    return {name: families.eager(f"glm5/{name}") for name in VARIANTS}


# ----------------------------------------------------------------------------- helpers


@torch.no_grad()
def capture(ref, seq: torch.Tensor) -> tuple[dict, dict]:
    """One reference forward over seq [B, T]: per layer, its attention input x [B, T, D] and its
    indexer's top-k indices [B, T, min(Ks, T)]."""
    inputs, picked, hooks = {}, {}, []
    for i, layer in enumerate(ref.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True))
        hooks.append(layer.self_attn.indexer.register_forward_hook(
            lambda mod, args, out, i=i: picked.__setitem__(i, out.long())))
    try:
        ref(seq)
    finally:
        for h in hooks:
            h.remove()
    return inputs, picked


def causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


@torch.no_grad()
def zoo_selection(model, i: int, x: torch.Tensor):
    """Layer i of the zoo model on the reference's attention input x [B, T, D]: its index scores
    [B, T, T] (-inf above the diagonal) and its prefill choice [B, T, T] bool."""
    mixer = model.module.layers[i].mixer
    cos, sin = (t[: x.shape[1]] for t in model.engine.rope[mixer.rope])
    q_resid = mixer.query_residual(x)
    keys = mixer.indexer.keys(x, cos, sin)
    scores = mixer.indexer.scores(x, q_resid, keys, cos, sin).masked_fill(~causal(x.shape[1]), float("-inf"))
    return scores, choice_mask(mixer.indexer.select_prefill_slots(x, q_resid, keys, cos, sin))


def tie_free(model, ref, seq: torch.Tensor, rel_gap: float = 1e-5) -> None:
    """Every query of seq with more than Ks candidates, in every layer: the Ks-th best score beats
    the next one by rel_gap of the row's largest |score| (else the fixture compares tie-breaks)."""
    if seq.shape[1] <= TOPK:
        return  # every query attends to all its keys: nothing to break
    inputs, _ = capture(ref, seq)
    for i, x in inputs.items():
        scores, _ = zoo_selection(model, i, x)
        rows = scores[:, TOPK:]  # queries t >= Ks have t + 1 > Ks candidates
        top = rows.sort(dim=-1, descending=True).values
        scale = rows.masked_fill(rows.isinf(), 0).abs().amax(-1)
        gap = ((top[..., TOPK - 1] - top[..., TOPK]) / scale).min().item()
        assert gap > rel_gap, f"layer {i}: the top-{TOPK} boundary is a (near) tie ({gap:.1e}); change the seed"


def tie_free_guard(ref, model, seq: torch.Tensor) -> None:
    """tie_free in the harness's argument order (tests/family_harness.py's Family.guard)."""
    tie_free(model, ref, seq)


def reference_choice(picked: torch.Tensor) -> torch.Tensor:
    """The reference's top-k indices [B, T, k] -> chosen [B, T, T] bool (picks above the diagonal,
    which it makes while fewer than k keys are visible, dropped)."""
    B, T, _ = picked.shape
    return torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, picked, True) & causal(T)


# ----------------------------------------------------------------------------- parity


def test_index_topk_chunks_equal_one_pass():
    """The prefill indexer scores query rows a chunk at a time (memory O(chunk * L), not O(L^2)
    per head): the picks are those of one pass over all rows, for chunks that split the prompt
    unevenly, including rows with fewer visible keys than k."""
    from zoo.compiler.mixers.dsa import index_topk

    g = torch.Generator().manual_seed(3)
    B, L, Hi, Di, k = 2, 23, 4, 16, 8
    q, keys, w = torch.randn(B, L, Hi, Di, generator=g), torch.randn(B, L, Di, generator=g), torch.randn(B, L, Hi, generator=g)
    one = index_topk(q, keys, w, Di ** -0.5, k, L)
    per_head = torch.relu(torch.einsum("blhd,bsd->blhs", q, keys) * Di ** -0.5)
    scores = torch.einsum("blh,blhs->bls", w, per_head).masked_fill(~causal(L), float("-inf"))
    expect = torch.nn.functional.pad(scores, (0, k), value=float("-inf")).topk(k, dim=-1).indices
    visible = expect < torch.arange(L)[None, :, None] + 1  # picks among visible keys (unique scores)
    assert torch.equal(one[visible], expect[visible])
    for chunk in (1, 5, 16):
        assert torch.equal(index_topk(q, keys, w, Di ** -0.5, k, chunk), one)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("gather_from", [64, 0])
def test_selected_attention_matches_its_fake(heads, gather_from):
    """The custom op's output has the size and strides its fake kernel promises, on both paths,
    with one head (a tensor-parallel rank's share: the masked path's output was a strided view
    there, which compiled graphs reject) and with two."""
    from zoo.compiler.mixers.dsa import selected_attention

    g = torch.Generator().manual_seed(5)
    B, L, nope, R, C, Dv, k = 2, 6, 8, 4, 12, 6, 3
    q_nope, q_rope = torch.randn(B, heads, L, nope, generator=g), torch.randn(B, heads, L, R, generator=g)
    kv, wkv_b = torch.randn(B, L, C + R, generator=g), torch.randn(heads * (nope + Dv), C, generator=g)
    slots = torch.randint(0, L, (B, L, k), generator=g)
    args = (q_nope, q_rope, kv, wkv_b, slots, 0.3, gather_from, 4)
    out = selected_attention(*args)
    assert out.shape == (B, L, heads * Dv) and out.is_contiguous()
    torch.library.opcheck(selected_attention, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_gathered_prefill(references, monkeypatch, variant):
    """Prefill through the long-prompt path (each query attends over its gathered top-k latents,
    absorbed form) on the 19-token prompts, with the indexer and the attention split into
    4- and 3-row chunks; and the same logits as the masked dense path."""
    import zoo.compiler.mixers.dsa

    ref, path, ids = references[variant]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=ids.shape[0], max_seq=MAX_SEQ)
    dense = m.prefill(ids)
    monkeypatch.setattr(zoo.compiler.mixers.dsa, "PREFILL_CHUNK", 4)
    monkeypatch.setattr(zoo.compiler.mixers.dsa, "ATTENTION_CHUNK", 3)
    for layer in m.module.layers:
        layer.mixer.gather_from = 0
    check_parity(ref, m, ids, steps=2)
    assert_logits_close(m.prefill(ids), dense, 1e-5, "gathered vs masked dense prefill")


def test_gather_threshold_switches_path(monkeypatch):
    """Prompts up to `gather_from` tokens run the masked dense kernel, longer ones attend over
    gathered latents; on the same prompt each path gives the other's logits, and one compiled
    prefill graph serves both sides of the threshold."""
    m = zoo.build("glm5_tiny", ["runtime.aot=false"], compile=True, max_seq=64, seed=0)
    eager = zoo.build("glm5_tiny", compile=False, max_seq=64, seed=0)
    n = m.module.layers[0].mixer.gather_from
    assert 2 < n < 63 and {layer.mixer.gather_from for layer in m.module.layers} == {n}
    calls = []
    dense, absorb = dsa.expanded_attention, dsa.absorb_query
    monkeypatch.setattr(dsa, "expanded_attention", lambda *a, **k: calls.append("dense") or dense(*a, **k))
    monkeypatch.setattr(dsa, "absorb_query", lambda *a, **k: calls.append("gathered") or absorb(*a, **k))
    graphs = m.engine.graph_counts()
    ids = torch.randint(0, m.spec.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(2))
    for length, path, forced in ((n, "dense", 0), (n + 1, "gathered", 10**6)):
        for model in (m, eager):
            calls.clear()
            model.prefill(ids[:, :length])
            assert calls and set(calls) == {path}, f"{length} tokens ran {set(calls)}, expected {path}"
        want = eager.prefill(ids[:, :length])
        for layer in eager.module.layers:  # the other path, same model and prompt
            layer.mixer.gather_from = forced
        calls.clear()
        other = eager.prefill(ids[:, :length])
        assert calls and path not in calls
        assert_logits_close(other, want, 1e-5, f"{path} vs the other path at {length} tokens")
        for layer in eager.module.layers:
            layer.mixer.gather_from = n
    assert m.engine.graph_counts() == graphs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_selected_indices(references, models, variant):
    """The tokens each query attends to == the reference indexer's top-k, for every prompt
    position (prefill) and for every decode position from the zoo's own indexer key cache."""
    ref, _, ids = references[variant]
    m = models[variant]
    seq = greedy(ref, ids, STEPS)
    tie_free(m, ref, seq)
    inputs, picked = capture(ref, seq)
    B, T = seq.shape
    for i, x in inputs.items():
        want = reference_choice(picked[i])
        assert want[:, -1].sum(-1).eq(TOPK).all() and want[:, 3].sum(-1).eq(4).all()  # sparse late, full early
        _, got = zoo_selection(m, i, x)
        assert torch.equal(got, want), f"layer {i}: prefill selection"
    # decode: fill the zoo caches token by token, then score each decode position against them
    with torch.no_grad():
        m.prefill(seq[:, :PROMPT])
        for t in range(PROMPT, T):
            m.decode(seq[:, t])
        for i, x in inputs.items():
            mixer, cache = m.module.layers[i].mixer, m.engine.caches[i]
            cos, sin = m.engine.rope[mixer.rope]
            for t in range(PROMPT, T):
                pos = torch.full((B,), t)
                xt = x[:, t:t + 1]
                slots = mixer.indexer.select_decode(xt, mixer.query_residual(xt), cache["index_k"][:B], pos,
                                                    cos[pos], sin[pos])
                assert slots.shape == (B, TOPK)
                assert torch.equal(slots.sort(-1).values, picked[i][:, t].sort(-1).values), \
                    f"layer {i}: decode selection at position {t}"


def test_sparsity_changes_the_result(references):
    """The same checkpoint with index_topk >= the sequence (dense MLA over every token) is far
    from the reference: the comparisons above do exercise the sparse selection."""
    ref, path, ids = references["glm"]
    dense = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=MAX_SEQ,
                                overrides=["mixers.attn.index_topk=64"])
    with torch.no_grad():
        want = ref(ids).logits
        got = dense.prefill(ids)
    assert_logits_close(got[:, :TOPK], want[:, :TOPK], 1e-5, "positions < Ks see every key either way")
    assert (got[:, TOPK:] - want[:, TOPK:]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- DSA module


def test_imported_config(models):
    glm, v32 = models["glm"].spec, models["v32"].spec
    for spec in (glm, v32):
        a = spec.mixers["attn"]
        assert (a.kind, a.q_lora_rank, a.kv_lora_rank, a.qk_rope_dim, a.rope_interleaved) == ("dsa", 48, 32, 8, True)
        assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (16, 16, TOPK)
        assert spec.layout_runs() == [("attn+dense", 1), ("attn+moe", 2)]
    assert glm.mixers["attn"].index_rope_interleaved and not v32.mixers["attn"].index_rope_interleaved
    assert glm.mtp.share_embeddings and not v32.mtp.share_embeddings
    assert (glm.rope.kind, glm.rope.theta, glm.ffns["moe"].n_group) == ("default", 1e6, 1)
    assert (v32.rope.kind, v32.rope.factor, v32.ffns["moe"].n_group) == ("yarn", 4.0, 4)
    # YaRN's mscale^2 on MLA's softmax scale (the indexer's own scale is Di^-0.5)
    assert models["v32"].module.layers[0].mixer.scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def _copy_config(src, dst, **update):
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(update)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_shared_indexer_layers_not_supported(references, tmp_path):
    """GLM's cross-layer top-k sharing (indexer_types "shared", or index_topk_freq > 1): a clear
    error, not a model that silently runs an indexer the checkpoint does not have."""
    _, path, _ = references["glm"]
    bad = _copy_config(path, tmp_path / "shared", indexer_types=["full", "shared", "full"])
    with pytest.raises(ConfigError, match=r"indexer_types .*not yet supported.*'shared' at layers \[1\]"):
        zoo.from_pretrained(str(bad), compile=False)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["indexer_types"]
    freq = _copy_config(path, tmp_path / "freq")
    (freq / "config.json").write_text(json.dumps({**cfg, "index_topk_freq": 2}))
    with pytest.raises(ConfigError, match="not yet supported"):
        zoo.from_pretrained(str(freq), compile=False)


def test_caches_latent_plus_indexer_keys(models):
    """Per layer: MLA's latent [B, 1, S, C + R] and the indexer keys [B, S, Di]; both per token."""
    m = models["glm"]
    for layer in m.engine.plan.layers:
        assert {name: f.shape for name, f in layer.items()} == {"kv": (2, 1, MAX_SEQ, 32 + 8),
                                                               "index_k": (2, MAX_SEQ, 16)}
        assert all(f.grows for f in layer.values())
    assert m.info.cache_bytes_per_token == 3 * (32 + 8 + 16) * 4  # float32


@torch.no_grad()
def test_decode_reads_only_the_selected_latents(models):
    """Decode attends over exactly the Ks gathered latent entries: poisoning every other cache slot
    (NaN) changes nothing, while MLA's dense decode over the same cache is ruined."""
    m = models["glm"]
    mixer = m.module.layers[1].mixer
    B, S = 2, MAX_SEQ
    cache = {name: torch.zeros(f.shape) for name, f in mixer.cache_fields(B, S, torch.float32).items()}
    cos, sin = m.engine.rope[mixer.rope]
    L = 20
    x = torch.randn(B, L + 1, 64, generator=torch.Generator().manual_seed(0))
    mixer.prefill(x[:, :L], cache, {"rope": {mixer.rope: (cos[:L], sin[:L])}})
    pos = torch.full((B,), L)
    ctx = {"rope": {mixer.rope: (cos[pos], sin[pos])}, "pos": pos}
    clean = {k: v.clone() for k, v in cache.items()}
    want = mixer.decode(x[:, L:], clean, ctx)
    xt = x[:, L:]
    slots = mixer.indexer.select_decode(xt, mixer.query_residual(xt), clean["index_k"], pos, cos[pos], sin[pos])
    keep = torch.zeros(B, S, dtype=torch.bool).scatter_(1, slots, True)
    poisoned = {k: v.clone() for k, v in cache.items()}
    poisoned["kv"][~keep[:, None, :, None].expand_as(poisoned["kv"])] = float("nan")
    got = mixer.decode(x[:, L:], poisoned, ctx)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert MLA.decode(mixer, x[:, L:], poisoned, ctx).isnan().all()


@pytest.mark.parametrize("override,match", [
    ("mixers.attn.q_lora_rank=null", "mixers.attn: q_lora_rank=null: the dsa indexer's queries"),
    ("mixers.attn.index_head_dim=4", "index_head_dim=4 must be >= qk_rope_dim=8"),
    ("mixers.attn.index_topk=0", "'index_topk': 0} must be positive"),
])
def test_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        zoo.build("glm5_tiny", [override], dry=True)


# ----------------------------------------------------------------------------- the preset


def glm5_parameter_count() -> tuple[int, int]:
    """zai-org/GLM-5's parameters from the shapes in checkpoints.md: (main model, MTP layer)."""
    D, V, L, dense_layers, H = 6144, 154880, 78, 3, 64
    q_lora, kv_lora, nope, rope, v_dim = 2048, 512, 192, 64, 256
    attn = (D * q_lora + q_lora + q_lora * H * (nope + rope)  # q_a, q_a_layernorm, q_b
            + D * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v_dim)  # kv_a, kv_a_layernorm, kv_b
            + H * v_dim * D)  # o_proj
    indexer = 32 * 128 * q_lora + 128 * D + 2 * 128 + 32 * D  # wq_b, wk, k_norm (weight, bias), weights_proj
    dense = 3 * D * 12288
    moe = 256 * 3 * D * 2048 + 3 * D * 2048 + 256 * D + 256  # experts, shared, gate, bias
    norms = 2 * D
    main = 2 * V * D + D + dense_layers * (attn + indexer + dense + norms) + \
        (L - dense_layers) * (attn + indexer + moe + norms)
    mtp = attn + indexer + moe + norms + 2 * D * D + 3 * D  # eh_proj, enorm, hnorm, shared_head.norm
    return main, mtp


def test_preset_counts_cache_and_flops():
    main, mtp = glm5_parameter_count()
    assert main == 743_911_218_432  # "744B total"
    m = zoo.build("glm5", dry=True, dtype=torch.bfloat16)
    assert m.info.dry and m.info.params == main
    # per token per layer: latent 512 + 64 and one indexer key of 128, bfloat16
    assert m.info.cache_bytes_per_token == 78 * (512 + 64 + 128) * 2 == 109_824
    assert m.spec.layout_runs() == [("attn+dense", 3), ("attn+moe", 75)]
    assert m.module.layers[0].mixer.scale == pytest.approx(256 ** -0.5)
    with_mtp = zoo.build("glm5", ["checkpoint.mtp=true"], dry=True, dtype=torch.bfloat16)
    assert with_mtp.info.params == main + mtp  # no embedding / head copies: tied to the main ones

    # report FLOPs: the indexer scans the whole context, MLA attends over at most 2048 tokens
    from zoo.compiler.analysis import analyze

    flops = {t: analyze(m.spec, context=t)["decode_flops_per_token"] for t in (1024, 2048, 4096, 8192)}
    indexer_per_key = 2 * 32 * (128 + 1)
    mla_per_key = 2 * 64 * (2 * 512 + 64)
    assert flops[8192] - flops[4096] == 78 * indexer_per_key * 4096  # flat attention past Ks
    assert flops[2048] - flops[1024] == 78 * (indexer_per_key + mla_per_key) * 1024
    mixer = m.module.layers[0].mixer
    assert np.array_equal(mixer.attention_flops(np.array([100, 5000])),
                          [(indexer_per_key + mla_per_key) * 100, indexer_per_key * 5000 + mla_per_key * 2048])


def test_cli_dry_build_report(capsys):
    from zoo.cli import main

    assert main(["build", "conf=glm5", "dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "743,911,218,432" in out and "109,824 B" in out
    assert "attn+dense x3, attn+moe x75" in out


# ----------------------------------------------------------------------------- MTP


@pytest.fixture(scope="module")
def mtp_checkpoint(references, tmp_path_factory):
    """The glm checkpoint plus a random MTP layer model.layers.3 (a DSA + MoE block, enorm,
    hnorm, eh_proj, shared_head.norm; no embedding or head of its own, as GLM-5 stores it)."""
    ref, path, ids = references["glm"]
    path = _copy_config(path, tmp_path_factory.mktemp("mtp") / "ckpt", num_nextn_predict_layers=1)
    config = copy.deepcopy(ref.config)  # the reference's per-layer lists, one layer longer
    config.indexer_types = config.indexer_types + ["full"]
    config.mlp_layer_types = config.mlp_layer_types + ["sparse"]
    layer_cls = transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaDecoderLayer
    block, extra = make_mtp_layer(config, seed=3, layer_cls=layer_cls)
    extra.update({"embed_tokens.weight": ref.model.embed_tokens.weight, "shared_head.head.weight": ref.lm_head.weight})
    tensors = {k: v for k, v in mtp_hub_tensors(block, extra, 3).items()
               if not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    add_shard(path, "model-mtp.safetensors", tensors)
    return ref, path, block, extra, tensors


def test_mtp_logits(mtp_checkpoint):
    ref, path, block, extra, _ = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=MAX_SEQ, overrides=["checkpoint.mtp=true"])
    assert len(m.module.mtp) == 1 and not hasattr(m.module.mtp[0], "embed")
    assert isinstance(m.module.mtp[0].mixer, DSA)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    assert_logits_close(logits, ref(ids).logits, 1e-5, "main logits")
    assert_logits_close(mtp, mtp_reference(ref, block, extra, ids), 1e-5, "mtp logits")


def test_mtp_skipped_and_reported(mtp_checkpoint):
    """checkpoint.mtp=false (the default): every MTP tensor (indexer included) is dropped by the
    explicit rule whose reason the load report lists."""
    _, path, _, _, tensors = mtp_checkpoint
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    assert len(m.module.mtp) == 0
    skipped = dict(m.info.load.ignored)
    assert sorted(skipped) == sorted(tensors)
    assert "model.layers.3.self_attn.indexer.wk.weight" in skipped
    assert all("multi-token-prediction" in why and "checkpoint.mtp=false" in why for why in skipped.values())


# ----------------------------------------------------------------------------- FP8


def test_fp8_checkpoint(references, tmp_path):
    """GLM-5-FP8 layout: V3-style e4m3 blocks + weight_scale_inv on every block linear, the
    indexer's wq_b and wk included (weights_proj, norms, router, embeddings stay bf16/f32):
    the fp8_block stage dequantizes them; logits = transformers on the dequantized values."""
    ref, path, ids = references["glm"]
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    hub = {}
    for name, t in state.items():
        if (is_fp8(name) and "weights_proj" not in name) or name.endswith(("indexer.wq_b.weight", "indexer.wk.weight")):
            hub[name], hub[name.removesuffix("weight") + "weight_scale_inv"] = quantize(t.float())
        else:
            hub[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    assert hub["model.layers.1.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(hub, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    values = stored_values(hub)
    plain = tmp_path / "dequantized"
    plain.mkdir()
    save_file(values, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (plain / "config.json").write_text(json.dumps(cfg))
    deq_ref = transformers.GlmMoeDsaForCausalLM.from_pretrained(plain).eval()

    m = zoo.from_pretrained(str(fp8), compile=False, max_batch=2, max_seq=MAX_SEQ)
    rules = m.spec.checkpoint.rules  # the quantization stages, then the family's
    assert rules[0] == "fp8_block" and rules[-2:] == ["deepseek_mtp", "deepseek_v3"]
    p = dict(m.module.named_parameters())
    assert torch.equal(p["layers.1.mixer.indexer.wq_b.weight"], values["model.layers.1.self_attn.indexer.wq_b.weight"])
    assert torch.equal(p["layers.2.mixer.indexer.wk.weight"], values["model.layers.2.self_attn.indexer.wk.weight"])
    assert torch.equal(p["layers.0.mixer.indexer.k_norm.bias"], values["model.layers.0.self_attn.indexer.k_norm.bias"])
    tie_free(m, deq_ref, greedy(deq_ref, ids, 3))
    check_parity(deq_ref, m, ids, steps=3)
