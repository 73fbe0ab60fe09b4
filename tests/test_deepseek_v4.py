"""DeepSeek-V4 compressed layers: compressed-sparse attention (CSA: overlapping blocks of 4, a
lightning indexer over the compressed entries, top-k) and heavily-compressed attention (HCA), next
to the sliding-window layers; FP8 (E8M0 block scales) and MXFP4 weights; the real schedule.

Parity with transformers' DeepseekV4ForCausalLM on tiny random checkpoints in the Hub layout
(written by the fixtures: tests/test_deepseek_v4_swa.py's `hub_tensors` plus the compressor and
indexer keys), CPU float32, prefill and every greedy decode step, eager and compiled, runs in
tests/test_family_parity.py (the deepseek_v4 entry). The HCA ratio is 8 in the
fixtures (128 in V4-Flash) so that short prompts complete blocks; prompts of 20 tokens + 12 decode
steps complete CSA blocks at positions 23, 27, 31 and HCA ones at 23, 31 during decode, with top-2
of up to 8 CSA entries.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import zoo
from zoo.compiler.analysis import analyze
from zoo.compiler.checkpoint.ops import get_op
from zoo.compiler.config import load_config
from zoo.compiler.model import build_model, count_parameters
from tests.helpers import check_parity
from tests.test_deepseek_v4_swa import hub_tensors, mtp_tensors, randomize, tiny_config

transformers = pytest.importorskip("transformers")

# 32 like tests/test_deepseek_v4_swa.py: the sliding blocks' compiled graphs are the same, and a
# persisted inductor graph carries the L <= max_seq guard of the run that compiled it
VOCAB, MAX_SEQ = 256, 32
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def v4_config(**kw):
    base = dict(layer_types=KINDS, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                index_n_heads=8, index_head_dim=16, index_topk=2, rope_parameters=dict(YARN))
    base.update(kw)
    return tiny_config(4, **base)


# transformers' compressor / indexer names -> the Hub's
_COMP = [("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
         ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
         ("self_attn.compressor.indexer.", "attn.indexer.compressor."),
         ("self_attn.compressor.", "attn.compressor.")]
_LEAF = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "position_bias": "ape",
         "kv_norm.weight": "norm.weight", "weights_proj.weight": "weights_proj.weight", "q_b_proj.weight": "wq_b.weight"}


class _Rest:
    """A model's state without the compressor keys, for the sliding-layer helper hub_tensors."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def v4_hub_tensors(ref) -> dict[str, torch.Tensor]:
    state, comp = {}, {}
    for name, t in ref.state_dict().items():
        hit = next(((a, b) for a, b in _COMP if a in name), None)
        if hit is None:
            state[name] = t
            continue
        head, leaf = name.removeprefix("model.").split(hit[0])
        leaf = _LEAF.get(leaf, leaf)
        comp[f"{head}{hit[1]}{leaf}".replace("indexer.wq_b.wq_b", "indexer.wq_b")] = t.contiguous()
    rest = _Rest(state)
    rest.config = ref.config
    return {**hub_tensors(rest), **comp}


def make_reference(seed: int, **kw):
    torch.manual_seed(seed)
    ref = transformers.DeepseekV4ForCausalLM(v4_config(**kw)).eval()
    randomize(ref)
    with torch.no_grad():  # gate biases large enough that pooling is far from uniform
        for name, p in ref.named_parameters():
            if name.endswith("position_bias"):
                p.normal_(0, 1.0)
    return ref


def save_checkpoint(ref, path, tensors=None, config_edit=None):
    ref.config.save_pretrained(path)
    if config_edit:
        cfg = json.loads((path / "config.json").read_text())
        config_edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    tensors = tensors if tensors is not None else v4_hub_tensors(ref)
    tensors = {**tensors, **mtp_tensors(ref.config.hidden_size, 4)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reference(families):
    """(reference, checkpoint dir): tests/test_family_parity.py's deepseek_v4 entry (its prefill /
    decode parity, eager and compiled, runs there), shared for the session."""
    return families.reference("deepseek_v4")


@pytest.fixture(scope="module")
def eager(families):
    return families.eager("deepseek_v4")


# ----------------------------------------------------------------------------- parity


def test_layout_and_kinds(eager):
    spec = eager.spec
    assert [(x.mixer.kind, x.mixer_name) for x in spec.layers] == \
        [("swa_mqa", "swa"), ("csa_mqa", "csa"), ("hca_mqa", "hca"), ("csa_mqa", "csa")]
    csa, hca = spec.mixers["csa"], spec.mixers["hca"]
    assert (csa.compress_ratio, csa.compress_overlap, csa.index_n_heads, csa.index_head_dim, csa.index_topk,
            csa.rope_slot) == (4, True, 8, 16, 2, "compress")
    assert (hca.compress_ratio, hca.compress_overlap, hca.rope_slot) == (8, False, "compress")
    comp = spec.ropes["compress"]
    assert (comp.kind, comp.theta, comp.factor, comp.original_max_position, comp.attention_factor) == \
        ("yarn", 160000.0, 4.0, 32, 1.0)


def test_indexer_selects(reference, eager):
    """The fixture is meaningful: with 21 tokens some queries see more CSA entries than top-k, and
    the chosen top-k scores are strictly above the next one (no tie the references may break
    differently)."""
    m = eager.engine.model.layers[1].mixer
    x = torch.randn(1, 21, 64)
    cache = {k: torch.zeros(f.shape, dtype=f.dtype) for k, f in m.cache_fields(1, MAX_SEQ, torch.float32).items()}
    cos, sin = eager.engine.rope[m.rope]
    keys = m.indexer.compressor.prefill(x, cache["index_block"], cos[:21], sin[:21], m.write_ring, MAX_SEQ // 4)
    scores = m.index_scores(x, m.query_residual(x), keys, cos[:21, None], sin[:21, None])[0]
    n_visible = (torch.arange(21) + 1) // 4
    assert (n_visible > 2).any()
    for t in range(21):
        s = scores[t, :n_visible[t]].sort(descending=True).values
        if len(s) > 2:
            assert s[1] > s[2]


# ----------------------------------------------------------------------------- caches and report


def test_cache_plan():
    """Per layer kind: the window ring and the block rings are per-sequence state; the compressed
    entries (and the CSA indexer keys) grow at 1/ratio per token."""
    m = zoo.build("deepseek_v4_flash_tiny", compile=False, max_batch=2, max_seq=MAX_SEQ)
    plan = m.engine.plan.layers
    assert {k: (f.shape, f.grows) for k, f in plan[2].items()} == {
        "kv": ((2, 1, 8, 32), False), "block": ((2, 1, 8, 64), False), "start": ((2, 8), False),
        "entries": ((2, 1, MAX_SEQ // 8, 32), True)}
    assert {k: (f.shape, f.grows) for k, f in plan[1].items()} == {
        "kv": ((2, 1, 8, 32), False), "block": ((2, 1, 8, 128), False), "start": ((2, 8), False),
        "entries": ((2, 1, MAX_SEQ // 4, 32), True), "index_block": ((2, 1, 8, 64), False),
        "index_keys": ((2, 1, MAX_SEQ // 4, 16), True)}
    spec = load_config("deepseek_v4_flash")
    a = analyze(spec, context=1 << 16)
    fields = {f["field"]: f for f in a["cache_fields"]}
    # bf16: CSA 512/4 + 128/4 values per token, HCA 512/128, sliding 0
    assert fields["csa.entries"]["bytes_per_token"] == 21 * 512 * 2 // 4
    assert fields["csa.index_keys"]["bytes_per_token"] == 21 * 128 * 2 // 4
    assert fields["hca.entries"]["bytes_per_token"] == 20 * 512 * 2 // 128
    assert fields["swa.kv"]["bytes_per_token"] == 0
    assert a["cache_bytes_per_token"] == 21 * (512 + 128) * 2 // 4 + 20 * 512 * 2 // 128


def test_real_schedule_dry_build():
    spec = load_config("deepseek_v4_flash")
    kinds = [x.mixer_name for x in spec.layers]
    assert kinds == ["swa", "swa"] + ["csa", "hca"] * 20 + ["csa"]
    assert [x.ffn_name for x in spec.layers[:4]] == ["moe_hash"] * 3 + ["moe"]
    assert round(count_parameters(build_model(spec, mtp=False)) / 1e9, 1) == 284.3
    # attention FLOPs per decoded token grow with the compressed entries, CSA capped at top-k
    near, far = (analyze(spec, context=t)["decode_flops_per_token"] for t in (1 << 12, 1 << 16))
    per_entry_hca = 20 * 4 * 64 * 512
    per_entry_indexer = 21 * 2 * 64 * 129
    extra = per_entry_hca * ((1 << 16) - (1 << 12)) // 128 + per_entry_indexer * ((1 << 16) - (1 << 12)) // 4
    assert far - near == extra  # CSA attention: 512 of 1024 entries at 4k, still 512 at 64k


# ----------------------------------------------------------------------------- weights


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def test_mxfp4_op_by_hand():
    """Bytes written by hand: low nibble first, sign bit 3, E8M0 scale 2^(byte - 127) per 32."""
    packed = torch.tensor([[0x21, 0xF9] + [0x00] * 14 + [0x77] * 16], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[127, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = get_op("mxfp4_dequant", "test").apply([scale, packed], block=32)
    assert out.shape == (1, 64)
    assert out[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]  # 0x21: 1 then 2; 0xF9: 9 then 15
    assert out[0, 4:32].abs().sum() == 0
    assert out[0, 32:].tolist() == [6.0 * 4] * 32  # code 7 (6.0) times 2^(129 - 127)
    with pytest.raises(ValueError, match="needs a scale of shape"):
        get_op("mxfp4_dequant", "test").shape([(1, 3), (1, 32)], block=32)


def test_fp8_e8m0_op_by_hand():
    torch.manual_seed(0)
    w = (torch.randn(200, 300) * 4).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 134, (2, 3), dtype=torch.uint8)
    out = get_op("fp8_e8m0_block_dequant", "test").apply([exps.view(torch.float8_e8m0fnu), w], block=(128, 128))
    for i in range(200):
        for j in (0, 127, 128, 299):
            assert out[i, j].item() == w[i, j].float().item() * 2.0 ** (int(exps[i // 128, j // 128]) - 127)


def quantize_fp8(w):
    """w [out, in] -> (e4m3 codes, E8M0 scale bytes [ceil(out/128), ceil(in/128)])."""
    rows, cols = math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)
    codes, exps = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(rows, cols, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            e = math.ceil(math.log2(blk.abs().max().item() / 448.0))
            exps[i, j] = e + 127
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / 2.0 ** e).to(torch.float8_e4m3fn)
    return codes, exps.view(torch.float8_e8m0fnu)


def dequant_fp8(codes, exps):
    out = codes.float().clone()
    e = exps.view(torch.uint8)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] *= 2.0 ** (int(e[i // 128, j // 128]) - 127)
    return out


def quantize_fp4(w):
    """w [out, in] -> (int8 [out, in/2] two e2m1 codes per byte, low first; E8M0 [out, in/32])."""
    out, inp = w.shape
    table = torch.tensor([e2m1_value(c) for c in range(16)])
    exps = torch.empty(out, inp // 32, dtype=torch.uint8)
    codes = torch.empty(out, inp, dtype=torch.int64)
    for g in range(inp // 32):
        blk = w[:, g * 32:(g + 1) * 32]
        e = torch.ceil(torch.log2(blk.abs().amax(-1) / 6.0))
        exps[:, g] = (e + 127).to(torch.uint8)
        codes[:, g * 32:(g + 1) * 32] = ((blk / 2.0 ** e[:, None])[..., None] - table).abs().argmin(-1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, exps.view(torch.float8_e8m0fnu)


def dequant_fp4(packed, exps):
    b, e = packed.view(torch.uint8), exps.view(torch.uint8)
    out = torch.empty(b.shape[0], 2 * b.shape[1])
    for i in range(b.shape[0]):
        for j in range(b.shape[1]):
            byte = int(b[i, j])
            for k, code in enumerate((byte & 15, byte >> 4)):
                col = 2 * j + k
                out[i, col] = e2m1_value(code) * 2.0 ** (int(e[i, col // 32]) - 127)
    return out


FP8_KEYS = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight", ".attn.wo_b.weight",
            ".shared_experts.w1.weight", ".shared_experts.w2.weight", ".shared_experts.w3.weight")


def test_fp8_fp4_checkpoint(tmp_path):
    """FP8 attention / shared-expert weights with E8M0 block scales, MXFP4 routed experts, selected
    by quantization_config (quant_method fp8) + expert_dtype fp4 at config.json's top level, as on
    the Hub. The reference gets the hand-dequantized values."""
    ref = make_reference(seed=5)
    tensors, exact = {}, {}
    for name, t in v4_hub_tensors(ref).items():
        stem = name.removesuffix(".weight")
        if ".ffn.experts." in name:
            tensors[name], tensors[f"{stem}.scale"] = quantize_fp4(t.float())
            exact[name] = dequant_fp4(tensors[name], tensors[f"{stem}.scale"])
        elif name.endswith(FP8_KEYS):
            tensors[name], tensors[f"{stem}.scale"] = quantize_fp8(t.float())
            exact[name] = dequant_fp8(tensors[name], tensors[f"{stem}.scale"])
        else:
            tensors[name] = t
    assert sum(".scale" in k for k in tensors) > 40

    def quant(cfg):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        cfg["expert_dtype"] = "fp4"

    path = save_checkpoint(ref, tmp_path, tensors, quant)
    m = zoo.from_pretrained(str(path), compile=False, max_batch=1, max_seq=MAX_SEQ)
    # the reference with the dequantized values (Hub names back to transformers' through the map)
    hub_of = {hub: name for name, hub in _hub_names(ref).items()}
    with torch.no_grad():
        experts = {}
        for hub, value in exact.items():
            if ".ffn.experts." in hub:
                experts[hub] = value
            else:
                ref.get_parameter(hub_of[hub]).copy_(value)
        for i in range(ref.config.num_hidden_layers):
            mlp = ref.model.layers[i].mlp.experts
            for e in range(ref.config.n_routed_experts):
                pre = f"layers.{i}.ffn.experts.{e}."
                mlp.gate_up_proj[e].copy_(torch.cat((experts[pre + "w1.weight"], experts[pre + "w3.weight"])))
                mlp.down_proj[e].copy_(experts[pre + "w2.weight"])
    check_parity(ref, m, torch.randint(0, VOCAB, (1, 20)), steps=4)


def _hub_names(ref) -> dict[str, str]:
    """transformers parameter name -> Hub name (for non-expert tensors)."""
    out = {}
    for name in ref.state_dict():
        if "mlp.experts." in name:
            continue
        single = _Rest({name: torch.zeros(1)})
        single.config = ref.config
        hit = next(((a, b) for a, b in _COMP if a in name), None)
        if hit is None:
            out[name] = next(iter(hub_tensors(single)))
    return out


def test_unknown_quant_variant_fails_clearly(reference, tmp_path):
    ref, _ = reference

    def quant(cfg):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}

    path = save_checkpoint(ref, tmp_path, config_edit=quant)
    from zoo.compiler.errors import ConfigError
    with pytest.raises(ConfigError, match="quantization_config.fmt='e5m2' is not supported"):
        zoo.from_pretrained(str(path), compile=False)


# ----------------------------------------------------------------------------- import, MTP, CLI


def hub_style(cfg):
    """The Hub's legacy config keys: compress_ratios (+ MTP entry), compress_rope_theta, rope_scaling."""
    n = cfg["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor", "compress_rates"):
        cfg.pop(key, None)
    cfg.update(compress_ratios=[0, 4, 128, 4][:n] + [0], num_hash_layers=2, compress_rope_theta=160000.0,
               rope_theta=10000.0, qk_rope_head_dim=8,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1})


def test_hub_style_config(tmp_path):
    ref = make_reference(seed=7, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                         rope_parameters={**YARN, "factor": 16.0, "original_max_position_embeddings": 65536})
    hub = save_checkpoint(ref, tmp_path, config_edit=hub_style)
    m = zoo.from_pretrained(str(hub), compile=False, max_seq=16)
    assert [x.mixer_name for x in m.spec.layers] == ["swa", "csa", "hca", "csa"]
    assert (m.spec.mixers["csa"].compress_ratio, m.spec.mixers["hca"].compress_ratio) == (4, 128)
    comp = m.spec.ropes["compress"]
    assert (comp.theta, comp.factor, comp.original_max_position) == (160000.0, 16.0, 65536)
    # transformers reads the same config: the same rope tables
    tcfg = transformers.DeepseekV4Config.from_pretrained(hub)
    emb = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(tcfg)
    rope = m.engine.model.rope_impls["compress"]
    torch.testing.assert_close(rope.inv_freq(8), emb.compress_inv_freq, rtol=1e-6, atol=0)
    assert rope.cos_sin_scale() == emb.compress_attention_scaling == 1.0
    check_parity(ref, m, torch.randint(0, VOCAB, (1, 9)), steps=2)


def test_mtp_skipped_and_reported(eager):
    ignored = dict(eager.info.load.ignored)
    assert set(ignored) == set(mtp_tensors(64, 4))
    assert set(ignored.values()) == {"multi-token-prediction layer, not loaded (checkpoint.mtp=false)"}


def test_cli_import_check_report_diff(reference, tmp_path, monkeypatch, capsys):
    from zoo.cli import main

    _, path = reference
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), "name=v4c_imported"]) == 0
    built = zoo.build("v4c_imported", weights=str(path), compile=False, max_seq=MAX_SEQ)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=MAX_SEQ)
    ids = torch.randint(0, VOCAB, (1, 21))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    capsys.readouterr()
    assert main(["check", f"weights={path}"]) == 0
    assert "OK: every tensor accounted for" in capsys.readouterr().out
    assert main(["report", "conf=deepseek_v4_flash"]) == 0
    out = capsys.readouterr().out
    assert "csa.entries" in out and "hca.entries" in out
    assert main(["diff", "deepseek_v4_flash", "deepseek_v4_flash_tiny"]) == 0
    assert "csa=csa_mqa" in capsys.readouterr().out
