"""A GGUF file's blocks kept by default (runtime.quant=null on the CPU), float as the opt-out
(quant=none): which modules keep which layout, the load report's per-type count, logits against
transformers' own dequantization of the file (prefill and every decode step), no float copy of a
kept tensor, the weight cache, and a file too large for the machine refused before allocating,
with the kept bytes compared. The MoE twins (expert stacks kept) are in test_gguf_families.py
(test_gguf_moe_kept_by_default); SmolLM2's shipped file in test_quant_smollm2.py.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.errors import ZooError  # noqa: E402
from zoo.compiler.quant.linear import QuantLinear  # noqa: E402
from tests.helpers import check_decode_equals_prefill, check_parity  # noqa: E402
from tests.test_gguf_load import random_llama, reference, tiny_gguf  # noqa: E402,F401  (module fixtures)
from tests.test_gguf_quants import KDIMS, MIXES, write_mix  # noqa: E402

# zoo's kernels round activations to int8 per 32 inputs on up to 16 rows (llama.cpp's numerics):
# the tiny twins' logits stay within this share of the largest logit (measured under 0.02)
KEPT_RTOL = 5e-2
LAYOUT = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int5", "Q5_1": "int5", "Q5_K": "int5",
          "Q6_K": "q6k"}  # every other block type: int8g


def _mapped_file(t: torch.Tensor):
    """The path (or [heap], ...) of the mapping holding tensor t's bytes (/proc/self/maps), or None."""
    at = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= at < hi:
                return rest[4] if len(rest) > 4 else None
    return None


def _float_elements(m) -> int:
    return sum(p.numel() for p in m.module.parameters())


def _elements(path, names) -> int:
    entries = GGUFSource(str(path)).entries()
    return sum(math.prod(entries[n].shape) for n in names)


def test_default_keeps_the_blocks_per_module(tiny_gguf, reference):
    """tests/test_gguf_load.py's file (q / k / v Q8_0 / Q4_0 / Q4_1, gate Q8_0 next to up F16,
    o BF16, down F32, token_embd Q8_0, untied output F16): wqkv keeps its three types (re-blocked
    as int8 codes), the embedding looks its rows up in its own Q8_0 blocks, everything stored as
    floats stays float, and the Q8_0 gate joined with an F16 up is dequantized, named in the
    report with its reason. The float parameters are exactly the float and dequantized tensors
    (no float copy of a kept one). Logits: transformers' at the prefill and every decode step,
    and decoding through the caches equals one prefill (<= 16 rows: the same kernel path)."""
    m = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=48)
    assert m.info.quant.mode == "stored"
    body = m.module
    for layer in body.layers:
        wqkv = layer.mixer.wqkv
        assert isinstance(wqkv, QuantLinear) and wqkv.blocks_only and (wqkv.layout, wqkv.group) == ("int8g", 32)
        assert type(layer.mixer.wo) is nn.Linear and type(layer.ffn.w13) is nn.Linear and type(layer.ffn.w2) is nn.Linear
    assert type(body.head) is nn.Linear  # output.weight is F16: float
    assert body.embed.weight is None and body.embed.rows_from is body.embed.stored
    assert body.embed.stored.layout == "int8g" and body.embed.stored.scales.dtype == torch.float16  # Q8_0 as stored
    want_rows = GGUFSource(str(tiny_gguf)).read("token_embd.weight")
    ids = torch.tensor([0, 5, 255, 17])
    assert torch.equal(body.embed(ids[None])[0], want_rows[ids])

    held, how = m.info.load.held, m.info.load.tensors
    assert set(held["kept"]) == {"Q8_0", "Q4_0", "Q4_1"} and held["kept"]["Q8_0"][0] == 1 + 2  # token_embd, attn_q x2
    assert set(held["float"]) == {"BF16", "F16", "F32"}
    assert held["dequantized"] == {"Q8_0": [2, held["dequantized"]["Q8_0"][1]]}  # the two ffn_gate
    assert how["blk.0.ffn_gate.weight"] == "dequantized Q8_0 -> float32"
    assert "layers.0.ffn.w13.weight" in m.info.quant.kept_float
    assert "dequantized" in m.info.quant.kept_float["layers.0.ffn.w13.weight"]
    floats = [n for n, h in how.items() if not h.startswith("kept") and "kept" not in h]
    assert _float_elements(m) == _elements(tiny_gguf, floats)
    assert m.info.params == sum(p.numel() for p in reference.parameters())

    torch.manual_seed(2)
    seq = check_parity(reference, m, torch.randint(0, 256, (1, 11)), steps=4, rtol=KEPT_RTOL)
    check_decode_equals_prefill(m, seq, prompt_len=6, rtol=1e-4)


def test_quant_none_is_the_float_path(tiny_gguf):
    """quant=none: every linear and the embedding float, every block dequantized (the report says
    so per type), nothing kept."""
    m = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, quant="none")
    assert m.info.quant is None
    assert not [q for q in m.module.modules() if isinstance(q, QuantLinear)]
    assert m.module.embed.weight is not None and m.module.embed.weight.dtype == torch.float32
    held = m.info.load.held
    assert "kept" not in held and set(held["dequantized"]) == {"Q8_0", "Q4_0", "Q4_1"}


@pytest.fixture(scope="module")
def kquant_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**KDIMS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("mix", ["Q4_K_M", "others"])
def test_kquant_mix_kept_by_default(tmp_path, kquant_llama, mix):
    """llama.cpp's Q4_K_M mix and one of Q5_0 / Q5_1 / IQ4_NL / IQ4_XS / Q2_K / Q3_K / Q8_0 /
    Q4_0 / Q4_1 (test_gguf_quants.MIXES), no quant=: each linear in the layout of its type, the
    head too, the untied embedding reading its own blocks; logits as transformers' (prefill of
    24 rows under runtime.quant_prefill=float: the float32 GEMM path, tight; decode steps:
    int8-rounded activations)."""
    path = write_mix(tmp_path / f"{mix}.gguf", kquant_llama, mix)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    m = zoo.from_pretrained(str(path), compile=False, max_seq=32, max_batch=2, quant_prefill="float")
    types, body = MIXES[mix], m.module
    for part, module in (("attn_output", body.layers[0].mixer.wo), ("ffn_down", body.layers[0].ffn.w2),
                         ("output", body.head), ("token_embd", body.embed.stored)):
        assert isinstance(module, QuantLinear) and module.blocks_only, part
        assert module.layout == LAYOUT.get(types[part], "int8g"), (part, types[part], module.layout)
    assert body.embed.weight is None
    for module in (body.layers[0].ffn.w2, body.layers[1].ffn.w2, body.head):  # Q6_K as stored: mapped, not copied
        if module.layout == "q6k":
            assert _mapped_file(module.qweight) == str(path), module
    assert _mapped_file(body.layers[0].mixer.wo.qweight) != str(path)  # repacked (int4 / int8 codes): its own memory
    held = m.info.load.held
    assert set(held) == {"kept", "float"} and set(held["float"]) == {"F32"}
    assert set(held["kept"]) == set(types.values())
    assert sum(p.numel() * p.element_size() for p in body.parameters()) == held["float"]["F32"][1]
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = ref(ids).logits
    assert (m.prefill(ids) - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    check_parity(ref, m, ids[:1, :6], steps=4, rtol=KEPT_RTOL)


def test_weight_cache_holds_the_kept_default(tmp_path, tiny_gguf, monkeypatch):
    """The default's layouts are planned before allocating, so a second load maps the cache entry
    back with the same state (the embedding's own blocks included)."""
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", str(tmp_path / "weights"))
    first = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)
    second = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)
    assert first.info.load.cache.startswith("wrote ") and second.info.load.cache.startswith("hit ")
    assert second.info.load.held == first.info.load.held
    a, b = first.module.state_dict(), second.module.state_dict()
    assert "embed.stored.qweight" in a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    assert torch.equal(first.prefill(ids), second.prefill(ids))


def _held_bytes(m) -> int:
    """What a loaded model really holds: the storages of its parameters and buffers (kept blocks,
    scales, float tensors; a file-mapped Q6_K tensor its mapped pages) and of the engine's caches,
    each storage once."""
    tensors = [*m.module.parameters(), *m.module.buffers(), *(t for layer in m.engine.caches for t in layer.values())]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("case", ["kept", "float", "Q4_K_M", "moe", "safetensors"])
def test_the_estimate_is_what_the_model_holds(tmp_path, tiny_gguf, random_llama, kquant_llama, case):
    """The fit check's figure, counted on the meta model from the checkpoint's headers (weights
    at their held size: kept blocks as repacked or mapped, float tensors in the runtime dtype;
    the cache plan at max_batch x max_seq), is within 20% of the bytes the loaded model holds,
    for the kept default, the float opt-out, a K-quant mix, a MoE's kept expert stacks and a
    safetensors checkpoint (measured: equal)."""
    from tests.test_gguf_families import FAMILIES, LAYOUTS, MOE_KEPT, twin, write_gguf

    path, quant = tiny_gguf, None
    if case == "float":
        quant = "none"
    elif case == "Q4_K_M":
        path = write_mix(tmp_path / "mix.gguf", kquant_llama, "Q4_K_M")
    elif case == "moe":
        layout, config_class, kwargs, *_ = FAMILIES["qwen3moe"]
        path = write_gguf(tmp_path / "moe.gguf", twin(config_class, kwargs), LAYOUTS[layout],
                          quantize=dict(MOE_KEPT["qwen3moe"]))
    elif case == "safetensors":
        random_llama.save_pretrained(tmp_path / "st")
        path = tmp_path / "st"
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, quant=quant)
    held = _held_bytes(m)
    assert abs(m.info.needed_bytes - held) <= 0.2 * held, (m.info.needed_bytes, held)
    assert m.info.cache_bytes == sum(t.numel() * t.element_size() for layer in m.engine.caches for t in layer.values())


def test_a_file_too_large_is_refused_before_reading(tiny_gguf, monkeypatch):
    """The fit check compares what the model will hold (the kept blocks' bytes, not their float
    size) with the memory it may use ($ZOO_MEMORY_LIMIT here) and refuses before any weight is
    read or anything allocated, naming the file, the weights and caches, what is available and
    from where, and what would fit (the largest max_seq, a smaller quant type, force_load)."""
    import zoo.compiler.build as build

    kept = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16).info
    floated = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, quant="none").info
    assert kept.needed_bytes < floated.needed_bytes
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(kept.needed_bytes))
    m = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)
    assert m.info.needed_bytes == kept.needed_bytes and m.info.available_bytes == kept.needed_bytes
    assert m.records.fit.available_from == "$ZOO_MEMORY_LIMIT" and not m.records.fit.forced

    def nothing(*args, **kwargs):
        raise AssertionError("read or allocated before the fit check refused")

    for name in ("read", "read_blocks"):
        monkeypatch.setattr(GGUFSource, name, nothing)
    monkeypatch.setattr(build, "materialize", nothing)
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(kept.needed_bytes - 1))
    with pytest.raises(ZooError) as e:
        zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)
    weights, caches = kept.param_bytes / 2**20, kept.cache_bytes / 2**20
    # one token of cache less than max_seq=16 fits in one byte less
    want = (rf"^{tiny_gguf} \(GGUF.*\): \S+ needs {kept.needed_bytes / 2**20:.2f} MiB: {weights:.2f} MiB of "
            rf"weights \([\d,]+ parameters in float32: [\d.]+ MiB of quantized or kept GGUF blocks, [\d.]+ MiB float\) "
            rf"\+ {caches:.2f} MiB of caches \(max_batch=1 x max_seq=16\), but cpu has "
            rf"{(kept.needed_bytes - 1) / 2**20:.2f} MiB available; nothing was allocated \(available is "
            rf"\$ZOO_MEMORY_LIMIT\)\. To fit: max_seq=15 \(the most that fits at max_batch=1\); a file of a "
            rf"smaller quant type .*; force_load=true to load anyway")
    assert re.match(want, str(e.value)), str(e.value)

    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(kept.param_bytes - 1))  # the weights alone do not fit
    with pytest.raises(ZooError, match=r"the weights alone \([\d.]+ MiB\) exceed what is available"):
        zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)
    with pytest.raises(ZooError, match=r"available is runtime.memory_limit\). To fit: .*quant= unset: the file's "
                                       r"blocks kept as stored"):
        zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, quant="none", memory_limit=kept.needed_bytes)


def test_force_load_and_the_limit_settings(tiny_gguf, monkeypatch):
    """force_load=True builds past the budget (the record says it was forced); the limit's setting
    takes precedence over $ZOO_MEMORY_LIMIT; a limit that is no positive byte count is refused
    naming the key or the variable."""
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "1000")
    m = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, force_load=True)
    assert m.records.fit.forced and not m.records.fit.fits and m.info.available_bytes == 1000
    assert m.prefill(torch.tensor([[1, 2, 3]])).shape == (1, 3, 256)
    m = zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, memory_limit=1 << 30)
    assert m.records.fit.available_from == "runtime.memory_limit" and m.info.available_bytes == 1 << 30
    with pytest.raises(ZooError, match=r"runtime.memory_limit=0: expected a positive number of bytes"):
        zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16, memory_limit=0)
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "8G")
    with pytest.raises(ZooError, match=r"\$ZOO_MEMORY_LIMIT='8G': expected a positive number of bytes"):
        zoo.from_pretrained(str(tiny_gguf), compile=False, max_seq=16)


def test_cli_refuses_a_file_too_large(tiny_gguf, monkeypatch, capsys):
    """zoo build / generate / serve of a file past the budget: exit 2, the refusal on stderr
    naming the file and the sizes; force_load=true builds it."""
    from zoo.cli import main as zoo_main

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "1000")
    for argv in (["build"], ["generate", "prompt=hi", "max_new_tokens=2"], ["serve"]):
        assert zoo_main([*argv, f"weights={tiny_gguf}", "compile=false", "max_seq=16"]) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert str(tiny_gguf) in err and "MiB" in err and "available" in err and "$ZOO_MEMORY_LIMIT" in err, (argv, err)
        assert "force_load=true" in err, (argv, err)
    assert zoo_main(["build", f"weights={tiny_gguf}", "compile=false", "max_seq=16", "force_load=true"]) == 0


def test_cli_build_reports_what_was_kept(tiny_gguf, capsys, monkeypatch):
    """`zoo build weights=file.gguf`: the report's rows per outcome and type, tensors and bytes."""
    from zoo.cli import main as zoo_main

    monkeypatch.setenv("COLUMNS", "400")  # the report's table unwrapped

    assert zoo_main(["build", f"weights={tiny_gguf}", "compile=false", "max_seq=16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GGUF blocks kept as stored" in out
    assert "kept as stored │ Q4_0 2 tensors" in out or "kept as stored Q4_0 2 tensors" in out, out
    assert "dequantized │ Q8_0 2 tensors" in out or "dequantized Q8_0 2 tensors" in out, out


def test_cli_generate_says_what_was_kept_on_smollm2(smollm2_gguf, capsys):
    """`zoo generate conf=smollm2_135m ...` (the shipped Q4_1 file), no quant=: the blocks kept,
    one line on stderr saying so per type (stdout keeps only the answer)."""
    from zoo.cli import main as zoo_main

    assert zoo_main(["generate", "conf=smollm2_135m", "prompt=What is the capital of France?", "chat=true",
                     "compile=false", "max_new_tokens=8"]) == 0
    captured = capsys.readouterr()
    assert "weights: kept as stored: Q4_1 210 tensors (63.28 MiB), Q8_0 1 tensor (28.69 MiB); float as stored: F32 " \
           "61 tensors" in captured.err, captured.err
    assert "France" in captured.out and "weights:" not in captured.out


def test_which_builds_keep_the_blocks(tiny_gguf, tmp_path):
    """The default keeps a file's blocks only where zoo's kernels run them in one process: a GGUF
    source on the CPU with runtime.quant unset; quant=none / int8 / int4, another device, a
    parallel run or a safetensors checkpoint decide as before (float unless quant= asks)."""
    from zoo.compiler.build import keeps_stored_blocks, spec_stage
    from zoo.compiler.checkpoint.hub import open_source
    from zoo.compiler.config import compose

    def keeps(overrides, source, device="cpu"):
        spec = spec_stage(compose("llama3_8b_tiny", overrides), "conf/llama3_8b_tiny.yaml").spec
        return keeps_stored_blocks(spec, source, torch.device(device))

    gguf_source = GGUFSource(str(tiny_gguf))
    assert keeps([], gguf_source)
    assert not keeps(["runtime.quant=none"], gguf_source) and not keeps(["runtime.quant=int4"], gguf_source)
    assert not keeps([], gguf_source, "meta") and not keeps([], None)
    assert not keeps(["runtime.parallel.tp=2"], gguf_source)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(tmp_path)
    assert not keeps([], open_source(str(tmp_path)))
