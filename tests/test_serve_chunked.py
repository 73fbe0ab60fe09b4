"""Chunked prefill as a scheduler policy (zoo/serve/scheduler.py, runtime.step_tokens), on an eager
tiny model: a prompt admitted in chunks gives the greedy tokens it gives admitted whole, the
running rows get a token every step while it is admitted (and no step spends more than the
budget), cancelling it mid-prompt frees its row, and a budget below max_batch is refused."""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.compiler.errors import ConfigError
from zoo.serve.scheduler import SamplingParams, Scheduler, Sequence

MAX_BATCH, MAX_SEQ, BUDGET = 4, 96, 8


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama3_8b_tiny", compile=False, max_batch=MAX_BATCH, max_seq=MAX_SEQ, seed=0)


def _seq(prompt, n):
    events = []
    s = Sequence(list(prompt), SamplingParams(max_tokens=n, temperature=0.0), sink=events.append)
    s.events = events
    return s


def _prompts(model):
    g = torch.Generator().manual_seed(5)
    V = model.engine.vocab_size
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in (5, 3, 41, 6)]


def _drain(sched, limit=300):
    for _ in range(limit):
        if not sched.step():
            return
    raise AssertionError("the scheduler did not go idle")


def test_a_chunked_prompt_gives_the_tokens_of_a_whole_one_and_the_running_rows_keep_streaming(model):
    short, other, long, late = _prompts(model)
    # alone, prefilled whole
    alone = {}
    for name, prompt, n in (("short", short, 30), ("other", other, 30), ("long", long, 10), ("late", late, 6)):
        s = _seq(prompt, n)
        sched = Scheduler(model, eos_ids=[], step_tokens=0)
        sched.submit([s])
        _drain(sched)
        alone[name] = s.tokens

    sched = Scheduler(model, eos_ids=[], step_tokens=BUDGET)
    a, b = _seq(short, 30), _seq(other, 30)
    sched.submit([a, b])
    sched.step()  # both fit the budget: admitted whole (a token from the prefill, one from the decode step)
    assert (len(a.tokens), len(b.tokens)) == (2, 2)
    c, d = _seq(long, 10), _seq(late, 6)
    sched.submit([c, d])
    steps = 0
    while not c.tokens:  # the long prompt goes in, BUDGET - 2 tokens a step, above bucket 2
        before = (len(a.tokens), len(b.tokens))
        sched.step()
        steps += 1
        assert (len(a.tokens), len(b.tokens)) == (before[0] + 1, before[1] + 1), f"step {steps}: a row stalled"
        if not c.tokens:
            assert sched._chunk is not None and sched._chunk.row == 2 and sched._chunk.done == steps * (BUDGET - 2)
            assert sched.engine.row_len[2] == steps * (BUDGET - 2) and not d.tokens  # nothing admitted behind it
    assert steps == -(-len(long) // (BUDGET - 2))  # 41 tokens, 6 a step: 7 steps
    assert c.row == 2 and sched._chunk is None
    _drain(sched)
    assert [s.tokens for s in (a, b, c, d)] == [alone["short"], alone["other"], alone["long"], alone["late"]]
    assert sched.engine.free_rows() == list(range(MAX_BATCH))


def test_cancelling_a_prompt_mid_chunk_frees_its_row(model):
    short, _, long, late = _prompts(model)
    sched = Scheduler(model, eos_ids=[], step_tokens=BUDGET)
    a = _seq(short, 40)
    sched.submit([a])
    sched.step()
    c = _seq(long, 10)
    sched.submit([c])
    sched.step()
    sched.step()
    assert sched._chunk is not None and sched.engine.row_len[1] == 2 * (BUDGET - 1)
    sched.cancel(c)
    sched.step()
    assert c.finish_reason == "cancelled" and [e.kind for e in c.events] == ["done"] and not c.tokens
    assert sched._chunk is None and sched.engine.row_len[1:] == [None] * (MAX_BATCH - 1) and sched.running == 1
    d = _seq(late, 4)  # the freed row serves the next request
    sched.submit([d])
    _drain(sched)
    assert a.finish_reason == d.finish_reason == "length" and len(d.tokens) == 4


def test_a_budget_below_max_batch_is_refused(model):
    with pytest.raises(ValueError, match=r"step_tokens=3: .* expected step_tokens >= max_batch=4"):
        Scheduler(model, step_tokens=3)
    with pytest.raises(ConfigError, match=r"runtime.step_tokens=2: .* expected >= max_batch=4"):
        zoo.build("llama3_8b_tiny", ["runtime.step_tokens=2"], compile=False, max_batch=4, max_seq=8, dry=True)
