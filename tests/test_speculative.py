"""Speculative decoding (compiler/engine/speculative.py): the acceptance rules, the drafters, and
greedy output identical to plain decoding through generate, on tiny twins (eager)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import zoo

from zoo.compiler.engine.acceptance import accept_greedy, accept_sampled
from zoo.compiler.engine.drafters import NgramDrafter

V = 6


def test_accept_greedy_stops_at_the_first_mismatch_and_at_the_count():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 3], [1, 2, 3]])
    kept = accept_greedy(target, drafts, torch.tensor([3, 3, 2, 3]))
    assert kept.tolist() == [3, 1, 2, 0]


def _toy(seed: int):
    g = torch.Generator().manual_seed(seed)
    # every probability well above zero so the chi-square test has expected counts > 5
    def dist(*shape):
        x = torch.rand(*shape, V, generator=g) + 0.3
        return x / x.sum(-1, keepdim=True)

    return dist(), dist(V), dist(V, V), dist(), dist(V)  # p1, p2|x1, p3|x1,x2, q1, q2|d1


def _two_tokens(rule, p1, p2, p3, q1, q2, deterministic: bool, g: torch.Generator) -> tuple[int, int]:
    """The first two tokens a speculative round (Kd = 2) and, if it emitted one, a plain step give."""
    if deterministic:  # a drafter that always proposes the same continuation (n-gram lookup)
        d1, d2 = 2, 4
    else:
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2[d1], 1, generator=g))
    p = torch.stack((p1, p2[d1], p3[d1, d2]))
    q = None if deterministic else torch.stack((q1, q2[d1]))
    a, nxt = rule(p, torch.tensor([d1, d2]), 2, q, g)
    out = [d1, d2][:a] + [nxt]
    if len(out) == 1:
        out.append(int(torch.multinomial(p2[out[0]], 1, generator=g)))
    return out[0], out[1]


def _always_accept(p, drafts, count, q, g):
    return count, int(torch.multinomial(p[count], 1, generator=g))


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled_drafter", "deterministic_drafter"])
def test_rejection_rule_keeps_the_target_distribution(deterministic):
    """The joint law of the first two emitted tokens is the target's p1(x1) p2(x2 | x1), whatever
    the drafter proposes (chi-square over the 36 pairs); a rule that keeps every draft fails the
    same test (the test has the power to fail)."""
    p1, p2, p3, q1, q2 = _toy(0)
    expected = (p1[:, None] * p2).flatten()
    n = 12000

    def statistic(rule):
        g = torch.Generator().manual_seed(1)
        counts = torch.zeros(V * V)
        for _ in range(n):
            x1, x2 = _two_tokens(rule, p1, p2, p3, q1, q2, deterministic, g)
            counts[x1 * V + x2] += 1
        return chisquare(counts.numpy(), (expected * n).numpy()).pvalue

    assert statistic(accept_sampled) > 1e-3
    assert statistic(_always_accept) < 1e-6


def test_ngram_lookup():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    assert d.lookup(torch.tensor([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]), 4) == [4, 5, 9, 9]
    assert d.lookup(torch.tensor([5, 6, 7, 8]), 3) == []  # no earlier occurrence
    assert d.lookup(torch.tensor([7]), 3) == []
    # the longest suffix wins: [8, 2] occurs once (-> 7), [2] last occurred before 5
    assert d.lookup(torch.tensor([8, 2, 7, 1, 2, 5, 3, 8, 2]), 2) == [7, 1]


# --------------------------------------------------------------------------- generate, eager twins

def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random prompts; each row repeats a span of its own at a different place, so n-gram lookup
    drafts from row 1 on and rows accept different counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    for i in range(1, batch):
        span = 2 + 2 * i
        ids[i, -span:] = ids[i, :span]
    return ids


def _record_rounds(spec):
    """Wrap spec.step to keep each round's tokens per row (lengths = kept drafts + 1)."""
    rounds, step = [], spec.step

    def recording(rows, histories, picks):
        out = step(rows, histories, picks)
        rounds.append({r: len(res.tokens) for r, res in zip(rows, out)})
        return out

    spec.step = recording
    return rounds


def _check_greedy(model, drafter: str, prompts: torch.Tensor, new: int, kd: int, plain: torch.Tensor):
    spec = model.speculator(drafter, kd)
    rounds = _record_rounds(spec)
    got = model.generate(prompts, new, speculative=drafter, draft_tokens=kd)
    assert torch.equal(got, plain), f"{drafter}: speculative greedy output differs from plain decoding"
    return rounds, spec.stats


def test_greedy_ngram_equals_plain_batch_rows_accept_different_counts():
    model = zoo.build("llama3_8b_tiny", compile=False, max_batch=3, max_seq=64)
    prompts = _prompts(model.spec.vocab_size, 3, 16)
    plain = model.generate(prompts, 24, speculative="off")
    rounds, stats = _check_greedy(model, "ngram", prompts, 24, 3, plain)
    assert stats.accepted > 0
    assert any(len(set(r.values())) > 1 for r in rounds), "no round had rows keeping different counts"
