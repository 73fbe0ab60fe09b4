"""Mixture-of-experts FFN: a router picks top_k of n_experts SwiGLU experts per token, plus
optional always-on shared experts.

    x [T, D] --router (float32)--> scores [T, E] --select--> idx [T, K], weights [T, K]
      routed:  sum_k weights[t, k] * expert_{idx[t, k]}(x[t])
      shared:  shared(x) (* sigmoid(x @ shared_gate) when shared_expert_gate)
    y = routed + shared     ((routed + shared) / 2 with shared_combine mean: Cohere2-MoE's "average")

Routing (one code path for the DeepSeek and Qwen families, chosen by the spec):
  routing               learned: the top_k experts by score (below); hash: a fixed table
                        tid2eid [V, K] picks each token's experts by its token id (DeepSeek-V4's
                        first layers; ctx["ids"]), the scores still weight them; sparsemixer:
                        Phi-3.5-MoE's inference routing (sparsemixer_route, below: k rounds of
                        the best remaining logit, each weighted by a softmax over the logits
                        within jitter_eps of it; scoring, norm_topk_prob and groups unused)
  scoring               softmax over all experts, sigmoid per expert, or sqrtsoftplus
                        (sqrt(softplus(logit)) per expert, DeepSeek-V4)
  score_correction_bias added to the scores for *selection only* (DeepSeek-V3 noaux_tc); the
                        weights are the uncorrected scores of the chosen experts
  n_group, topk_group   group-limited selection: experts split into n_group groups, a group scores
                        the sum of its top-2 (or its max) corrected scores, only the best
                        topk_group groups compete for the top_k experts
  norm_topk_prob        weights renormalised to sum to 1 over the chosen experts
  routed_scaling_factor weights multiplied by it
  scale_input           each chosen expert's *input* multiplied by its weight instead of its
                        output: expert(w * x), not w * expert(x) (Llama 4; the experts are
                        nonlinear, so the two differ). Every backend (gathered, grouped, quantized
                        stacks) takes the scaled rows; under expert parallelism an expert held
                        elsewhere still contributes 0
  swiglu_limit          experts (routed and shared) clamp their pre-activations (see ffn.py)

The routings the shipped families use, as combinations of these options:
  softmax, top-k renormalised        scoring softmax, norm_topk_prob true (Mixtral; Qwen3-MoE's flag)
  softmax, top-k as is, scaled       norm_topk_prob false, routed_scaling_factor (DeepSeek-V2 greedy)
  group-limited softmax              + n_group, topk_group, group_score max (a group scores its best
                                     expert: DeepSeek-V2 group_limited_greedy)
  sigmoid + selection bias           scoring sigmoid, score_correction_bias, group_score top2_sum,
                                     shared experts (DeepSeek-V3 noaux_tc, GLM-4.5 with n_group 1)

Biased router and experts (gpt-oss), independent of the routing options above:
  router_bias           a learned bias added to the router logits before scoring (and so before
                        selection and weighting alike): router.bias [E]
  expert_bias           every routed expert's projections carry biases: w13_bias [E, 2F], w2_bias [E, D]
  swiglu_alpha,         gpt-oss's clamped SwiGLU in the experts: (up + swiglu_up_offset) *
  swiglu_up_offset      gate * sigmoid(swiglu_alpha * gate), after the swiglu_limit clamp (dense.swiglu)

Expert weights are stacked: w13 [E, 2F, D] (gate rows, then up rows) and w2 [E, D, F]; checkpoint
rules fill them expert by expert (`stack: expert`). Neither entry point loops over experts in
the graph:
  decode   gathered: the K chosen experts' weights of each token are gathered and applied with
           batched matmuls (one graph, static shapes: T = max_batch tokens).
  prefill  grouped: the T*K (token, expert) pairs are sorted by expert and run through
           `expert_mm`, one grouped matmul over contiguous row segments (torch's grouped GEMM on
           CUDA bf16, a segment loop inside the kernel elsewhere); the graph holds one op
           whatever E is, and T is a dynamic dimension.
Under runtime.quant the stacks named in `quant_stacks` may be replaced by quantized ones
(compiler/quant/experts.py) with the same `grouped_mm` contract; they have no float rows to
gather, so decode runs the grouped path too (static shapes; the op reads only the chosen experts).
A quantized w13 without biases also takes the activation (`grouped_act`: _act's SwiGLU, clamp,
alpha and offset included), in one kernel call on zoo's CPU kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .dense import SwiGLU, swiglu
from ..contracts import FFN, KeepFloat32, KindSpec, QuantStacks, span
from ..errors import ConfigError
from ..registry import register

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTINGS = ("learned", "hash", "sparsemixer")
GROUP_SCORES = ("top2_sum", "max")
SHARED_COMBINES = ("sum", "mean")


# ---------------------------------------------------------------------------- grouped matmul

@torch.library.custom_op("zoo::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, I] rows sorted by expert, w [E, O, I], offs [E] int64 (end row of each expert's
    segment, cumulative) -> [N, O] with row n = x[n] @ w[e]^T for the expert e owning row n."""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 \
            and torch.cuda.get_device_capability(x.device) >= (9, 0):
        # one grouped GEMM kernel (Hopper+, bf16, rows 16-byte aligned)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs.to(torch.int32))
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.matmul(x[start:end], w[e].t(), out=out[start:end])
        start = end
    return out


@expert_mm.register_fake
def _expert_mm_fake(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _grouped(x: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """expert_mm over a float stack w [E, O, I], or a quantized stack's own grouped_mm."""
    return expert_mm(x, w, offs) if isinstance(w, torch.Tensor) else w.grouped_mm(x, offs)


# ---------------------------------------------------------------------------- module

class Router(nn.Module, KeepFloat32):
    """weight [E, D] and, with score_correction_bias, score_bias [E]; kept in float32 (the
    checkpoints store the bias in float32, and near-ties in selection are decided by it).
    With routing=hash, hash.tid2eid [V, K] (see TokenHash)."""

    def __init__(self, n_experts: int, dim: int, score_bias: bool, hash_table: Optional["TokenHash"] = None,
                 logit_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.score_bias = nn.Parameter(torch.empty(n_experts)) if score_bias else None
        self.hash = hash_table
        self.bias = nn.Parameter(torch.empty(n_experts)) if logit_bias else None  # router_bias


class TokenHash(nn.Module):
    """Hash routing's table: tid2eid [V, K] int32, the experts of each token id (checkpoint data,
    not trained; int32 as the checkpoints store it)."""

    def __init__(self, vocab_size: int, top_k: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.tid2eid = nn.Parameter(torch.empty(vocab_size, top_k, dtype=torch.int32), requires_grad=False)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random-build table: token t gets experts (t*K + k) % E, distinct when K <= E."""
        V, K = self.tid2eid.shape
        rows = torch.arange(V, device=self.tid2eid.device)[:, None] * K + torch.arange(K, device=self.tid2eid.device)
        self.tid2eid.data.copy_(rows % self.n_experts)

    def active_parameters(self, matmul_only: bool = False) -> int:
        return 0 if matmul_only else self.tid2eid.shape[1]  # a token reads its own row

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> expert indices [numel(ids), K] int64."""
        return self.tid2eid[ids.reshape(-1)].long()


def sparsemixer_route(logits: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's routing at inference (Phi-3.5-MoE; arXiv 2409.12136): logits [T, E] float32
    -> (weights [T, K], idx [T, K]). Round k picks the best logit m not picked before; the logits
    farther below m than 2 * jitter_eps relative to max(|logit|, m) are masked, and so are earlier
    picks; the pick's weight is its softmax over what is left. No renormalisation across picks.
    (transformers writes the two rounds of top_k = 2 out; this is the same loop for any K.)"""
    remaining = logits
    weights, picks = [], []
    for _ in range(top_k):
        best, pick = remaining.max(dim=-1, keepdim=True)  # [T, 1]
        factor = logits.abs().clamp(min=best)
        far = (best - logits) / factor > 2 * jitter_eps
        gates = remaining.masked_fill(far, float("-inf")).softmax(-1)
        weights.append(gates.gather(-1, pick))
        picks.append(pick)
        remaining = remaining.scatter(-1, pick, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(picks, dim=-1)


@register("ffn", "moe")
class MoE(FFN, QuantStacks):
    """x [..., D] -> [..., D]. Parameters: router.weight [E, D], router.score_bias [E] (when
    score_correction_bias), router.hash.tid2eid [V, K] int32 (routing=hash), w13 [E, 2F, D],
    w2 [E, D, F], shared.* (a SwiGLU of shared_ffn_dim),
    shared_gate.weight [1, D] (when shared_expert_gate)."""

    quant_stacks = ("w13", "w2")  # stacked [E, O, I] weights runtime.quant may quantize (quant/experts.py)

    @dataclass
    class Spec(KindSpec):
        kind: str = "moe"
        n_experts: int = "???"  # type: ignore[assignment]
        top_k: int = "???"  # type: ignore[assignment]
        ffn_dim: int = "???"  # type: ignore[assignment]  # hidden width of one routed expert
        routing: str = "learned"  # learned | hash (experts from a token-id table, tid2eid)
        scoring: str = "softmax"  # softmax | sigmoid | sqrtsoftplus
        score_correction_bias: bool = False  # learned per-expert bias added for selection only
        n_group: int = 1
        topk_group: int = 1
        group_score: str = "top2_sum"  # top2_sum | max: how a group of experts is scored
        norm_topk_prob: bool = True
        routed_scaling_factor: float = 1.0
        n_shared_experts: int = 0
        shared_ffn_dim: Optional[int] = None  # None: n_shared_experts * ffn_dim
        shared_expert_gate: bool = False  # shared output * sigmoid(x @ shared_gate^T)
        shared_combine: str = "sum"  # sum | mean: routed + shared, or their mean (Cohere2-MoE's "average")
        swiglu_limit: Optional[float] = None  # clamp of every expert's pre-activations (DeepSeek-V4)
        router_bias: bool = False  # learned bias on the router logits (gpt-oss)
        expert_bias: bool = False  # routed experts' projections with biases (gpt-oss)
        swiglu_alpha: Optional[float] = None  # experts' gate * sigmoid(alpha * gate) instead of silu (gpt-oss)
        swiglu_up_offset: float = 0.0  # experts' (up + offset) (gpt-oss: 1)
        scale_input: bool = False  # expert(weight * x) instead of weight * expert(x) (Llama 4)
        jitter_eps: float = 0.0  # routing=sparsemixer: the relative logit gap of its masks (Phi-3.5-MoE: 0.01)

        def resolve(self, model: dict) -> "MoE.Spec":
            shared = self.shared_ffn_dim
            if shared is None:
                shared = self.n_shared_experts * self.ffn_dim
            return replace(self, shared_ffn_dim=shared)

        def check(self, model: dict) -> Optional[str]:
            if self.n_experts <= 0 or self.ffn_dim <= 0:
                return f"n_experts={self.n_experts} and ffn_dim={self.ffn_dim} must be positive"
            if not 0 < self.top_k <= self.n_experts:
                return f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}"
            if self.scoring not in SCORINGS:
                return f"scoring={self.scoring!r}: expected one of {list(SCORINGS)}"
            if self.routing not in ROUTINGS:
                return f"routing={self.routing!r}: expected one of {list(ROUTINGS)}"
            if self.routing == "hash" and (self.score_correction_bias or self.n_group > 1):
                return ("routing=hash takes the experts from the token-id table: score_correction_bias and "
                        "n_group (which only steer a learned selection) must be false and 1")
            if self.routing == "sparsemixer" and (self.score_correction_bias or self.n_group > 1
                                                  or self.norm_topk_prob or self.jitter_eps < 0):
                return ("routing=sparsemixer weights each pick by its own masked softmax: score_correction_bias, "
                        f"n_group and norm_topk_prob must be false, 1 and false, jitter_eps >= 0 (got "
                        f"{self.score_correction_bias}, {self.n_group}, {self.norm_topk_prob}, {self.jitter_eps})")
            if self.swiglu_limit is not None and self.swiglu_limit <= 0:
                return f"swiglu_limit must be positive (or null), got {self.swiglu_limit}"
            if self.swiglu_alpha is not None and self.swiglu_alpha <= 0:
                return f"swiglu_alpha must be positive (or null), got {self.swiglu_alpha}"
            if self.group_score not in GROUP_SCORES:
                return f"group_score={self.group_score!r}: expected one of {list(GROUP_SCORES)}"
            if self.n_group <= 0 or self.n_experts % self.n_group:
                return f"n_group={self.n_group} must be positive and divide n_experts={self.n_experts}"
            if not 0 < self.topk_group <= self.n_group:
                return f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}"
            per_group = self.n_experts // self.n_group
            if self.n_group > 1 and self.group_score == "top2_sum" and per_group < 2:
                return f"group_score=top2_sum needs >= 2 experts per group, got {per_group}"
            if self.n_group > 1 and self.topk_group * per_group < self.top_k:
                return (f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                        f"top_k={self.top_k} experts")
            if self.n_shared_experts < 0 or self.shared_ffn_dim < 0:
                return f"n_shared_experts and shared_ffn_dim must be >= 0"
            if self.shared_expert_gate and not self.shared_ffn_dim:
                return "shared_expert_gate needs a shared expert (n_shared_experts or shared_ffn_dim)"
            if self.shared_combine not in SHARED_COMBINES:
                return f"shared_combine={self.shared_combine!r}: expected one of {list(SHARED_COMBINES)}"
            return None

    def __init__(self, spec: "MoE.Spec", model):
        super().__init__()
        self.spec = spec
        s, D = spec, model.dim
        self.n_experts, self.top_k, self.ffn_dim = s.n_experts, s.top_k, s.ffn_dim
        table = TokenHash(model.spec.vocab_size, s.top_k, s.n_experts) if s.routing == "hash" else None
        self.router = Router(s.n_experts, D, s.score_correction_bias, table, logit_bias=s.router_bias)
        self.w13 = nn.Parameter(torch.empty(s.n_experts, 2 * s.ffn_dim, D))
        self.w2 = nn.Parameter(torch.empty(s.n_experts, D, s.ffn_dim))
        self.w13_bias = nn.Parameter(torch.empty(s.n_experts, 2 * s.ffn_dim)) if s.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(s.n_experts, D)) if s.expert_bias else None
        self.shared = SwiGLU(SwiGLU.Spec(ffn_dim=s.shared_ffn_dim, swiglu_limit=s.swiglu_limit), model) \
            if s.shared_ffn_dim else None
        self.shared_gate = nn.Linear(D, 1, bias=False) if s.shared_expert_gate else None
        self.local: Optional[tuple[int, int]] = None  # experts [lo, hi) this rank holds (expert parallel)

    # ------------------------------------------------------------------ parallel (parallel/plan.py)

    def shard(self, plan) -> bool:
        """Expert parallel: rank r holds the experts of its group (E / ep of them), each with its
        hidden width split P / ep ways (gate and up rows of w13, columns of w2); the shared expert
        is split P ways; router and shared gate are replicated. Dispatch is static: every rank
        already holds every token (attention leaves them replicated), routes them all, applies its
        own experts (the others weigh 0) and the sub-layer all-reduce sums the experts' outputs
        (the all-gather / reduce-scatter exchange, fused into that one collective)."""
        mesh = plan.mesh
        if mesh.size == 1:
            return False
        if self.w13_bias is not None:
            raise ConfigError("runtime.parallel: experts with biases (expert_bias, gpt-oss) have no sharding plan "
                              "yet; run them with tp=1 ep=1")
        E, F_ = self.n_experts, self.ffn_dim
        e = plan.units(E, "n_experts", parts=mesh.ep, index=mesh.expert_group)
        parts, index = mesh.expert_split
        f = plan.units(F_, "ffn_dim", parts=parts, index=index)
        plan.param(self, "w13", {0: [e], 1: [f, span(F_, f, 1)]})
        plan.param(self, "w2", {0: [e], 2: [f]})
        self.ffn_dim = f[1] - f[0]
        if mesh.ep > 1:
            self.local = e
        if self.shared is not None:
            self.shared.shard(plan, parts=mesh.size)
        return True

    def _local(self, idx: torch.Tensor, weights: torch.Tensor):
        """Chosen experts idx [T, K] (global ids) -> (local rows, weights, own [T, K] bool): experts
        held elsewhere get weight 0 and the row `hi - lo` (past the local ones). Unchanged (own None)
        without expert parallelism."""
        if self.local is None:
            return idx, weights, None
        lo, hi = self.local
        own = (idx >= lo) & (idx < hi)
        return torch.where(own, idx - lo, hi - lo), weights * own, own

    # ------------------------------------------------------------------ analysis (analysis.py)

    def routed_parameters(self) -> int:
        """Parameters of all routed experts: E * (2F*D + D*F) (+ E * (2F + D) biases)."""
        biases = 0 if self.w13_bias is None else self.w13_bias.numel() + self.w2_bias.numel()
        return self.w13.numel() + self.w2.numel() + biases

    def active_parameters(self, matmul_only: bool = False) -> int:
        """Parameters one token touches: top_k of the E routed experts, the router (its weight
        [E, D] multiplies every token; the 1-D selection bias and the token's tid2eid row are read,
        not multiplied), the shared experts and their gate. matmul_only: >= 2-D multiplied weights."""
        routed = self.routed_parameters() * self.top_k // self.n_experts
        n = routed + self.router.weight.numel()
        if matmul_only and self.w13_bias is not None:  # the chosen experts' biases are added, not multiplied
            n -= (self.w13_bias.numel() + self.w2_bias.numel()) * self.top_k // self.n_experts
        if not matmul_only:
            n += 0 if self.router.score_bias is None else self.router.score_bias.numel()
            n += 0 if self.router.bias is None else self.router.bias.numel()
            n += 0 if self.router.hash is None else self.router.hash.active_parameters()
        for part in (self.shared, self.shared_gate):
            if part is not None:
                n += sum(p.numel() for p in part.parameters() if p.dim() >= 2 or not matmul_only)
        return n

    def decode_weight_fraction(self, batch: int) -> float:
        """Expected share of the routed experts a decode step over `batch` tokens reads: each
        token picks top_k distinct experts of E, uniformly (the balanced load the routers are
        trained for), so an expert is missed by all with probability (1 - K/E)^B."""
        return 1.0 - (1.0 - self.top_k / self.n_experts) ** batch

    # ------------------------------------------------------------------ routing

    def route(self, x: torch.Tensor, ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], ids [T] token ids (read by hash routing only) -> (weights [T, K] float32,
        idx [T, K] int64). Scores in float32."""
        s = self.spec
        bias = None if self.router.bias is None else self.router.bias.float()
        logits = F.linear(x.float(), self.router.weight.float(), bias)
        if s.routing == "sparsemixer":
            weights, idx = sparsemixer_route(logits, s.top_k, s.jitter_eps)
            return weights * s.routed_scaling_factor, idx
        if s.scoring == "softmax":
            scores = logits.softmax(-1)
        elif s.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if s.routing == "hash":
            return self._weights(scores, self.router.hash(ids))
        bias = self.router.score_bias
        choice = scores if bias is None else scores + bias.float()
        if s.n_group > 1:
            grouped = choice.view(-1, s.n_group, s.n_experts // s.n_group)
            if s.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(s.topk_group, dim=-1).indices  # [T, topk_group]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(s.n_experts // s.n_group, dim=1), float("-inf"))
        return self._weights(scores, choice.topk(s.top_k, dim=-1).indices)

    def _weights(self, scores: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts' scores, renormalised and scaled: (weights [T, K], idx [T, K])."""
        s = self.spec
        weights = scores.gather(1, idx)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, idx

    def _split_weights(self, weights: torch.Tensor, own: Optional[torch.Tensor]):
        """Routing weights [T, K] -> (on the expert's input, on its output): (None, weights), or
        with scale_input (weights, 1 where the expert is held here, 0 elsewhere)."""
        if not self.spec.scale_input:
            return None, weights
        return weights, (torch.ones_like(weights) if own is None else own.to(weights.dtype))

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """Experts' pre-activations [..., 2F] (gate | up) -> [..., F]."""
        s = self.spec
        gate, up = h.split(self.ffn_dim, dim=-1)
        return swiglu(gate, up, s.swiglu_limit, alpha=s.swiglu_alpha, up_offset=s.swiglu_up_offset)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared(x)
        if self.shared_gate is not None:
            y = torch.sigmoid(self.shared_gate(x)) * y
        return y

    def _finish(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """routed [T, D] float32 -> y [..., D] in x's dtype, plus the shared experts."""
        y = routed.to(x.dtype).view(x.shape)
        if self.shared is None:
            return y
        y = y + self._shared(x)
        return y / 2 if self.spec.shared_combine == "mean" else y

    # ------------------------------------------------------------------ entry points

    def decode(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Gathered: x [B, 1, D] -> [B, 1, D]; reads only the chosen experts' weights."""
        if not isinstance(self.w13, torch.Tensor):  # quantized stacks: grouped (see the module docstring)
            return self.prefill(x, ctx)
        xt = x.reshape(-1, x.shape[-1])  # [T, D]
        weights, idx = self.route(xt, ctx["ids"])
        idx, weights, own = self._local(idx, weights)
        if own is not None:
            idx = idx.clamp(max=self.w13.shape[0] - 1)  # any local expert: its output weighs 0
        w_in, weights = self._split_weights(weights, own)
        xk = xt[:, None, :, None] if w_in is None else (xt[:, None, :] * w_in[..., None].to(xt.dtype))[..., None]
        w13 = self.w13[idx]  # [T, K, 2F, D]
        h = torch.matmul(w13, xk).squeeze(-1)  # [T, K, 2F]
        if self.w13_bias is not None:
            h = h + self.w13_bias[idx]
        a = self._act(h)  # [T, K, F]
        y = torch.matmul(self.w2[idx], a[..., None]).squeeze(-1)  # [T, K, D]
        if self.w2_bias is not None:
            y = y + self.w2_bias[idx]
        routed = (y.float() * weights[..., None]).sum(1)
        return self._finish(x, routed)

    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Grouped: x [B, L, D] -> [B, L, D]; (token, expert) pairs sorted by expert."""
        xt = x.reshape(-1, x.shape[-1])  # [T, D]
        weights, idx = self.route(xt, ctx["ids"])
        idx, weights, own = self._local(idx, weights)
        E = self.w13.shape[0]  # local experts; pairs of experts held elsewhere sort last, uncomputed
        flat = idx.reshape(-1)  # [T*K] expert of each pair
        order = flat.argsort(stable=True)
        token = order // self.top_k  # token of each sorted pair
        counts = torch.zeros(E + (own is not None), dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        offs = counts[:E].cumsum(0)
        w_in, weights = self._split_weights(weights, own)
        rows = xt[token] if w_in is None else xt[token] * w_in.reshape(-1)[order, None].to(xt.dtype)
        expert = flat[order].clamp(max=E - 1)  # expert of each sorted pair (others: discarded)
        if isinstance(self.w13, torch.Tensor) or self.w13_bias is not None:
            h = _grouped(rows, self.w13, offs)  # [T*K, 2F]
            if self.w13_bias is not None:
                h = h + self.w13_bias[expert]
            a = self._act(h)
        else:  # a quantized stack: the activation inside its matmul (no [T*K, 2F] floats; experts.py)
            s = self.spec
            a = self.w13.grouped_act(rows, offs, s.swiglu_limit, alpha=s.swiglu_alpha, up_offset=s.swiglu_up_offset)
        y = _grouped(a, self.w2, offs)  # [T*K, D]
        if self.w2_bias is not None:
            y = y + self.w2_bias[expert]
        # back to (token, k) order by a gather, then a sum over k: a scatter-add into tokens
        # compiles to atomic adds on CPU (7x slower here)
        arange = torch.arange(order.numel(), device=x.device)
        inverse = torch.empty_like(order).scatter_(0, order, arange)
        y = y[inverse].view(*weights.shape, -1).float()  # [T, K, D]
        if own is not None:  # rows of other ranks' experts were never written
            y = torch.where(own[..., None], y, 0.0)
        routed = (y * weights[..., None]).sum(1)
        return self._finish(x, routed)
