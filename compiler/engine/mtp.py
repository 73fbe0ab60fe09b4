"""Multi-token prediction at run time: the MTP blocks' caches, their pass after a prefill, and
the MTP drafter of speculative decoding (MtpDrafter).
The MTPLayer modules are built with the model (compiler/mtp.py, which draws the scheme); each
block runs through the engine's compiled block prefill (`Engine.block_prefill`).
"""
from __future__ import annotations

import torch

from ..contracts.cache import CachePlan
from ..errors import InputError
from .drafters import Draft, Drafter


def mtp_caches(model, max_batch: int, max_seq: int, dtype: torch.dtype, device) -> list[dict]:
    """The MTP blocks' own caches (their attention runs over their own positions) of the
    model.Decoder `model`."""
    plan = CachePlan(tuple(layer.mixer.cache_fields(max_batch, max_seq, dtype) for layer in model.mtp),
                     max_batch, max_seq)
    return plan.allocate(device)


def mtp_prefill(engine, ids: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
    """After the main prefill of ids [b, L] (a bucket's rows) by `engine` (graphs.Engine; this
    module is below it) with last residual state h: per depth k = 1..n, logits [b, L - k, V] (float32) for tokens
    t + k + 1 at positions t = 0..L-1-k."""
    model = engine.model
    if not len(model.mtp):
        raise InputError("return_mtp: this model has no multi-token-prediction layers (the config has "
                         "mtp.n_layers=0, or checkpoint.mtp=false so they were not built)")
    hidden = model.final_hidden(h)  # hidden^0: what the main head reads
    out = []
    b = ids.shape[0]  # the prefill's bucket: the MTP caches' first b rows
    for k, (layer, cache) in enumerate(zip(model.mtp, engine.mtp_caches), start=1):
        cache = {name: t[:b] for name, t in cache.items()}
        n = ids.shape[1] - k  # positions this depth predicts from
        if n < 1:
            out.append(hidden.new_zeros(ids.shape[0], 0, model.spec.vocab_size, dtype=torch.float32))
            continue
        nxt = ids[:, k:]
        x = layer.step_in(model, hidden[:, :n], nxt)
        x = engine.block_prefill(layer, x, cache, nxt)
        hidden, logits = layer.step_out(model, x)
        out.append(logits)
    return out


class MtpDrafter(Drafter):
    """The model's first MTP layer as the drafter (speculative.py), its own cache per row.

    Depth 1 at position t reads the target's final hidden state at t and token t + 1 and predicts
    token t + 2. A row whose target cache holds T tokens (the next one, x, chosen) keeps its MTP
    cache filled up to m <= T - 1 positions and the target's hidden states at m..T-1 (`pending`):
    a round first appends positions m..T-1 (hidden states and tokens m+1..T, x the last), whose
    last output drafts d_1, then runs the layer once per further draft at T, T+1, ..., reading
    its own last hidden state in place of the target's (as DeepSeek's and vLLM's one-layer MTP
    drafting does; a model with more MTP layers drafts with the first). Those further positions
    are speculative: after the verify the row's m is T and its pending states are the target's
    at T..T+a, so they are overwritten. Slots past m are never read (the MTP layers' fields
    grow with tokens; a layer with constant-state fields is refused).
    """

    name = "mtp"
    wants_hidden = True

    def __init__(self, engine):
        model = engine.model
        if not len(model.mtp):
            raise InputError("runtime.speculative.drafter=mtp: this model has no multi-token-prediction layers "
                             "(build it with checkpoint.mtp=true from a config with mtp.n_layers > 0)")
        layer = model.mtp[0]
        state = [n for n, f in layer.mixer.cache_fields(1, 1, torch.float32).items() if not f.grows]
        if state:
            raise InputError(f"runtime.speculative.drafter=mtp: the MTP layer's mixer ({layer.mixer.kind}) keeps "
                             f"constant-state cache fields {state}, which drafting ahead would overwrite; "
                             f"expected a mixer whose cache grows with tokens")
        self.engine = engine
        self.filled: dict[int, int] = {}  # row -> m
        self.pending: dict[int, torch.Tensor] = {}  # row -> target hidden states [T - m, D]

    def prefilled(self, rows, ids, hidden) -> None:
        for i, r in enumerate(rows):
            self.filled[r], self.pending[r] = 0, hidden[i]

    def verified(self, rows, starts, tokens, kept, hidden) -> None:
        for i, r in enumerate(rows):
            new = hidden[i, :kept[i] + 1]
            # caught up this round (m == T), else (a round with no drafts) the states pile up
            self.pending[r] = new if self.filled[r] == starts[i] else torch.cat((self.pending[r], new))

    def release(self, row: int) -> None:
        self.filled.pop(row, None)
        self.pending.pop(row, None)

    def move(self, src: int, dst: int) -> None:  # its MTP cache rows moved with Engine.move_row
        for d in (self.filled, self.pending):
            if src in d:
                d[dst] = d.pop(src)

    def reset(self) -> None:
        self.filled.clear()
        self.pending.clear()

    def _run(self, rows: list[int], prev: torch.Tensor, ids: torch.Tensor, start: torch.Tensor):
        """The first MTP layer over prev [n, L, D], ids [n, L] at positions start[i].. of rows'
        MTP caches -> (hidden [n, D], logits [n, V]) of the last position (Engine.mtp_extend: an
        engine call, which a torchrun leader replays on every rank)."""
        return self.engine.mtp_extend(0, rows, prev, ids, start)

    def propose(self, rows, histories, kd, picks) -> Draft:
        e = self.engine
        n = len(rows)
        hidden = torch.empty(n, self.pending[rows[0]].shape[-1], dtype=self.pending[rows[0]].dtype, device=e.device)
        logits = torch.empty(n, e.vocab_size, device=e.device)
        # catch up: rows with as many pending positions go together
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(self.pending[r].shape[0], []).append(i)
        for c, group in groups.items():
            rs = [rows[i] for i in group]
            prev = torch.stack([self.pending[r] for r in rs])
            m = [self.filled[r] for r in rs]
            ids = torch.stack([histories[i][m_i + 1:m_i + 1 + c] for i, m_i in zip(group, m)]).to(e.device)
            start = torch.tensor(m, dtype=torch.long, device=e.device)
            hidden[group], logits[group] = self._run(rs, prev, ids, start)
            for r, m_i in zip(rs, m):
                self.filled[r] = m_i + c
        start = torch.tensor([histories[i].shape[0] - 1 for i in range(n)], dtype=torch.long, device=e.device)
        tokens = torch.empty(n, kd, dtype=torch.long, device=e.device)
        q = torch.zeros(n, kd, e.vocab_size, device=e.device) if any(p.probs is not None for p in picks) else None
        for j in range(kd):
            if j:
                hidden, logits = self._run(rows, hidden[:, None], tokens[:, j - 1:j], start + j - 1)
            for i, p in enumerate(picks):
                if p.probs is None:
                    tokens[i, j] = logits[i].argmax()
                else:
                    q[i, j] = p.probs(logits[i:i + 1])[0]
                    tokens[i, j] = torch.multinomial(q[i, j].to(p.generator.device if p.generator else q.device),
                                                     1, generator=p.generator)[0]
        return Draft(tokens, [kd] * n, q)
