"""zoo's CPU decode-attention kernel (compiler/mixers/one_query.py) against its torch-op reference,
and the engine's decode through it against the same engine without it."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_logits_close
from zoo.compiler.mixers import one_query


@pytest.mark.parametrize("B,H,Hkv,S,Dh", [(1, 9, 3, 640, 64), (3, 8, 8, 300, 80), (2, 4, 1, 129, 16),
                                          (16, 9, 3, 512, 64), (2, 16, 2, 260, 128)])
def test_kernel_computes_its_reference(B, H, Hkv, S, Dh):
    """GQA groups of 1-8 heads, head dims with and without a compiled specialisation, rows that
    see 1 slot, a partial chunk (not a multiple of 128) and the whole cache."""
    assert one_query.available(), one_query._load()
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, Dh), torch.randn(B, Hkv, S, Dh), torch.randn(B, Hkv, S, Dh)
    n = torch.randint(1, S + 1, (B,))
    n[0] = S
    n[-1] = 1 if B > 1 else n[-1]
    k[:, :, S - 1] += 50.0 * (n[:, None, None] < S)  # invisible slots with large scores must not count
    want = one_query.reference(q, k, v, n, Dh ** -0.5)
    assert_logits_close(one_query.decode_attention(q, k, v, n, Dh ** -0.5), want, rtol=1e-5, what=f"{B, H, Hkv, S, Dh}")


def test_kernel_refuses_what_it_cannot_take():
    assert one_query.available()
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="sees 9 slots"):
        one_query.decode_attention(q, k, k, torch.tensor([9]), 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        one_query.decode_attention(q.double(), k.double(), k.double(), torch.tensor([3]), 0.1)


@pytest.mark.parametrize("B,H,Hkv,L,T,Dh", [(2, 4, 2, 5, 9, 16), (1, 9, 3, 3, 300, 64), (3, 8, 8, 4, 200, 128)])
def test_window_kernel_is_a_decode_step_over_its_keys(B, H, Hkv, L, T, Dh):
    """window_attention (a sliding window's keys read through an index, in position order) computes
    its reference, and each query the same bits as decode_attention over its keys copied to slots
    0..n-1: what makes a window's prefill, extend and decode agree bit for bit (issue #46). Windows
    past one chunk of 128 keys, rows reading keys in any order, repeated ones."""
    assert one_query.available(), one_query._load()
    g = torch.Generator().manual_seed(B * T)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, H, L, Dh), (B, Hkv, T, Dh), (B, Hkv, T, Dh)))
    P = T + 7
    slots = torch.randint(0, T, (B, P), generator=g)
    n = torch.randint(1, min(T, 150) + 1, (B, L), generator=g)
    first = (torch.rand(B, L, generator=g) * (P - n + 1)).long()
    o = one_query.window_attention(q, k, v, slots, first, n, Dh ** -0.5)
    assert_logits_close(o, one_query.window_reference(q, k, v, slots, first, n, Dh ** -0.5), rtol=1e-5, what="window")
    for b in range(B):
        for t in range(L):
            rows = slots[b, first[b, t]:first[b, t] + n[b, t]]
            one = one_query.decode_attention(q[b:b + 1, :, t].contiguous(), k[b:b + 1, :, rows].contiguous(),
                                             v[b:b + 1, :, rows].contiguous(), n[b, t].view(1), Dh ** -0.5)
            assert torch.equal(one[0], o[b, :, t]), (b, t)
    with pytest.raises(RuntimeError, match="outside its"):
        one_query.window_attention(q, k, v, slots + T, first, n, 0.1)
    with pytest.raises(RuntimeError, match=r"sees slots\["):
        one_query.window_attention(q, k, v, slots, first + P, n, 0.1)


def test_engine_decode_with_and_without_the_kernel(tmp_path):
    """Two engines on one checkpoint, one built without the kernel: rows of different lengths
    (continuous batching) decode to the same logits, and only the first calls the kernel."""
    import zoo

    from tests.test_llama import make_reference

    make_reference(tmp_path, dict(num_attention_heads=4, num_key_value_heads=2), {})
    m1 = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=3, max_seq=40)
    m2 = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=3, max_seq=40)
    assert m1.engine.context_flags["one_query_kernel"]
    m2.engine.context_flags["one_query_kernel"] = False  # before its first decode step
    gen = torch.Generator().manual_seed(0)
    prompts = {0: torch.randint(0, 320, (5,), generator=gen), 1: torch.randint(0, 320, (11,), generator=gen)}
    tok = torch.zeros(3, dtype=torch.long)
    for row, ids in prompts.items():
        a, b = m1.engine.prefill_row(row, ids), m2.engine.prefill_row(row, ids)
        assert_logits_close(a, b, rtol=1e-6, what=f"prefill row {row}")
        tok[row] = a.argmax()
    for step in range(4):
        with torch.profiler.profile() as prof:
            a = m1.engine.decode_rows(tok)
        assert any(e.name == "zoo_attn::decode_attention" for e in prof.events())
        with torch.profiler.profile() as prof:
            b = m2.engine.decode_rows(tok)
        assert not any(e.name == "zoo_attn::decode_attention" for e in prof.events())
        assert_logits_close(a[:2], b[:2], rtol=1e-5, what=f"decode step {step}")
        tok = a.argmax(-1)
