"""zoo's expert-stack kernel (zoo_quant.expert_linear, cpu_kernels.cpp; QuantExperts' one
`zoo::block_expert_mm` call per stack): against its torch reference (cpu_kernels.expert_reference)
and against the float experts it holds (gguf's dequantization of the blocks), for every kept
layout (int4 from Q4_0 / Q4_K, int5 from Q5_0 / Q5_K, q6k from Q6_K, int8g from Q8_0 / Q2_K / Q3_K)
at 1, 3 and 17 rows with experts of no rows; w13's gated form (act(gate) * up in the call, the
clamped gpt-oss variant too); batch invariance (a row's output the same bits whatever other rows
chose its expert); and a qwen3_moe GGUF twin with Q4_K, Q5_K and Q6_K expert stacks against
transformers at prefill and every decode step. tests/test_cpu_isa.py runs the kernel tests at
every ISA level the CPU has."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from zoo.compiler.contracts import StoredBlocks  # noqa: E402
from zoo.compiler.quant import cpu_kernels  # noqa: E402
from zoo.compiler.quant.experts import KERNEL_KIND, QuantExperts  # noqa: E402
from tests.test_gguf_quants import scaled_blocks  # noqa: E402

E, O, I = 6, 48, 512  # O = 2F for the gated form; I two Q*_K blocks of 256
LAYOUT = {"Q4_0": "q4", "Q4_K": "q4", "Q5_0": "int5", "Q5_K": "int5", "Q6_K": "q6k", "Q8_0": "int8g",
          "Q2_K": "int8g", "Q3_K": "int8g"}
# rows per expert (sorted by expert): experts 0, 3 (and more at 1 row) choose none
COUNTS = {1: [0, 0, 0, 0, 1, 0], 3: [0, 1, 2, 0, 0, 0], 17: [0, 12, 1, 0, 4, 0]}
GATED = [dict(), dict(limit=0.3, alpha=1.702, up_offset=1.0)]  # SwiGLU; gpt-oss's clamped variant


def stack(ggml_type: str, seed: int = 0) -> tuple[QuantExperts, torch.Tensor]:
    """A QuantExperts [E, O, I] holding random blocks of ggml_type as a GGUF file's stack, and the
    float experts they are (gguf's dequantization) [E, O, I]."""
    rng = np.random.default_rng(seed)
    data = scaled_blocks(ggml_type, E * O, I, rng).reshape(E, O, -1)
    q = QuantExperts(E, O, I, "int4", 32, torch.bfloat16)
    q.blocks_only = True
    q.prepare_blocks(ggml_type)
    q.load_weight(StoredBlocks(ggml_type, torch.from_numpy(data), (E, O, I)))
    assert q.layout == LAYOUT[ggml_type]
    w = torch.from_numpy(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, ggml_type))).reshape(E, O, I)
    return q, w


def reference(q: QuantExperts, x, offs, act=0, limit=0.0, alpha=1.0, up_offset=0.0, float_rows=0):
    return cpu_kernels.expert_reference(x, offs, KERNEL_KIND[q.layout], q.qweight, q._buffers.get("qhigh"),
                                        q._buffers.get("scales"), q.group, act, limit, alpha, up_offset, float_rows)


def close(got, want, rtol, what):
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item() + 1e-6, f"{what}: max error {err} of {want.abs().max().item()}"


def segments(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor(COUNTS[rows])
    return counts.cumsum(0), torch.repeat_interleave(torch.arange(E), counts)  # offs [E], expert of each row


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("ggml_type", list(LAYOUT))
def test_expert_kernel_computes_its_reference_and_the_float_experts(ggml_type):
    assert cpu_kernels.available(), cpu_kernels.status()
    q, w = stack(ggml_type, seed=list(LAYOUT).index(ggml_type))
    torch.manual_seed(0)
    for rows in COUNTS:
        offs, owner = segments(rows)
        x = torch.randn(rows, I)
        x[0, 32:64] = 0.0  # a zero block of activations
        got = q.grouped_mm(x, offs)
        close(got, reference(q, x, offs), 1e-5, f"{ggml_type} rows={rows}")
        floats = torch.stack([w[e] @ x[n] for n, e in enumerate(owner.tolist())])
        close(got, floats, 2e-2, f"{ggml_type} rows={rows} against the float experts")  # x rounded to int8 per 32
        for kw in GATED:
            a = q.grouped_act(x, offs, **kw)
            assert a.shape == (rows, O // 2)
            args = (kw.get("limit", 0.0), kw.get("alpha", 1.0), kw.get("up_offset", 0.0))
            close(a, reference(q, x, offs, 1, *args), 1e-5, f"{ggml_type} rows={rows} gated {kw}")
            close(a, cpu_kernels.gated_act(got, *args), 1e-5, f"{ggml_type} rows={rows} gated after the matmul {kw}")
        # runtime.quant_prefill=float: the segment of 12 rows through the float GEMM, x as it is
        held, q.float_rows = q.float_rows, 8
        try:
            got = q.grouped_mm(x, offs)
            close(got, reference(q, x, offs, float_rows=8), 1e-5, f"{ggml_type} rows={rows} float_rows")
            if rows == 17:
                close(got[:12], x[:12] @ w[1].t(), 1e-5, f"{ggml_type} the float GEMM's segment")
        finally:
            q.float_rows = held


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K", "Q3_K"])
def test_a_rows_expert_output_is_the_same_bits_whatever_other_rows_chose_it(ggml_type):
    """Each row of 17 computed alone (decode), and each expert's rows among others' rows, equal the
    17-row call bit for bit (plain and gated), and a row alone equals the linear kernel on its expert."""
    q, _ = stack(ggml_type, seed=7)
    offs, owner = segments(17)
    torch.manual_seed(1)
    x = torch.randn(17, I)
    together, gated = q.grouped_mm(x, offs), q.grouped_act(x, offs)
    for n, e in enumerate(owner.tolist()):
        alone = torch.zeros(E, dtype=torch.int64)
        alone[e:] = 1
        assert torch.equal(q.grouped_mm(x[n:n + 1], alone), together[n:n + 1]), (ggml_type, n)
        assert torch.equal(q.grouped_act(x[n:n + 1], alone), gated[n:n + 1]), (ggml_type, n)
    if q.layout == "q6k":
        one = torch.ops.zoo_quant.q6k_linear(x[:1], q.qweight[owner[0]])
    elif q.layout == "int5":
        one = torch.ops.zoo_quant.int5_linear(x[:1], q.qweight[owner[0]], q.qhigh[owner[0]], q.scales[owner[0]], 32)
    elif q.layout == "q4":
        one = torch.ops.zoo_quant.int4_linear(x[:1], q.qweight[owner[0]], q.scales[owner[0]], 32)
    else:
        one = torch.ops.zoo_quant.int8g_linear(x[:1], q.qweight[owner[0]], q.scales[owner[0]], q.group)
    assert torch.equal(one, together[:1])
    # experts 1 and 4 alone, expert 2's one row dropped from the call: the others' bits stay
    offs2 = torch.tensor([0, 12, 12, 12, 16, 16])
    rest = torch.cat((x[:12], x[13:]))
    assert torch.equal(q.grouped_mm(rest, offs2), torch.cat((together[:12], together[13:])))


def test_bad_input_is_refused_naming_what_was_expected():
    q, _ = stack("Q4_K")
    x = torch.randn(3, I)
    with pytest.raises(RuntimeError, match="offs must be non-decreasing"):
        q.grouped_mm(x, torch.tensor([2, 1, 3, 3, 3, 3]))
    with pytest.raises(RuntimeError, match=r"offs must be \[E\] = \[6\] int64"):
        q.grouped_mm(x, torch.tensor([3, 3, 3]))
    with pytest.raises(RuntimeError, match="x has 256 inputs, the weight 512"):
        q.grouped_mm(torch.randn(3, 256), torch.tensor([3] * E))
    with pytest.raises(RuntimeError, match="a gated stack needs an even O"):
        torch.ops.zoo_quant.expert_linear(x, torch.tensor([3] * E), 0, q.qweight[:, :47], None, q.scales[:, :47], 32, 1)


def test_a_float_expert_cannot_join_a_q6k_stack():
    from zoo.compiler.errors import CheckpointError

    q = QuantExperts(2, 16, 256, "int4", 32, torch.bfloat16)
    q.prepare_blocks("Q6_K")
    with pytest.raises(CheckpointError, match="Q6_K block experts"):
        q.load_weight(torch.zeros(16, 256), 1)


# ------------------------------------------------------------------------------ an MoE twin

QWEN3_MOE = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 max_position_embeddings=256, tie_word_embeddings=False, use_sliding_window=False,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# Q4_K_M's expert types (gate / up Q4_K, some ffn_down Q6_K) and Q5_K_M's
TWIN_TYPES = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q4_K",
              "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_gate_exps.weight": "Q5_K",
              "blk.1.ffn_up_exps.weight": "Q5_K", "blk.1.ffn_down_exps.weight": "Q4_K"}


def test_qwen3_moe_gguf_with_k_quant_experts_matches_transformers(tmp_path):
    """A qwen3_moe GGUF whose expert stacks are Q4_K, Q5_K and Q6_K: kept at their stored layouts
    (q4, int5, q6k; w13 with the SwiGLU in its call), the logits of the prefill and every decode
    step equal transformers' (its own dequantization of the file) within the int8 rounding of the
    activations, and decoding through the caches equals a prefill of the whole sequence."""
    transformers = pytest.importorskip("transformers")
    import zoo
    from tests.gguf_writer import LAYOUTS, write_gguf
    from tests.helpers import check_decode_equals_prefill, check_parity
    from tests.test_gguf_families import twin

    ref = twin("Qwen3MoeConfig", QWEN3_MOE)
    rng = np.random.default_rng(41)
    E_, F_, D = QWEN3_MOE["num_experts"], QWEN3_MOE["moe_intermediate_size"], QWEN3_MOE["hidden_size"]
    quantize = {}
    for name, t in TWIN_TYPES.items():
        rows, cols = (F_, D) if "down" not in name else (D, F_)
        blocks = scaled_blocks(t, E_ * rows, cols, rng).reshape(E_, rows, -1)
        quantize[name] = (blocks, getattr(gguf.GGMLQuantizationType, t))
    path = write_gguf(tmp_path / "qwen3moe.gguf", ref, LAYOUTS["qwen3moe"], quantize=quantize)
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    layouts = {(layer, s): m.module.get_submodule(f"layers.{layer}.ffn.{s}").layout for layer in (0, 1)
               for s in ("w13", "w2")}
    assert layouts == {(0, "w13"): "q4", (0, "w2"): "q6k", (1, "w13"): "int5", (1, "w2"): "q4"}
    how = m.info.load.tensors
    assert how["blk.0.ffn_down_exps.weight"] == "kept Q6_K blocks as stored (6.5625 bits a weight), 4 experts"
    assert how["blk.1.ffn_gate_exps.weight"] == "kept Q5_K blocks as int5 g32 (float32 scales), 4 experts"
    torch.manual_seed(2)
    ids = torch.randint(0, QWEN3_MOE["vocab_size"], (2, 9))
    seq = check_parity(ref, m, ids, steps=4, rtol=5e-3)  # (measured: 1.1e-3 of the largest logit)
    check_decode_equals_prefill(m, seq, prompt_len=5, rtol=1e-4)
