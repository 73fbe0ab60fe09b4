"""The engine works under the caller's autograd mode, for every runner: the batch API and the row
operations give the same logits under `torch.no_grad()`, `torch.inference_mode()` and neither,
compile nothing more after the first use of each step (compiled decode steps still skip dynamo's
guards), and return ordinary tensors. Before the engine fixed its own mode, the compiled runner's
first decode step under inference mode failed ("Recompilation triggered with
skip_guard_eval_unsafe stance"): inference tensors fail guards the warm-up never saw."""
from __future__ import annotations

import contextlib

import pytest
import torch

import zoo

CONF, MAX_BATCH, MAX_SEQ = "llama3_8b_tiny", 2, 16
RUNNERS = {  # name -> (build keywords, the engine's runner)
    "eager": (dict(compile=False), "eager"),
    # one decode bucket (CI time: a batch-1 step runs padded in it; the buckets are tests/test_buckets.py's)
    "compiled": (dict(compile=True, overrides=["runtime.aot=false", "runtime.decode_buckets=[2]"]), "compiled"),
    "aot": (dict(compile=True, overrides=["runtime.aot=true", "runtime.decode_buckets=[2]"]), "aot"),
    "cuda_graph": (dict(compile=False, device="cuda"), "cuda_graph+eager"),
    "cuda_graph_compiled": (dict(compile=True, device="cuda"), "cuda_graph+compiled"),
}
MODES = {"neither": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def test_the_runner_is_chosen_by_priority_from_the_options():
    from zoo.compiler.engine.runners import RunnerOptions, runner_class

    def kind(device, compile=True, cuda_graph=True, aot=False):
        return runner_class(RunnerOptions(torch.device(device), compile, cuda_graph, aot)).kind

    assert kind("cpu", compile=False) == "eager" and kind("meta", compile=False) == "eager"
    assert kind("cpu") == "compiled" and kind("cuda", cuda_graph=False) == "compiled"
    assert kind("cuda") == kind("cuda", compile=False) == "cuda_graph"
    assert kind("cpu", aot=True) == "aot"
    for device, compile in (("cuda", True), ("cpu", False)):
        with pytest.raises(ValueError, match="aot needs compile=True on a CPU"):
            kind(device, compile=compile, aot=True)


@pytest.fixture(scope="module", params=list(RUNNERS))
def model(request):
    kw, runner = RUNNERS[request.param]
    if kw.get("device") == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = dict(kw)
    m = zoo.build(CONF, kw.pop("overrides", ()), max_batch=MAX_BATCH, max_seq=MAX_SEQ, seed=0, **kw)
    assert m.engine.runner == runner
    # the row prefill's steps (>= 2 tokens, 1 token) on first use, outside any mode, as a server's warmup
    for n in (2, 1):
        m.engine.prefill_row(0, torch.zeros(n, dtype=torch.long))
        m.engine.release_row(0)
    return m


def _steps(m) -> list[torch.Tensor]:
    """Every step the engine offers, from a reset state: a batch prefill and decode steps, a
    1-token batch prompt, rows of two lengths prefilled apart and decoded together."""
    e, dev = m.engine, m.engine.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.spec.vocab_size, (MAX_BATCH, 6), generator=gen).to(dev)
    out = [m.prefill(ids)]
    tok = out[-1][:, -1].argmax(-1)
    for _ in range(3):
        out.append(m.decode(tok))
        tok = out[-1].argmax(-1)
    out.append(m.prefill(ids[:1, :1]))
    out.append(m.decode(out[-1][:, -1].argmax(-1)))
    e.reset()
    out.append(e.prefill_row(1, ids[1, :4]))
    out.append(e.prefill_row(0, ids[0]))
    tok = torch.stack([out[-1].argmax(-1), out[-2].argmax(-1)])
    for _ in range(3):
        out.append(e.decode_rows(tok))
        tok = out[-1].argmax(-1)
    e.release_row(0)
    e.release_row(1)
    return out


@pytest.mark.parametrize("first", ["inference_mode", "no_grad", "neither"])
def test_every_autograd_mode_gives_the_same_logits_and_compiles_nothing(model, first):
    counts = model.engine.graph_counts()
    order = [first] + [m for m in MODES if m != first]
    results = {}
    for mode in order:
        with MODES[mode]():
            results[mode] = _steps(model)
        assert model.engine.graph_counts() == counts, f"{mode}: steps compiled again"
    for mode in order[1:]:
        for i, (a, b) in enumerate(zip(results[order[0]], results[mode])):
            assert torch.equal(a, b), f"step {i}: {order[0]} and {mode} differ"
    assert not any(t.is_inference() or t.requires_grad for r in results.values() for t in r)
    if model.engine.runner == "compiled":
        assert model.engine._trusted is True  # the decode steps still skip the guards


def test_compiled_decode_in_other_global_state_runs_the_guards(model):
    """Guards are skipped only in the global state the first decode step ran in: a step with
    another thread count (part of dynamo's global-state guard, and of inductor's CPU kernels)
    runs with the full guards, so it compiles its own entry instead of replaying the other
    one's; from then on the steps keep the guards. Last in the file: it ends the trust."""
    if model.engine.runner != "compiled":
        pytest.skip("the compiled runner's guard skipping")
    e = model.engine
    ids = torch.randint(0, model.spec.vocab_size, (MAX_BATCH, 5), generator=torch.Generator().manual_seed(3))
    tok = model.prefill(ids)[:, -1].argmax(-1)
    want = model.decode(tok)
    counts, threads = e.graph_counts(), torch.get_num_threads()
    assert e._trusted is True
    model.prefill(ids)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        got = model.decode(tok)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert e.graph_counts() == {**counts, "decode": counts["decode"] + 1}
    assert e._trusted is False
    model.prefill(ids)
    assert torch.equal(model.decode(tok), want)  # back in the first state: its entry, through the guards
    assert e.graph_counts() == {**counts, "decode": counts["decode"] + 1}
