"""Next-token selection: greedy, temperature, top-k and top-p (nucleus)."""
from __future__ import annotations

from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy (argmax)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature, top_k, top_p), 1, generator=generator)[:, 0]


def probabilities(logits: torch.Tensor, temperature: float, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> torch.Tensor:
    """logits [B, V] -> the distribution `sample` draws from at temperature > 0 [B, V] (what
    speculative decoding's rejection rule keeps, compiler/engine/acceptance.py)."""
    if temperature <= 0:
        raise ValueError(f"probabilities: temperature must be > 0 (0 is greedy), got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [N, V] and the tokens that followed them ids [N] -> per position (the token's
    log-probability, its k most likely tokens and theirs). Each is logit - logsumexp (float32),
    one formula for all, so a token that is the top one has exactly the top value (what a
    client's is-greedy check compares); no [N, V] log_softmax is made beside the logits (a
    prompt's N is up to max_seq)."""
    logits = logits.float()
    lse = logits.logsumexp(-1, keepdim=True)
    chosen = (logits.gather(-1, ids.to(logits.device, torch.long)[:, None]) - lse)[:, 0].tolist()
    if k <= 0:
        return [(lp, []) for lp in chosen]
    v, i = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return [(lp, list(zip(ii, vv))) for lp, ii, vv in zip(chosen, i.tolist(), (v - lse).tolist())]
