"""mHC n-stream residuals: doubly-stochastic mixing, parity with DeepSeek-V4's hyper-connection
modules in transformers, composition with any preset, decode == prefill."""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.compiler.config import load_config
from zoo.compiler.residual.mhc import HyperConnection, HyperHead, sinkhorn
from tests.helpers import check_decode_equals_prefill

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def assert_doubly_stochastic(m: torch.Tensor, atol: float = 1e-5):
    ones = torch.ones(m.shape[:-1])
    torch.testing.assert_close(m.sum(-1), ones, rtol=0, atol=atol)
    torch.testing.assert_close(m.sum(-2), ones, rtol=0, atol=atol)
    assert (m >= 0).all()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sinkhorn_doubly_stochastic(n):
    # logits of the size the stream projection produces; sharply peaked logits (std >= 1) need
    # more than the reference's 20 iterations before the row sums settle (the last step
    # normalises columns, which stay exact)
    logits = torch.randn(256, n, n) * 0.5
    assert_doubly_stochastic(sinkhorn(logits, iters=20, eps=1e-6))


def _v4_config(n, dim=32):
    return v4.DeepseekV4Config(hidden_size=dim, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=16)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_hyper_connection_matches_transformers(n):
    dim = 32
    ref = v4.DeepseekV4HyperConnection(_v4_config(n, dim)).float()
    ours = HyperConnection(n, dim, iters=20, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        for p in (ref.fn, ref.base, ref.scale):
            p.normal_()
        ours.fn.copy_(ref.fn), ours.base.copy_(ref.base), ours.scale.copy_(ref.scale)
    h = torch.randn(2, 5, n, dim)
    post_r, comb_r, x_r = ref(h)
    x, (post, comb) = ours.enter(h)
    torch.testing.assert_close(x, x_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(post, post_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb, comb_r, rtol=1e-6, atol=1e-6)
    y = torch.randn(2, 5, dim)
    want = post_r.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), h)
    torch.testing.assert_close(ours.exit(h, y, (post, comb)), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [2, 4])
def test_hyper_head_matches_transformers(n):
    dim = 32
    ref = v4.DeepseekV4HyperHead(_v4_config(n, dim)).float()
    ours = HyperHead(n, dim, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        for p in (ref.hc_fn, ref.hc_base, ref.hc_scale):
            p.normal_()
        ours.fn.copy_(ref.hc_fn), ours.base.copy_(ref.hc_base), ours.scale.copy_(ref.hc_scale)
    h = torch.randn(3, 4, n, dim)
    torch.testing.assert_close(ours.collapse(h), ref(h), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.expand(h[:, :, 0]), h[:, :, :1].expand(-1, -1, n, -1))


@pytest.fixture(scope="module")
def llama_mhc():
    return zoo.build("llama3_8b_tiny", ["residual=mhc", "residual.streams=3"], compile=False, max_batch=2,
                     max_seq=40, seed=1)


def test_every_comb_and_their_product_doubly_stochastic(llama_mhc):
    m = llama_mhc.module
    h = torch.randn(2, 7, 3, 64)
    product = torch.eye(3).expand(2, 7, 3, 3)
    for block in m.layers:
        for conn in (block.mixer_residual, block.ffn_residual):
            _, _, comb = conn.weights(h)
            assert_doubly_stochastic(comb)
            product = product @ comb
            h = conn.exit(h, torch.randn(2, 7, 64), conn.weights(h)[1:])
    assert_doubly_stochastic(product, atol=1e-4)


def test_streams_flow_between_layers(llama_mhc):
    assert llama_mhc.module.streams.fn.shape == (3, 3 * 64)
    block = llama_mhc.module.layers[0]
    assert block.mixer_residual.fn.shape == ((2 + 3) * 3, 3 * 64)
    assert block.mixer_residual.fn.dtype == torch.float32


@pytest.mark.parametrize("compile", [False, True])
def test_llama_mhc_decode_equals_prefill(compile):
    # one decode bucket (CI time: another would be one more decode graph; tests/test_buckets.py)
    m = zoo.build("llama3_8b_tiny", ["residual=mhc", "residual.streams=4", "runtime.decode_buckets=[2]", "runtime.aot=false"],
                  compile=compile, max_batch=2,
                  max_seq=40, seed=2)
    check_decode_equals_prefill(m, torch.randint(0, 256, (2, 20)), prompt_len=7)
    if compile:
        assert m.engine.graph_counts() == {"prefill": 1, "decode": 1}


def test_mhc_composes_from_the_command_line(capsys):
    from zoo.cli import main

    assert main(["build", "conf=llama3_8b", "residual=mhc", "residual.streams=4"]) == 0
    out = capsys.readouterr().out
    assert "mhc, 4 streams, 25,233,093 parameters" in out  # 64 connections x 393,243 + head 65,541
    spec = load_config("llama3_8b", ["residual=mhc", "residual.streams=2", "residual.sinkhorn_iters=5"])
    assert (spec.residual.streams, spec.residual.sinkhorn_iters) == (2, 5)


def test_mhc_bad_streams():
    with pytest.raises(zoo.ConfigError, match="streams must be >= 1, got 0"):
        load_config("llama3_8b_tiny", ["residual=mhc", "residual.streams=0"])
