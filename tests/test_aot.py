"""runtime.aot: CPU layers as AOTInductor packages, prefill and decode (compiler/engine/aot.py).

Tiny random checkpoints saved by transformers: Llama with int4 weights (zoo's int4 and
decode-attention kernels inside the packages: the benchmark's path) against the same file
through dynamo's compiled layers and zoo's eager reading, and Qwen3-Next's Gated DeltaNet layers
(chunked prefill over a dynamic length, the recurrent state and conv caches written by the
packages) against transformers. Every prompt length through one prefill package, decode through
the caches equal to one prefill, a row's prefill (serving) sharing the batch package at
max_batch=1, a fresh process that loads the packages without importing dynamo or inductor, and
the clear errors for settings packages cannot serve. Four packages are compiled in all (each
~20-25 s on a cold cache): CI time.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.compiler.errors import ConfigError
from tests.helpers import assert_logits_close, check_decode_equals_prefill, check_parity, save_reference

transformers = pytest.importorskip("transformers")

AOT = ["runtime.aot=true"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.test_llama import make_reference

    path = tmp_path_factory.mktemp("llama")
    make_reference(path, {}, {})
    return path


def test_llama_int4_packages_equal_the_compiled_layers(llama):
    """The packages run the graphs inductor makes for the compiled layers: equal logits to theirs
    (measured: identical) in prefill at several lengths and in decode, and to the eager reading
    within int4's compiled tolerance (the fused norm rounds the activations differently before the
    int8 activation codes, as test_quant)."""
    kw = dict(quant="int4", max_batch=1, max_seq=32)
    m = zoo.from_pretrained(str(llama), overrides=AOT, **kw)
    compiled = zoo.from_pretrained(str(llama), overrides=["runtime.aot=false"], **kw)
    assert compiled.engine.runner_kind == "compiled"
    eager = zoo.from_pretrained(str(llama), compile=False, **kw)
    assert m.engine.graph_counts() == {"prefill_packages": 1, "decode_packages": 1}
    gen = torch.Generator().manual_seed(1)
    for n in (2, 7, 32):  # one package for every prompt length
        ids = torch.randint(0, m.spec.vocab_size, (1, n), generator=gen)
        a, c, e = m.prefill(ids), compiled.prefill(ids), eager.prefill(ids)
        assert_logits_close(a, c, 1e-6, f"int4 prefill of {n} tokens, packages vs compiled layers")
        assert_logits_close(a, e, 2e-2, f"int4 prefill of {n} tokens, packages vs eager")
    ids = torch.randint(0, m.spec.vocab_size, (1, 7), generator=gen)
    tok = compiled.prefill(ids)[:, -1].argmax(-1)
    m.prefill(ids), eager.prefill(ids)
    for step in range(6):
        a, c, e = m.decode(tok), compiled.decode(tok), eager.decode(tok)
        assert_logits_close(a, c, 1e-6, f"int4 decode step {step}, packages vs compiled layers")
        assert_logits_close(a, e, 2e-2, f"int4 decode step {step}, packages vs eager")
        tok = c.argmax(-1)
    seq = torch.randint(0, m.spec.vocab_size, (1, 12), generator=gen)
    check_decode_equals_prefill(m, seq, prompt_len=5, rtol=3e-2)
    # a row's prefill (the server's path) has the batch's layout at max_batch=1: the same package
    m.engine.release_row(0)
    row = m.engine.prefill_row(0, ids[0])
    assert_logits_close(row, compiled.prefill(ids)[0, -1], 1e-6, "prefill_row through the packages")
    assert m.engine.graph_counts() == {"prefill_packages": 1, "decode_packages": 1}
    assert len(m.engine.packages_built()) <= 2


def test_a_warm_process_imports_neither_dynamo_nor_inductor(llama):
    """What makes a warm start fast: the packages are on disk (the test above made them), so a new
    process builds, prefills and decodes without importing torch._dynamo or torch._inductor (~4 s
    of torch's Python on this project's machines) and compiles nothing."""
    script = f"""
import json, sys, torch, zoo
m = zoo.from_pretrained({str(llama)!r}, quant="int4", max_batch=1, max_seq=32, overrides={AOT!r})
out = m.generate(torch.tensor([[1, 2, 3]]), 4)
print(json.dumps({{"built": m.engine.packages_built(), "counts": m.engine.graph_counts(),
                  "tokens": out.shape[1], "imported": sorted(k for k in ("torch._dynamo", "torch._inductor")
                                                          if k in sys.modules)}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"built": [], "counts": {"prefill_packages": 1, "decode_packages": 1}, "tokens": 7,
                   "imported": []}


def test_gated_deltanet_matches_transformers(tmp_path):
    """Qwen3-Next's linear-attention layers (DeltaNet chunked prefill over a dynamic length: the
    chunk padding depends on it) with their MoE: one structure, one prefill package and one
    decode package per decode bucket (1 and 2 rows)."""
    from tests.test_qwen3_next import randomize, tiny_config

    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(tiny_config(num_hidden_layers=2,
                                                        layer_types=["linear_attention"] * 2)).eval()
    randomize(ref)
    save_reference(ref, tmp_path)
    m = zoo.from_pretrained(str(tmp_path), max_batch=2, max_seq=32, overrides=AOT + ["mixers.linear.chunk_size=4"])
    assert m.engine.graph_counts() == {"prefill_packages": 1, "decode_packages": 2}
    with torch.no_grad():
        for n in (9, 2):  # a length that pads its last chunk, and the shortest
            ids = torch.randint(0, m.spec.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
            # full forwards without a cache (transformers' cache needs an attention layer)
            check_parity(lambda seq: ref(seq, use_cache=False), m, ids, steps=4)
    seq = torch.randint(0, m.spec.vocab_size, (2, 14), generator=torch.Generator().manual_seed(4))
    check_decode_equals_prefill(m, seq, prompt_len=6)
    assert m.engine.graph_counts() == {"prefill_packages": 1, "decode_packages": 2}


@pytest.mark.parametrize("kw", [{"compile": False}, {"device": "cuda"}])
def test_settings_it_cannot_serve_are_refused(llama, kw):
    with pytest.raises(ConfigError, match=r"runtime\.aot=true needs runtime\.device=cpu"):
        zoo.from_pretrained(str(llama), max_seq=32, overrides=AOT, **kw)


def test_auto_uses_packages_only_where_they_apply(llama):
    eager = zoo.from_pretrained(str(llama), max_seq=32, compile=False, overrides=["runtime.aot=auto"])
    assert not eager.engine.aot and eager.engine.graph_counts() == {"prefill": 0, "decode": 0}
    with pytest.raises(ConfigError, match=r"runtime\.aot: expected one of \['false', 'true', 'auto'\], got 'maybe'"):
        zoo.from_pretrained(str(llama), max_seq=32, overrides=["runtime.aot=maybe"])


def test_the_packages_are_the_default_on_a_cpu(llama, tmp_path):
    """runtime.aot=auto by default: on a CPU, from_pretrained (a checkpoint directory, a GGUF
    file), `zoo generate` and `zoo serve` (conf= or weights=, with a drafter too) resolve to the
    packages without a flag, and to compiled regions with runtime.aot=false (dry builds: the runner
    stage is asked, nothing is compiled)."""
    from tests.test_gguf_load import write_llama_gguf
    from zoo.cli import _load, _speculative, parse_args
    from zoo.compiler.build import runner_stage

    def kind(m) -> str:
        return runner_stage(m.spec, torch.device("cpu"), dry=False).runner

    gguf = write_llama_gguf(tmp_path / "tiny.gguf", transformers.LlamaForCausalLM.from_pretrained(str(llama)))
    for path in (str(llama), str(gguf)):
        # from_pretrained's own defaults (compile=True), as the API passes them
        assert kind(zoo.runtime.from_pretrained_config(path, dry=True, compile=True, max_seq=32)) == "aot", path
        assert kind(zoo.runtime.from_pretrained_config(path, ["runtime.aot=false"], dry=True, compile=True,
                                                       max_seq=32)) == "compiled", path
    for command in ("generate", "serve"):
        for source in (f"weights={gguf}", "conf=llama3_8b_tiny"):
            for extra in ([], ["speculative=ngram"]):
                opts, overrides = parse_args([source, *extra], command)
                got = kind(_load(opts, _speculative(opts, overrides), dry=True, progress=False))
                assert got == "aot", (command, source, extra)
    # where packages do not apply (tp / ep: tests/test_build_stages.py's runner stage)
