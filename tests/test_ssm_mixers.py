"""The state-space and convolution mixers (compiler/mixers/mamba.py, mamba2.py, short_conv.py) on
their own, float32: the chunked prefill equals the naive token loop, decoding token by token
equals the prefill, a prefill continuing from a cached conv history and state equals the prefill
of the whole sequence, and bad options are refused naming the key."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import zoo
from zoo.compiler.mixers.mamba import Mamba, selective_scan, selective_scan_reference
from zoo.compiler.mixers.mamba2 import Mamba2, ssd_reference, ssd_scan
from zoo.compiler.mixers.short_conv import ShortConv

DIM = 24

MIXERS = {
    "mamba": lambda: Mamba(Mamba.Spec(d_inner=40, d_state=6, dt_rank=5, conv_kernel=4, chunk_size=4), _model()),
    "mamba/falcon": lambda: Mamba(Mamba.Spec(d_inner=40, d_state=6, dt_rank=5, conv_kernel=3, chunk_size=5,
                                             bcdt_norm="weightless", bias=True), _model()),
    "mamba/jamba": lambda: Mamba(Mamba.Spec(d_inner=40, d_state=6, dt_rank=5, chunk_size=6, bcdt_norm="weighted"),
                                 _model()),
    "mamba2": lambda: Mamba2(Mamba2.Spec(n_heads=6, head_dim=5, d_state=7, n_groups=2, chunk_size=4), _model()),
    "mamba2/limit": lambda: Mamba2(Mamba2.Spec(n_heads=3, head_dim=8, d_state=4, n_groups=1, chunk_size=3,
                                               conv_bias=False, time_step_limit=[0.05, 0.5]), _model()),
    "short_conv": lambda: ShortConv(ShortConv.Spec(conv_kernel=3), _model()),
    "short_conv/bias": lambda: ShortConv(ShortConv.Spec(conv_kernel=4, bias=True), _model()),
}


def _model():
    return SimpleNamespace(dim=DIM)


def _make(name: str):
    torch.manual_seed(0)
    m = MIXERS[name]()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n == "A_log":
                p.uniform_(-1.0, 1.5)  # decays from slow to fast
            elif p.dim() == 1:
                p.uniform_(-0.5, 0.5) if "bias" in n else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.4)
    return m.eval()


def _cache(m, batch: int) -> dict:
    return {k: torch.zeros(f.shape, dtype=f.dtype) for k, f in m.cache_fields(batch, 64, torch.float32).items()}


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("name", list(MIXERS))
@torch.no_grad()
def test_chunked_prefill_equals_naive_loop(name):
    m = _make(name)
    x = torch.randn(2, 13, DIM)  # 13: chunks of 3, 4, 5 with a ragged last one
    _close(m.prefill(x, _cache(m, 2), {}), m.reference(x))


@pytest.mark.parametrize("name", list(MIXERS))
@torch.no_grad()
def test_decode_step_by_step_equals_prefill(name):
    m = _make(name)
    x = torch.randn(2, 11, DIM)
    want = m.prefill(x, _cache(m, 2), {})
    cache = _cache(m, 2)
    got = [m.prefill(x[:, :3], cache, {})]
    for t in range(3, 11):
        got.append(m.decode(x[:, t:t + 1], cache, {}))
    _close(torch.cat(got, dim=1), want)


@pytest.mark.parametrize("name", list(MIXERS))
@torch.no_grad()
def test_prefill_continues_from_the_cached_state(name):
    """The initial-state path (for extend: chunked prefill, prefix reuse): a prompt split in two,
    the second part run from the first part's conv history and state, equals one prefill, and
    leaves the same cache."""
    m = _make(name)
    x = torch.randn(2, 14, DIM)
    whole = _cache(m, 2)
    want = m.prefill(x, whole, {})
    cache = _cache(m, 2)
    first = m.prefill(x[:, :6], cache, {})
    args = [cache["conv"].clone()] + ([cache["state"].clone()] if "state" in cache else [])
    second = m.prefill_from(x[:, 6:], *args, cache)
    _close(torch.cat([first, second], dim=1), want)
    for k in whole:
        _close(cache[k], whole[k])


@torch.no_grad()
def test_the_scans_with_a_start_state_equal_their_loops():
    """The chunked scans themselves, from a random start state, every chunk size."""
    g = torch.Generator().manual_seed(1)
    u, dt = torch.randn(2, 5, 9, generator=g), torch.rand(2, 5, 9, generator=g)
    A, b, c = -torch.rand(5, 3, generator=g) * 3, torch.randn(2, 9, 3, generator=g), torch.randn(2, 9, 3, generator=g)
    S0 = torch.randn(2, 5, 3, generator=g)
    want = selective_scan_reference(u, dt, A, b, c, S0)
    for lc in (1, 2, 4, 9, 16):
        for got, ref in zip(selective_scan(u, dt, A, b, c, S0, lc), want):
            _close(got, ref)
    u, a = torch.randn(2, 3, 9, 4, generator=g), -torch.rand(2, 3, 9, generator=g) * 2
    b, c, S0 = torch.randn(2, 3, 9, 5, generator=g), torch.randn(2, 3, 9, 5, generator=g), torch.randn(2, 3, 4, 5,
                                                                                                          generator=g)
    want = ssd_reference(u, a, b, c, S0)
    for lc in (1, 2, 4, 9, 16):
        for got, ref in zip(ssd_scan(u, a, b, c, S0, lc), want):
            _close(got, ref)


@pytest.mark.parametrize("spec, words", [
    (lambda: Mamba.Spec(d_inner=8, dt_rank=2, conv_kernel=1), ["conv_kernel=1", ">= 2"]),
    (lambda: Mamba.Spec(d_inner=0, dt_rank=2), ["d_inner=0", "positive"]),
    (lambda: Mamba.Spec(d_inner=8, dt_rank=2, bcdt_norm="yes"), ["bcdt_norm='yes'", "weightless", "weighted"]),
    (lambda: Mamba2.Spec(n_heads=6, n_groups=4), ["n_heads=6", "n_groups=4", "multiple"]),
    (lambda: Mamba2.Spec(n_heads=4, time_step_limit=[1.0, 0.5]), ["time_step_limit=[1.0, 0.5]", "min <= max"]),
    (lambda: ShortConv.Spec(conv_kernel=0), ["conv_kernel=0", ">= 2"]),
])
def test_bad_options_are_refused(spec, words):
    msg = spec().check({})
    assert msg is not None and all(w in msg for w in words), msg
