"""zoo's CPU kernels at every instruction-set level this machine runs (compiler/native.py ISAS:
avx512_vnni, avx512, avx2, portable): the level chosen by default is the best the CPU has, $ZOO_CPU_ISA
forces a lower one (a library per level; one level per process, since each registers the same
ops), and at each level the kernels compute their torch reference (the kernel tests of
test_quant.py and test_gguf_quants.py, run in a subprocess per level)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo.compiler import native

ROOT = Path(__file__).resolve().parent.parent
LEVEL = {"avx512_vnni": 4, "avx512": 3, "avx2": 2, "portable": 0}


def usable_levels() -> list[str]:
    have = native.cpu_flags()
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return [n for n, (need, _) in native.ISAS.items() if set(need) <= have and (vector or not need)]


def test_every_level_is_tested():
    assert list(LEVEL) == list(native.ISAS)


def test_default_level_is_the_best_the_cpu_runs():
    if os.environ.get(native.ISA_ENV):
        pytest.skip(f"${native.ISA_ENV} is set")
    assert native.isa() == usable_levels()[0]
    from zoo.compiler.quant import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    assert torch.ops.zoo_quant.simd_level() == LEVEL[native.isa()]


def test_a_forced_level_the_cpu_lacks_or_an_unknown_one_is_refused(monkeypatch):
    lacking = [n for n in native.ISAS if n not in usable_levels()]
    for value, words in [("avx1024", "expected one of avx512_vnni, avx512, avx2, portable")] + \
            [(n, "this CPU lacks") for n in lacking]:
        monkeypatch.setenv(native.ISA_ENV, value)
        native.isa.cache_clear()
        try:
            with pytest.raises(ValueError, match=words):
                native.isa()
        finally:
            native.isa.cache_clear()


@pytest.mark.parametrize("level", list(LEVEL))
def test_kernels_compute_their_reference_at_each_level(level):
    if level not in usable_levels():
        lacking = sorted(set(native.ISAS[level][0]) - native.cpu_flags()) or ["torch AVX2 dispatch"]
        pytest.skip(f"this CPU does not run {level}: it lacks {', '.join(lacking)}")
    if level == native.isa():
        pytest.skip(f"{level} is this process's level: the kernel tests run on it in the suite itself")
    env = dict(os.environ, **{native.ISA_ENV: level})
    check = (f"import torch; from zoo.compiler.quant import cpu_kernels as k; assert k.available(), k.status(); "
             f"assert torch.ops.zoo_quant.simd_level() == {LEVEL[level]}, torch.ops.zoo_quant.simd_level()")
    subprocess.run([sys.executable, "-c", check], env=env, cwd=ROOT, check=True)
    tests = ["tests/test_quant.py::test_cpu_kernel_computes_its_reference",
             "tests/test_quant.py::test_int4_reference_and_kernel_against_an_independent_float64_computation",
             "tests/test_gguf_quants.py::test_int8g_kernel_computes_its_reference",
             "tests/test_gguf_quants.py::test_int5_kernel_computes_its_reference",
             "tests/test_gguf_quants.py::test_int4_kernel_takes_float32_scales",
             "tests/test_gguf_quants.py::test_q6k_kernel_computes_its_reference",
             "tests/test_gguf_quants.py::test_quant_linear_keeps_every_block_type_exactly",
             "tests/test_kernel_invariance.py",
             "tests/test_expert_kernel.py::test_expert_kernel_computes_its_reference_and_the_float_experts",
             "tests/test_expert_kernel.py::test_a_rows_expert_output_is_the_same_bits_whatever_other_rows_chose_it"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
