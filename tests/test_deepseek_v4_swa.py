"""DeepSeek-V4 sliding-window layers: mHC streams, shared-KV sliding-window attention with sinks,
hash + learned sqrtsoftplus MoE with the swiglu clamp, loaded from the real Hub key layout.

Parity is against transformers' DeepseekV4ForCausalLM on tiny random checkpoints (CPU, float32),
for the prefill and every greedy decode step, with prompts longer than the window. transformers'
own save of V4 writes other key names than the Hub (`model.` prefix, attn.norm), so the fixtures
write the Hub layout themselves (`hub_tensors`), plus an MTP layer (mtp.0.*) as real checkpoints
have one.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import zoo
from zoo.compiler.analysis import analyze
from zoo.compiler.config import load_config
from zoo.compiler.errors import ConfigError
from zoo.compiler.model import build_model, count_parameters
from zoo.compiler.mixers.sink_attention import softmax_with_sink
from tests.helpers import check_decode_equals_prefill, check_parity

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

VOCAB, WINDOW, HEAD_DIM = 256, 8, 32
MAX_SEQ = 32  # > window: the ring wraps
# the presets with their sliding-window layers only (the compressed kinds: tests/test_deepseek_v4.py)
SWA_TINY = "layout=[{repeat: 2, mixer: swa, ffn: moe_hash}, {mixer: swa, ffn: moe}]"
SWA_FLASH = "layout=[{repeat: 3, mixer: swa, ffn: moe_hash}, {mixer: swa, ffn: moe}]"


def tiny_config(streams: int, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=HEAD_DIM,
                q_lora_rank=48, partial_rotary_factor=0.25, sliding_window=WINDOW, o_groups=2, o_lora_rank=16,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=streams,
                layer_types=["sliding_attention"] * 4, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
                # small enough that about a quarter of the gate pre-activations are clamped
                swiglu_limit=0.5, routed_scaling_factor=1.5, max_position_embeddings=256,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(kw)
    return transformers.DeepseekV4Config(**base)


def randomize(ref) -> None:
    """Every weight away from its init (zero sinks, unit norms and scales, zero biases would hide
    a misplaced tensor); the hash table: distinct random experts per token."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith((".base", "hc_base")):
                p.normal_(0, 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
            elif name.endswith("tid2eid"):
                E = ref.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E)[: b.shape[1]] for _ in range(b.shape[0])]))


# transformers module names -> the Hub's (the inverse of transformers' deepseek_v4 conversion mapping)
_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "norm.weight": "norm.weight",
        "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_BLOCK = [("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
          ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."),
          ("self_attn.kv_norm.", "attn.kv_norm."), ("self_attn.o_a_proj.", "attn.wo_a."),
          ("self_attn.o_b_proj.", "attn.wo_b."), ("self_attn.sinks", "attn.attn_sink"),
          ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
          ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"),
          ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.", "ffn.gate."),
          ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
          ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
          ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2.")]


def hub_tensors(ref) -> dict[str, torch.Tensor]:
    """A transformers V4 model's tensors under the Hub's names (no `model.` prefix, attn.kv_norm,
    one tensor per expert w1/w3/w2, tid2eid int32)."""
    out = {}
    for name, t in ref.state_dict().items():
        name = name.removeprefix("model.")
        if name in _TOP:
            out[_TOP[name]] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            block = name.removesuffix("mlp.experts.gate_up_proj")
            for e, w in enumerate(t):
                out[f"{block}ffn.experts.{e}.w1.weight"], out[f"{block}ffn.experts.{e}.w3.weight"] = w.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            block = name.removesuffix("mlp.experts.down_proj")
            for e, w in enumerate(t):
                out[f"{block}ffn.experts.{e}.w2.weight"] = w
        else:
            old, new = next((a, b) for a, b in _BLOCK if a in name)
            out[name.replace(old, new)] = t.to(torch.int32) if name.endswith("tid2eid") else t
    return {k: v.contiguous() for k, v in out.items()}


def mtp_tensors(D: int, streams: int) -> dict[str, torch.Tensor]:
    """A few tensors of the MTP layer real V4 checkpoints carry (transformers drops them)."""
    return {"mtp.0.e_proj.weight": torch.randn(D, D), "mtp.0.h_proj.weight": torch.randn(D, D),
            "mtp.0.enorm.weight": torch.ones(D), "mtp.0.hnorm.weight": torch.ones(D),
            "mtp.0.norm.weight": torch.ones(D), "mtp.0.attn.wq_a.weight": torch.randn(48, D),
            "mtp.0.ffn.gate.weight": torch.randn(8, D),
            "mtp.0.hc_attn_fn": torch.randn((2 + streams) * streams, streams * D),
            "mtp.0.hc_head_fn": torch.randn(streams, streams * D)}


def hub_style_config(path) -> None:
    """Rewrite config.json with the Hub's legacy schedule keys: compress_ratios (one entry per
    layer plus one for the MTP layer) and num_hash_layers, no layer_types / mlp_layer_types."""
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"):
        cfg.pop(key)
    cfg.update(compress_ratios=[0] * (cfg["num_hidden_layers"] + 1), num_hash_layers=2)
    (path / "config.json").write_text(json.dumps(cfg))


def make_checkpoint(path, streams: int, hub_config: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    ref = transformers.DeepseekV4ForCausalLM(tiny_config(streams)).eval()
    randomize(ref)
    ref.config.save_pretrained(path)
    if hub_config:
        hub_style_config(path)
    tensors = {**hub_tensors(ref), **mtp_tensors(ref.config.hidden_size, streams)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return ref


# streams -> batch, config.json style
VARIANTS = {2: (2, False), 3: (1, True), 4: (2, False)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for n, (batch, hub_config) in VARIANTS.items():
        path = tmp_path_factory.mktemp(f"v4_{n}")
        out[n] = (make_checkpoint(path, n, hub_config, seed=n), path, batch)
    return out


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("streams", list(VARIANTS))
def test_parity_eager(references, streams):
    """Prompt of 13 > window 8 tokens, then 8 decode steps: the ring wraps twice."""
    ref, path, batch = references[streams]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=batch, max_seq=MAX_SEQ)
    assert m.spec.residual.streams == streams
    check_parity(ref, m, torch.randint(0, VOCAB, (batch, 13)), steps=8)


# compiled: the family harness's deepseek_v4 sample (tests/test_family_parity.py) has these sliding-window
# layers with 4 streams and both routings beside the compressed kinds (one compile of them: CI time)


def test_decode_equals_prefill(references):
    _, path, _ = references[2]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=MAX_SEQ)
    check_decode_equals_prefill(m, torch.randint(0, VOCAB, (2, 30)), prompt_len=3)


# ----------------------------------------------------------------------------- import and load


@pytest.mark.parametrize("streams", [3, 4])  # Hub-style and transformers-style config.json
def test_imported_config(references, streams):
    _, path, _ = references[streams]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    assert m.spec.layout_runs() == [("swa+moe_hash", 2), ("swa+moe", 2)]
    swa, hashed, learned = m.spec.mixers["swa"], m.spec.ffns["moe_hash"], m.spec.ffns["moe"]
    assert (swa.kind, swa.head_dim, swa.rot_dim, swa.window, swa.o_groups, swa.o_lora_rank) == \
        ("swa_mqa", HEAD_DIM, 8, WINDOW, 2, 16)
    assert (hashed.routing, hashed.score_correction_bias, learned.routing, learned.score_correction_bias) == \
        ("hash", False, "learned", True)
    for moe in (hashed, learned):
        assert (moe.scoring, moe.swiglu_limit, moe.routed_scaling_factor, moe.shared_ffn_dim) == \
            ("sqrtsoftplus", 0.5, 1.5, 32)
    assert (m.spec.rope.kind, m.spec.rope.theta, m.spec.residual.kind) == ("default", 10000.0, "mhc")
    # the tiny twin is the same architecture (the fixtures clamp harder than V4's limit of 10)
    twin = load_config("deepseek_v4_flash_tiny", [f"residual.streams={streams}", "ffns.moe.swiglu_limit=0.5", SWA_TINY])
    assert [(x.mixer, x.ffn) for x in twin.layers] == [(x.mixer, x.ffn) for x in m.spec.layers]
    assert twin.residual == m.spec.residual
    assert count_parameters(build_model(twin, mtp=False)) == m.info.params


def test_mtp_tensors_skipped_and_reported(references, capsys):
    _, path, _ = references[3]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    ignored = dict(m.info.load.ignored)
    assert set(ignored) == set(mtp_tensors(64, 3))
    assert set(ignored.values()) == {"multi-token-prediction layer, not loaded (checkpoint.mtp=false)"}
    from zoo.report import build_rows

    rows = [value for key, value in build_rows(m) if key.strip() == "skipped"]
    assert "mtp.0.hc_head_fn: multi-token-prediction layer, not loaded (checkpoint.mtp=false)" in rows


def test_import_round_trip_and_check(references, tmp_path, monkeypatch, capsys):
    """`zoo import` writes a conf that builds the same model; `zoo check` accounts for every tensor."""
    from zoo.cli import main

    _, path, _ = references[3]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), "name=v4_imported"]) == 0
    built = zoo.build("v4_imported", weights=str(path), compile=False, max_seq=16)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=16)
    ids = torch.randint(0, VOCAB, (1, 11))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    capsys.readouterr()
    assert main(["check", f"weights={path}"]) == 0
    out = capsys.readouterr().out
    assert "9 ignored by rule" in out and "OK: every tensor accounted for" in out


@pytest.mark.parametrize("schedule", [
    {"layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"]},
    {"compress_ratios": [0, 0, 4, 128, 4]},
])
def test_compressed_schedules_import(references, schedule):
    """Both schedule spellings give the compressed kinds (built and tested in test_deepseek_v4.py)."""
    from zoo.compiler.hf_import import import_config

    _, path, _ = references[3]
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("compress_ratios")
    cfg.update(schedule)
    layout = import_config(cfg, "config.json").layout
    kinds = [(run["mixer"], run.get("repeat", 1)) for run in layout]
    assert kinds == [("swa", 2), ("csa", 1), ("hca", 1)]


def test_bad_hash_config():
    with pytest.raises(ConfigError, match="routing=hash.*score_correction_bias"):
        load_config("deepseek_v4_flash_tiny", ["ffns.moe_hash.score_correction_bias=true"])
    with pytest.raises(ConfigError, match="routing='learnt'.*expected one of"):
        load_config("deepseek_v4_flash_tiny", ["ffns.moe.routing=learnt"])


# ----------------------------------------------------------------------------- attention


def test_ring_cache():
    """The cache is a constant per-sequence ring of min(window, max_seq) slots, not per token."""
    m = zoo.build("deepseek_v4_flash_tiny", [SWA_TINY], compile=False, max_batch=2, max_seq=MAX_SEQ)
    for layer in m.engine.plan.layers:
        assert {k: (f.shape, f.grows) for k, f in layer.items()} == {"kv": ((2, 1, WINDOW, HEAD_DIM), False)}
    assert m.info.cache_bytes_per_token == 0
    assert m.info.state_bytes_per_sequence == 4 * WINDOW * HEAD_DIM * 4  # 4 layers, float32
    short = zoo.build("deepseek_v4_flash_tiny", [SWA_TINY], compile=False, max_seq=5)
    assert short.engine.plan.layers[0]["kv"].shape == (1, 1, 5, HEAD_DIM)
    check_decode_equals_prefill(short, torch.randint(0, VOCAB, (1, 5)), prompt_len=2)


def test_report_window_capped():
    """zoo report: attention FLOPs stop growing at the window; the cache is per-sequence state."""
    spec = load_config("deepseek_v4_flash", [SWA_FLASH])
    at = {t: analyze(spec, context=t) for t in (64, 128, 4096)}
    per_key = 43 * 4 * 64 * 512  # layers x (qk + av) x heads x head_dim
    assert at[128]["decode_flops_per_token"] - at[64]["decode_flops_per_token"] == per_key * 64
    assert at[4096]["decode_flops_per_token"] == at[128]["decode_flops_per_token"]
    assert at[4096]["cache_bytes_per_token"] == 0
    assert at[4096]["state_bytes_per_sequence"] == 43 * 128 * 512 * 2  # bf16 ring per layer
    assert at[4096]["residual_streams"] == 4


def naive_attention(mixer, q, kv):
    """Full [L, L] scores with the band mask: the obviously-correct form of attend_window."""
    L = q.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    visible = (j <= i) & (j > i - mixer.window)
    scores = (q @ kv.transpose(-1, -2) * mixer.scale).masked_fill(~visible, float("-inf"))
    return softmax_with_sink(scores, mixer.sink.weight.view(1, -1, 1, 1)) @ kv


@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 17, 30])
def test_window_prefill_equals_naive(length):
    m = zoo.build("deepseek_v4_flash_tiny", compile=False, max_seq=MAX_SEQ, seed=3)
    mixer = m.module.layers[0].mixer
    with torch.no_grad():
        mixer.sink.weight.normal_()
        q, kv = torch.randn(2, 4, length, HEAD_DIM), torch.randn(2, 1, length, HEAD_DIM)
        torch.testing.assert_close(mixer.attend_window(q, kv, WINDOW), naive_attention(mixer, q, kv))


def test_sink_takes_probability_mass():
    scores = torch.zeros(1, 2, 1, 3)
    probs = softmax_with_sink(scores, torch.tensor([0.0, np.log(3.0)]).view(1, 2, 1, 1))
    torch.testing.assert_close(probs.sum(-1), torch.tensor([[[0.75], [0.5]]]))


def test_rope_slots():
    """A mixer reads the rope schedule its `rope_slot` names; the engine keys tables by slot."""
    ids = torch.randint(0, VOCAB, (1, 12))
    main = zoo.build("deepseek_v4_flash_tiny", [SWA_TINY], compile=False, max_seq=16, seed=5)
    same = zoo.build("deepseek_v4_flash_tiny", [SWA_TINY, "+ropes.alt.kind=default", "+ropes.alt.theta=10000.0",
                                                "mixers.swa.rope_slot=alt"], compile=False, max_seq=16, seed=5)
    other = zoo.build("deepseek_v4_flash_tiny", [SWA_TINY, "+ropes.alt.kind=default", "+ropes.alt.theta=50.0",
                                                 "mixers.swa.rope_slot=alt"], compile=False, max_seq=16, seed=5)
    assert set(main.engine.rope) == {"rope:8"} and set(same.engine.rope) == {"alt:8"}
    for m in (same, other):  # the same weights (mhc's random init does not follow `seed`)
        m.module.load_state_dict(main.module.state_dict())
    torch.testing.assert_close(same.prefill(ids), main.prefill(ids))
    assert not torch.allclose(other.prefill(ids), main.prefill(ids), atol=1e-3)
    with pytest.raises(ConfigError, match="rope_slot='nowhere' is not one of the model's rope slots"):
        load_config("deepseek_v4_flash_tiny", ["mixers.swa.rope_slot=nowhere"])
