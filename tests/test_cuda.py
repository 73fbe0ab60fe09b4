"""CUDA path: the decode step captured as a CUDA graph, replayed, equal to eager. Skips without a GPU."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import assert_logits_close
from tests.test_llama import make_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda")
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2), {})
    return path


@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decode_matches_cpu(ckpt, compile):
    cpu = zoo.from_pretrained(str(ckpt), compile=False, max_batch=2, max_seq=64)
    gpu = zoo.from_pretrained(str(ckpt), device="cuda", compile=compile, max_batch=2, max_seq=64)
    assert gpu.engine.use_cuda_graph and gpu.engine._graph is not None
    seq = torch.randint(0, 320, (2, 24))
    full = cpu.prefill(seq)
    assert_logits_close(gpu.prefill(seq[:, :8]).cpu(), full[:, :8], 1e-4, "prefill")
    for t in range(8, 24):
        assert_logits_close(gpu.decode(seq[:, t].cuda()).cpu(), full[:, t], 1e-4, f"decode {t}")
    # a new batch replays the same graph from reset caches
    assert_logits_close(gpu.prefill(seq[:, :5]).cpu(), full[:, :5], 1e-4, "second prefill")
    assert_logits_close(gpu.decode(seq[:, 5].cuda()).cpu(), full[:, 5], 1e-4, "second decode")


def test_bf16_close_to_fp32(ckpt):
    ref = zoo.from_pretrained(str(ckpt), compile=False, max_seq=64)
    bf = zoo.from_pretrained(str(ckpt), device="cuda", dtype=torch.bfloat16, compile=True, max_seq=64)
    ids = torch.randint(0, 320, (1, 16))
    assert_logits_close(bf.prefill(ids).cpu(), ref.prefill(ids), 5e-2, "bf16 prefill")
