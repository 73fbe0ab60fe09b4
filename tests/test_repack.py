"""The native repack of GGUF blocks into zoo's kernel layouts (compiler/quant/repack.py / .cpp)
equals the torch reference it replaces (gguf_blocks.int4_parts / int5_parts / to_mixed / codes)
bit for bit, on random blocks and through a whole load: a tiny Qwen3-MoE file of Q4_K / Q5_K /
Q6_K linears and expert stacks loads to the same buffers and logits with and without it (and with
gate and up joined before the repack instead of each repacked into its rows)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.contracts import StoredBlocks  # noqa: E402
from zoo.compiler.quant import gguf_blocks, repack  # noqa: E402
from zoo.compiler.quant.experts import QuantExperts  # noqa: E402
from tests.gguf_writer import LAYOUTS, write_gguf  # noqa: E402
from tests.test_gguf_quants import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType

needs_native = pytest.mark.skipif(not repack.native_available(), reason="repack.cpp did not build")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Float tensors compared by their bits (-0.0 and +0.0 told apart)."""
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.dtype == torch.float16 else t


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(_bits(a), _bits(b)), what


@needs_native
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K"])
def test_native_int4_int5_equal_the_reference(ggml_type):
    R, nb = 37, 3  # an odd row count: the row split of the parallel loop
    data = torch.from_numpy(random_blocks(ggml_type, R, nb, seed=nb))
    b = StoredBlocks(ggml_type, data, (R, nb * 256))
    ref = gguf_blocks.int4_parts(b) if ggml_type == "Q4_K" else gguf_blocks.int5_parts(b)
    # outputs as the buffers are: d and m rows of one scales tensor [R, 2, I/32] (strided views)
    scales = torch.full((R, 2, nb * 8), float("nan"))
    qs = torch.full((R, nb * 128), 0xAA, dtype=torch.uint8)
    if ggml_type == "Q4_K":
        repack.into_int4(b, qs, scales[:, 0], scales[:, 1])
        got = (qs, scales[:, 0], scales[:, 1])
    else:
        qh = torch.full((R, nb * 32), 0x55, dtype=torch.uint8)
        repack.into_int5(b, qs, qh, scales[:, 0], scales[:, 1])
        got = (qs, qh, scales[:, 0], scales[:, 1])
    for name, g, r in zip(("qs", "qh", "d", "m") if len(got) == 4 else ("qs", "d", "m"), got, ref):
        _same(g, r, f"{ggml_type} {name}")
    # and through the kernels' own dequantization: gguf's values
    w = torch.from_numpy(gguf.quants.dequantize(data.numpy(), Q[ggml_type]))
    from zoo.compiler.quant import cpu_kernels
    deq = cpu_kernels.int4_dequantize(qs, scales, got[1] if ggml_type == "Q5_K" else None)
    _same(deq, w.reshape(R, -1), f"{ggml_type} values")


@needs_native
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K"])
def test_native_stack_part_rows_equal_the_reference(ggml_type):
    """A part of an expert stack (w13's up rows) [E, n, I] into its rows of the buffers [E, O, ...]."""
    E, n, O, nb = 3, 5, 12, 2
    data = torch.from_numpy(random_blocks(ggml_type, E * n, nb, seed=11)).reshape(E, n, -1)
    qs = torch.zeros(E, O, nb * 128, dtype=torch.uint8)
    qh = torch.zeros(E, O, nb * 32, dtype=torch.uint8)
    sc = torch.zeros(E, O, 2, nb * 8)
    b = StoredBlocks(ggml_type, data, (E, n, nb * 256))
    if ggml_type == "Q4_K":
        repack.into_int4(b, qs[:, 4:4 + n], sc[:, 4:4 + n, 0], sc[:, 4:4 + n, 1])
    else:
        repack.into_int5(b, qs[:, 4:4 + n], qh[:, 4:4 + n], sc[:, 4:4 + n, 0], sc[:, 4:4 + n, 1])
    for e in range(E):
        part = StoredBlocks(ggml_type, data[e], (n, nb * 256))
        ref = gguf_blocks.int4_parts(part) if ggml_type == "Q4_K" else gguf_blocks.int5_parts(part)
        got = (qs[e, 4:4 + n], sc[e, 4:4 + n, 0], sc[e, 4:4 + n, 1]) if ggml_type == "Q4_K" else \
            (qs[e, 4:4 + n], qh[e, 4:4 + n], sc[e, 4:4 + n, 0], sc[e, 4:4 + n, 1])
        for g, r in zip(got, ref):
            _same(g, r, f"expert {e}")
    assert not qs[:, :4].any() and not qs[:, 4 + n:].any() and not sc[:, :4].any()  # the other rows untouched


@needs_native
@pytest.mark.parametrize("ggml_type, fmt", [("Q4_K", "ZQ8_G16"), ("Q4_K", "ZQ8_G32"), ("Q5_K", "ZQ8_G16"),
                                            ("Q5_K", "ZQ8_G32"), ("Q6_K", "ZQ8_G16")])
def test_native_mixed_reblocking_equals_the_reference(ggml_type, fmt):
    data = torch.from_numpy(random_blocks(ggml_type, 19, 2, seed=7))
    got = repack.to_mixed(data, ggml_type, fmt)
    assert torch.equal(got, gguf_blocks.to_mixed(data, ggml_type, fmt))
    # the int8g fill of ZQ8 bytes (natively, and the views of the fallback) is the format's codes and scales
    ref = gguf_blocks.codes(got, fmt)
    q, d, m = repack.zq8_parts(got, fmt)
    for qq, dd, mm in ((q.reshape(19, -1), d, m), _split(got, fmt)):
        _same(qq.int(), ref.q, "q")
        _same(dd, ref.d, "d")
        _same(mm, ref.m, "m")


def _split(data, fmt):
    g = gguf_blocks.layout(fmt).group
    n = data.shape[1] // (g + 8)
    q = torch.zeros(len(data), n * g, dtype=torch.int8)
    sm = torch.full((len(data), 2, n), float("nan"))
    repack.into_int8g_zq8(data, fmt, q, sm[:, 0], sm[:, 1])
    return q, sm[:, 0], sm[:, 1]


def test_reference_path_where_native_does_not_apply():
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 are their bytes copied: into_* still writes int4_parts' values."""
    for t, into in (("Q4_0", "int4"), ("Q4_1", "int4"), ("Q5_0", "int5"), ("Q5_1", "int5")):
        data = torch.from_numpy(random_blocks(t, 5, 16, seed=2))
        b = StoredBlocks(t, data, (5, 16 * 32))
        sm = torch.empty(5, 2, 16, dtype=torch.float16)
        qs = torch.empty(5, 256, dtype=torch.uint8)
        if into == "int4":
            repack.into_int4(b, qs, sm[:, 0], sm[:, 1])
            ref, got = gguf_blocks.int4_parts(b), (qs, sm[:, 0], sm[:, 1])
        else:
            qh = torch.empty(5, 64, dtype=torch.uint8)
            repack.into_int5(b, qs, qh, sm[:, 0], sm[:, 1])
            ref, got = gguf_blocks.int5_parts(b), (qs, qh, sm[:, 0], sm[:, 1])
        for g, r in zip(got, ref):
            _same(g, r.to(g.dtype), t)


def test_bad_output_shape_names_it():
    data = torch.from_numpy(random_blocks("Q4_K", 2, 1))
    with pytest.raises(Exception, match=r"output d of shape \[2, 4\].*expected \[2, 8\]"):
        repack.into_int4(StoredBlocks("Q4_K", data, (2, 256)), torch.empty(2, 128, dtype=torch.uint8),
                         torch.empty(2, 4), torch.empty(2, 8))


# a tiny Qwen3-MoE of every repacked shape: inputs of 256 (the K-quants' block)
MOE = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           tie_word_embeddings=False, use_sliding_window=False, max_position_embeddings=256,
           rope_parameters={"rope_type": "default", "rope_theta": 1e6},
           bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Q4_K_M's mix: q / k Q4_K with v Q6_K (one wqkv: ZQ8), Q4_K gate / up, Q6_K down; layer 1 Q5_K
# stacks (int5) and Q5_K q / k / v (an int5 wqkv)
TYPES = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q4_K", "blk.0.ffn_down_exps.weight": "Q6_K",
         "blk.1.attn_q.weight": "Q5_K", "blk.1.attn_k.weight": "Q5_K", "blk.1.attn_v.weight": "Q5_K",
         "blk.1.ffn_gate_exps.weight": "Q5_K", "blk.1.ffn_up_exps.weight": "Q5_K", "blk.1.ffn_down_exps.weight": "Q4_K"}


def _moe_file(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**MOE)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    shapes = {"attn_q": (64, 256), "attn_k": (32, 256), "attn_v": (32, 256),
              "ffn_gate_exps": (4, 256, 256), "ffn_up_exps": (4, 256, 256), "ffn_down_exps": (4, 256, 256)}
    blocks = {}
    for i, (name, t) in enumerate(TYPES.items()):
        shape = shapes[name.split(".")[2]]
        data = random_blocks(t, int(np.prod(shape[:-1])), 1, seed=i).reshape(*shape[:-1], -1)
        blocks[name] = (data, getattr(Q, t))
    return ref, write_gguf(tmp_path / "moe.gguf", ref, LAYOUTS["qwen3moe"], quantize=blocks)


@needs_native
def test_a_moe_file_loads_the_same_with_and_without_native_repack(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", "0")
    ref, path = _moe_file(tmp_path)
    taken, real = [], QuantExperts.load_row_parts
    monkeypatch.setattr(QuantExperts, "load_row_parts", lambda self, parts, dim: taken.append(real(self, parts, dim))
                        or taken[-1])
    fast = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=16)
    monkeypatch.setattr(QuantExperts, "load_row_parts", real)
    assert len(taken) == 2 and all(taken), taken  # both layers' w13 (q4, int5) filled part by part
    with monkeypatch.context() as m:
        m.setattr(repack, "native_available", lambda: False)
        slow = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=16)
    with monkeypatch.context() as m:  # gate and up joined by the rule's cat first (one copy), then repacked
        m.setattr(QuantExperts, "load_row_parts", lambda self, parts, dim: None)
        joined = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=16)
    stacks = [q for q in fast.module.modules() if isinstance(q, QuantExperts)]
    assert sorted(q.layout for q in stacks) == ["int5", "q4", "q4", "q6k"]
    tensors = fast.info.load.tensors
    assert "kept Q4_K blocks as int4 g32" in tensors["blk.0.ffn_gate_exps.weight"]
    assert "kept (with parts of other types) as int8 g16" in tensors["blk.0.attn_v.weight"]
    a = fast.module.state_dict()
    for other in (slow, joined):
        b = other.module.state_dict()
        assert a.keys() == b.keys()
        for name in a:
            _same(a[name], b[name], name)
    ids = torch.randint(0, MOE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    logits = fast.prefill(ids)
    _same(logits, slow.prefill(ids), "prefill logits")
    # and the twin's logits (transformers' own dequantization of the file), within int8 activations
    from tests.helpers import assert_logits_close
    assert_logits_close(logits, ref(ids).logits, 5e-2, "prefill")
