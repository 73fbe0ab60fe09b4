"""Issue #46's repro, served: `zoo serve conf=smollm2_135m quant=int4` (SmolLM2-135M-Instruct's Q4_1
GGUF, its blocks kept on zoo's kernels), a long shared system prompt, three greedy chat requests
(a question, another, the first again, which then finds its prefix stored): the repeated request
gets the same answer with the same token log-probabilities, bit for bit. Before, a whole prompt's
prefill ran float GEMMs and SDPA, a reused prefix's rest int8 dots and a masked SDPA over the cache,
and the answers parted (here "holds 5 marbles" / "holds 3 marbles")."""
from __future__ import annotations

import pytest

from tests.serve_fixtures import running_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

LINES = 60  # "Item i: the <colour> box holds <n> marbles.": about 900 prompt tokens (the 160: 2.4k)
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
QUESTIONS = ("How many marbles does the box of item 3 hold?", "Which colour is the box of item 5?",
             "How many marbles does the box of item 3 hold?")


def test_the_same_request_after_prefix_reuse_gets_the_same_answer(smollm2_gguf, tmp_path):
    system = "\n".join(f"Item {i}: the {COLOURS[i * 5 % 8]} box holds {i * 7 % 13 + 1} marbles."
                       for i in range(1, LINES + 1))
    args = ["conf=smollm2_135m", "quant=int4", "max_batch=4", "max_seq=1280", "compile=false", "log_level=warning",
            "model_name=smollm2"]
    with running_server(args, tmp_path) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
        answers = []
        for q in QUESTIONS:
            r = client.chat.completions.create(
                model="smollm2", temperature=0, max_tokens=16, logprobs=True,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
            c = r.choices[0]
            answers.append((c.message.content, [(t.token, t.logprob) for t in c.logprobs.content]))
        metrics = httpx.get(base + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("zoo_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 2, hits  # the 2nd and 3rd requests reused the system prompt
    (first, first_lp), _, (again, again_lp) = answers
    assert again == first, f"the same greedy request after prefix reuse answered {again!r}, first {first!r}"
    assert again_lp == first_lp  # bit for bit: one kernel numerics on every path (tests/test_invariance.py)
