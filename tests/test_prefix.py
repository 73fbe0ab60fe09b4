"""Prefix reuse (compiler/engine/prefix.py) on tiny twins (tests/family_harness.py's eager models):
a prompt that shares a prefix with a stored one starts from it and its logits, and the decode
steps after, equal a cold prefill's; families with constant state (recurrent, ring) reuse only
whole stored prompts and say so; a full store evicts and never fails; the scheduler admits
through it and /metrics reports it."""
from __future__ import annotations

import pytest
import torch

from tests.test_extend import close, sequence
from zoo.compiler.engine.prefix import PrefixCache
from zoo.compiler.errors import InputError


def cold(model, ids: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    """Logits [V] of a cold prefill of ids [L] in row 0, then of each decode step of `steps`."""
    e = model.engine
    e.reset()
    out = [e.prefill_row(0, ids).clone()]
    for t in steps:
        tok = torch.zeros(e.max_batch, dtype=torch.long)
        tok[0] = t
        out.append(e.decode_rows(tok)[0].clone())
    e.release_row(0)
    return out


def warm(model, cache: PrefixCache, row: int, ids: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    e = model.engine
    out = [cache.start(row, ids).clone()]
    for t in steps:
        tok = torch.zeros(e.max_batch, dtype=torch.long)
        tok[row] = t
        out.append(e.decode_rows(tok)[row].clone())
    return out


@pytest.mark.parametrize("name", ["llama/gqa", "attn/mistral", "deepseek_v3/main", "qwen3_next"])
def test_reused_prefix_equals_cold_prefill(families, name):
    model, rtol = families.eager(name), max(families.family(name).rtol, 1e-5)
    e = model.engine
    seq = sequence(model, 3, 30, 5)
    system, steps = seq[0, :20], seq[2, :4]
    first = torch.cat((system, seq[0, 20:26]))  # system prompt + a question
    second = torch.cat((system, seq[1, 20:25]))  # the same system prompt + another
    want_first, want_second = cold(model, first, steps), cold(model, second, steps)
    e.reset()
    cache = PrefixCache(e, max_bytes=1 << 26, block=4)
    if cache.any_prefix:
        # the first request is stored at its end; the second shares 20 tokens with it
        got = warm(model, cache, 0, first, steps)
        assert cache.hits == 0 and len(cache) == 1
        for g, w in zip(got, want_first):
            close(g, w, rtol, f"{name}: cold start through the cache")
        e.release_row(0)
        got = warm(model, cache, 1, second, steps)
        assert (cache.hits, cache.tokens_reused) == (1, 20)
    else:
        assert "constant state" in cache.mode and "stored prompts only" in cache.mode
        warm(model, cache, 0, first, steps)
        e.release_row(0)
        cache.start(1, torch.cat((system, seq[2, 20:23])))  # shares 20 tokens, but no state was saved at 20
        assert cache.hits == 0
        e.release_row(1)
        cache.start(0, system)  # the system prompt alone: a reuse point
        e.release_row(0)
        got = warm(model, cache, 1, second, steps)
        assert (cache.hits, cache.tokens_reused) == (1, 20)
    for g, w in zip(got, want_second):
        close(g, w, rtol, f"{name}: reused prefix")
    e.release_row(1)
    # the whole prompt stored with its logits: no step at all
    again = cache.start(0, second)
    assert cache.tokens_reused == 20 + len(second)
    close(again, want_second[0], rtol, f"{name}: exact match")
    e.release_row(0)


def test_full_store_evicts_and_never_fails(families):
    model = families.eager("llama/gqa")
    e = model.engine
    e.reset()
    probe = PrefixCache(e, max_bytes=1 << 30, block=4)
    seq = sequence(model, 6, 24, 6)
    probe.start(0, seq[0])
    one = probe.bytes  # one 24-token entry
    e.release_row(0)
    cache = PrefixCache(e, max_bytes=int(2.5 * one), block=4)
    for i in range(6):
        cache.start(0, seq[i])
        e.release_row(0)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 2 and cache.evictions == 4
    tiny = PrefixCache(e, max_bytes=one // 2, block=4)  # smaller than any entry: nothing kept, all served
    close(tiny.start(0, seq[0]), cold(model, seq[0], [])[0], 1e-5, "tiny store")
    assert len(tiny) == 0
    with pytest.raises(InputError, match="max_bytes=-1"):
        PrefixCache(e, max_bytes=-1)


def test_conversation_is_stored_for_its_next_turn(families):
    """A stored conversation (prompt + reply) is the reuse point of its next turn, recurrent
    state included."""
    model, rtol = families.eager("qwen3_next"), 1e-5
    e = model.engine
    seq = sequence(model, 1, 40, 7)[0]
    turn1, reply, turn2 = seq[:14], seq[14:20], seq[20:30]
    want = cold(model, torch.cat((turn1, reply, turn2)), [])[0]
    e.reset()
    cache = PrefixCache(e, max_bytes=1 << 26, block=4)
    cache.start(0, turn1)
    e.extend_rows([0], reply[None])  # the reply, as the decode steps would have fed it
    cache.store(0, torch.cat((turn1, reply)))
    e.release_row(0)
    got = cache.start(1, torch.cat((turn1, reply, turn2)))
    assert cache.tokens_reused == 20
    close(got, want, rtol, "next turn")


def one_after_another(model, prompts, **kw):
    """Each prompt served to 5 greedy tokens by a fresh Scheduler(model, **kw), one after the
    other (the second admission finds the first stored): (their tokens, the scheduler)."""
    from zoo.serve.scheduler import SamplingParams, Scheduler, Sequence

    sched = Scheduler(model, eos_ids=[], **kw)
    outs = []
    for p in prompts:
        s = Sequence(p, SamplingParams(max_tokens=5, temperature=0.0), sink=lambda ev: None)
        sched.submit([s])
        while sched.step():
            pass
        outs.append(s.tokens)
    return outs, sched


def test_scheduler_reuses_prefixes_and_reports_them(families):
    from zoo.serve.metrics import Metrics

    model = families.eager("llama/gqa")
    seq = sequence(model, 2, 30, 8)
    system = seq[0, :20].tolist()
    prompts = [system + seq[0, 20:24].tolist(), system + seq[1, 20:27].tolist()]

    def run(prefix_bytes):
        metrics = Metrics()
        outs, sched = one_after_another(model, prompts, metrics=metrics, prefix_cache_bytes=prefix_bytes)
        return outs, sched, metrics.render().decode()

    want, sched, _ = run(0)
    assert sched.prefix is None
    got, sched, text = run(1 << 26)
    assert got == want
    assert sched.prefix.hits == 1 and sched.prefix.tokens_reused == 20  # the system prompt
    assert "zoo_prefix_cache_hits_total 1.0" in text
    assert "zoo_prefix_cache_tokens_reused_total 20.0" in text
    assert 'zoo_prefix_cache_reuse{mode="any_prefix"} 1.0' in text
    assert f"zoo_prefix_cache_bytes {float(sched.prefix.bytes)}" in text


def test_scheduler_on_the_packages_reuses_prefixes_and_chunks_prompts(families):
    """runtime.aot: prefix reuse (a stored prompt's cache imported, the rest extended) and chunked
    prefill (runtime.step_tokens: a prompt extended in chunks between decode steps) run through
    the packages' extend; the greedy tokens equal the eager model's whole prefills. Same
    checkpoint, max_batch and max_seq as tests/test_extend.py's aot case (shared packages)."""
    import zoo

    eager = families.eager("llama/gqa")
    fam, (_, path) = families.family("llama/gqa"), families.reference("llama/gqa")
    model = zoo.from_pretrained(str(path), max_batch=fam.batch, max_seq=fam.max_seq, overrides=["runtime.aot=true"])
    seq = sequence(eager, 2, 30, 8)
    system = seq[0, :20].tolist()
    prompts = [system + seq[0, 20:24].tolist(), system + seq[1, 20:27].tolist()]

    want, _ = one_after_another(eager, prompts, prefix_cache_bytes=0, step_tokens=0)
    got, sched = one_after_another(model, prompts, prefix_cache_bytes=1 << 26, step_tokens=4)
    assert got == want
    assert sched.prefix.hits == 1 and sched.prefix.tokens_reused == 20
    assert model.engine.runner_kind == "aot" and model.engine.graph_counts()["extend_packages"] >= 1
