"""The scheduler of `zoo serve` with every serving policy on (prefix reuse, chunked prefill under a
step_tokens budget, n-gram speculative decoding), driven step by step over fixed requests:
`drive(model)` in one process (the reference), or one rank of a tensor-parallel pair (launched by
tests/test_serve_parallel.py, never forked): rank 0 drives the scheduler against a LeaderEngine,
rank 1 follows its engine calls (zoo/serve/parallel.py).

    python tests/serve_tp_worker.py CHECKPOINT RANK PORT [DRAFTER [OVERRIDE...]]
        -> rank 0 prints drive()'s result as JSON (DRAFTER: ngram, the default, or mtp, which
           is served without chunked prefill: it starts from a whole prompt's hidden states)
"""
from __future__ import annotations

import json
import sys

import torch

MAX_BATCH, MAX_SEQ, STEP_TOKENS = 4, 96, 24
# a 20-token prompt (repeats: prompt lookup finds drafts); one that shares it and is prefilled in
# chunks while the first decodes (60 tokens > the step's budget); one that reuses it whole plus 4
SYSTEM = [10, 11, 12, 13, 14] * 4
REQUESTS = [(0, SYSTEM, 16), (2, SYSTEM + list(range(40, 80)), 10), (12, SYSTEM + [7, 8, 9, 10], 12)]


def load(checkpoint: str, overrides=()):
    import zoo

    return zoo.from_pretrained(checkpoint, compile=False, max_batch=MAX_BATCH, max_seq=MAX_SEQ,
                               overrides=list(overrides))


@torch.no_grad()
def drive(model, drafter: str = "ngram") -> dict:
    """REQUESTS (submitted at step i: prompt ids, max_tokens; greedy) through a Scheduler over
    model.engine -> each request's tokens and what the policies did (prefix hits, chunked
    prompts, drafted and accepted tokens)."""
    from zoo.serve.scheduler import Sequence, SamplingParams, Scheduler

    sched = Scheduler(model, eos_ids=[], step_tokens=STEP_TOKENS if drafter == "ngram" else 0,
                      speculative=drafter, draft_tokens=3)
    seqs, chunked, step = [], 0, 0
    while step < 200 and (len(seqs) < len(REQUESTS) or any(s.finish_reason is None for s in seqs)):
        for at, prompt, n in REQUESTS:
            if at == step:
                seqs.append(Sequence(list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
                                     sink=lambda ev: None))
                sched.submit([seqs[-1]])
        sched.step()
        chunked += sched._chunk is not None
        step += 1
    return {"tokens": [s.tokens for s in seqs], "finish": [s.finish_reason for s in seqs],
            "prefix_hits": sched.prefix.hits, "tokens_reused": sched.prefix.tokens_reused,
            "chunked_steps": chunked, "drafted": sched.spec.stats.drafted, "accepted": sched.spec.stats.accepted}


def main(checkpoint: str, rank: int, port: int, drafter: str = "ngram", *overrides: str) -> int:
    import torch.distributed as dist

    from zoo.compiler.parallel.mesh import shutdown
    from zoo.serve.parallel import LeaderEngine, control_group, follow

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        model = load(checkpoint, ["runtime.parallel.tp=2", *overrides])
        group = control_group()
        if rank == 0:
            leader = model.engine = LeaderEngine(model.engine, group)
            try:
                print(json.dumps(drive(model, drafter)), flush=True)
            finally:
                leader.stop()
        else:
            follow(model.engine, group)
    finally:
        shutdown()  # a rank that exits with gloo's threads running aborts
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]))
