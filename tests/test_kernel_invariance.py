"""Batch invariance of zoo's quantized CPU kernels (compiler/quant/cpu_kernels.cpp, issue #46): a
row of x gives the same output bits whether it is computed alone (decode), among a few rows (a
decode bucket, a speculative verification), or among hundreds (a prefill chunk, a whole prompt),
wherever it sits among them, and however the outputs split between threads; and that output is
the kernel's reference (cpu_kernels.*_reference) within float32 rounding. Every kept layout:
int8 per channel, int4 g32 / g64 (float16 scales: Q4_0 / Q4_1; float32: Q4_K), int5 (Q5_0 / Q5_1;
float32 scales: Q5_K), int8g (groups of 16 and 32, with and without offsets, float16 and float32
scales: Q8_0, IQ4_NL, the K-quants' codes), q6k. tests/test_cpu_isa.py runs this file at every
ISA level the CPU has. runtime.quant_prefill=float is the documented exception (the last test)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_logits_close

ROWS = (1, 3, 16, 17, 64, 300)  # decode, a bucket, the old few-row limit and one past, chunks, a prompt
O, I = 37, 416  # an odd O (thread tasks of 16 outputs split unevenly); 13 blocks (AVX512's odd one)


def _layouts():
    """name -> (kernel(x, float_rows), reference(x, float_rows)) over random weights."""
    from zoo.compiler.quant import cpu_kernels as k

    g = torch.Generator().manual_seed(46)
    rand = lambda *s: torch.rand(*s, generator=g)
    randn = lambda *s: torch.randn(*s, generator=g)
    out = {}
    qw8 = torch.randint(-127, 128, (O, I), dtype=torch.int8, generator=g)
    scale = rand(O) * 0.01
    out["int8"] = (lambda x, f=0: torch.ops.zoo_quant.int8_linear(x, qw8, scale, f),
                   lambda x, f=0: k.int8_reference(x, qw8, scale, f))
    for group, dtype in ((32, torch.float16), (32, torch.float32), (64, torch.float16)):
        ii = I if I % group == 0 else 384
        q = torch.randint(0, 16, (O, ii), generator=g)
        qs, sm = k.pack_int4(q, rand(O, ii // group) * 0.01, randn(O, ii // group) * 0.05)
        sm = sm.to(dtype)
        out[f"int4 g{group} {dtype}"] = (lambda x, f=0, qs=qs, sm=sm, gr=group: torch.ops.zoo_quant.int4_linear(x, qs, sm, gr, f),
                                         lambda x, f=0, qs=qs, sm=sm, gr=group: k.int4_reference(x, qs, sm, gr, float_rows=f))
    for dtype in (torch.float16, torch.float32):
        q = torch.randint(0, 32, (O, I), generator=g)
        qs, qh, sm = k.pack_int5(q, rand(O, I // 32) * 0.01, randn(O, I // 32) * 0.05)
        sm = sm.to(dtype)
        out[f"int5 {dtype}"] = (lambda x, f=0, qs=qs, qh=qh, sm=sm: torch.ops.zoo_quant.int5_linear(x, qs, qh, sm, 32, f),
                                lambda x, f=0, qs=qs, qh=qh, sm=sm: k.int5_reference(x, qs, qh, sm, 32, f))
    qwg = torch.randint(-128, 128, (O, I), dtype=torch.int8, generator=g)
    for group in (16, 32):
        for dtype in (torch.float16, torch.float32):
            for ns in (1, 2):  # d only (Q8_0, Q6_K's codes, ...) and d, m (the offset types)
                sm = torch.stack((randn(O, I // group) * 0.01, randn(O, I // group) * 0.05), 1)[:, :ns].to(dtype)
                out[f"int8g g{group} {dtype} ns={ns}"] = (
                    lambda x, f=0, sm=sm, gr=group: torch.ops.zoo_quant.int8g_linear(x, qwg, sm, gr, f),
                    lambda x, f=0, sm=sm, gr=group: k.int8g_reference(x, qwg, sm, gr, f))
    blocks = torch.randint(0, 256, (O, 2 * 210), dtype=torch.uint8, generator=g)
    d = (randn(O, 2) * 0.01).to(torch.float16).view(torch.uint8).reshape(O, 2, 2)
    blocks.view(O, 2, 210)[:, :, 208:210] = d
    out["q6k"] = (lambda x, f=0: torch.ops.zoo_quant.q6k_linear(x, blocks, f),
                  lambda x, f=0: k.q6k_reference(x, blocks, f))
    # each takes the first inputs of x its weight has (416; int4 g64 384, q6k 512)
    inputs = {name: 384 if "g64" in name else 512 if name == "q6k" else I for name in out}
    return {name: (lambda x, f=0, fn=kf, n=inputs[name]: fn(x[:, :n].contiguous(), f),
                   lambda x, f=0, fn=rf, n=inputs[name]: fn(x[:, :n].contiguous(), f)) for name, (kf, rf) in out.items()}


@pytest.fixture(scope="module")
def layouts():
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    return _layouts()


def _x(rows: int) -> torch.Tensor:
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[1, :32] = 0.0  # an all-zero block (scale 0)
    x[2] *= 1e3  # rows of very different scales beside each other
    return x


def test_a_row_is_the_same_bits_at_every_row_count_and_position(layouts):
    """Each layout: the 300 rows at once, then every window of 1, 3, 16, 17 and 64 rows at a few
    offsets, each row bit-identical to its row in the 300; and the 300 are their reference."""
    x = _x(300)
    for name, (kernel, reference) in layouts.items():
        whole = kernel(x)
        assert_logits_close(whole, reference(x), rtol=1e-5, what=f"{name}: 300 rows against the reference")
        for rows in ROWS[:-1]:
            for start in (0, 1, 150, 300 - rows):
                part = kernel(x[start:start + rows].contiguous())
                same = (part == whole[start:start + rows]).all(dim=1)
                assert same.all(), (f"{name}: rows {start}..{start + rows} computed {rows} at a time differ from the same "
                                    f"rows among 300 (row {start + int((~same).nonzero()[0])})")


def test_a_row_is_the_same_bits_whichever_threads_split_the_outputs(layouts):
    """One thread against two (tasks of 16 outputs, 37 outputs: an uneven split) and four."""
    x = _x(300)[:70].contiguous()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {name: kernel(x) for name, (kernel, _) in layouts.items()}
        for threads in (2, 4):
            torch.set_num_threads(threads)
            for name, (kernel, _) in layouts.items():
                assert torch.equal(kernel(x), one[name]), f"{name}: {threads} threads differ from one"
    finally:
        torch.set_num_threads(before)


def test_float_prefill_is_the_float_gemm_and_not_invariant(layouts):
    """runtime.quant_prefill=float (float_rows 16): calls of up to 16 rows keep the int8 numerics, more
    rows run the float GEMM over x as it is (its reference) and so differ from the same rows one at a
    time: the invariance it documents giving up."""
    from zoo.compiler.quant import cpu_kernels

    f = cpu_kernels.FLOAT_ROWS
    x = _x(40)
    for name, (kernel, reference) in layouts.items():
        assert torch.equal(kernel(x[:16], f), kernel(x[:16])), f"{name}: 16 rows, float setting"
        many = kernel(x, f)
        assert_logits_close(many, reference(x, f), rtol=1e-5, what=f"{name}: float GEMM against its reference")
        assert not torch.equal(many[:1], kernel(x[:1])), f"{name}: the float GEMM equals the int8 path"
    with pytest.raises(RuntimeError, match="float_rows must be 0"):
        torch.ops.zoo_quant.int8_linear(x[:, :416].contiguous(), torch.zeros(O, I, dtype=torch.int8), torch.ones(O), -1)


def test_quant_prefill_setting_reaches_every_kernel_and_bad_values_name_the_key():
    """runtime.quant_prefill: int8 (the default, float_rows 0) or float (16) on every QuantLinear and
    QuantExperts of a build; anything else refused naming the key, the value and the choices."""
    import zoo
    from zoo.compiler.errors import ConfigError
    from zoo.compiler.quant.experts import QuantExperts
    from zoo.compiler.quant.linear import QuantLinear

    for overrides, rows in (((), 0), (("runtime.quant_prefill=float",), 16)):
        m = zoo.build("deepseek_v3_tiny", list(overrides), quant="int4", dry=True)
        quantized = [q for q in m.module.modules() if isinstance(q, (QuantLinear, QuantExperts))]
        assert any(isinstance(q, QuantExperts) for q in quantized)
        assert {q.float_rows for q in quantized} == {rows}, overrides
    with pytest.raises(ConfigError, match=r"runtime\.quant_prefill: expected one of \['int8', 'float'\], got 'fp32'"):
        zoo.build("llama3_8b_tiny", ["runtime.quant_prefill=fp32"], quant="int4", dry=True)
