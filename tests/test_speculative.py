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
        ids[i, -span:] = ids[i, :span].clone()
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


def test_greedy_ngram_on_the_packages_equals_plain(families):
    """runtime.aot: the verify step (k+1 tokens over 2 rows) and the rollback's re-extend run
    through the packages' extend (those of tests/test_extend.py's aot case: the same checkpoint,
    max_batch and max_seq, so the on-disk packages are shared); greedy output equals plain
    decoding on the eager model."""
    fam = families.family("llama/gqa")
    _, path = families.reference("llama/gqa")
    model = zoo.from_pretrained(str(path), max_batch=fam.batch, max_seq=fam.max_seq, overrides=["runtime.aot=true"])
    assert model.engine.runner_kind == "aot"
    prompts = _prompts(model.spec.vocab_size, 2, 16)
    plain = families.eager("llama/gqa").generate(prompts, 12, speculative="off")
    _, stats = _check_greedy(model, "ngram", prompts, 12, 3, plain)
    assert stats.accepted > 0
    assert model.engine.graph_counts()["extend_packages"] >= 1


def test_sampled_rule_end_to_end_at_a_vanishing_temperature():
    """Sampled rounds (the rejection rule, row generators) through generate: at a temperature so
    low that the target's distribution is one-hot, they must give plain greedy's tokens."""
    model = zoo.build("llama3_8b_tiny", compile=False, max_batch=2, max_seq=48)
    prompts = _prompts(model.spec.vocab_size, 2, 12, seed=1)
    plain = model.generate(prompts, 16, speculative="off")
    got = model.generate(prompts, 16, temperature=1e-6, generator=torch.Generator().manual_seed(0),
                         speculative="ngram", draft_tokens=3)
    assert torch.equal(got, plain)
    assert model.speculator("ngram", 3).stats.accepted > 0


def _train_mtp_head(model, seqs: torch.Tensor, steps: int = 60) -> float:
    """Fit the first MTP layer to the model's own greedy predictions over seqs [B, T]: at
    position t it reads the target's final hidden state at t and token t + 1 and must give the
    target's argmax after t + 1. Returns the training accuracy."""
    e, layer, V = model.engine, model.module.mtp[0], model.spec.vocab_size
    e.reset()
    logits, hidden = e.prefill_rows(0, seqs, return_hidden=True)
    e.reset()
    full = e.prefill(seqs)  # [B, T, V]
    e.reset()
    B, T = seqs.shape
    target, prev, nxt = full.argmax(-1)[:, 1:], hidden[:, :T - 1].detach(), seqs[:, 1:]
    rope = {k: (c[:T - 1], s[:T - 1]) for k, (c, s) in e.rope.items()}
    layer.requires_grad_(True)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            cache = {k: torch.zeros(f.shape, dtype=f.dtype)
                     for k, f in layer.mixer.cache_fields(B, T, torch.float32).items()}
            x = layer.prefill(layer.step_in(model.module, prev, nxt), cache, {"ids": nxt, "rope": rope})
            out = layer.step_out(model.module, x)[1]
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, V), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    layer.requires_grad_(False)
    return float((out.argmax(-1) == target).float().mean())


def test_mla_deepseek_v3_mtp_and_ngram_greedy_equal_plain_and_a_trained_head_accepts():
    """MLA + the MTP drafter: random MTP heads accept almost nothing and still leave greedy output
    unchanged; the MTP layer trained for 60 steps on the model's own greedy outputs (its FFN is
    the dense one: zoo's MoE kernels have no backward) accepts most drafts at Kd = 2."""
    model = zoo.build("deepseek_v3_tiny", ["checkpoint.mtp=true", "mtp.ffn=dense"], compile=False,
                      max_batch=3, max_seq=64)
    prompts = _prompts(model.spec.vocab_size, 3, 10, seed=2)
    plain = model.generate(prompts, 16, speculative="off")
    _check_greedy(model, "ngram", prompts, 16, 3, plain)
    _, random_head = _check_greedy(model, "mtp", prompts, 16, 2, plain)
    assert random_head.acceptance < 0.2
    assert _train_mtp_head(model, plain) > 0.9
    model._speculators.clear()  # fresh counts
    rounds, trained = _check_greedy(model, "mtp", prompts, 16, 2, plain)
    assert trained.acceptance > 0.5, trained
    assert any(len(set(r.values())) > 1 for r in rounds)
    # sampled MTP drafts (q from the MTP layer's logits) at a one-hot temperature: greedy's tokens
    got = model.generate(prompts, 16, temperature=1e-6, generator=torch.Generator().manual_seed(0),
                         speculative="mtp", draft_tokens=2)
    assert torch.equal(got, plain)

    # served: cancelled mid-speculation, the row and the drafter's state of it are freed
    from zoo.serve.scheduler import Scheduler

    sched = Scheduler(model, eos_ids=[], speculative="mtp", draft_tokens=2)
    s = _seq(prompts[0].tolist(), max_tokens=30, temperature=0.0)
    _serve(sched, [s], steps=3)
    drafter = model.speculator("mtp", 2).drafter
    assert list(drafter.filled) == [s.row] and list(drafter.pending) == [s.row]
    assert s.tokens == plain[0, 10:10 + len(s.tokens)].tolist()
    sched.cancel(s)
    sched.step()
    assert s.finish_reason == "cancelled" and sched.engine.free_rows() == [0, 1, 2]
    assert drafter.filled == {} and drafter.pending == {}


def test_sliding_window_ring_rollback_mistral_greedy_equals_plain():
    """A sliding-window ring (window 6, constant state: restored, then the kept tokens re-extended)
    over generations much longer than the window."""
    model = zoo.build("mistral_7b_tiny", compile=False, max_batch=2, max_seq=48)
    prompts = _prompts(model.spec.vocab_size, 2, 12, seed=5)
    plain = model.generate(prompts, 20, speculative="off")
    _, stats = _check_greedy(model, "ngram", prompts, 20, 3, plain)
    assert stats.drafted > stats.accepted  # rollbacks happened


def test_recurrent_qwen3_next_mtp_and_ngram_greedy_equal_plain():
    """Gated DeltaNet + full attention + MTP: a rollback restores the recurrent and conv states
    and re-extends the kept tokens."""
    model = zoo.build("qwen3_next_tiny", ["checkpoint.mtp=true"], compile=False, max_batch=2, max_seq=48)
    prompts = _prompts(model.spec.vocab_size, 2, 10, seed=3)
    plain = model.generate(prompts, 10, speculative="off")
    _, stats = _check_greedy(model, "ngram", prompts, 10, 3, plain)
    _check_greedy(model, "mtp", prompts, 10, 2, plain)


# --------------------------------------------------------------------------- the server's scheduler

def _serve(sched, seqs, steps: int = 400):
    for s in seqs:
        sched.submit([s])
    for _ in range(steps):
        if not sched.step():
            break


def _seq(prompt, **kw):
    from zoo.serve.scheduler import SamplingParams, Sequence

    events = []
    s = Sequence(list(prompt), SamplingParams(**kw), sink=events.append)
    s.events = events
    return s


def test_scheduler_speculative_greedy_equals_plain_and_reports_acceptance():
    """Greedy sequences served with n-gram speculation get plain serving's tokens, ending inside a
    step (max_tokens) where they must; a constrained-free sampled row runs beside them; /metrics
    counts drafted and accepted tokens; a cancelled sequence frees its row."""
    from zoo.serve.metrics import Metrics
    from zoo.serve.scheduler import Scheduler

    model = zoo.build("llama3_8b_tiny", compile=False, max_batch=3, max_seq=64)
    prompts = _prompts(model.spec.vocab_size, 3, 14, seed=4).tolist()
    lengths = [9, 17, 12]

    def run(speculative, metrics=None):
        sched = Scheduler(model, eos_ids=[], speculative=speculative, draft_tokens=3, metrics=metrics)
        seqs = [_seq(p, max_tokens=n, temperature=0.0) for p, n in zip(prompts, lengths)]
        seqs.append(_seq(prompts[0], max_tokens=6, temperature=1.0, seed=3))  # waits for a free row
        _serve(sched, seqs)
        assert [s.finish_reason for s in seqs] == ["length"] * 4
        assert sched.engine.free_rows() == [0, 1, 2]
        return [s.tokens for s in seqs]

    metrics = Metrics()
    plain, spec = run("off"), run("ngram", metrics)
    assert spec[:3] == plain[:3] and [len(t) for t in spec] == lengths + [6]
    text = metrics.render().decode()
    accepted = metrics.spec_accepted._value.get()
    assert accepted > 0 and metrics.spec_drafted._value.get() >= accepted
    assert "zoo_spec_acceptance_rate" in text and "zoo_spec_tokens_per_step" in text

    sched = Scheduler(model, eos_ids=[], speculative="ngram", draft_tokens=3)
    long = _seq(prompts[1], max_tokens=40, temperature=0.0)
    _serve(sched, [long], steps=3)
    assert sched.running == 1 and long.finish_reason is None
    sched.cancel(long)
    sched.step()
    assert long.finish_reason == "cancelled" and sched.engine.free_rows() == [0, 1, 2]


# --------------------------------------------------------------------------- settings

@pytest.mark.parametrize("overrides, match", [
    (["runtime.speculative.drafter=eagle"], r"runtime.speculative.drafter: expected one of \['ngram', 'mtp'\] or null, "
                                            r"got 'eagle'"),
    (["runtime.speculative.drafter=ngram", "runtime.speculative.draft_tokens=0"],
     r"runtime.speculative.draft_tokens: must be >= 1, got 0"),
    (["runtime.speculative.ngram_min=3", "runtime.speculative.ngram_max=2"],
     r"ngram_min=3, ngram_max=2; expected 1 <= ngram_min <= ngram_max"),
    (["runtime.speculative.drafter=mtp"], r"drafter=mtp needs the model's multi-token-prediction layers: "
                                          r"checkpoint.mtp=true and mtp.n_layers > 0 \(got checkpoint.mtp=False"),
])
def test_speculative_settings_are_checked(overrides, match):
    from zoo.compiler.build import spec_stage
    from zoo.compiler.config import compose
    from zoo.compiler.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        spec_stage(compose("deepseek_v3_tiny", overrides), "conf/deepseek_v3_tiny.yaml")


def test_speculative_decoding_keeps_the_packages():
    """The packages extend rows (the k+1 verify step): runtime.aot=auto keeps them under a drafter."""
    from zoo.compiler.spec import use_aot
    from zoo.compiler.build import spec_stage
    from zoo.compiler.config import compose

    rt = lambda o: spec_stage(compose("smollm2_135m", o), "conf/smollm2_135m.yaml").spec.runtime
    assert use_aot(rt([])) and use_aot(rt(["runtime.speculative.drafter=ngram"]))
    assert use_aot(rt(["runtime.speculative.drafter=ngram", "runtime.aot=true"]))


def test_cli_speculative_keys():
    from zoo.cli import _speculative, parse_args
    from zoo.compiler.errors import ZooError

    opts, overrides = parse_args(["conf=x", "prompt=hi", "speculative=ngram", "draft_tokens=6"], "generate")
    assert _speculative(opts, overrides) == ["runtime.speculative.drafter=ngram", "runtime.speculative.draft_tokens=6"]
    opts, overrides = parse_args(["conf=x", "speculative=off"], "serve")
    assert _speculative(opts, overrides) == ["runtime.speculative.drafter=null"]
    with pytest.raises(ZooError, match=r"speculative='medusa': expected ngram"):
        _speculative({"speculative": "medusa"}, [])
    with pytest.raises(ZooError, match=r"zoo build does not use speculative='ngram'"):
        parse_args(["conf=x", "speculative=ngram"], "build")
