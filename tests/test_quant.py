"""Weight-only quantization (runtime.quant, compiler/quant): formats, loading, the compiled graphs.

- GGUF Q4_0 / Q4_1 blocks become int4 group 32 with the same codes: the kernel's weights equal
  gguf.quants' reference dequantization (float32 compute: to float32 rounding; bfloat16 compute:
  within the rounding of the scales to bfloat16); Q8_0 is kept as int8 g32 by zoo's float32
  kernels (exactly) and converted to int8 per channel for torch's, its error measured.
  (Every other block type: tests/test_gguf_quants.py.)
- A tiny Llama GGUF whose linears are all Q4_1 loads kept (the report says so per tensor), and
  its compiled int4 graphs match transformers' float32 reading of the same file within the
  bfloat16 rounding of the activations; decode through the caches == a full prefill; one graph each.
- zoo's int4 CPU kernel is held to cpu_kernels.int4_reference, and both to a float64 product over
  the documented format written in this file (nibble layout, W = q d + m, int8 activations).
- int8 / int4 of a random build against the float model with the dequantized weights; the build
  report lists what stays float.
- Safetensors quantize as they load: peak RSS <= 1.2 x the quantized model + one shard.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.contracts import StoredBlocks  # noqa: E402
from zoo.compiler.errors import ConfigError  # noqa: E402
from zoo.compiler.quant.linear import QuantLinear  # noqa: E402
from zoo.report import build_rows  # noqa: E402
from tests.helpers import assert_logits_close, check_decode_equals_prefill, save_reference  # noqa: E402
from tests.test_gguf_load import llama_cpp_permute, random_llama, write_llama_gguf  # noqa: E402,F401 (a fixture)

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]


def blocks(w: np.ndarray, qtype) -> StoredBlocks:
    data = gguf.quants.quantize(w, qtype)
    return StoredBlocks(qtype.name, torch.from_numpy(data.copy()), tuple(w.shape))


@torch.no_grad()
def kernel_weight(q: QuantLinear) -> torch.Tensor:
    """The weight [O, I] the quantized matmul applies, read back through the kernel itself (its
    float GEMM, runtime.quant_prefill=float: 1 * w exactly; int8-rounded rows of the identity would
    scale each weight by 127 * (1 / 127))."""
    from zoo.compiler.quant import cpu_kernels

    eye = torch.eye(q.in_features, dtype=q.compute_dtype)
    held, q.float_rows = q.float_rows, cpu_kernels.FLOAT_ROWS
    try:
        return q(eye).float().t()
    finally:
        q.float_rows = held


# -- formats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_are_int4_group32_exactly(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * 0.05 + rng.standard_normal((48, 1)) * 0.02).astype(np.float32)
    b = blocks(w, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(b.data.numpy(), qtype).reshape(48, 96))
    q32 = QuantLinear(96, 48, False, "int4", 32, torch.float32)
    assert q32.load_weight(b) == f"kept {qtype.name} blocks as int4 g32"
    got = kernel_weight(q32)
    # (q - 8) * d + (m + 8 d) against d * q + m: a float32 rounding or two, nothing more
    assert (got - ref).abs().max() <= 4 * torch.finfo(torch.float32).eps * ref.abs().max()
    qbf = QuantLinear(96, 48, False, "int4", 32, torch.bfloat16)
    qbf.load_weight(b)
    # bfloat16 compute: the scale and zero rounded to bfloat16 (2^-9 relative), codes unchanged
    assert (kernel_weight(qbf) - ref).abs().max() <= 2 ** -7 * ref.abs().max()


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("mode,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", None)])
def test_cpu_kernel_computes_its_reference(mode, group):
    """zoo's compiled CPU kernel against its torch-op reference (cpu_kernels.py), for decode-sized
    and prefill-sized inputs (int8-rounded activations at every row count; above 16 rows also the
    float32 GEMM of runtime.quant_prefill=float), with row counts that split unevenly between threads."""
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    # 12, 13, 1 and 36 blocks (the AVX512 kernels take blocks in pairs, the odd one apart; one block:
    # no pair at all), an odd O (uneven thread splits)
    for O, I in ((200, 384), (200, 416), (37, 32), (37, 1152)):
        if I % (group or 32) == 0:
            check_kernel_against_reference(mode, group, O, I)


def check_kernel_against_reference(mode, group, O, I):
    from zoo.compiler.quant import cpu_kernels

    torch.manual_seed(0)
    if mode == "int4":
        q, d, m = torch.randint(0, 16, (O, I)), torch.rand(O, I // group) * 0.01, torch.randn(O, I // group) * 0.05
        qs, sm = cpu_kernels.pack_int4(q, d, m)
        assert torch.equal(cpu_kernels.int4_dequantize(qs, sm), q * sm[:, 0].float().repeat_interleave(group, 1)
                           + sm[:, 1].float().repeat_interleave(group, 1))
        kernel = lambda x, f=0: torch.ops.zoo_quant.int4_linear(x, qs, sm, group, f)
        reference = lambda x, f=0: cpu_kernels.int4_reference(x, qs, sm, group, float_rows=f)
    else:
        qw, scale = torch.randint(-127, 128, (O, I), dtype=torch.int8), torch.rand(O) * 0.01
        kernel = lambda x, f=0: torch.ops.zoo_quant.int8_linear(x, qw, scale, f)
        reference = lambda x, f=0: cpu_kernels.int8_reference(x, qw, scale, f)
    for rows in (1, 2, 3, 5, 16, 17, 40):
        x = torch.randn(rows, I)
        if I > 32:  # an all-zero block: scale 0, no division by it (beside non-zero ones: the check below)
            x[0, :32] = 0.0
        want = reference(x)
        assert_logits_close(kernel(x), want, rtol=1e-5, what=f"{mode} g{group} rows={rows}")
        exact = F.linear(x, (cpu_kernels.int4_dequantize(qs, sm) if mode == "int4" else qw.float() * scale[:, None]))
        assert (want - exact).abs().max() > 1e-4  # the rounding is real: the float product differs
        if rows > cpu_kernels.FLOAT_ROWS:  # runtime.quant_prefill=float: the float GEMM, x as it is
            want = reference(x, cpu_kernels.FLOAT_ROWS)
            assert_logits_close(kernel(x, cpu_kernels.FLOAT_ROWS), want, rtol=1e-5, what=f"{mode} float rows={rows}")
            assert_logits_close(want, exact, rtol=1e-5, what=f"{mode} float reference rows={rows}")


def documented_int4_weight(qs: torch.Tensor, sm: torch.Tensor, group: int) -> tuple[np.ndarray, ...]:
    """(q, d, m) [O, I] float64 (W = q d + m) from the stored int4 format as cpu_kernels.py's docstring states it, written
    independently of its code: byte t of each 32-input block holds input t in its low nibble and
    input t + 16 in its high one; W[o, i] = q * d + m with (d, m) = sm[o, :, i // group]."""
    codes = qs.numpy()
    O, I = codes.shape[0], 2 * codes.shape[1]
    q = np.empty((O, I), dtype=np.float64)
    for block in range(I // 32):
        for t in range(16):
            byte = codes[:, block * 16 + t].astype(np.int64)
            q[:, block * 32 + t] = byte % 16
            q[:, block * 32 + t + 16] = byte // 16
    d, m = (sm[:, k].double().numpy()[:, np.arange(I) // group] for k in (0, 1))
    return q, d, m


def documented_rounding(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, I] float64 rounded as the few-row path is documented to: per block of 32 inputs,
    codes round(x * 127 / max|x|) (halves to even), times max|x| / 127; an all-zero block stays 0.
    Also the slack [M, I]: one step (max|x| / 127) where a code lies within 1e-4 of a tie, which
    float32 arithmetic (a few ulps of 127, ~1e-5) may round either way; 0 elsewhere."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scaled = np.divide(blocks * 127.0, amax, out=np.zeros_like(blocks), where=amax > 0)
    near_tie = np.abs(scaled - np.floor(scaled) - 0.5) < 1e-4
    slack = np.where(near_tie, amax / 127.0, 0.0)
    return (np.round(scaled) * amax / 127.0).reshape(x.shape), slack.reshape(x.shape)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_reference_and_kernel_against_an_independent_float64_computation(group):
    """cpu_kernels.int4_reference is what the kernel is held to; here both are held to a float64
    product over the documented format (nibble layout, W = q d + m, int8 activations per 32
    inputs at every row count), within float32 accumulation over I terms: |got - want| <=
    (2 sqrt(I) + 8) u * (|x_r| . |q d| + |x_r| . |m|) elementwise, plus one activation step where a
    code is a near tie (rounding errors of a float32 sum grow as sqrt(I) u, not the worst case I u,
    so a wrong scale, code or nibble shows far above it). The documented rounding itself stays
    within half a step of x (max|x| / 254 per block) of the exact product."""
    from zoo.compiler.quant import cpu_kernels

    torch.manual_seed(1)
    O, I = 200, 384
    q, d, m = torch.randint(0, 16, (O, I)), torch.rand(O, I // group) * 0.01, torch.randn(O, I // group) * 0.05
    qs, sm = cpu_kernels.pack_int4(q, d, m)
    codes, d64, m64 = documented_int4_weight(qs, sm, group)
    assert np.array_equal(codes, q.numpy()), "pack_int4 does not write the documented nibble layout"
    qd, w = codes * d64, codes * d64 + m64
    u = torch.finfo(torch.float32).eps / 2
    kernel = cpu_kernels.available()
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, I)
        x[0, :32] = 0.0
        x64 = x.double().numpy()
        xr, slack = documented_rounding(x64)  # at every row count (test_cpu_kernel_... checks the float setting)
        want = xr @ w.T  # the m part over the rounded x too (as llama.cpp's Q8_1 block sums)
        bound = (2 * I ** 0.5 + 8) * u * (np.abs(xr) @ np.abs(qd).T + np.abs(xr) @ np.abs(m64).T) + slack @ np.abs(w).T
        got = {"reference": cpu_kernels.int4_reference(x, qs, sm, group)}
        if kernel:
            got["kernel"] = torch.ops.zoo_quant.int4_linear(x, qs, sm, group)
        for name, out in got.items():
            err = np.abs(out.double().numpy() - want)
            assert (err <= bound).all(), f"{name} rows={rows}: error {err.max():.3g} over the bound {bound.max():.3g}"
        # the rounding moves each activation by at most half a step of its block
        exact = x64 @ w.T
        step = np.abs(x64).reshape(rows, -1, 32).max(-1).repeat(32, axis=1) / 254.0
        assert (np.abs(xr - x64) <= step * (1 + 1e-12)).all()
        assert (np.abs(want - exact) <= step @ np.abs(w).T * (1 + 1e-9)).all()
        assert np.abs(want - exact).max() > 1e-4  # and it is not nothing


def test_q8_0_is_kept_by_zoo_kernels_and_per_channel_for_torch_kernels():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 128)) * 0.05).astype(np.float32)
    b = blocks(w, Q.Q8_0)
    ref = torch.from_numpy(gguf.quants.dequantize(b.data.numpy(), Q.Q8_0).reshape(64, 128))
    q = QuantLinear(128, 64, False, "int8", None, torch.float32)
    assert q.load_weight(b) == "kept Q8_0 blocks as int8 g32 (float16 scales)"
    assert torch.equal(kernel_weight(q), ref)
    q = QuantLinear(128, 64, False, "int8", None, torch.bfloat16)
    assert q.load_weight(b) == "converted Q8_0 -> int8 per channel (requantized from its values)"
    err = ((kernel_weight(q) - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.01, err  # measured 0.0047 plus bfloat16 scales (per-row scale instead of one per 32 weights)


def test_int4_quantize_roundtrip_is_within_half_a_step():
    torch.manual_seed(0)
    O = 272  # more than one 256-row chunk, and a partial one: chunks pack as the whole would
    w = torch.randn(O, 128)
    for group in (32, 64, 128):
        q = QuantLinear(128, O, False, "int4", group, torch.float32)
        q.load_weight(w)
        lo, hi = w.view(O, -1, group).amin(-1), w.view(O, -1, group).amax(-1)
        step = (hi - lo) / 15
        err = (kernel_weight(q) - w).abs().view(O, -1, group).amax(-1)
        # the scale and offset are stored in float16 (as GGUF's Q4_1): each rounds by 2^-11 relative
        f16 = 2.0 ** -11 * (lo.abs() + 15 * step) + 1e-5
        assert (err <= step / 2 + f16).all(), group


def test_bad_quant_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"runtime\.quant: expected one of \['int8', 'int4', 'none'\] or null.*'int3'"):
        zoo.build("llama3_8b_tiny", quant="int3", dry=True)
    with pytest.raises(ConfigError, match=r"runtime\.quant_group: expected one of \[32, 64, 128\].*48"):
        zoo.build("llama3_8b_tiny", quant="int4", quant_group=48, dry=True)


def test_quant_is_a_config_override():
    """`zoo generate conf=NAME quant=int4` composes runtime.quant like any other runtime key."""
    m = zoo.build("llama3_8b_tiny", ["runtime.quant=int4", "runtime.quant_group=64"], dry=True)
    assert m.spec.runtime.quant == "int4" and m.spec.runtime.quant_group == 64
    assert zoo.build("llama3_8b_tiny", dry=True).spec.runtime.quant is None
    out = subprocess.run([sys.executable, "-m", "zoo.cli", "build", "conf=llama3_8b_tiny", "quant=int8", "compile=false"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "linears int8" in out.stdout


# -- a tiny Llama GGUF whose linears are all Q4_1 ----------------------------------------------------


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory, random_llama) -> Path:
    """test_gguf_load's random Llama with every linear Q4_1 (q/k rows permuted as llama.cpp stores
    them), the embedding Q8_0."""
    cfg, sd = random_llama.config, random_llama.state_dict()
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    override = {"output.weight": (gguf.quants.quantize(sd["lm_head.weight"].numpy(), Q.Q8_0), Q.Q8_0)}
    for i in range(cfg.num_hidden_layers):
        for part, hf in parts.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            t = llama_cpp_permute(t, heads[part]) if part in heads else t
            override[f"blk.{i}.{part}.weight"] = (gguf.quants.quantize(t.numpy(), Q.Q4_1), Q.Q4_1)
    return write_llama_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", random_llama, override_type=override)


@pytest.fixture(scope="module")
def q4_reference(q4_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        q4_gguf.parent, gguf_file=q4_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def q4_zoo(q4_gguf):
    # one decode bucket (CI time: another would be one more decode graph; tests/test_buckets.py)
    return zoo.from_pretrained(str(q4_gguf), compile=True, max_seq=48, max_batch=2, quant="int4",
                               overrides=["runtime.decode_buckets=[2]", "runtime.aot=false"])


def test_q4_gguf_is_kept_and_reported_per_tensor(q4_zoo):
    tensors = q4_zoo.info.load.tensors
    kept = {n for n, how in tensors.items() if how == "kept Q4_1 blocks as int4 g32"}
    assert kept == {f"blk.{i}.{p}.weight" for i in range(2) for p in
                    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert tensors["output.weight"] == "kept Q8_0 blocks as int8 g32 (float16 scales)"  # the head is int8
    assert tensors["token_embd.weight"] == "dequantized Q8_0 -> float32"  # lookups stay float
    assert tensors["blk.0.attn_norm.weight"] == "F32 -> float32"
    q = q4_zoo.info.quant
    assert q.quantized["layers.0.mixer.wqkv"] == "int4 g32" and q.quantized["head"] == "int8 per channel"
    assert q.kept_float["embed.weight"].startswith("embedding")
    assert q.kept_float["layers.1.ffn_norm.weight"] == "RMSNorm parameter (no nn.Linear)"


def test_q4_gguf_compiled_matches_transformers(q4_zoo, q4_reference):
    """The kept blocks compute what transformers' dequantized float32 weights do, within the rounding
    of the activations, which the kernels round to int8 per 32 inputs at every row count (as
    llama.cpp does): a prefill and decode steps; batch 2, one graph each."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        expected = q4_reference(ids).logits
    assert_logits_close(q4_zoo.prefill(ids), expected, rtol=3e-2, what="int4 prefill vs transformers")
    seq = torch.cat((ids, torch.randint(0, 256, (2, 6))), dim=1)
    # measured: at most 1.3% of the largest logit apart (the int8 activations of 14 linears)
    check_decode_equals_prefill(q4_zoo, seq, prompt_len=5, rtol=3e-2)
    assert q4_zoo.engine.graph_counts() == {"prefill": 1, "decode": 1}


# -- random builds and safetensors -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_random_build_equals_float_model_with_dequantized_weights(mode):
    m = zoo.build("llama3_8b_tiny", ["runtime.quant_prefill=float"], compile=False, max_batch=2, max_seq=32, quant=mode)
    f = zoo.build("llama3_8b_tiny", compile=False, max_batch=2, max_seq=32)
    with torch.no_grad():
        for name, q in m.module.named_modules():
            if isinstance(q, QuantLinear):
                f.module.get_submodule(name).weight.copy_(kernel_weight(q))
    ids = torch.randint(0, 256, (2, 12))  # 24 rows: runtime.quant_prefill=float's GEMM path, activations as they are
    assert_logits_close(m.prefill(ids), f.prefill(ids), rtol=1e-4, what=mode)
    assert m.info.param_bytes < f.info.param_bytes
    rows = dict(build_rows(m))
    assert f"linears {mode}" in rows["weights"]


def _peak_script(directory: Path, warmup: Path, mode: str) -> str:
    return f"""
import json, threading, time, psutil, torch, zoo
# a one-layer checkpoint through the same path first: imports and one-time set-up (kernels, the
# hub and tokenizer code, lazily built tables) are not weights, and stay out of the measurement
zoo.from_pretrained({str(warmup)!r}, compile=False, max_seq=16, quant={mode!r})
proc = psutil.Process(); base = proc.memory_info().rss; peak = [base]; stop = []
def watch():
    while not stop:
        peak[0] = max(peak[0], proc.memory_info().rss); time.sleep(0.002)
t = threading.Thread(target=watch); t.start()
m = zoo.from_pretrained({str(directory)!r}, compile=False, max_seq=16, quant={mode!r})
stop.append(1); t.join()
print(json.dumps({{"growth": peak[0] - base, "bytes": m.info.param_bytes + m.info.cache_bytes}}))
"""


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_safetensors_quantize_shard_by_shard(tmp_path, mode):
    """A 12-layer bfloat16 Llama (~100 MB, 20 MB shards): the load's peak RSS growth stays under 1.2 x what the
    quantized model holds + one shard (no float copy of the whole model)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    directory = save_reference(ref, tmp_path / "llama", max_shard_size="20MB")
    cfg.num_hidden_layers = 1
    warmup = save_reference(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), tmp_path / "one_layer")
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) >= 3
    out = subprocess.run([sys.executable, "-c", _peak_script(directory, warmup, mode)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    largest = max(p.stat().st_size for p in shards)
    assert r["growth"] <= 1.2 * r["bytes"] + largest, (r, largest)
