"""runtime.aot_decode: CPU decode layers as AOTInductor packages (compiler/engine/aot.py).

Tiny random checkpoints saved by transformers: Llama with int4 weights (zoo's int4 and
decode-attention kernels inside the package: the benchmark's path) against zoo's eager reading
of the same file, and Qwen3-Next (Gated DeltaNet's recurrent state and conv caches written by
the package, gated attention) against transformers. Each step of a continuous decode, and decode
through the caches equal to one prefill; a second engine loads the packages without compiling;
one package per layer structure; the clear error for a setting it cannot serve. Three packages
are compiled in all (each ~15 s on a cold cache): CI time.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.compiler.errors import ConfigError
from tests.helpers import assert_logits_close, check_decode_equals_prefill, check_parity, save_reference

transformers = pytest.importorskip("transformers")

AOT = ["runtime.aot_decode=true"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.test_llama import make_reference

    path = tmp_path_factory.mktemp("llama")
    make_reference(path, {}, {})
    return path


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    from tests.test_qwen3_next import randomize, tiny_config

    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    randomize(ref)
    path = tmp_path_factory.mktemp("qwen3_next")
    save_reference(ref, path)
    return ref, path


def test_llama_int4_decode_equals_the_compiled_layers(llama):
    """The package runs the graph inductor makes for the compiled layers: equal logits to theirs
    (measured: identical), and to the eager reading within int4's compiled tolerance (the fused
    norm rounds the activations differently before the int8 activation codes, as test_quant)."""
    m = zoo.from_pretrained(str(llama), quant="int4", max_batch=2, max_seq=32, overrides=AOT)
    compiled = zoo.from_pretrained(str(llama), quant="int4", max_batch=2, max_seq=32)
    eager = zoo.from_pretrained(str(llama), quant="int4", max_batch=2, max_seq=32, compile=False)
    assert m.engine.graph_counts() == {"prefill": 1, "decode": 0, "decode_packages": 1}
    ids = torch.randint(0, m.spec.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    a, c, e = m.prefill(ids), compiled.prefill(ids), eager.prefill(ids)
    tok = c[:, -1].argmax(-1)
    for step in range(6):
        a, c, e = m.decode(tok), compiled.decode(tok), eager.decode(tok)
        assert_logits_close(a, c, 1e-6, f"int4 decode step {step}, packages vs compiled layers")
        assert_logits_close(a, e, 2e-2, f"int4 decode step {step}, packages vs eager")
        tok = c.argmax(-1)
    seq = torch.randint(0, m.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    check_decode_equals_prefill(m, seq, prompt_len=5, rtol=3e-2)
    # a second engine of the same structure loads the package: nothing compiled
    again = zoo.from_pretrained(str(llama), quant="int4", max_batch=2, max_seq=32, overrides=AOT)
    assert again.engine.aot.built == [] and again.engine.aot.packages == 1
    again.prefill(ids), compiled.prefill(ids)
    assert_logits_close(again.decode(tok), compiled.decode(tok), 1e-6, "second engine decode")


def test_qwen3_next_matches_transformers(qwen3_next):
    ref, path = qwen3_next
    m = zoo.from_pretrained(str(path), max_batch=2, max_seq=32, overrides=AOT + ["mixers.linear.chunk_size=4"])
    # DeltaNet and gated-attention layers: two structures, two packages, no dynamo decode graph
    assert m.engine.aot.packages == 2 and m.engine.graph_counts()["decode"] == 0
    ids = torch.randint(0, m.spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        check_parity(ref, m, ids, steps=4)
    seq = torch.randint(0, m.spec.vocab_size, (2, 14), generator=torch.Generator().manual_seed(4))
    check_decode_equals_prefill(m, seq, prompt_len=6)


@pytest.mark.parametrize("kw", [{"compile": False}, {"device": "cuda"}])
def test_settings_it_cannot_serve_are_refused(llama, kw):
    with pytest.raises(ConfigError, match=r"runtime\.aot_decode=true needs runtime\.device=cpu"):
        zoo.from_pretrained(str(llama), max_seq=32, overrides=AOT, **kw)
