"""zoo report / diff / import / check for every family: figures, structure-aware diffs, round
trips, header-only checks.

How the figures are proven:
  - cache bytes: exact numbers derived here from the published shapes (checkpoints.md);
  - active parameters: exact numbers derived here from the shapes, and the published "about"
    figures within a stated tolerance (see test_active_parameters for the conventions);
  - FLOPs: a decode step of each tiny twin run under torch's FlopCounterMode (which counts the
    matmuls / SDPA the code really runs) equals `analyze`'s decode FLOPs at a context of max_seq
    (the static cache attends over every slot); the contractions a module writes elementwise
    (DeltaNet's recurrence and conv, mHC's stream sums) are checked on their own, against a
    matmul form of the same computation under FlopCounterMode.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import zoo
from zoo.compiler.analysis import analyze, token_flops
from zoo.compiler.config import load_config
from zoo.compiler.mixers.gated_deltanet import recurrent_gated_delta_step
from zoo.compiler.residual.mhc import HyperConnection
from zoo.compiler.ffn.moe import MoE
from tests.helpers import save_reference
from tests.test_llama import make_reference
from zoo.cli import main
from zoo.report import human_bytes

transformers = pytest.importorskip("transformers")

KEYS = ("params_total", "params_active", "cache_bytes_per_token", "state_bytes_per_sequence",
        "decode_flops_per_token", "prefill_flops_per_token")
FAMILIES = ("llama3_8b", "smollm2_135m", "deepseek_v3", "qwen3_next", "glm5", "deepseek_v4_flash")


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """`zoo report conf=<every family> context=4096 output=json`, one CLI call."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", f"conf={','.join(FAMILIES)}", "context=4096", "output=json"]) == 0
    return {r["name"]: r for r in json.loads(out.getvalue())}


# ----------------------------------------------------------------------------- zoo report


def test_report_json_every_family(reports):
    assert set(reports) == set(FAMILIES)
    for name, r in reports.items():
        for key in KEYS:
            assert isinstance(r[key], int) and r[key] >= 0, (name, key)
        assert 0 < r["params_active"] <= r["params_total"]
        # decode at 4096 sees more context than the average prompt position of a 4096 prefill
        assert r["decode_flops_per_token"] >= r["prefill_flops_per_token"] > 2 * r["params_active_layers"] * 0.9


def test_report_json_llama3_8b(capsys):
    code, out = run(capsys, "report", "conf=llama3_8b", "context=8192", "device=h200", "output=json")
    assert code == 0
    r = json.loads(out)
    assert r["params_total"] == 8_030_261_248
    assert r["cache_bytes_per_token"] == 131_072  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    assert r["state_bytes_per_sequence"] == 0
    # active: everything but the input embedding table (untied: the head counts)
    assert r["params_active"] == 8_030_261_248 - 128_256 * 4096
    assert r["device"]["decode_bound"] == "memory"
    assert r["device"]["max_batch_at_context"] == (141_000_000_000 - r["weight_bytes"]) // (131_072 * 8192)


def test_cache_figures(reports):
    """bf16 cache (constant states keep their own dtype: DeltaNet's recurrent state is float32)."""
    assert reports["llama3_8b"]["cache_bytes_per_token"] == 32 * 2 * 8 * 128 * 2 == 131_072
    assert reports["deepseek_v3"]["cache_bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    qwen = reports["qwen3_next"]
    assert qwen["cache_bytes_per_token"] == 12 * 2 * 2 * 256 * 2 == 24_576  # 12 attention layers, k and v
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1) * 2  # [q|k|v] channels x (kernel - 1) inputs, bf16
    state = 32 * 128 * 128 * 4  # value heads x Dk x Dv, float32
    assert qwen["state_bytes_per_sequence"] == 36 * (conv + state) == 77_266_944
    fields = {f["field"]: f for f in qwen["cache_fields"]}
    assert (fields["linear.state"]["dtype"], fields["linear.state"]["state_bytes_per_sequence"]) == \
        ("float32", 36 * state)
    glm = {f["field"]: f["bytes_per_token"] for f in reports["glm5"]["cache_fields"]}
    assert glm == {"attn.kv": 78 * (512 + 64) * 2, "attn.index_k": 78 * 128 * 2}
    assert glm["attn.kv"] == 89_856 and glm["attn.index_k"] == 19_968
    assert reports["glm5"]["cache_bytes_per_token"] == 109_824


def deepseek_v3_active() -> int:
    """DeepSeek-V3's parameters per token from the checkpoint shapes: 3 dense + 58 MoE layers
    (8 of 256 routed experts + the shared one + the router and its bias), final norm, head."""
    D, H, Cq, C, Dn, R, Dv = 7168, 128, 1536, 512, 128, 64, 128
    mla = D * Cq + Cq + Cq * H * (Dn + R) + D * (C + R) + C + C * H * (Dn + Dv) + H * Dv * D
    expert = 3 * D * 2048
    dense, moe = 3 * D * 18432, 8 * expert + expert + 256 * D + 256
    return 3 * (mla + 2 * D + dense) + 58 * (mla + 2 * D + moe) + D + 129_280 * D


def qwen3_next_active() -> int:
    """Qwen3-Next-80B-A3B's: 12 gated-attention + 36 DeltaNet layers, each MoE (10 of 512 experts,
    the gated shared expert, the router), final norm, head."""
    D = 2048
    attn = (16 * 256 * 2) * D + 2 * (2 * 256) * D + D * (16 * 256) + 2 * 256
    linear = 12288 * D + 64 * D + 8192 * 4 + 32 + 32 + 128 + D * 4096
    moe = 512 * D + 10 * 3 * 512 * D + 3 * 512 * D + D
    return 12 * (attn + moe + 2 * D) + 36 * (linear + moe + 2 * D) + D + 151_936 * D


def glm5_active() -> int:
    D, H, Cq, C, Dn, R, Dv = 6144, 64, 2048, 512, 192, 64, 256
    dsa = (D * Cq + Cq + Cq * H * (Dn + R) + D * (C + R) + C + C * H * (Dn + Dv) + H * Dv * D
           + 32 * 128 * Cq + 128 * D + 2 * 128 + 32 * D)  # the indexer
    expert = 3 * D * 2048
    dense, moe = 3 * D * 12288, 8 * expert + expert + 256 * D + 256
    return 3 * (dsa + 2 * D + dense) + 75 * (dsa + 2 * D + moe) + D + 154_880 * D


def test_active_parameters(reports):
    """Convention (params_active): what a token touches except the input embedding table (a
    lookup of one row); the output head counts (it multiplies every token); MTP layers are not
    part of the main model (reported as params_mtp).

    Against the published "about" figures (checkpoints.md): DeepSeek-V3 37B, GLM-5 40B and
    DeepSeek-V4-Flash 13B match within 3% in this convention. Qwen3-Next's "3B" is the A3B of its
    name: our 3.56B is 19% above it; it matches within 10% only without the head too (the decoder
    blocks alone, params_active_layers = 3.25B). Qwen's own model cards count embeddings AND head
    as activated (Qwen3-30B-A3B: "3.3B activated", which that convention gives), under which
    Qwen3-Next would be 3.9B: the name is rounded down, so no convention makes it exact."""
    ds3, qwen, glm = reports["deepseek_v3"], reports["qwen3_next"], reports["glm5"]
    assert ds3["params_active"] == deepseek_v3_active() == 36_625_618_432
    assert qwen["params_active"] == qwen3_next_active() == 3_563_764_480
    assert glm["params_active"] == glm5_active() == 40_833_146_112
    for r, about in ((ds3, 37e9), (glm, 40e9), (reports["deepseek_v4_flash"], 13e9)):
        assert abs(r["params_active"] / about - 1) < 0.03, (r["name"], r["params_active"])
    assert abs(qwen["params_active_layers"] / 3e9 - 1) < 0.10
    assert qwen["params_active_layers"] == qwen["params_active"] - 151_936 * 2048 - 2048  # head, final norm
    # MTP apart: DeepSeek-V3 671B main (+ an MTP layer with its own embedding and head copies)
    assert ds3["params_total"] == 671_026_419_200 and ds3["params_mtp"] > 11e9
    from tests.test_glm5 import glm5_parameter_count

    assert (glm["params_total"], glm["params_mtp"]) == glm5_parameter_count()


def test_mtp_reported_apart():
    """Building the MTP layers (checkpoint.mtp=true) changes no per-token figure."""
    base, with_mtp = (analyze(load_config("deepseek_v3_tiny", o)) for o in ([], ["checkpoint.mtp=true"]))
    assert base == {**with_mtp, "source": base["source"]} and base["params_mtp"] > 0


def test_moe_active_and_expected_experts():
    """MoE.active_parameters by hand; decode_weight_fraction against an exact enumeration of
    every way B tokens can each pick K distinct experts of E (uniform routing)."""
    spec = load_config("deepseek_v4_flash_tiny")  # hash-routed and learned MoE with shared experts
    model = zoo.build("deepseek_v4_flash_tiny", dry=True).module
    D, V = spec.dim, spec.vocab_size
    for layer, block in zip(spec.layers, model.layers):
        moe, s = block.ffn, layer.ffn
        per_expert = 3 * s.ffn_dim * D
        matmul = s.top_k * per_expert + s.n_experts * D + 3 * s.shared_ffn_dim * D
        assert moe.routed_parameters() == s.n_experts * per_expert
        assert moe.active_parameters(matmul_only=True) == matmul
        read = s.n_experts if s.score_correction_bias else 0  # the selection bias is read, not multiplied
        read += s.top_k if s.routing == "hash" else 0  # the token's row of tid2eid
        assert moe.active_parameters() == matmul + read
    for E, K, B in ((4, 1, 3), (5, 2, 2), (6, 3, 2), (4, 2, 3)):
        moe = MoE(MoE.Spec(n_experts=E, top_k=K, ffn_dim=2).resolve({}), type("M", (), {"dim": 2, "spec": None})())
        choices = list(itertools.combinations(range(E), K))
        hit = [len(set().union(*picks)) for picks in itertools.product(choices, repeat=B)]
        assert moe.decode_weight_fraction(B) == pytest.approx(np.mean(hit) / E, rel=1e-12)


def test_moe_decode_bytes(reports):
    """A decode step reads, of each MoE layer's routed experts, the share B tokens hit."""
    spec = load_config("deepseek_v3")
    one, many = analyze(spec, batch=1), analyze(spec, batch=32)
    routed = 256 * 3 * 7168 * 2048 * 2  # one MoE layer's routed experts, bf16
    share = lambda b: 1 - (1 - 8 / 256) ** b  # noqa: E731
    per_seq = 7168 * 2 + one["decode_cache_bytes_read_per_sequence"]  # embedding row + its cache
    assert many["decode_bytes_per_step"] - one["decode_bytes_per_step"] == \
        pytest.approx(31 * per_seq + 58 * routed * (share(32) - share(1)), rel=1e-9)
    assert one["decode_bytes_per_step"] == pytest.approx(
        one["weight_bytes"] - 129_280 * 7168 * 2 + per_seq - 58 * routed * (1 - 8 / 256), rel=1e-9)


# ----------------------------------------------------------------------------- FLOPs

_CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
             lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}
S = 32  # max_seq of the tiny models below (> the DSA top-k, > the V4 window)


def measured_decode_flops(model) -> int:
    """FLOPs of one decode step (batch 1) that torch's FlopCounterMode sees."""
    model.prefill(torch.randint(0, model.spec.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0)))
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
        model.decode(torch.tensor([3]))
    return counter.get_total_flops()


def _one_query_attention(model) -> int:
    """GQA's decode on the CPU runs zoo's one-query kernel (mixers/one_query.py), which
    FlopCounterMode does not see: q . k and p . v, 2 H Dh FLOPs each per cache slot, counted here
    at the analysis's context (all S slots; the kernel itself reads only the visible ones)."""
    from zoo.compiler.mixers.attention import Attention

    assert model.engine.context_flags["one_query_kernel"]
    return sum(4 * b.mixer.n_heads * b.mixer.head_dim * cache["k"].shape[2]
               for b, cache in zip(model.module.layers, model.engine.caches) if isinstance(b.mixer, Attention))


def _deltanet_elementwise(model) -> int:
    """DeltaNet's decode writes its depthwise conv and its recurrence elementwise (FlopCounterMode
    sees neither), counted by hand from the shapes: per value head the decay, the read S^T k, the
    rank-1 write k delta^T and the read S^T q are three [Dk, Dv] contractions (2 FLOPs per
    multiply-add, as test_deltanet_state_flops measures them); the conv is one multiply-add per
    weight."""
    return sum(2 * 3 * b.mixer.Hv * b.mixer.Dk * b.mixer.Dv + 2 * b.mixer.conv_weight.numel()
               for b in model.module.layers if b.mixer.kind == "gated_deltanet") + _one_query_attention(model)


def _mhc_elementwise(model) -> int:
    """mHC writes the pre-weighted sums and post (x) y elementwise; comb^T @ h is a matmul
    (test_mhc_token_flops)."""
    spec = model.spec
    n, d = (spec.residual.streams if spec.residual.kind == "mhc" else 1), spec.dim
    return 0 if n == 1 else 2 * spec.n_layers * 4 * n * d + 2 * n * d


def _v4_elementwise(model) -> int:
    """mHC, and the compressors' gate-weighted pooling of each entry (written elementwise): an
    entry weights and sums the span token rows of Dc channels, measured here as the same
    contraction written as a matmul, once per ratio tokens."""
    from zoo.compiler.mixers.compressed_attention import Compressor

    pooling = 0
    for c in (m for m in model.module.modules() if isinstance(m, Compressor)):
        rows, probs = torch.randn(1, c.span, c.out_dim), torch.rand(1, c.span)
        with FlopCounterMode(display=False) as counter:
            torch.einsum("bs,bsd->bd", probs, rows)
        assert counter.get_total_flops() % c.ratio == 0
        pooling += counter.get_total_flops() // c.ratio
    return _mhc_elementwise(model) + pooling


@pytest.mark.parametrize("conf, overrides, elementwise", [
    ("llama3_8b_tiny", [], _one_query_attention),  # GQA
    ("deepseek_v3_tiny", [], None),  # MLA absorbed decode, grouped MoE, dense first layer
    ("glm5_tiny", [], None),  # DSA: indexer over the 32 slots, attention over top-8
    ("qwen3_next_tiny", [], _deltanet_elementwise),  # DeltaNet + gated attention, gated shared expert
    ("deepseek_v4_flash_tiny", ["layout=[{repeat:2,mixer:swa,ffn:moe_hash},{mixer:swa,ffn:moe}]"],
     _mhc_elementwise),  # sliding window 8 < 32 slots, hash + learned MoE, 4 mHC streams
    ("deepseek_v4_flash_tiny", [], _v4_elementwise),  # + compressed layers (HCA; CSA with its indexer)
])
def test_decode_flops_match_flop_counter(conf, overrides, elementwise):
    model = zoo.build(conf, overrides, compile=False, max_seq=S, dtype=torch.float32)
    expected = analyze(model.spec, context=S, weight_dtype="float32", cache_dtype="float32")
    extra = elementwise(model) if elementwise else 0
    assert measured_decode_flops(model) + extra == expected["decode_flops_per_token"]


def test_deltanet_state_flops():
    """The recurrence written as matmuls gives the module's step, and FlopCounterMode counts
    exactly `attention_flops` for it, whatever the context."""
    model = zoo.build("qwen3_next_tiny", dry=True).module
    mixer = next(b.mixer for b in model.layers if hasattr(b.mixer, "conv_weight"))
    H, Dk, Dv = mixer.Hv, mixer.Dk, mixer.Dv
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, H, Dk, generator=g), torch.randn(1, H, Dk, generator=g)
    v, state = torch.randn(1, H, Dv, generator=g), torch.randn(1, H, Dk, Dv, generator=g)
    decay, beta = -torch.rand(1, H, generator=g), torch.rand(1, H, generator=g)
    o_ref, s_ref = recurrent_gated_delta_step(q, k, v, decay, beta, state)
    with FlopCounterMode(display=False) as counter:
        s = state * decay.exp()[..., None, None]  # elementwise
        delta = beta[..., None] * (v - (k[..., None, :] @ s)[..., 0, :])  # S^T k
        s = s + k[..., :, None] @ delta[..., None, :]  # the rank-1 write
        o = (q[..., None, :] @ s)[..., 0, :]  # S^T q
    torch.testing.assert_close((o, s), (o_ref, s_ref))
    assert counter.get_total_flops() == mixer.attention_flops(7) == 6 * H * Dk * Dv
    assert np.array_equal(mixer.attention_flops(np.array([1, 10, 10**6])), [6 * H * Dk * Dv] * 3)


def test_mhc_token_flops():
    """enter + exit of one hyper-connection: FlopCounterMode sees fn's matmul and comb^T @ h;
    token_flops adds the two N*D contractions written elementwise."""
    n, d = 4, 16
    hc = HyperConnection(n, d, iters=3, eps=1e-6, norm_eps=1e-6)
    hc.init_weights()
    h, y = torch.randn(1, 1, n, d), torch.randn(1, 1, d)
    with FlopCounterMode(display=False) as counter:
        x, aux = hc.enter(h)
        out = hc.exit(h, y, aux)
    pre, post, comb = hc.weights(h)
    torch.testing.assert_close(x, (pre[..., None] * h).sum(-2))
    torch.testing.assert_close(out, post[..., None] * y[..., None, :] + comb.transpose(-1, -2) @ h)
    assert counter.get_total_flops() == 2 * hc.fn.numel() + 2 * n * n * d
    assert 2 * hc.fn.numel() + token_flops(hc) == counter.get_total_flops() + 2 * (2 * n * d)


def test_flops_grow_with_context():
    spec = load_config("llama3_8b")
    short, long = analyze(spec, context=1024), analyze(spec, context=8192)
    per_token_attention = 32 * 4 * 32 * 128  # layers x (qk + av) x heads x head_dim, per context token
    assert long["decode_flops_per_token"] - short["decode_flops_per_token"] == per_token_attention * (8192 - 1024)
    # prefill: the causal mean over positions 1..T
    assert short["decode_flops_per_token"] - short["prefill_flops_per_token"] == \
        per_token_attention * (1024 - 1025 / 2)


def test_mla_prefill_expanded_decode_absorbed(reports):
    """MLA decodes absorbed (per head and cached token: q.k over C + R latent channels and a
    C-wide weighted sum) but prefills expanded (Dn + R and Dv)."""
    r, T = reports["deepseek_v3"], 4096
    absorbed, expanded = 2 * 128 * (2 * 512 + 64), 2 * 128 * (128 + 64 + 128)
    dense = r["decode_flops_per_token"] - 61 * absorbed * T
    assert dense == 2 * (deepseek_v3_active() - 58 * 256 - 61 * 2 * 7168 - 7168 - 61 * (1536 + 512))  # 1-D weights
    assert r["prefill_flops_per_token"] == dense + 61 * expanded * (T + 1) / 2


def test_dsa_flat_beyond_top_k(reports):
    """GLM-5: the indexer scans the whole context, MLA attends over at most 2048 tokens; the
    decode step reads every indexer key but only 2048 latents."""
    spec = load_config("glm5")
    at = {t: analyze(spec, context=t) for t in (1024, 2048, 8192)}
    at[4096] = reports["glm5"]
    indexer, absorbed = 2 * 32 * (128 + 1), 2 * 64 * (2 * 512 + 64)
    d = {t: r["decode_flops_per_token"] for t, r in at.items()}
    assert d[2048] - d[1024] == 78 * (indexer + absorbed) * 1024
    assert d[8192] - d[4096] == 78 * indexer * 4096  # attention flat beyond top-k
    p = {t: r["prefill_flops_per_token"] for t, r in at.items()}
    # prefill of T: the mean over positions t of indexer * t + absorbed * min(t, 2048) (each query
    # attends over its own gathered latents in the absorbed form, as in decode)
    mean = lambda T: (indexer * (T + 1) / 2 + absorbed * np.minimum(np.arange(1, T + 1), 2048).mean())  # noqa: E731
    assert p[8192] - p[1024] == pytest.approx(78 * (mean(8192) - mean(1024)), abs=2)
    assert at[8192]["decode_cache_bytes_read_per_sequence"] == 78 * (8192 * 128 + 2048 * 576) * 2
    assert at[1024]["decode_cache_bytes_read_per_sequence"] == 78 * 1024 * (128 + 576) * 2


def test_v4_compressed_reads(reports):
    """DeepSeek-V4-Flash's CSA layers read every indexer key but only the top-k compressed entries."""
    spec = load_config("deepseek_v4_flash")
    csa = spec.mixers["csa"]
    n_csa = sum(layer.mixer_name == "csa" for layer in spec.layers)
    r, T = analyze(spec, context=131072), 131072
    skipped = n_csa * (T // csa.compress_ratio - csa.index_topk) * csa.head_dim * 2  # bf16 entries not read
    everything = r["cache_bytes_at_context"] + r["state_bytes_per_sequence"]
    assert r["decode_cache_bytes_read_per_sequence"] == everything - skipped


def test_report_table_and_tiny(capsys):
    code, out = run(capsys, "report", "conf=llama3_8b_tiny", "residual=mhc", "residual.streams=2")
    assert code == 0 and "2 streams (mHC)" in out and "per layer kind" in out
    code, out = run(capsys, "report", "conf=deepseek_v3", "device=h200", "context=32768")
    assert code == 0 and "13,463,426,304 more in the multi-token-prediction layers" in out
    assert "attn.kv" in out and "does NOT fit" in out and "the weights alone need" in out


def test_report_plot(tmp_path, capsys):
    """One plot of every family (looked at by eye when written: log-log, one labelled line each)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "cache.png"
    code, _ = run(capsys, "report", "conf=llama3_8b,deepseek_v3,glm5,qwen3_next,deepseek_v4_flash", f"plot={png}",
                  "context=131072")
    assert code == 0 and png.stat().st_size > 30_000 and png.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- zoo diff


def test_diff_shows_only_differences(capsys):
    code, out = run(capsys, "diff", "llama3_8b", "llama3_8b mixers.attn.n_kv_heads=4", "output=json")
    assert code == 0
    d = json.loads(out)
    assert [c["key"] for c in d["changed"]] == ["mixers.attn.n_kv_heads"]
    cache = next(f for f in d["figures"] if f["figure"] == "cache_bytes_per_token")
    assert (cache["a"], cache["b"], cache["ratio"]) == (131_072, 65_536, 0.5)
    assert d["layout"]["same"]


def test_diff_layout_as_runs(capsys):
    code, out = run(capsys, "diff", "llama3_8b_tiny", "llama3_8b_tiny n_layers=5", "output=json")
    d = json.loads(out)
    assert (d["layout"]["a"], d["layout"]["b"], d["layout"]["same"]) == ("attn+mlp x2", "attn+mlp x5", False)
    code, out = run(capsys, "diff", "llama3_8b_tiny", "llama3_8b_tiny n_layers=5")
    assert "attn+mlp x5" in out


def _changed(d: dict) -> dict:
    return {c["key"]: (c["a"], c["b"]) for c in d["changed"]}


def test_diff_deepseek_v3_vs_glm5(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps cells to the terminal's width
    code, out = run(capsys, "diff", "deepseek_v3", "glm5", "output=json")
    assert code == 0
    d = json.loads(out)
    changed = _changed(d)
    # a changed kind: the kind, the keys both have that differ, the new kind's own keys as one row
    assert changed["mixers.attn.kind"] == ("mla", "dsa")
    assert changed["mixers.attn.n_heads"] == (128, 64)
    assert changed["mixers.attn (dsa only)"][0] is None
    assert changed["mixers.attn (dsa only)"][1]["index_topk"] == 2048
    assert changed["rope.kind"] == ("yarn", "default") and changed["rope (yarn only)"][0]["factor"] == 40.0
    assert "mixers.attn.kv_lora_rank" not in changed  # 512 in both
    assert (d["layout"]["runs_a"], d["layout"]["runs_b"]) == ([["attn+dense", 3], ["attn+moe", 58]],
                                                              [["attn+dense", 3], ["attn+moe", 75]])
    figures = {f["figure"]: f for f in d["figures"]}
    assert (figures["cache_bytes_per_token"]["a"], figures["cache_bytes_per_token"]["b"]) == (70_272, 109_824)
    assert figures["cache_bytes_per_token"]["ratio"] == pytest.approx(109_824 / 70_272)
    code, out = run(capsys, "diff", "deepseek_v3", "glm5")
    assert "mixers.attn (dsa only)" in out and "index_topk=2048" in out and "1.563x" in out


def test_diff_llama_vs_qwen3_next(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps cells to the terminal's width
    code, out = run(capsys, "diff", "llama3_8b", "qwen3_next", "output=json")
    d = json.loads(out)
    # the hybrid layout as a repeating group of runs, not 48 lines
    assert d["layout"]["b"] == "12 x (linear+moe x3, attn+moe x1)"
    assert d["layout"]["kinds_b"] == "linear=gated_deltanet, moe=moe, attn=gqa"
    changed = _changed(d)
    # a node one side lacks is one row (the whole node), not one row per key
    assert changed["mixers.linear"][0] is None and changed["mixers.linear"][1]["kind"] == "gated_deltanet"
    assert changed["ffns.moe"][1]["n_experts"] == 512 and changed["ffns.mlp"][1] is None
    assert not any(k.startswith(("mixers.linear.", "ffns.moe.")) for k in changed)
    assert changed["mixers.attn.head_dim"] == (128, 256)  # resolved (llama's conf says null)
    assert len(d["changed"]) < 25
    figures = {f["figure"]: f for f in d["figures"]}
    assert figures["cache_bytes_per_token"]["ratio"] == 24_576 / 131_072
    assert (figures["state_bytes_per_sequence"]["a"], figures["state_bytes_per_sequence"]["ratio"]) == (0, None)
    code, out = run(capsys, "diff", "llama3_8b", "qwen3_next")
    assert "12 x (linear+moe x3, attn+moe x1)" in out and "gated_deltanet(n_k_heads=16" in out


# ----------------------------------------------------------------------------- checkpoints


def _llama(path):
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True), {})


def _deepseek_v3(path):
    from tests.test_deepseek_v3 import make_reference as deepseek_v3

    deepseek_v3(path, {}, {"max_shard_size": "150KB"})


def _qwen3_next(path):
    from tests.test_qwen3_next import randomize, tiny_config

    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    randomize(ref)
    save_reference(ref, path)


def _glm5(path):
    from tests.test_glm5 import make_reference as glm5

    glm5("glm", path)


def _deepseek_v32(path):
    from tests.test_glm5 import make_reference as glm5

    glm5("v32", path)


def _deepseek_v4(path):
    from tests.test_deepseek_v4_swa import make_checkpoint

    make_checkpoint(path, streams=2)


def _deepseek_v4_compressed(path):
    """The whole V4 schedule: sliding, CSA (indexer) and HCA layers."""
    from tests.test_deepseek_v4 import make_reference as deepseek_v4, save_checkpoint

    save_checkpoint(deepseek_v4(seed=1), path)


def _gguf(path):
    """SmolLM2's format: a llama.cpp GGUF file (mixed quantization types, permuted q/k rows)."""
    from tests.test_gguf_load import DIMS, THETA, write_llama_gguf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**DIMS, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": THETA})
    write_llama_gguf(path / "tiny.gguf", transformers.LlamaForCausalLM(cfg).eval())


# family -> fixture builder (the families' own); each writes one tiny checkpoint into a directory
BUILDERS = {"llama": _llama, "deepseek_v3": _deepseek_v3, "qwen3_next": _qwen3_next, "glm5": _glm5,
            "deepseek_v32": _deepseek_v32, "deepseek_v4": _deepseek_v4,
            "deepseek_v4_compressed": _deepseek_v4_compressed,
            **({"gguf": _gguf} if importlib.util.find_spec("gguf") else {})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """One tiny checkpoint per family, written by the families' own fixture builders."""
    out = {}
    for name, build in BUILDERS.items():
        path = tmp_path_factory.mktemp(name)
        build(path)
        out[name] = path / "tiny.gguf" if name == "gguf" else path
    return out


@pytest.fixture
def ckpt(checkpoints):
    return checkpoints["llama"]


def _same_architecture(a, b) -> None:
    for field in ("dim", "vocab_size", "tie_embeddings", "max_position", "norm", "rope", "ropes", "residual",
                  "mixers", "ffns", "layers", "mtp", "mtp_layers"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.checkpoint.rules == b.checkpoint.rules


@pytest.mark.parametrize("family", list(BUILDERS))
def test_import_round_trip(family, checkpoints, tmp_path, monkeypatch, capsys):
    """`zoo import DIR name=X` then `zoo build conf=X weights=DIR`: the spec from_pretrained
    builds, and the same logits (prefill and decode steps, bit for bit)."""
    path = checkpoints[family]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    code, out = run(capsys, "import", str(path), f"name={family}_imported")
    assert code == 0 and (tmp_path / "confs" / f"{family}_imported.yaml").exists()
    built = zoo.build(f"{family}_imported", weights=str(path), compile=False, max_seq=24)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=24)
    _same_architecture(built.spec, direct.spec)
    ids = torch.randint(0, built.spec.vocab_size, (1, 13), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    for tok in (5, 7, 11):
        torch.testing.assert_close(built.decode(torch.tensor([tok])), direct.decode(torch.tensor([tok])),
                                   rtol=0, atol=0)


def test_imported_conf_composes_with_groups(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert run(capsys, "import", str(checkpoints["llama"]), "name=tiny_imported")[0] == 0
    code, out = run(capsys, "diff", "tiny_imported", "tiny_imported residual=mhc", "output=json")
    assert code == 0 and any(c["key"] == "residual.kind" for c in json.loads(out)["changed"])


@pytest.mark.parametrize("family, conf, differ", [
    ("deepseek_v3", "deepseek_v3_tiny", {"max_position": (256, 512)}),
    ("qwen3_next", "qwen3_next_tiny", {"mixers.linear.chunk_size": (64, 16)}),
])
def test_diff_checkpoint_vs_conf(family, conf, differ, checkpoints, capsys):
    """A checkpoint directory against the tiny twin it was made from: only the real differences."""
    code, out = run(capsys, "diff", str(checkpoints[family]), conf, "output=json")
    assert code == 0
    d = json.loads(out)
    assert _changed(d) == differ and d["layout"]["same"]
    assert all(f["a"] == f["b"] for f in d["figures"] if f["figure"] != "params_mtp")


@pytest.mark.parametrize("family", list(BUILDERS))
def test_check_every_family(family, checkpoints, capsys):
    code, out = run(capsys, "check", f"weights={checkpoints[family]}")
    assert code == 0 and "OK: every tensor accounted for" in out and "headers only" in out


def _truncate(path) -> None:
    """Cut every safetensors file of `path` down to its header."""
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        f.write_bytes(raw[: 8 + int.from_bytes(raw[:8], "little")])


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A DeepSeek-V3 FP8 Hub checkpoint (test_fp8's builders: e4m3 blocks on partial dims, bf16
    and f32 tensors, 2 shards)."""
    from tests.deepseek_v3_fixtures import hub_tensors, randomize
    from tests.test_fp8 import DIMS, hub_config, to_hub_fp8, write_sharded

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**DIMS)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize(model)
    hub = to_hub_fp8(hub_tensors(model.state_dict()))
    first = {k: v for k, v in hub.items() if k.startswith(("model.embed", "model.layers.0."))}
    path = tmp_path_factory.mktemp("fp8")
    write_sharded(path, {"model-00001-of-00002.safetensors": first,
                         "model-00002-of-00002.safetensors": {k: v for k, v in hub.items() if k not in first}},
                  hub_config(config))
    return path, hub


def test_check_fp8(fp8_checkpoint, tmp_path, capsys):
    path, hub = fp8_checkpoint
    code, out = run(capsys, "check", f"weights={path}")
    assert code == 0 and "OK: every tensor accounted for" in out
    stored = sum(t.numel() * t.element_size() for t in hub.values())
    assert f"{len(hub)} stored tensors: {len(hub)} mapped" in out
    assert f"the load will read {human_bytes(stored)}" in out  # FP8 codes + scales, as stored
    # headers only: with every data section gone, names, shapes and dtypes still all check out
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    _truncate(cut)
    code, out = run(capsys, "check", f"weights={cut}")
    assert code == 1
    assert f"{len(hub)} mapped" in out and "unexpected" not in out and "missing" not in out
    assert out.count("data section has 0 bytes") == 2


def test_check_ok_and_reads_no_tensor_data(ckpt, tmp_path, capsys):
    code, out = run(capsys, "check", f"weights={ckpt}")
    assert code == 0 and "OK" in out
    # cut the data section away: a header-only check still verifies every name/shape/dtype
    bad = tmp_path / "cut"
    shutil.copytree(ckpt, bad)
    _truncate(bad)
    code, out = run(capsys, "check", f"weights={bad}")
    assert code == 1
    assert "mapped to" in out and "unexpected" not in out and "missing" not in out
    assert "data section has 0 bytes" in out


def test_check_lists_offenders(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors.pop("model.norm.weight")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    code, out = run(capsys, "check", f"weights={bad}")
    assert code == 1
    assert "unexpected  model.layers.0.extra.weight" in out
    assert "missing  parameter norm.weight" in out
    assert "mismatched" in out and "does not fit parameter layers.1.ffn.w13.weight" in out


def test_check_fp8_missing_scale(fp8_checkpoint, tmp_path, capsys):
    """A weight whose block scale is gone is named (it cannot be dequantized)."""
    from safetensors.torch import load_file, save_file

    path, _ = fp8_checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    shard = bad / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out = run(capsys, "check", f"weights={bad}")
    assert code == 1 and "q_a_proj" in out and "OK" not in out
