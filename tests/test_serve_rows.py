"""Continuous batching in the engine and the scheduler, for every family's cache kinds (GQA KV,
MLA latent, DeltaNet conv/recurrent state, DSA indexer keys, V4 ring buffers and compressor
state): a sequence prefilled into one row while other rows are mid-generation, then decoded among
them, gives the logits it gives alone through the batch API; greedy tokens are identical alone and
among 7 others that start and stop at different times; the graph counts stay fixed."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import assert_logits_close
from zoo.serve.scheduler import SamplingParams, Scheduler, Sequence

FAMILIES = ["llama3_8b_tiny", "deepseek_v3_tiny", "qwen3_next_tiny", "glm5_tiny", "deepseek_v4_flash_tiny"]
# row writes through compiled graphs: a KV cache (Llama) and DSA's latent + indexer caches with its
# custom ops (GLM-5); the other families' cache kinds run the same row logic eagerly (CI time)
COMPILED = {"llama3_8b_tiny", "glm5_tiny"}
MAX_BATCH, MAX_SEQ = 8, 64
# (prompt length, decode steps, start step, row); 33 tokens take GLM-5's gathered DSA prefill; the
# last two reuse rows freed earlier
PLAN = [(7, 9, 0, 5), (1, 4, 0, 2), (33, 3, 1, 0), (2, 12, 2, 7), (13, 5, 3, 3), (20, 6, 4, 1),
        (5, 7, 6, 2), (9, 4, 9, 0)]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    # two decode buckets (CI time): the batch API at batch 1 and decode_rows with row 0 alone in
    # use run bucket 1, the rest bucket 8
    return zoo.build(request.param, ["runtime.decode_buckets=[1,8]", "runtime.aot=false"], max_batch=MAX_BATCH, max_seq=MAX_SEQ,
                     compile=request.param in COMPILED)


def _reference(e, prompt, forced):
    """Logits [steps + 1, V] of prompt then the forced tokens, alone through prefill/decode."""
    out = [e.prefill(prompt[None], last_only=True)[0, -1]]
    for t in forced:
        out.append(e.decode(t[None])[0])
    return out


@torch.no_grad()
def test_rows_match_the_batch_api(model):
    e = model.engine
    g = torch.Generator().manual_seed(1)
    V = e.vocab_size
    jobs = [(torch.randint(0, V, (L,), generator=g), torch.randint(0, V, (n,), generator=g), start, row)
            for L, n, start, row in PLAN]
    base = e.graph_counts()  # one graph per layer kind after warmup (decode: per bucket too)
    refs = [_reference(e, p, f) for p, f, _, _ in jobs]
    # the batch API at batch 1 ran the 1-row prefill graph (the rows' own, below)
    assert e.graph_counts() == {"prefill": 2 * base["prefill"], "decode": base["decode"]}
    e.reset()
    counts = None
    done, live = 0, {}  # job -> number of its logits checked
    for t in range(64):
        for j, (p, f, start, row) in enumerate(jobs):
            if start == t:
                assert row in e.free_rows()
                assert_logits_close(e.prefill_row(row, p), refs[j][0], 1e-4, f"job {j} prefill_row")
                live[j] = 1
        if counts is None and t >= 1:
            counts = e.graph_counts()  # both row-prefill graphs (1 token, >= 2 tokens) compiled
        if not live:
            if done == len(jobs):
                break
            continue
        tok = torch.zeros(MAX_BATCH, dtype=torch.long)
        for j, k in live.items():
            tok[jobs[j][3]] = jobs[j][1][k - 1]
        out = e.decode_rows(tok)
        for j in list(live):
            row, k = jobs[j][3], live[j]
            assert_logits_close(out[row], refs[j][k], 1e-4, f"job {j} decode step {k}")
            live[j] = k + 1
            if live[j] == len(refs[j]):
                e.release_row(row)
                del live[j]
                done += 1
    assert done == len(jobs)
    assert e.graph_counts() == counts, "admissions of new lengths into new rows recompiled"
    # per layer kind: batch prefill, row prefill (L >= 2 and L = 1); one decode graph
    assert counts == {"prefill": 3 * base["prefill"], "decode": base["decode"]}
    assert (base["decode"] > 0) == e.compiled


def _run(sched, requests):
    """requests: (start step, prompt, max_tokens). Steps the scheduler in this thread; -> tokens."""
    seqs = [Sequence(prompt, SamplingParams(max_tokens=n, temperature=0.0), sink=lambda ev: None)
            for _, prompt, n in requests]
    t = 0
    while t < 400:
        for (start, _, _), s in zip(requests, seqs):
            if start == t:
                sched.submit([s])
        busy = sched.step()
        t += 1
        if not busy and t > max(r[0] for r in requests):
            break
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    return [s.tokens for s in seqs]


def test_greedy_tokens_alone_equal_among_others(model):
    sched = Scheduler(model, eos_ids=[])
    g = torch.Generator().manual_seed(2)
    V = model.engine.vocab_size
    target = (2, torch.randint(0, V, (6,), generator=g).tolist(), 20)
    others = [(start, torch.randint(0, V, (L,), generator=g).tolist(), n)
              for start, L, n in [(0, 3, 5), (0, 11, 30), (1, 1, 8), (3, 25, 4), (5, 2, 14), (8, 9, 3), (12, 17, 9)]]
    alone = _run(sched, [target])[0]
    among = _run(sched, [others[0], others[1], target, *others[2:]])
    assert len(alone) == 20
    assert among[2] == alone
