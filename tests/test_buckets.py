"""Decode batch buckets (compiler/engine/buckets.py): each bucket runs only its rows and gives the
logits the whole batch gives; decode_active and move_row (a compacting server's steps) keep every
sequence's logits; a compiled engine makes one decode graph per bucket and layer kind at warmup
and never recompiles, its steps still skipping dynamo's guards; bad bucket lists are refused."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import assert_logits_close
from zoo.compiler.engine.buckets import bucket_for, check_buckets, default_buckets
from zoo.compiler.errors import ConfigError, InputError

CONF, MAX_BATCH, MAX_SEQ = "llama3_8b_tiny", 4, 24


def test_default_buckets_and_their_checks():
    assert default_buckets(1) == (1,) and default_buckets(16) == (1, 2, 4, 8, 16)
    assert default_buckets(12) == (1, 2, 4, 8, 12)
    assert check_buckets([2, 8], 8) == (2, 8) and bucket_for((2, 8), 1) == 2 and bucket_for((2, 8), 3) == 8
    for bad in ([1, 4], [4, 2, 8], [0, 8], [], [2, 2, 8]):
        with pytest.raises(ValueError, match=r"decode_buckets=.*ending with max_batch"):
            check_buckets(bad, 8)
    with pytest.raises(ConfigError, match=r"runtime.decode_buckets=\[1, 2\]: expected .* ending with max_batch"):
        zoo.build(CONF, ["runtime.decode_buckets=[1,2]"], compile=False, max_batch=4, max_seq=8, dry=True)


@pytest.fixture(scope="module")
def eager():
    return zoo.build(CONF, compile=False, max_batch=MAX_BATCH, max_seq=MAX_SEQ, seed=0)


def _reference(m, ids, steps):
    """Logits of the whole batch: the prefill's last position, then `steps` greedy decode steps."""
    out = [m.prefill(ids, last_only=True)[:, -1]]
    for _ in range(steps):
        out.append(m.decode(out[-1].argmax(-1)))
    return out


@torch.no_grad()
def test_the_batch_api_runs_its_bucket(eager):
    m = eager
    assert m.engine.buckets == (1, 2, 4)
    ids = torch.randint(0, m.spec.vocab_size, (MAX_BATCH, 7), generator=torch.Generator().manual_seed(0))
    ref = _reference(m, ids, 4)
    for B in (1, 2, 3):
        got = _reference(m, ids[:B], 4)
        for k, (a, b) in enumerate(zip(got, ref)):
            assert_logits_close(a, b[:B], 1e-5, f"batch {B} step {k}")


@torch.no_grad()
def test_decode_active_and_move_row_keep_each_sequence(eager):
    """Three rows decode (bucket 4), row 0 ends and row 2 moves into it (bucket 2), a fourth
    sequence waits above the bucket in row 2 while the others decode: every logit is the one the
    sequence gets in the whole batch."""
    m, e = eager, eager.engine
    ids = torch.randint(0, m.spec.vocab_size, (MAX_BATCH, 7), generator=torch.Generator().manual_seed(1))
    ref = _reference(m, ids, 4)
    forced = [r.argmax(-1) for r in ref]  # the token each sequence decodes at each step
    e.reset()
    for r in range(3):
        assert_logits_close(e.prefill_row(r, ids[r]), ref[0][r], 1e-5, f"row {r} prefill")
    out = e.decode_active(forced[0][:3])
    assert_logits_close(out, ref[1][:3], 1e-5, "3 rows")
    e.release_row(0)
    e.move_row(2, 0)
    assert e.row_len[:3] == [8, 8, None] and int(e.pos[0]) == 8 and int(e.pos[2]) == 0
    seqs = [2, 1]  # row -> the batch sequence it holds
    e.prefill_row(2, ids[3])  # above bucket 2: the steps below leave it alone
    for k in (1, 2):
        out = e.decode_active(forced[k][seqs])
        assert_logits_close(out, ref[k + 1][seqs], 1e-5, f"2 rows after the move, step {k}")
    assert e.row_len[2] == 7
    assert_logits_close(e.decode_active(forced[0][[2, 1, 3]])[2], ref[1][3], 1e-5, "the waiting row, in bucket 4")
    with pytest.raises(InputError, match=r"move_row: row 1 is in use .* expected a free row as dst"):
        e.move_row(0, 1)
    with pytest.raises(InputError, match=r"move_row: row 3 holds no sequence"):
        e.move_row(3, 1)
    # decode_rows keeps its meaning: [max_batch, V], the rows past its bucket free
    e.reset()
    e.prefill_row(1, ids[1])
    out = e.decode_rows(torch.stack([forced[0][0], forced[0][1], forced[0][2], forced[0][3]]))
    assert out.shape == (MAX_BATCH, m.spec.vocab_size)
    assert_logits_close(out[1], ref[1][1], 1e-5, "decode_rows, bucket 2")
    e.reset()
    e.prefill_row(3, ids[3])
    with pytest.raises(InputError, match=r"decode_active: row 3 is in use but inside the decode bucket of 4 rows"):
        e.decode_active(forced[0][:3])
    e.reset()


def test_compiled_buckets_make_one_graph_each_and_never_recompile():
    """Two buckets (CI time): warmup compiles one decode graph per bucket and layer kind; steps
    of either bucket, moves and the batch API compile nothing more, and skip dynamo's guards."""
    m = zoo.build(CONF, ["runtime.decode_buckets=[1,4]", "runtime.aot=false"], compile=True, max_batch=MAX_BATCH, max_seq=MAX_SEQ, seed=0)
    e = m.engine
    kinds = len({(layer.mixer_name, layer.ffn_name) for layer in m.spec.layers})
    assert e.buckets == (1, 4)
    assert e.graph_counts() == {"prefill": kinds, "decode": 2 * kinds}
    ids = torch.randint(0, m.spec.vocab_size, (MAX_BATCH, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = _reference(m, ids, 3)  # bucket 4
        one = _reference(m, ids[:1], 3)  # bucket 1: its own decode graph, and the 1-row prefill graph
        for k in range(4):
            assert_logits_close(one[k], ref[k][:1], 1e-4, f"bucket 1 step {k}")
        counts = e.graph_counts()
        assert counts == {"prefill": 2 * kinds, "decode": 2 * kinds}
        e.reset()
        e.prefill_row(0, ids[0])
        e.prefill_row(1, ids[1])
        tok = torch.stack([ref[0][0].argmax(), ref[0][1].argmax()])
        out = e.decode_active(tok)  # 2 rows: bucket 4
        e.release_row(0)
        e.move_row(1, 0)
        out = e.decode_active(out[1:].argmax(-1))  # 1 row: bucket 1
        assert_logits_close(out, ref[2][1:2], 1e-4, "moved row in bucket 1")
        e.reset()
    assert e.graph_counts() == counts
    assert e._trusted is True


@torch.no_grad()
def test_an_mtp_prefill_runs_its_bucket():
    """The MTP blocks' prefill (return_mtp) writes the first rows of their own caches, as many
    as the main prefill's bucket: batch 1 of a max_batch=2 engine gives batch 2's first row."""
    m = zoo.build("deepseek_v3_tiny", ["checkpoint.mtp=true"], compile=False, max_batch=2, max_seq=16, seed=0)
    ids = torch.randint(0, m.spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, (mtp,) = m.prefill(ids, return_mtp=True)
    one, (mtp_one,) = m.prefill(ids[:1], return_mtp=True)
    assert mtp_one.shape == (1, 8, m.spec.vocab_size)
    assert_logits_close(one, logits[:1], 1e-5, "main logits, bucket 1")
    assert_logits_close(mtp_one, mtp[:1], 1e-5, "mtp logits, bucket 1")
