"""Gated DeltaNet's two execution forms against a naive per-timestep reference.

The chunked form (prefill) and the recurrent form (decode) of compiler/gated_deltanet.py are
checked against `naive_gated_delta_rule`, written here straight from the definition with the
explicit (I - beta k k^T) transition, on lengths around chunk boundaries: outputs and final
states. The chunked form is also checked to run in O(L) memory (allocator-level peak).
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

        S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

    q, k [B, H, L, Dk], v [B, H, L, Dv], g, beta [B, H, L], state [B, H, Dk, Dv] (float64 here).
    """
    B, H, L, Dk = q.shape
    eye = torch.eye(Dk, dtype=q.dtype)
    S = state.clone()
    out = []
    for t in range(L):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        transition = eye - bt * kt[..., :, None] * kt[..., None, :]  # [B, H, Dk, Dk]
        S = transition @ (g[:, :, t].exp()[..., None, None] * S) + bt * kt[..., :, None] * vt[..., None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2), S


def recurrent(q, k, v, g, beta, state):
    """The decode form, stepped over the sequence."""
    out = []
    for t in range(q.shape[2]):
        o, state = recurrent_gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        out.append(o)
    return torch.stack(out, dim=2), state


def inputs(L, B=2, H=3, Dk=8, Dv=12, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, L, Dk, generator=gen), dim=-1) * Dk ** -0.5
    k = F.normalize(torch.randn(B, H, L, Dk, generator=gen), dim=-1)
    v = torch.randn(B, H, L, Dv, generator=gen)
    # decays from ~0 to strongly forgetting, so the chunk-relative exponents span a wide range
    g = -torch.rand(B, H, L, generator=gen) * torch.linspace(0.01, 3.0, H)[None, :, None]
    beta = torch.rand(B, H, L, generator=gen)
    s0 = torch.randn(B, H, Dk, Dv, generator=gen) if state else torch.zeros(B, H, Dk, Dv)
    return q, k, v, g, beta, s0


def close(actual, expected, what, tol=2e-5):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * max(scale, 1.0),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("L", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("state", [False, True], ids=["zero_state", "initial_state"])
def test_chunked_and_recurrent_match_naive(L, state):
    q, k, v, g, beta, s0 = inputs(L, state=state)
    ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, 64)
    close(o, ref_o, f"chunked output L={L}")
    close(s, ref_s, f"chunked final state L={L}")
    o, s = recurrent(q, k, v, g, beta, s0)
    close(o, ref_o, f"recurrent output L={L}")
    close(s, ref_s, f"recurrent final state L={L}")


@pytest.mark.parametrize("chunk", [1, 7, 16, 200])
def test_chunk_size_does_not_change_the_result(chunk):
    q, k, v, g, beta, s0 = inputs(101, seed=1)
    ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk)
    close(o, ref_o, f"chunk {chunk} output")
    close(s, ref_s, f"chunk {chunk} final state")


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


def test_chunked_prefill_memory_is_linear_in_length():
    """A 2k-token chunked pass allocates O(L * chunk), far below one [L, L] score matrix per
    head, and doubling L about doubles the peak."""
    H = 8
    peaks = {}
    for L in (1024, 2048):
        q, k, v, g, beta, s0 = inputs(L, B=1, H=H, Dk=16, Dv=16, state=False)
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

    for L in (5, 64, 130):
        q, k, v, g, beta, s0 = inputs(L)
        for x in (q, k, v, g, beta):
            torch._dynamo.mark_dynamic(x, 2, min=2, max=4096)
        o, s = run(q, k, v, g, beta, s0)
        ref_o, ref_s = naive_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))
        close(o, ref_o, f"compiled output L={L}")
        close(s, ref_s, f"compiled state L={L}")
    assert len(calls) == 1


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
