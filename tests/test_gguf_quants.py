"""Every common GGML block type read in torch (compiler/quant/gguf_blocks.py) equals llama.cpp's
reference dequantization (gguf.quants) bit for bit, on random blocks and on a real file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from zoo.compiler.contracts import StoredBlocks  # noqa: E402
from zoo.compiler.errors import CheckpointError  # noqa: E402
from zoo.compiler.quant import gguf_blocks  # noqa: E402

# byte offsets of each type's float16 fields (random bytes there could be inf / nan)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
              "MXFP4": [], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
              "IQ1_S": [0], "TQ1_0": [52], "TQ2_0": [64]}
E8M0_FIELDS = {"MXFP4": [0]}  # byte offsets of E8M0 scales: 2 ** (e - 128), subnormal for e < 2
TYPES = list(F16_FIELDS)


def random_blocks(ggml_type: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks_per_row * bytes]: random bytes, finite float16 scales of both signs
    (zeros and subnormals included)."""
    rng = np.random.default_rng(seed)
    nbytes = gguf.GGML_QUANT_SIZES[Q[ggml_type]][1]
    b = rng.integers(0, 256, (rows * blocks_per_row, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        h = (rng.standard_normal(len(b)) * 10.0 ** rng.integers(-7, 2, len(b))).astype(np.float16)
        h[::17] = 0
        b[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    for off in E8M0_FIELDS.get(ggml_type, []):  # the subnormal scales, and none that overflow a product
        b[:, off] = rng.integers(0, 136, len(b))
        b[::7, off] = rng.integers(0, 2, len(b[::7]))
    return b.reshape(rows, -1)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.int32)


def test_layouts_agree_with_gguf_sizes():
    for name, lay in gguf_blocks.LAYOUTS.items():
        assert (lay.block, lay.nbytes) == gguf.GGML_QUANT_SIZES[Q[name]], name
        assert lay.block % lay.group == 0


@pytest.mark.parametrize("ggml_type", TYPES)
def test_random_blocks_equal_gguf_bit_for_bit(ggml_type):
    data = random_blocks(ggml_type, 3, 5, seed=TYPES.index(ggml_type))
    want = gguf.quants.dequantize(data, Q[ggml_type])
    got = gguf_blocks.dequantize(torch.from_numpy(data), ggml_type)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(bits(got.numpy()), bits(want))  # -0.0 and +0.0 told apart
    # the codes form: w = q d (+ m) per group
    q, d, m = gguf_blocks.codes(torch.from_numpy(data), ggml_type)
    g = gguf_blocks.LAYOUTS[ggml_type].group
    again = d.repeat_interleave(g, 1) * q.float() + (0 if m is None else m.repeat_interleave(g, 1))
    np.testing.assert_array_equal(again.numpy(), want)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"])
def test_quantized_values_equal_gguf(ggml_type):
    """Blocks written by gguf's own quantizer (real scales, not random bytes)."""
    w = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    data = gguf.quants.quantize(w, Q[ggml_type])
    got = gguf_blocks.dequantize(torch.from_numpy(data), ggml_type)
    np.testing.assert_array_equal(bits(got.numpy()), bits(gguf.quants.dequantize(data, Q[ggml_type])))


@pytest.mark.parametrize("ggml_type", ["IQ1_M", "NVFP4"])
def test_packed_scale_types_equal_gguf_bit_for_bit(ggml_type):
    """IQ1_M's float16 d is spread over its scale bytes, NVFP4's scales are UE4M3: random bytes, the
    blocks whose reference is finite."""
    lay = gguf_blocks.LAYOUTS[ggml_type]
    data = np.random.default_rng(5).integers(0, 256, (64, lay.nbytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(data.reshape(-1), Q[ggml_type]).reshape(64, -1)
    finite = np.isfinite(want).all(axis=1)
    assert finite.sum() >= 32
    data, want = data[finite], want[finite]
    q, d, m = gguf_blocks.codes(torch.from_numpy(data), ggml_type)
    assert q.abs().max() <= 127  # int8 codes (the int8g layout)
    again = d.repeat_interleave(lay.group, 1) * q.float() + (0 if m is None else m.repeat_interleave(lay.group, 1))
    np.testing.assert_array_equal(again.numpy(), want)


@pytest.mark.parametrize("ggml_type", ["BF16", "F16"])
def test_half_types(ggml_type):
    w = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    data = gguf.quants.quantize(w, Q[ggml_type])
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    want = gguf.quants.dequantize(data, Q[ggml_type])
    np.testing.assert_array_equal(bits(gguf_blocks.dequantize(raw, ggml_type).numpy()), bits(want))


def test_more_blocks_than_one_chunk(monkeypatch):
    monkeypatch.setattr(gguf_blocks, "CHUNK_BLOCKS", 7)
    data = random_blocks("Q6_K", 4, 5)
    want = gguf.quants.dequantize(data, Q.Q6_K)
    np.testing.assert_array_equal(gguf_blocks.dequantize(torch.from_numpy(data), "Q6_K").numpy(), want)


def test_int4_parts_hold_q4_types_exactly():
    """Q4_0 / Q4_1 / Q4_K into zoo's int4 layout: the kernel's dequantization is gguf's values."""
    from zoo.compiler.quant.cpu_kernels import int4_dequantize

    for t in gguf_blocks.INT4_TYPES:
        data = random_blocks(t, 16, 2)
        b = StoredBlocks(t, torch.from_numpy(data), (16, data.shape[1] // gguf_blocks.LAYOUTS[t].nbytes
                                                    * gguf_blocks.LAYOUTS[t].block))
        qs, d, m = gguf_blocks.int4_parts(b)
        assert d.dtype == (torch.float32 if t == "Q4_K" else torch.float16)
        w = int4_dequantize(qs, torch.stack((d, m), dim=1))
        want = gguf.quants.dequantize(data, Q[t]).reshape(b.shape)
        np.testing.assert_array_equal(w.numpy(), want, err_msg=t)


def test_bad_block_data_is_named():
    with pytest.raises(CheckpointError, match="Q8_K has no block reader.*Q4_K"):
        gguf_blocks.dequantize(torch.zeros(1, 292, dtype=torch.uint8), "Q8_K")
    with pytest.raises(CheckpointError, match="Q6_K data.*210-byte blocks"):
        gguf_blocks.dequantize(torch.zeros(1, 200, dtype=torch.uint8), "Q6_K")
    with pytest.raises(CheckpointError, match=r"Q4_K blocks of shape \[2, 144\] do not hold a \[2, 512\]"):
        gguf_blocks.values(StoredBlocks("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), (2, 512)))


def test_shipped_smollm2_file_reads_as_gguf_does(smollm2_gguf):
    """Every tensor of the SmolLM2 Q4_1 GGUF (Q4_1, Q8_0, F32) through GGUFSource.read equals
    gguf.quants.dequantize of its stored data."""
    from zoo.compiler.checkpoint.gguf import GGUFSource

    src = GGUFSource(smollm2_gguf)
    seen, entries = set(), src.entries()
    for name, t in src._open_tensors().items():
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(entries[name].shape)
        np.testing.assert_array_equal(bits(src.read(name).numpy()), bits(want), err_msg=name)
        seen.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0"} <= seen
    src.close()


# -- zoo's kernels on the codes ----------------------------------------------------------------------


def _assert_close(got, want, what):
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item() + 1e-6, f"{what}: max error {err}"


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("scales", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_int8g_kernel_computes_its_reference(group, scales):
    """zoo_quant.int8g_linear against its torch reference, decode-sized and prefill-sized inputs
    (int8-rounded x; and the float GEMM of runtime.quant_prefill=float), offsets on and off, float32 and float16 (Q8_0's) scales,
    uneven thread splits."""
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    # 12, 13 and 1 blocks (the AVX512 kernels take blocks in pairs, the odd one apart), an odd O
    for O, I in ((200, 384), (200, 416), (37, 32)):
        if I % group == 0:
            check_int8g_kernel(group, O, I, scales)


def check_int8g_kernel(group, O, I, scales=torch.float32):
    from zoo.compiler.quant import cpu_kernels

    torch.manual_seed(0)
    qw = torch.randint(-128, 128, (O, I), dtype=torch.int8)
    sm = torch.stack((torch.randn(O, I // group) * 0.01, torch.randn(O, I // group) * 0.05), dim=1).to(scales)
    for offsets in ("m", "zero m", "no m"):  # no m: sm [O, 1, I/g], d only (Q8_0, Q6_K, ...)
        if offsets == "zero m":
            sm[:, 1] = 0
        if offsets == "no m":
            sm = sm[:, :1]
        for rows in (1, 2, 3, 5, 16, 17, 40):
            x = torch.randn(rows, I)
            x[0, :32] = 0.0
            want = cpu_kernels.int8g_reference(x, qw, sm, group)
            _assert_close(torch.ops.zoo_quant.int8g_linear(x, qw, sm, group), want, f"g{group} rows={rows}")
            if rows > cpu_kernels.FLOAT_ROWS:  # runtime.quant_prefill=float: the float linear of the weights
                want = cpu_kernels.int8g_reference(x, qw, sm, group, cpu_kernels.FLOAT_ROWS)
                _assert_close(torch.ops.zoo_quant.int8g_linear(x, qw, sm, group, cpu_kernels.FLOAT_ROWS), want, "float")
                _assert_close(want, torch.nn.functional.linear(x, cpu_kernels.int8g_dequantize(qw, sm)), "float")


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("scales", [torch.float16, torch.float32])
def test_int5_kernel_computes_its_reference(scales):
    """zoo_quant.int5_linear against its torch reference: 1, 2, 3, 5, 16, 17 and 40 rows (integer
    dots over the int8-rounded x; above 16 also the dequantize + GEMM path of
    runtime.quant_prefill=float), odd O, an odd number of blocks (AVX512 takes them in pairs) and a single one, a zero
    block of x, every code 0..31 and both groups of 32 and 64."""
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    torch.manual_seed(2)
    for O, I, group in ((5, 32, 32), (37, 416, 32), (50, 384, 64)):
        q = torch.randint(0, 32, (O, I))
        q[0, :32] = torch.arange(32)
        qs, qh, sm = cpu_kernels.pack_int5(q, torch.randn(O, I // group) * 0.01, torch.randn(O, I // group) * 0.05)
        sm = sm.to(scales)
        w = q.float() * sm[:, 0].float().repeat_interleave(group, 1) + sm[:, 1].float().repeat_interleave(group, 1)
        np.testing.assert_array_equal(cpu_kernels.int4_dequantize(qs, sm, qh).numpy(), w.numpy())
        for rows in (1, 2, 3, 5, 16, 17, 40):
            x = torch.randn(rows, I)
            x[0, 32:64] = 0.0
            want = cpu_kernels.int5_reference(x, qs, qh, sm, group)
            _assert_close(torch.ops.zoo_quant.int5_linear(x, qs, qh, sm, group), want, f"O={O} rows={rows}")
            # x rounded per 32 inputs, as llama.cpp's Q8 activations (the offsets' sums too)
            _assert_close(want, torch.nn.functional.linear(cpu_kernels.round_activations(x), w), "rounded")
            if rows > cpu_kernels.FLOAT_ROWS:  # runtime.quant_prefill=float
                want = cpu_kernels.int5_reference(x, qs, qh, sm, group, cpu_kernels.FLOAT_ROWS)
                _assert_close(torch.ops.zoo_quant.int5_linear(x, qs, qh, sm, group, cpu_kernels.FLOAT_ROWS), want, "float")
                _assert_close(want, torch.nn.functional.linear(x, w), "float")
    with pytest.raises(RuntimeError, match=r"int5_linear: expected qh \[O, I/8\] uint8"):
        torch.ops.zoo_quant.int5_linear(torch.randn(1, 64), qs[:, :32], qh[:, :4], sm[:, :, :2].float(), 32)


@pytest.mark.usefixtures("two_threads")
def test_q6k_kernel_computes_its_reference():
    """zoo_quant.q6k_linear over Q6_K blocks as stored against its torch reference (int8g's d-only
    case of the blocks' codes) and gguf's dequantization: 1, 2, 3, 5, 16, 17 and 40 rows (integer
    dots over the int8-rounded x; above 16 also dequantize + GEMM, runtime.quant_prefill=float), odd
    O, one block of 256 inputs and several, a zero block of x and a zero d, every code 0..63."""
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    for O, nsb in ((5, 1), (37, 3), (64, 2)):
        b = random_blocks("Q6_K", O, nsb, seed=O).reshape(O * nsb, 210)
        d = (rng.standard_normal(O * nsb) * 0.01).astype(np.float16)
        d[1] = 0
        b[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
        b = b.reshape(O, nsb * 210)
        I = 256 * nsb
        blocks = torch.from_numpy(b)
        w = torch.from_numpy(gguf.quants.dequantize(b, Q.Q6_K)).reshape(O, I)
        qw, sm = cpu_kernels.q6k_codes(blocks)
        np.testing.assert_array_equal(cpu_kernels.int8g_dequantize(qw, sm).numpy(), w.numpy())
        assert set(qw.unique().tolist()) == set(range(-32, 32))
        for rows in (1, 2, 3, 5, 16, 17, 40):
            x = torch.randn(rows, I)
            x[0, 32:64] = 0.0
            want = cpu_kernels.q6k_reference(x, blocks)
            _assert_close(torch.ops.zoo_quant.q6k_linear(x, blocks), want, f"O={O} I={I} rows={rows}")
            _assert_close(want, torch.nn.functional.linear(cpu_kernels.round_activations(x), w), "gguf's weights")
            if rows > cpu_kernels.FLOAT_ROWS:  # runtime.quant_prefill=float
                want = cpu_kernels.q6k_reference(x, blocks, cpu_kernels.FLOAT_ROWS)
                _assert_close(torch.ops.zoo_quant.q6k_linear(x, blocks, cpu_kernels.FLOAT_ROWS), want, "float")
                _assert_close(want, torch.nn.functional.linear(x, w), "gguf's weights, float")
    with pytest.raises(RuntimeError, match=r"q6k_linear: expected blocks \[O, I/256 \* 210\] uint8"):
        torch.ops.zoo_quant.q6k_linear(torch.randn(1, 256), blocks[:, :200])
    with pytest.raises(RuntimeError, match="q6k_linear: x has 256 inputs, the weight 512"):
        torch.ops.zoo_quant.q6k_linear(torch.randn(1, 256), blocks)


def test_int4_kernel_takes_float32_scales():
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    torch.manual_seed(1)
    O, I = 48, 512
    q, d, m = torch.randint(0, 16, (O, I)), torch.randn(O, I // 32) * 0.01, torch.randn(O, I // 32) * 0.05
    qs, _ = cpu_kernels.pack_int4(q, d, m)
    sm = torch.stack((d, m), dim=1)  # float32
    for rows in (1, 5, 17):
        x = torch.randn(rows, I)
        _assert_close(torch.ops.zoo_quant.int4_linear(x, qs, sm, 32), cpu_kernels.int4_reference(x, qs, sm, 32),
                      f"rows={rows}")


# -- QuantLinear keeps the blocks ---------------------------------------------------------------------


def stored(ggml_type: str, rows: int, blocks_per_row: int, seed: int = 0) -> StoredBlocks:
    data = random_blocks(ggml_type, rows, blocks_per_row, seed)
    return StoredBlocks(ggml_type, torch.from_numpy(data), (rows, blocks_per_row * gguf_blocks.LAYOUTS[ggml_type].block))


KEPT = {"Q4_0": "int4 g32", "Q4_1": "int4 g32", "Q4_K": "int4 g32 (float32 scales)", "Q5_0": "int5 g32",
        "Q5_1": "int5 g32", "Q8_0": "int8 g32 (float16 scales)", "IQ4_NL": "int8 g32 (float16 scales)",
        "Q2_K": "int8 g16 (float32 scales)", "Q3_K": "int8 g16 (float32 scales)", "Q5_K": "int5 g32 (float32 scales)",
        "Q6_K": "stored (6.5625 bits a weight)", "IQ4_XS": "int8 g32 (float32 scales)", "MXFP4": "int8 g32 (float32 scales)",
        "IQ2_XXS": "int8 g32 (float32 scales)", "IQ2_XS": "int8 g16 (float32 scales)", "IQ2_S": "int8 g16 (float32 scales)",
        "IQ3_XXS": "int8 g32 (float32 scales)", "IQ3_S": "int8 g32 (float32 scales)", "IQ1_S": "int8 g32 (float32 scales)",
        "TQ1_0": "int8 g256 (float16 scales)", "TQ2_0": "int8 g256 (float16 scales)"}


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("ggml_type", TYPES)
def test_quant_linear_keeps_every_block_type_exactly(ggml_type, mode):
    """zoo's float32 kernels hold each type's codes and scales: the weight the kernel applies is
    gguf's dequantization bit for bit, a prefill-sized input gives the float linear of those weights
    within float rounding (runtime.quant_prefill=float), and by default any input the kernel's
    reference (int8-rounded activations)."""
    from zoo.compiler.quant import cpu_kernels
    from zoo.compiler.quant.linear import QuantLinear

    b = stored(ggml_type, 48, 2 if gguf_blocks.LAYOUTS[ggml_type].block == 256 else 9, seed=3)
    O, I = b.shape
    want = torch.from_numpy(gguf.quants.dequantize(b.data.numpy(), Q[ggml_type])).reshape(O, I)
    q = QuantLinear(I, O, False, mode, 32 if mode == "int4" else None, torch.float32)
    assert q.accepts_blocks(ggml_type)
    assert q.load_weight(b) == f"kept {ggml_type} blocks as {KEPT[ggml_type]}"
    with torch.no_grad():
        q.float_rows = cpu_kernels.FLOAT_ROWS  # runtime.quant_prefill=float: the GEMM path over the weights
        eye = torch.eye(I)
        np.testing.assert_array_equal(q(eye).t().numpy(), want.numpy())  # GEMM path: 1 * w, exactly
        x = torch.randn(40, I)
        _assert_close(q(x), x @ want.t(), "prefill")
        q.float_rows = 0  # the default: int8-rounded activations at every row count (checked below at 40 rows)
        x = torch.randn(40, I)
        if q.layout == "int8g":
            ref = cpu_kernels.int8g_reference(x, q.qweight, q.scales, q.group)
            # the types without an offset keep d only: 4 bytes a group less to read
            no_m = ("Q8_0", "IQ4_NL", "Q3_K", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                    "IQ1_S", "TQ1_0", "TQ2_0")
            assert q.scales.shape == (O, 1 if ggml_type in no_m else 2, I // q.group), q.scales.shape
            # d stored as a float16 (Q8_0: 34 bytes per 32 weights, as the file) stays one
            assert q.scales.dtype == (torch.float16 if ggml_type in ("Q8_0", "IQ4_NL", "TQ1_0", "TQ2_0") else torch.float32)
        elif q.layout == "int5":
            ref = cpu_kernels.int5_reference(x, q.qweight, q.qhigh, q.scales, q.group)
            # the reference's own dequantization, too: equal values (q d + m's zeros are +0 where
            # Q5_0's d (q - 16) gives -0 for d < 0, q = 16: no product or sum tells them apart)
            np.testing.assert_array_equal(cpu_kernels.int4_dequantize(q.qweight, q.scales, q.qhigh).numpy(), want.numpy())
        elif q.layout == "q6k":  # the blocks' bytes as they are, nothing beside them
            assert set(q.state_dict()) == {"qweight"} and torch.equal(q.qweight, b.data)
            ref = cpu_kernels.q6k_reference(x, q.qweight)
        else:
            ref = cpu_kernels.int4_reference(x, q.qweight, q.scales, q.group)
        _assert_close(q(x), ref, "decode")
        assert (q(x) - x @ want.t()).abs().max() < 0.05 * (x.abs() @ want.abs().t()).max()
    bytes_per_weight = q.quantized_bytes() / (O * I)
    # no float copy (int5: 24 / 32, Q5_K's float32 scales 28 / 32, Q6_K 210 / 256)
    assert bytes_per_weight <= {"int4": 0.75, "int5": 0.875, "q6k": 210 / 256}.get(q.layout, 1.5)


def test_blocks_not_kept_say_why():
    from zoo.compiler.quant.linear import QuantLinear

    g64 = QuantLinear(512, 16, False, "int4", 64, torch.float32)
    assert not g64.accepts_blocks("Q4_K")
    assert "int4 g64 does not hold groups of 32" in g64.why_not_kept("Q4_K")
    bf16 = QuantLinear(512, 16, False, "int4", 32, torch.bfloat16)
    assert bf16.accepts_blocks("Q4_1") and not bf16.accepts_blocks("Q6_K")
    assert "float32 CPU kernels keep every block type" in bf16.why_not_kept("Q6_K")
    with pytest.raises(CheckpointError, match="cannot take Q6_K blocks as they are: Q6_K blocks not kept"):
        bf16.load_weight(stored("Q6_K", 16, 2))
    kept = QuantLinear(512, 16, False, "int4", 32, torch.float32)
    kept.load_weight(stored("Q6_K", 16, 2))
    with pytest.raises(CheckpointError, match="holds GGUF blocks"):
        kept.load_weight(torch.zeros(16, 512))


# -- tiny Llama GGUF files in K-quant mixes, kept and compared with transformers -------------------------

# magnitude of each type's scale fields: weights of about +-0.05 from the largest codes
D_SCALE = {"Q4_0": 0.05 / 8, "Q4_1": 0.05 / 15, "Q5_0": 0.05 / 16, "Q5_1": 0.05 / 31, "Q8_0": 0.05 / 127,
           "IQ4_NL": 0.05 / 127, "Q2_K": 0.05 / 45, "Q3_K": 0.05 / 128, "Q4_K": 0.05 / 945, "Q5_K": 0.05 / 1953,
           "Q6_K": 0.05 / 4064, "IQ4_XS": 0.05 / 4064}
# tensor -> type, as llama.cpp's mixes store them (Q4_K_M: attn_v / ffn_down / output in Q6_K)
MIXES = {
    "Q4_K_M": dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K", ffn_gate="Q4_K", ffn_up="Q4_K",
                   ffn_down="Q6_K", token_embd="Q4_K", output="Q6_K"),
    "Q5_K_M": dict(attn_q="Q5_K", attn_k="Q5_K", attn_v="Q6_K", attn_output="Q5_K", ffn_gate="Q5_K", ffn_up="Q5_K",
                   ffn_down="Q6_K", token_embd="Q5_K", output="Q6_K"),
    "Q6_K": dict(attn_q="Q6_K", attn_k="Q6_K", attn_v="Q6_K", attn_output="Q6_K", ffn_gate="Q6_K", ffn_up="Q6_K",
                 ffn_down="Q6_K", token_embd="Q6_K", output="Q6_K"),
    "others": dict(attn_q="Q5_0", attn_k="Q5_1", attn_v="IQ4_NL", attn_output="IQ4_XS", ffn_gate="Q2_K", ffn_up="Q3_K",
                   ffn_down="Q8_0", token_embd="Q4_0", output="Q4_1"),
    # what llama.cpp's Q4_K_M / Q5_K_M store where the columns are no multiple of 256 (SmolLM2's
    # 576): Q5_0 / Q5_1, kept as int5 (q / k / v of one type join as int5 too); named to sort last
    # (the mixes' seeds are their sorted index)
    "q5_fallbacks": dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_0", attn_output="Q5_1", ffn_gate="Q5_1",
                         ffn_up="Q5_1", ffn_down="Q8_0", token_embd="Q8_0", output="Q5_0"),
}
KDIMS = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def scaled_blocks(ggml_type: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random valid blocks for a [rows, cols] weight with scale fields of D_SCALE's size."""
    lay = gguf_blocks.LAYOUTS[ggml_type]
    b = rng.integers(0, 256, (rows * cols // lay.block, lay.nbytes), dtype=np.uint8)
    for i, off in enumerate(F16_FIELDS[ggml_type]):
        h = rng.uniform(0.5, 1.0, len(b)) * D_SCALE[ggml_type] * (1 if i else rng.choice([-1, 1], len(b)))
        if i:  # the min / offset fields (Q4_1, Q5_1: m is an additive offset; K-quants: dmin)
            h = -h if ggml_type in ("Q4_1", "Q5_1") else h / 4
        b[:, off:off + 2] = h.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.fixture(scope="module")
def kquant_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**KDIMS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_mix(path, model, mix: str):
    from tests.test_gguf_load import write_llama_gguf

    rng = np.random.default_rng(sorted(MIXES).index(mix))
    cfg, types = model.config, MIXES[mix]
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    override = {f"{n}.weight": (scaled_blocks(types[n], 256, 256, rng), Q[types[n]]) for n in ("token_embd", "output")}
    for i in range(cfg.num_hidden_layers):
        for part, shape in shapes.items():
            override[f"blk.{i}.{part}.weight"] = (scaled_blocks(types[part], *shape, rng), Q[types[part]])
    return write_llama_gguf(path, model, override_type=override)


@pytest.mark.parametrize("mix", list(MIXES))
def test_kquant_file_is_kept_and_matches_transformers(tmp_path, kquant_llama, mix):
    """A Llama GGUF in llama.cpp's mixes loads with runtime.quant=int4: every linear's blocks kept
    (the report says how, per tensor; q / k / v of different types join as int8), and the logits of
    a prefill (runtime.quant_prefill=float: the kernels' float32 GEMM path) equal transformers'
    dequantized float32 model's within float rounding; decode-sized steps (int8-rounded activations,
    as every row count by default) within that rounding."""
    import transformers

    import zoo

    path = write_mix(tmp_path / f"{mix}.gguf", kquant_llama, mix)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32, max_batch=2, quant="int4",
                            overrides=["runtime.quant_prefill=float"])  # the 24-row prefill on the float GEMM
    report = m.info.load.tensors
    types = MIXES[mix]
    for name, how in report.items():
        part = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        if part in ("attn_norm", "ffn_norm", "output_norm"):
            assert how == "F32 -> float32", name
        elif part == "token_embd":  # lookups stay float
            assert how == f"dequantized {types[part]} -> float32", name
        else:
            assert "kept" in how and "quantized ->" not in how, (name, how)
            assert how.startswith(types[part]) or f"kept {types[part]} blocks" in how, (name, how)
    for part in ("attn_q", "attn_output", "ffn_up", "output"):  # Q5_0 / Q5_1 at their stored width, Q5_K as int5
        if types[part] in ("Q5_0", "Q5_1", "Q5_K") and (part != "attn_q" or len({types["attn_q"], types["attn_k"],
                                                                                 types["attn_v"]}) == 1):
            name = "output.weight" if part == "output" else f"blk.0.{part}.weight"
            scales = " (float32 scales)" if types[part] == "Q5_K" else ""
            assert report[name] == f"kept {types[part]} blocks as int5 g32{scales}", (name, report[name])
    for part in ("attn_q", "attn_output", "ffn_down", "output"):  # Q6_K as stored
        if types[part] == "Q6_K" and (part != "attn_q" or {types["attn_k"], types["attn_v"]} == {"Q6_K"}):
            name = "output.weight" if part == "output" else f"blk.0.{part}.weight"
            assert report[name] == "kept Q6_K blocks as stored (6.5625 bits a weight)", (name, report[name])
    if len({types["attn_q"], types["attn_k"], types["attn_v"]}) > 1:
        assert report["blk.0.attn_v.weight"].startswith(f"{types['attn_v']} kept (with parts of other types) as int8 g")
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = ref(ids).logits
    got = m.prefill(ids)
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"{mix}: prefill max error {err} of {want.abs().max().item()}"
    with torch.no_grad():
        one = m.prefill(ids[:1, :5])  # 5 rows: the decode-sized path of the kernels
    err = (one - want[:1, :5]).abs().max().item()
    assert err <= 3e-2 * want.abs().max().item(), f"{mix}: decode-sized max error {err}"


# -- malformed files ----------------------------------------------------------------------------------


def _one_tensor_file(path, ggml_type: int, dims: tuple, offset: int, data_bytes: int):
    """A GGUF v3 file by hand: no metadata, one tensor 'w' (dims GGUF order) at `offset`."""
    import struct

    name = b"w"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    head += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    head += struct.pack("<IQ", ggml_type, offset)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * (offset + data_bytes))
    return path


def test_misaligned_and_partial_block_tensors_are_named(tmp_path):
    from zoo.compiler.checkpoint.gguf import GGUFSource

    ok = _one_tensor_file(tmp_path / "ok.gguf", 0, (32, 2), 0, 256)
    assert GGUFSource(ok).entries()["w"].shape == (2, 32)
    bad = _one_tensor_file(tmp_path / "misaligned.gguf", 0, (32, 2), 4, 256)
    with pytest.raises(CheckpointError, match=r"misaligned.gguf: not a readable GGUF file \(tensor 'w': data offset 4 "
                                              r"is not a multiple of the file's alignment \(32\)"):
        GGUFSource(bad)
    partial = _one_tensor_file(tmp_path / "partial.gguf", int(Q.Q4_K), (384, 1), 0, 400)
    with pytest.raises(CheckpointError, match=r"partial.gguf.*tensor 'w': rows of 384 values are not whole blocks of "
                                              r"Q4_K \(256 values per block\)"):
        GGUFSource(partial)
    unknown = _one_tensor_file(tmp_path / "unknown.gguf", 250, (32, 1), 0, 64)
    with pytest.raises(CheckpointError, match=r"unknown.gguf.*tensor 'w': unknown GGML type 250"):
        GGUFSource(unknown)
    iq2 = _one_tensor_file(tmp_path / "iq2.gguf", int(Q.Q8_K), (256, 1), 0, 292)
    with pytest.raises(CheckpointError, match=r"iq2.gguf \(GGUF, general.architecture=None\): unsupported GGML quantization type\(s\) in w \(Q8_K\)"):
        GGUFSource(iq2).entries()


@pytest.mark.parametrize("mix, wqkv_layout", [("Q4_K_M", ("int8g", 16, torch.int8)),
                                               ("q5_fallbacks", ("int5", 32, torch.uint8)),
                                               ("Q6_K", ("q6k", 16, torch.uint8))])
def test_kept_layouts_are_planned_so_the_weight_cache_holds_them(tmp_path, kquant_llama, monkeypatch, mix, wqkv_layout):
    """The buffers take the kept blocks' layout while the load is planned (on the meta model), so
    a second build is a weight-cache hit with the same state (int5's high bits included; Q6_K's
    blocks as stored, no scales buffer)."""
    import zoo

    monkeypatch.setenv("ZOO_WEIGHT_CACHE", str(tmp_path / "weights"))
    path = write_mix(tmp_path / "m.gguf", kquant_llama, mix)
    first = zoo.from_pretrained(str(path), compile=False, max_seq=16, quant="int4")
    assert first.info.load.cache.startswith("wrote ")
    wqkv = first.module.layers[0].mixer.wqkv
    assert (wqkv.layout, wqkv.group, wqkv.qweight.dtype) == wqkv_layout
    second = zoo.from_pretrained(str(path), compile=False, max_seq=16, quant="int4")
    assert second.info.load.cache.startswith("hit ")
    a, b = first.module.state_dict(), second.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    assert torch.equal(first.prefill(ids), second.prefill(ids))


def test_report_says_why_blocks_were_not_kept(tmp_path, kquant_llama):
    """int4 g64 cannot hold the file's groups of 32: every linear is dequantized and quantized again,
    and the load report says so per tensor."""
    import zoo

    path = write_mix(tmp_path / "m.gguf", kquant_llama, "Q4_K_M")
    m = zoo.from_pretrained(str(path), compile=False, max_seq=16, quant="int4", quant_group=64)
    how = m.info.load.tensors
    assert how["blk.0.ffn_up.weight"] == ("Q4_K quantized -> int4 g64 (Q4_K blocks not kept: int4 g64 does not hold "
                                          "groups of 32 (runtime.quant_group=32 keeps them))")
    assert how["blk.0.attn_v.weight"].startswith("Q6_K quantized -> int4 g64 (Q6_K blocks not kept")
    assert how["output.weight"] == "kept Q6_K blocks as stored (6.5625 bits a weight)"  # the head is int8: kept


@pytest.mark.parametrize("ggml_type", TYPES)
def test_expert_stacks_keep_every_block_type_exactly(ggml_type):
    """A whole GGUF expert stack [E, O, I] (ffn_*_exps) into QuantExperts: every block type kept,
    Q4_0 / Q4_1 / Q4_K as int4 g32 (Q4_K's d * sc in float32 scales), Q5_0 / Q5_1 / Q5_K as int5 g32,
    Q6_K as its bytes, the others as int8 codes with float32 group scales; each expert's weight equals gguf's dequantization (signed zeros aside:
    Q4_0's q d + m gives +0 where d (q - 8) gives -0)."""
    from zoo.compiler.quant.experts import QuantExperts

    lay = gguf_blocks.LAYOUTS[ggml_type]
    E, O, I = 3, 16, 2 * lay.block
    data = random_blocks(ggml_type, E * O, I // lay.block, seed=TYPES.index(ggml_type))
    q = QuantExperts(E, O, I, "int4", 32, torch.bfloat16)
    q.prepare_blocks(ggml_type)
    done = q.load_weight(StoredBlocks(ggml_type, torch.from_numpy(data).reshape(E, O, -1), (E, O, I)))
    int4, int5 = ggml_type in gguf_blocks.INT4_TYPES, ggml_type in gguf_blocks.INT5_TYPES
    scales = "float16" if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1") else "float32"
    bits = "int4" if int4 else "int5" if int5 else "int8"
    if ggml_type == "Q6_K":
        assert done == "kept Q6_K blocks as stored (6.5625 bits a weight), 3 experts" and q.layout == "q6k"
        assert q.qweight.shape == (E, O, I // 256 * 210) and "scales" not in dict(q.named_buffers())
    else:
        assert done == f"kept {ggml_type} blocks as {bits} g{32 if int4 or int5 else lay.group} ({scales} scales), 3 experts"
    want = torch.from_numpy(gguf.quants.dequantize(data, Q[ggml_type])).reshape(E, O, I)
    for e in range(E):
        torch.testing.assert_close(q.dequantize(e), want[e], rtol=0, atol=0, equal_nan=True, msg=f"{ggml_type} expert {e}")


@pytest.mark.parametrize("ggml_type, layout", [("Q4_1", "int4"), ("Q4_K", "int4"), ("Q5_0", "int5"), ("Q8_0", "int8g"),
                                               ("Q6_K", "q6k"), ("Q5_K", "int5"), ("F16", None)])
def test_tied_embedding_reads_its_rows_from_the_kept_head(tmp_path, ggml_type, layout):
    """A tied GGUF (no output.weight, as SmolLM2's files): when the quantized head keeps
    token_embd's blocks, the embedding holds no float copy of them (contracts.RowTable) and its
    lookups equal gguf's dequantization (signed zeros aside); the report says so, the parameter
    count is unchanged, and the logits equal transformers'. A float table (F16), which the head
    quantizes anew, stays float for the lookups."""
    import transformers

    import zoo

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**KDIMS, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    tied = transformers.LlamaForCausalLM(cfg).eval()
    from tests.test_gguf_load import write_llama_gguf

    rng = np.random.default_rng(3)
    table = (rng.standard_normal((256, 256)) * 0.02).astype(np.float16) if ggml_type == "F16" else \
        scaled_blocks(ggml_type, 256, 256, rng)
    override = {"token_embd.weight": (table, Q[ggml_type])}
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    for i in range(cfg.num_hidden_layers):  # every linear in blocks too: kept, so no quantization error
        override.update({f"blk.{i}.{part}.weight": (scaled_blocks("Q8_0", *shape, rng), Q.Q8_0)
                         for part, shape in shapes.items()})
    path = write_llama_gguf(tmp_path / "tied.gguf", tied, override_type=override)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    # runtime.quant_prefill=float: the 18-row prefill below on the kernels' float32 GEMM, transformers' sums
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32, quant="int4", overrides=["runtime.quant_prefill=float"])
    embed, how = m.module.embed, m.info.load.tensors["token_embd.weight"]
    assert m.info.params == sum(p.numel() for p in ref.parameters())
    want_rows = torch.from_numpy(gguf.quants.dequantize(table, Q[ggml_type]).copy())
    ids = torch.tensor([[0, 7, 255, 128, 3, 3] * 3])  # 18 rows (> 16): the float32 GEMM path
    if layout is None:
        assert embed.weight is not None and embed.rows_from is None and "looks its rows up" not in how
    else:
        assert embed.weight is None and embed.rows_from is m.module.head, how
        assert m.module.head.layout == layout
        assert how.endswith("; embed.weight looks its rows up in them (no float copy)"), how
        assert torch.equal(embed(ids)[0], want_rows[ids[0]])
    with torch.no_grad():
        want = ref(ids).logits
    got = m.prefill(ids)
    margin = 1e-4 if layout else 2e-2  # F16: the head multiplies int8 codes quantized anew
    assert (got - want).abs().max().item() <= margin * want.abs().max().item()
