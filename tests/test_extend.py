"""The engine's extend primitive (core.Engine.extend_rows) and its rollbacks (truncate_row,
save_state / restore_state), on the tiny twins of every cache kind (tests/family_harness.py's
eager models): a prompt prefilled in chunks (1-token chunks included) gives the logits of one
whole prefill and the same decode steps after it; rows at different positions extend together;
a rolled-back row equals one that never held the dropped tokens. One compiled sample (llama)."""
from __future__ import annotations

import pytest
import torch

from zoo.compiler.errors import InputError

# family -> the cache kinds it covers
KINDS = {
    "llama/gqa": "gqa (full cache)",
    "attn/mistral": "gqa sliding window (ring)",
    "attn/gemma2": "gqa ring + softcap, global layers",
    "attn/gpt_oss": "gqa ring + sinks",
    "deepseek_v3/main": "mla",
    "glm5/glm": "dsa",
    "deepseek_v4": "swa_mqa, hca_mqa, csa_mqa",
    "qwen3_next": "gated_deltanet + gated gqa",
    "kimi_linear": "kda + mla",
}
MORE = {"gpt2era/gpt2": "learned absolute positions (Block.extend)", "gpt2era/bloom": "gqa with ALiBi",
        "reach_dense/diffllama": "diff_attn (gqa's full cache, doubled values)",
        "reach_moe/llama4_text": "gqa chunked (ring of 8 slots; the splits cross chunks) + NoPE with temperature"}
SPLITS = ([11, 9, 6], [1, 1, 1, 4, 19], [5, 1, 20], [2, 24])  # first chunk by prefill_row, the rest extended


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    err = (got - want).abs()
    bound = rtol * want.abs() + rtol * want.abs().max()
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3g} (rtol {rtol})"


def sequence(model, n: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.engine.vocab_size, (n, T), generator=g)


def whole(model, seq: torch.Tensor) -> torch.Tensor:
    """Logits [n, T, V] of one whole prefill of seq [n, T]."""
    return model.engine.prefill(seq).clone()


@pytest.mark.parametrize("name", [*KINDS, *MORE])
def test_chunked_prefill_equals_whole(families, name):
    """Chunks of every size (1-token chunks too) == one prefill, and the decode steps after."""
    model, rtol = families.eager(name), max(families.family(name).rtol, 1e-5)
    e = model.engine
    n, T = e.max_batch, min(e.max_seq, 32)
    seq = sequence(model, n, T, 0)
    want = whole(model, seq)
    for split in SPLITS:
        P = sum(split)
        e.reset()
        first = torch.stack([e.prefill_row(r, seq[r, :split[0]]) for r in range(n)])
        close(first, want[:, split[0] - 1], rtol, f"{name} {split}: first chunk")
        at = split[0]
        for c in split[1:]:
            got = e.extend_rows(list(range(n)), seq[:, at:at + c])
            close(got, want[:, at:at + c], rtol, f"{name} {split}: chunk at {at}")
            at += c
        assert e.row_len[:n] == [P] * n and e.pos[:n].tolist() == [P] * n
        for t in range(P, T):  # the decode steps after a chunked prefill
            tok = torch.zeros(e.max_batch, dtype=torch.long)
            tok[:n] = seq[:, t]
            close(e.decode_rows(tok)[:n], want[:, t], rtol, f"{name} {split}: decode at {t}")


@pytest.mark.parametrize("name", ["llama/gqa", "attn/gpt_oss", "glm5/glm", "deepseek_v4", "qwen3_next",
                                  "reach_moe/llama4_text"])
def test_rows_at_different_positions(families, name):
    """One extend of rows holding different lengths, each at its own position, last_only, rows
    given out of order."""
    model, rtol = families.eager(name), max(families.family(name).rtol, 1e-5)
    e = model.engine
    T, L = min(e.max_seq, 30), 6
    seq = sequence(model, 2, T, 1)
    want = whole(model, seq)
    e.reset()
    held = [T - L - 9, T - L]  # rows 0 and 1
    for r in (0, 1):
        e.prefill_row(r, seq[r, :held[r]])
    got = e.extend_rows([1, 0], torch.stack([seq[1, held[1]:held[1] + L], seq[0, held[0]:held[0] + L]]))
    close(got[0], want[1, held[1]:held[1] + L], rtol, f"{name}: row 1")
    close(got[1], want[0, held[0]:held[0] + L], rtol, f"{name}: row 0")
    assert e.row_len[:2] == [held[0] + L, held[1] + L]
    last = e.extend_rows([0], seq[:1, held[0] + L:held[0] + L + 3], last_only=True)
    assert last.shape == (1, e.vocab_size)
    close(last[0], want[0, held[0] + L + 2], rtol, f"{name}: last_only")


@pytest.mark.parametrize("name", list(KINDS))
def test_rollback_equals_never_extended(families, name):
    """save_state, extend draft tokens, restore_state, extend the kept ones == never having held
    the draft; truncate_row the same where every field grows, and a clear refusal elsewhere."""
    model, rtol = families.eager(name), max(families.family(name).rtol, 1e-5)
    e = model.engine
    n, T = e.max_batch, min(e.max_seq, 30)
    seq = sequence(model, n, T, 2)
    draft = sequence(model, n, 7, 3)
    want = whole(model, seq)
    P, rows = 12, list(range(n))
    grows_only = not e.constant_state_kinds()
    for how in ("restore", "truncate"):
        e.reset()
        for r in rows:
            e.prefill_row(r, seq[r, :P])
        e.extend_rows(rows, seq[:, P:P + 3])
        handle = e.save_state(rows)
        e.extend_rows(rows, draft[:, :4])
        e.extend_rows(rows, draft[:, 4:])
        if how == "restore":
            e.restore_state(rows, handle)
        elif grows_only:
            for r in rows:
                e.truncate_row(r, P + 3)
        else:
            with pytest.raises(InputError, match=r"constant-state.*save_state"):
                e.truncate_row(0, P + 3)
            continue
        assert e.row_len[:n] == [P + 3] * n
        got = e.extend_rows(rows, seq[:, P + 3:T])
        close(got, want[:, P + 3:T], rtol, f"{name} ({how}): after rollback")


def test_extend_refusals(families):
    model = families.eager("llama/gqa")
    e = model.engine
    e.reset()
    e.prefill_row(0, torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="row 1 is free"):
        e.extend_rows([1], torch.tensor([[4]]))
    with pytest.raises(InputError, match=r"expected ids of shape \[1, L\]"):
        e.extend_rows([0], torch.tensor([4, 5]))
    with pytest.raises(InputError, match="exceed max_seq"):
        e.extend_rows([0], torch.zeros(1, e.max_seq - 2, dtype=torch.long))
    with pytest.raises(InputError, match="twice"):
        e.extend_rows([0, 0], torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(InputError, match="length 9 must be in 0..3"):
        e.truncate_row(0, 9)


@pytest.mark.parametrize("runner", ["compiled", "aot"])
def test_compiled_extend(families, runner):
    """Compiled regions and AOTInductor packages: chunked extends == eager, one graph (package)
    per layer kind for every chunk length >= 2 and position (1-token chunks: one more, as dynamo
    and export specialise a size-1 dimension); rows given as a run (views) or out of order
    (gathered copies) share them."""
    import zoo

    name = "llama/gqa"
    eager = families.eager(name)
    _, path = families.reference(name)
    fam = families.family(name)
    model = zoo.from_pretrained(str(path), compile=True, max_batch=fam.batch, max_seq=fam.max_seq,
                                overrides=[f"runtime.aot={runner == 'aot'}"])
    e = model.engine
    assert e.runner_kind == runner
    seq = sequence(eager, 2, 30, 4)
    want = whole(eager, seq)
    for split in ([11, 9, 6, 4], [5, 3, 17, 5], [2, 1, 1, 26]):
        e.reset()
        for r in range(2):
            e.prefill_row(r, seq[r, :split[0]])
        at = split[0]
        for c in split[1:]:
            close(e.extend_rows([0, 1], seq[:, at:at + c]), want[:, at:at + c], 1e-4, f"{runner} {split} at {at}")
            at += c
    e.reset()
    for r in range(2):
        e.prefill_row(r, seq[r, :7])
    got = e.extend_rows([1, 0], seq[[1, 0], 7:12])  # out of order: gathered copies, written back
    close(got, want[[1, 0], 7:12], 1e-4, f"{runner} rows [1, 0]")
    close(e.extend_rows([0, 1], seq[:, 12:14]), want[:, 12:14], 1e-4, f"{runner} after the write-back")
    if runner == "compiled":
        assert e.graph_counts()["extend"] == 2  # L >= 2, and L = 1
    else:
        assert e.graph_counts()["extend_packages"] == 2
