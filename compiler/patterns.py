"""What a model's attention does over one prompt (`zoo patterns`), read through each mixer's own
probe (contracts.AttentionProbe: the prefill's projections, RoPE, masks, sinks and selection,
with an explicit softmax instead of the fused kernel), streamed one layer and one head group at
a time.

    prompt [1, L] -> the engine's layers, eagerly, through their prefill entry points
      each layer, before its mixer's prefill runs on x [B, L, D]:
        AttentionProbe   for head groups of h heads: maps [B, h, L, L] -> per-head scores
        MixerStatistics  (DeltaNet, ...) per-head gate / state statistics
      each residual connection that mixes streams (contracts.StreamMixing, mHC): its matrices
        [B, L, N, N] and their running product over the layers

Scores per (layer, head), averaged over the queries t >= 1 (query 0 sees only itself):
    sink            attention to position 0
    previous_token  attention to t - 1 (the -1 diagonal)
    induction       on BOS + n tokens + the same n tokens again (L = 1 + 2n): attention from each
                    token of the second copy (position 1 + n + i) to the token after its first
                    occurrence (2 + i) (Olsson et al. 2022)
    local           attention to the LOCAL + 1 most recent keys t - LOCAL .. t
    entropy         of the query's whole distribution (nats; learned sinks and compressed
                    entries are outcomes too)
  and where a kind has them: learned_sink (a learned sink's share), entries (compressed
  entries' share), dsa_captured (the share of dense causal softmax mass held by the indexer's
  picks, over the queries that see more than Ks keys).
distance: per layer, the mean scaled q.k logit at each distance |t - s| (RoPE's decay), over
keys s >= 1 (position 0's sink logits would otherwise dominate every query's farthest key).

Memory: one head group's [B, h, L, L] float32 map is at most `budget` bytes (h >= 1), and about
eight such tensors are alive at once (logits, probabilities, the probe's masking temporaries,
the distance profile's padded copy), so the analysis needs ~8 x budget beyond the model and its
caches; nothing of a layer survives it but the scores (and the strongest heads' maps when
L <= MAP_MAX).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .contracts import AttentionMaps, AttentionProbe, MixerStatistics, StreamMixing

SCORES = ("sink", "previous_token", "induction", "local", "entropy")
EXTRA_SCORES = ("learned_sink", "entries", "dsa_captured")
LOCAL = 3  # `local`: keys t - 3 .. t
MAP_MAX = 512  # keep the strongest heads' [L, L] maps for plots up to this prompt length
DEFAULT_BUDGET = 64 << 20  # bytes of one head group's [B, h, L, L] float32 map


@dataclass
class Patterns:
    """The analysis of one prompt. Grids are [n_layers][H] lists (None for a layer without
    softmax attention, or a score the kind has no notion of)."""

    tokens: list[int]
    n_repeat: int  # n of the induction prompt (0: not one)
    kinds: list[str]
    grids: dict[str, list] = field(default_factory=dict)
    distance: list = field(default_factory=list)  # per layer: mean logit at distance d (None: no attention)
    recurrent: list = field(default_factory=list)  # per layer: {statistic: [heads]} or None
    streams: Optional[dict] = None  # mHC: per connection and running-product summaries
    maps: dict = field(default_factory=dict)  # score -> (layer, head, value, [L, L] probabilities)
    budget: int = DEFAULT_BUDGET
    heads_per_group: dict = field(default_factory=dict)  # layer -> h used

    def top_heads(self, score: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The k (layer, head, value) of highest `score`."""
        cells = [(i, j, v) for i, row in enumerate(self.grids.get(score) or []) if row is not None
                 for j, v in enumerate(row) if v is not None and not math.isnan(v)]
        return sorted(cells, key=lambda c: -c[2])[:k]

    def to_json(self) -> dict:
        out = {"tokens": self.tokens, "repeat": self.n_repeat, "kinds": self.kinds,
               **{name: self.grids.get(name) for name in (*SCORES, *EXTRA_SCORES)},
               "top_heads": {name: [list(c) for c in self.top_heads(name)] for name in SCORES},
               "distance": self.distance, "recurrent": self.recurrent, "streams": self.streams,
               "budget_bytes": self.budget}
        return _finite(out)


def _finite(x):
    """NaN (a score with no query to average over) -> None, so the JSON stays standard."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def induction_prompt(n: int, bos: int, vocab: int, seed: int = 0, tokens: Optional[list[int]] = None) -> list[int]:
    """BOS + n tokens + the same n tokens again: the given `tokens` (n = their count) or n drawn
    uniformly from the vocabulary without `bos` (a torch.Generator seeded with `seed`)."""
    if tokens is None:
        if n < 1:
            raise ValueError(f"repeat={n}: expected a positive number of tokens to repeat")
        g = torch.Generator().manual_seed(seed)
        draw = torch.randint(0, vocab - 1, (n,), generator=g)
        tokens = (draw + (draw >= bos).long()).tolist()  # skip bos
    return [bos, *tokens, *tokens]


# ---------------------------------------------------------------------------- per-head scores


def head_scores(maps: AttentionMaps, n_repeat: int) -> dict[str, torch.Tensor]:
    """Scores [h] of a head group's maps (batch rows averaged; see the module docstring)."""
    p = maps.probs  # [B, h, L, L]
    B, h, L, _ = p.shape
    out = {"sink": p[..., 1:, 0].mean((0, -1)),
           "previous_token": torch.diagonal(p, -1, -2, -1).mean((0, -1))}
    if n_repeat and L == 1 + 2 * n_repeat:
        out["induction"] = torch.diagonal(p[..., 1 + n_repeat:, 2:2 + n_repeat], 0, -2, -1).mean((0, -1))
    else:
        out["induction"] = p.new_full((h,), float("nan"))
    t = torch.arange(L, device=p.device)
    band = (t[:, None] - t[None, :] >= 0) & (t[:, None] - t[None, :] <= LOCAL)
    out["local"] = (p * band).sum(-1)[..., 1:].mean((0, -1))
    ent = -torch.special.xlogy(p, p).sum(-1)  # [B, h, L]
    sink = maps.extras.get("sink")
    entries = maps.extras.get("entries")
    if sink is not None:
        ent = ent - torch.special.xlogy(sink, sink)
        out["learned_sink"] = sink[..., 1:].mean((0, -1))
    if entries is not None:
        ent = ent - torch.special.xlogy(entries, entries).sum(-1)
        out["entries"] = entries.sum(-1)[..., 1:].mean((0, -1))
    out["entropy"] = ent[..., 1:].mean((0, -1))
    captured, picks = maps.extras.get("captured"), maps.extras.get("picks")
    if captured is not None:
        drops = t + 1 > picks.shape[-1]  # queries that see more keys than the indexer keeps
        out["dsa_captured"] = captured[..., drops].mean((0, -1)) if bool(drops.any()) \
            else captured.new_full((h,), float("nan"))
    return out


def distance_sums(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, h, L, L] (-inf where not scored) -> (sum, count) [L] of the finite logits at each
    distance d = t - s (the d-th sub-diagonal), over heads, batch rows and queries."""
    B, h, L, _ = logits.shape
    x = logits.reshape(B * h, L, L).float()
    x = torch.where(torch.isfinite(x), x, torch.nan)
    # NaN-pad L columns on the left: row t of the padded [L, 2L] read with stride 2L + 1 from
    # column 1 gives, at column c, the logit of key t - (L - 1 - c) (NaN where that is < 0)
    padded = F.pad(x, (L, 0), value=float("nan")).contiguous()
    diag = padded.as_strided((B * h, L, L), (2 * L * L, 2 * L + 1, 1), padded.storage_offset() + 1).flip(-1)
    finite = ~torch.isnan(diag)
    return torch.nansum(diag, dim=(0, 1)), finite.sum(dim=(0, 1))


# ---------------------------------------------------------------------------- stream mixing


def mixing_summary(m: torch.Tensor) -> dict:
    """Stream-mixing matrices m [T, N, N] (one per token) -> how far they are from doubly
    stochastic: the largest |row sum - 1|, |column sum - 1|, the largest spectral norm, the
    smallest entry, the largest distance to the uniform J/N, and the token-mean matrix."""
    m = m.double()
    N = m.shape[-1]
    return {"row_sum_error": float((m.sum(-1) - 1).abs().max()), "col_sum_error": float((m.sum(-2) - 1).abs().max()),
            "spectral_norm": float(torch.linalg.matrix_norm(m, ord=2).max()), "min_entry": float(m.min()),
            "to_uniform": float((m - 1.0 / N).abs().max()), "mean": m.mean(0).tolist()}


class _StreamRecorder:
    """Per mixing connection, its matrices over the prompt; their running product in the order
    the connections apply (streams h_k = comb_k^T h_{k-1}, so h_k = (comb_1 ... comb_k)^T h_0
    besides the sub-layer outputs)."""

    def __init__(self):
        self.layers: list[dict] = []
        self.product: Optional[torch.Tensor] = None

    def record(self, layer: int, where: str, comb: torch.Tensor, rows: int) -> None:
        comb = comb[:rows].reshape(-1, *comb.shape[-2:]).double()  # [B * L, N, N]
        self.product = comb if self.product is None else torch.matmul(self.product, comb)
        self.layers.append({"layer": layer, "connection": where, **mixing_summary(comb),
                            "product": {k: v for k, v in mixing_summary(self.product).items() if k != "mean"}})


# ---------------------------------------------------------------------------- the driver


@contextlib.contextmanager
def _before(obj, name: str, hook):
    """While active, obj.name(*args) first calls hook(*args) (an instance attribute shadowing the
    method; eager runs only, which is how `analyze` runs the layers)."""
    method = getattr(obj, name)

    def wrapped(*args, **kwargs):
        hook(*args, **kwargs)
        return method(*args, **kwargs)

    setattr(obj, name, wrapped)
    try:
        yield
    finally:
        delattr(obj, name)


def heads_per_group(n_heads: int, rows: int, L: int, budget: int) -> int:
    """Heads h whose [rows, h, L, L] float32 map fits `budget` bytes (at least one)."""
    return max(1, min(n_heads, budget // max(1, rows * L * L * 4)))


@torch.no_grad()
def analyze(engine, ids: torch.Tensor, n_repeat: int = 0, budget: int = DEFAULT_BUDGET) -> Patterns:
    """Run ids [B, L] (positions 0..L-1) through `engine`'s layers eagerly and read every layer's
    attention / recurrent statistics and stream mixing on the way (module docstring). The engine's
    caches are reset afterwards. n_repeat: ids is an induction prompt of that n (0: none)."""
    model = engine.model
    B, L = ids.shape
    if L > engine.max_seq or B > engine.max_batch:
        raise ValueError(f"patterns: a prompt of {B} x {L} tokens exceeds the engine's max_batch x max_seq = "
                         f"{engine.max_batch} x {engine.max_seq} (rebuild with runtime.max_seq={L})")
    n_layers = len(model.layers)
    kinds = [block.mixer.kind for block in model.layers]
    grids = {name: [None] * n_layers for name in (*SCORES, *EXTRA_SCORES)}
    out = Patterns(tokens=ids[0].tolist(), n_repeat=n_repeat, kinds=kinds, grids=grids,
                   distance=[None] * n_layers, recurrent=[None] * n_layers, budget=budget)
    streams = _StreamRecorder()

    def probe(i: int, mixer, x: torch.Tensor, cache, ctx) -> None:
        x = x[:B]
        if isinstance(mixer, AttentionProbe):
            H = mixer.n_heads
            step = out.heads_per_group[i] = heads_per_group(H, B, L, budget)
            per_head: dict[str, list] = {}
            total, count = 0, 0
            for start in range(0, H, step):
                maps = mixer.attention_probe(x, ctx, slice(start, min(start + step, H)))
                scores = head_scores(maps, n_repeat)
                for name, v in scores.items():
                    per_head.setdefault(name, []).extend(v.tolist())
                s, c = distance_sums(maps.logits[..., 1:, 1:])  # without the sink's column (see below)
                total, count = total + s, count + c
                if L <= MAP_MAX:
                    _keep_maps(out, i, start, maps, scores)
                del maps
            for name, values in per_head.items():
                grids[name][i] = values
            out.distance[i] = (total / count.clamp(min=1)).masked_fill(count == 0, float("nan")).tolist()
        elif isinstance(mixer, MixerStatistics):
            out.recurrent[i] = {k: v.mean(0).tolist() for k, v in mixer.mixer_statistics(x, ctx).items()}

    def mixing(i: int, where: str, conn, h: torch.Tensor) -> None:
        streams.record(i, where, conn.mixing(h), B)

    _observe(engine, ids, probe, mixing)
    if streams.layers:
        out.streams = {"connections": streams.layers,
                       "product": {k: v for k, v in mixing_summary(streams.product).items()}}
    return out


@torch.no_grad()
def attention_maps(engine, ids: torch.Tensor, **probe_options) -> dict[int, AttentionMaps]:
    """layer -> its maps over ids [B, L], all heads at once (short prompts: tests, one-off looks);
    probe_options go to every probe (absorbed=True for MLA / DSA's decode form)."""
    maps = {}

    def probe(i: int, mixer, x: torch.Tensor, cache, ctx) -> None:
        if isinstance(mixer, AttentionProbe):
            maps[i] = mixer.attention_probe(x[:ids.shape[0]], ctx, **probe_options)

    _observe(engine, ids, probe)
    return maps


def _observe(engine, ids: torch.Tensor, on_mixer, on_mixing=None) -> None:
    """Run ids through the layers with on_mixer(layer, mixer, x, cache, ctx) called before each
    mixer's prefill and on_mixing(layer, where, connection, h) before each stream-mixing
    connection's enter; the caches are reset afterwards."""
    with contextlib.ExitStack() as stack:
        for i, block in enumerate(engine.model.layers):
            mixer = block.mixer
            stack.enter_context(_before(mixer, "prefill", lambda x, cache, ctx, i=i, m=mixer: on_mixer(i, m, x, cache, ctx)))
            for where in ("mixer_residual", "ffn_residual"):
                conn = getattr(block, where)
                if on_mixing is not None and isinstance(conn, StreamMixing):
                    stack.enter_context(_before(conn, "enter", lambda h, i=i, w=where, c=conn: on_mixing(i, w, c, h)))
        try:
            _run_layers(engine, ids)
        finally:
            engine.reset()


def _keep_maps(out: Patterns, layer: int, start: int, maps: AttentionMaps, scores: dict) -> None:
    """Keep the map of the strongest head so far for each score (row 0 of the batch)."""
    for name in ("sink", "previous_token", "induction"):
        values = scores[name]
        if torch.isnan(values).all():
            continue
        j = int(torch.nan_to_num(values, nan=-1.0).argmax())
        best = out.maps.get(name)
        if best is None or float(values[j]) > best[2]:
            out.maps[name] = (layer, start + j, float(values[j]), maps.probs[0, j].clone())


def _run_layers(engine, ids: torch.Tensor) -> None:
    """The prefill's layers, eagerly (the probes' hooks are Python), at positions 0..L-1."""
    model = engine.model
    L = ids.shape[1]
    ids = engine._pad_batch(ids.to(engine.device, torch.long)).contiguous()
    h = model.streams.expand(model.embed(ids))
    ctx = {"ids": ids, "rope": {k: (cos[:L], sin[:L]) for k, (cos, sin) in engine.rope.items()},
           **model.per_layer(ids)}  # as the engine's step context (per-layer input embeddings)
    for block, cache in zip(model.layers, engine.caches):
        h = block.prefill(h, cache, ctx)
