"""Gated DeltaNet's two execution forms against a naive per-timestep reference.

The chunked form (prefill) and the recurrent form (decode) of compiler/gated_deltanet.py are
checked against `naive_gated_delta_rule`, written here straight from the definition with the
explicit (I - beta k k^T) transition, on lengths around chunk boundaries: outputs and final
states, with one decay per head (Gated DeltaNet) and one per key channel (Kimi Delta Attention).
The chunked form is also checked to run in O(L) memory (allocator-level peak).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from zoo.compiler.config import load_config
from zoo.compiler.errors import ConfigError
from zoo.compiler.mixers.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_step


def naive_gated_delta_rule(q, k, v, g, beta, state):
    """The definition, one token at a time, per value head (S [Dk, Dv]):

        S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

    q, k [B, H, L, Dk], v [B, H, L, Dv], beta [B, H, L], g [B, H, L] (one decay per head: every
    diagonal entry the same) or [B, H, L, Dk] (one per key channel), state [B, H, Dk, Dv]
    (float64 here).
    """
    B, H, L, Dk = q.shape
    eye = torch.eye(Dk, dtype=q.dtype)
    if g.dim() == 3:
        g = g[..., None].expand(B, H, L, Dk)
    S = state.clone()
    out = []
    for t in range(L):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        transition = eye - bt * kt[..., :, None] * kt[..., None, :]  # [B, H, Dk, Dk]
        S = transition @ (torch.diag_embed(g[:, :, t].exp()) @ S) + bt * kt[..., :, None] * vt[..., None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2), S


def recurrent(q, k, v, g, beta, state):
    """The decode form, stepped over the sequence."""
    out = []
    for t in range(q.shape[2]):
        o, state = recurrent_gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        out.append(o)
    return torch.stack(out, dim=2), state


def inputs(L, B=2, H=3, Dk=8, Dv=12, seed=0, state=True, channelwise=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, L, Dk, generator=gen), dim=-1) * Dk ** -0.5
    k = F.normalize(torch.randn(B, H, L, Dk, generator=gen), dim=-1)
    v = torch.randn(B, H, L, Dv, generator=gen)
    # decays from ~0 to strongly forgetting, so the chunk-relative exponents span a wide range
    # (per channel: the rates also spread over the key channels of each head)
    if channelwise:
        rates = torch.linspace(0.01, 3.0, H)[:, None] * torch.linspace(0.05, 2.0, Dk)[None, :]
        g = -torch.rand(B, H, L, Dk, generator=gen) * rates[None, :, None, :]
    else:
        g = -torch.rand(B, H, L, generator=gen) * torch.linspace(0.01, 3.0, H)[None, :, None]
    beta = torch.rand(B, H, L, generator=gen)
    s0 = torch.randn(B, H, Dk, Dv, generator=gen) if state else torch.zeros(B, H, Dk, Dv)
    return q, k, v, g, beta, s0


def close(actual, expected, what, tol=2e-5):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * max(scale, 1.0),
                               msg=lambda m: f"{what}: {m}")


def check_both_forms(q, k, v, g, beta, s0, what, chunk=64):
    """Chunked and recurrent outputs and final states equal the naive reference's."""
    ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
    for form, (o, s) in (("chunked", chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk)),
                         ("recurrent", recurrent(q, k, v, g, beta, s0))):
        close(o, ref_o, f"{form} output {what}")
        close(s, ref_s, f"{form} final state {what}")
    return ref_o


@pytest.mark.parametrize("decay", ["per_head", "per_channel"])
@pytest.mark.parametrize("L", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("state", [False, True], ids=["zero_state", "initial_state"])
def test_chunked_and_recurrent_match_naive(L, state, decay):
    check_both_forms(*inputs(L, state=state, channelwise=decay == "per_channel"), f"L={L}")


@pytest.mark.parametrize("decay", ["per_head", "per_channel"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 200])
def test_chunk_size_does_not_change_the_result(chunk, decay):
    q, k, v, g, beta, s0 = inputs(101, seed=1, channelwise=decay == "per_channel")
    ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk)
    close(o, ref_o, f"chunk {chunk} output")
    close(s, ref_s, f"chunk {chunk} final state")


@pytest.mark.parametrize("L", [23, 77])
def test_per_channel_decay_is_not_reduced_to_a_per_head_one(L):
    """Odd lengths, Kimi's shape (Dv = Dk): a per-channel decay equal on every channel gives the
    per-head result, and one that differs across channels gives a different one, which the
    chunked and recurrent forms both follow (so neither averages or drops the channel axis)."""
    q, k, v, g, beta, s0 = inputs(L, H=2, Dk=8, Dv=8, seed=3, channelwise=True)
    flat = g[..., :1].expand_as(g).contiguous()
    o_head, s_head = chunk_gated_delta_rule(q, k, v, g[..., 0], beta, s0, 16)
    o_flat, s_flat = chunk_gated_delta_rule(q, k, v, flat, beta, s0, 16)
    torch.testing.assert_close(o_flat, o_head, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_flat, s_head, rtol=1e-5, atol=1e-5)
    ref_o = check_both_forms(q, k, v, g, beta, s0, f"L={L}", chunk=16)
    assert (ref_o - o_head.double()).abs().max() > 1e-2  # the channel spread matters


def test_chunked_form_fails_on_a_wrong_state():
    """The comparison can fail: a different initial state changes outputs and final state."""
    q, k, v, g, beta, s0 = inputs(65)
    ref_o, _ = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0 * 1.01, 64)
    with pytest.raises(AssertionError):
        close(o, ref_o, "perturbed")


def peak_cpu_bytes(fn) -> int:
    """Peak of live CPU allocator bytes while fn() runs (from the profiler's allocation events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("decay", ["per_head", "per_channel"])
def test_chunked_prefill_memory_is_linear_in_length(decay):
    """A 2k-token chunked pass allocates O(L * chunk), far below one [L, L] score matrix per
    head, and doubling L about doubles the peak (per channel too: the [Lc, Lc, Dk] decay
    products exist for one chunk at a time)."""
    H = 8
    peaks = {}
    for L in (1024, 2048):
        q, k, v, g, beta, s0 = inputs(L, B=1, H=H, Dk=16, Dv=16, state=False, channelwise=decay == "per_channel")
        peaks[L] = peak_cpu_bytes(lambda: chunk_gated_delta_rule(q, k, v, g, beta, s0, 64))
    L = 2048
    assert peaks[L] < L * L * H * 4 / 4, f"peak {peaks[L]} B is not far below L*L*H*4 = {L * L * H * 4} B"
    assert peaks[L] < 2.3 * peaks[1024], f"peak grows faster than L: {peaks}"


def test_compiled_chunked_form_has_one_graph_for_every_length():
    """The chunk loop is one custom op: a dynamic-length compile does not specialise on L."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, dynamic=False, backend=backend)
    def run(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, s0, 64)

    for L, channelwise in ((5, False), (64, False), (130, False), (5, True), (97, True)):
        q, k, v, g, beta, s0 = inputs(L, channelwise=channelwise)
        for x in (q, k, v, g, beta):
            torch._dynamo.mark_dynamic(x, 2, min=2, max=4096)
        o, s = run(q, k, v, g, beta, s0)
        ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
        close(o, ref_o, f"compiled output L={L}")
        close(s, ref_s, f"compiled state L={L}")
    assert len(calls) == 2  # one per decay shape ([B, H, L] and [B, H, L, Dk]), not per length


@pytest.mark.parametrize("override, message", [
    ("mixers.linear.n_v_heads=3", "n_v_heads=3 must be a multiple of n_k_heads=2"),
    ("mixers.linear.chunk_size=0", "chunk_size=0 must be positive"),
    ("mixers.linear.conv_kernel=1", "conv_kernel=1 must be >= 2"),
    ("+mixers.linear.n_heads=4", "n_heads"),
])
def test_bad_spec_names_the_key(override, message):
    with pytest.raises(ConfigError, match="mixers.linear") as err:
        load_config("qwen3_next_tiny", [override])
    assert message in str(err.value)
