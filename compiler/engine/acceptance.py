"""Which draft tokens a speculative step keeps: the greedy rule and the standard rejection rule.

A row has drafts d_1..d_Kd (of which `count` are real; the rest are padding never accepted) and
the target's distributions p_0..p_Kd from one verify step over the last chosen token and the
drafts: p_j is the target's next-token distribution after d_1..d_j. Both rules return how many
drafts are kept (a, 0..count) and the next token, chosen from p_a's rule, so a step always emits
a + 1 tokens.

    greedy    keep d_j while d_j == argmax p_(j-1); the next token is argmax p_a: exactly the
              tokens plain greedy decoding emits.
    sampled   (Leviathan et al. 2023, Chen et al. 2023) keep d_j with probability
              min(1, p(d_j) / q(d_j)) where q is the drafter's distribution for d_j (a
              deterministic drafter, e.g. n-gram lookup: q(d_j) = 1); at the first rejection
              the next token is drawn from the residual norm(max(p - q, 0)), and after keeping
              every draft from p_count. Every emitted token is then distributed as the target's
              own sampling would draw it, whatever the drafter proposes.

Distributions here are probabilities after the caller's temperature / top-k / top-p (zoo's
sampling), so the rule keeps that filtered distribution.
"""
from __future__ import annotations

from typing import Optional

import torch


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """target [n, Kd + 1] (argmax of each verified position), drafts [n, Kd], counts [n] (real
    drafts per row) -> kept drafts per row [n] (the next token is target[i, kept[i]])."""
    kd = drafts.shape[1]
    real = torch.arange(kd, device=drafts.device)[None] < counts[:, None]
    match = (drafts == target[:, :kd]) & real
    return match.long().cumprod(dim=1).sum(dim=1)


def accept_sampled(p: torch.Tensor, drafts: torch.Tensor, count: int, q: Optional[torch.Tensor] = None,
                   generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """One row: p [Kd + 1, V] target probabilities, drafts [Kd], count (real drafts), q [Kd, V]
    the drafter's probabilities (None: a deterministic drafter, q one-hot at the draft) ->
    (kept drafts a, next token). Random draws come from `generator` (the row's own)."""
    p = p.float()
    if generator is not None and p.device != generator.device:  # the row's generator decides where draws run
        p, drafts = p.to(generator.device), drafts.to(generator.device)
        q = None if q is None else q.to(generator.device)
    if count:
        idx = drafts[:count, None]
        p_d = p[:count].gather(1, idx)[:, 0]
        q_d = torch.ones_like(p_d) if q is None else q[:count].float().gather(1, idx)[:, 0]
        u = torch.rand(count, generator=generator, device=p.device)
        # u < p/q, written without dividing (q_d > 0 for a token the drafter proposed)
        keep = (u * q_d < p_d).tolist()
    else:
        keep = []
    for j, ok in enumerate(keep):
        if ok:
            continue
        if q is None:
            residual = p[j].clone()
            residual[drafts[j]] = 0.0
        else:
            residual = (p[j] - q[j].float()).clamp_min(0.0)
        total = float(residual.sum())
        # p == q up to rounding: the residual is empty and p itself is what remains to draw from
        dist = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(dist, 1, generator=generator)[0])
    return count, int(torch.multinomial(p[count], 1, generator=generator)[0])
