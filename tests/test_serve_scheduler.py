"""The scheduler and the streaming text of one sequence, on an eager tiny model (no compile):
stop strings held back until they cannot match, every end token of config.json and
generation_config.json ends a sequence, seeded sampling repeats whatever runs beside it, a
cancelled sequence frees its row at once, a full queue is refused."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.serve_fixtures import write_tiny_llama
from zoo.runtime import _eos_ids
from zoo.serve.scheduler import QueueFull, SamplingParams, Scheduler, Sequence
from zoo.serve.text import StopText


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "ckpt")
    return zoo.from_pretrained(str(path), compile=False, max_batch=4, max_seq=64)


class Chars:
    """A tokenizer stand-in for StopText: one character per id."""

    eos_ids: set = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def stream(self):
        from zoo.tokenizer import StreamDecoder
        return StreamDecoder(self)


def _feed(text, stop):
    st, out = StopText(Chars(), stop), []
    for ch in text:
        piece, stopped = st.feed(ord(ch))
        out.append(piece)
        if stopped:
            return out, True
    out.append(st.finish())
    return out, False


def test_stop_strings_are_held_back_until_they_cannot_match():
    out, stopped = _feed("hello wor world!", ["world"])
    assert stopped and "".join(out) == "hello wor "
    assert out[:6] == ["h", "e", "l", "l", "o", " "]
    assert out[6:9] == ["", "", ""]  # "wor" might start "world": held
    assert out[9] == "wor "  # the space shows it did not
    out, stopped = _feed("abcab", ["abd", "bx"])
    assert not stopped and "".join(out) == "abcab"  # a partial match at the end is released at finish
    out, stopped = _feed("xxENDyy", ["ND", "END"])
    assert stopped and "".join(out) == "xx"  # the earliest stop string wins


def test_eos_ids_read_config_and_generation_config(model, tmp_path):
    tok = model.tokenizer
    eot, im_end = tok.encode("<|endoftext|>")[0], tok.encode("<|im_end|>")[0]
    assert set(model.eos_ids) == {eot, im_end}  # generation_config.json's list joined config.json's id
    assert _eos_ids({"eos_token_id": 3}) == [3]


def _run(sched, seqs, steps=300):
    for s in seqs:
        sched.submit([s])
    for _ in range(steps):
        if not sched.step():
            break


def _seq(prompt, **kw):
    events = []
    s = Sequence(prompt, SamplingParams(**kw), sink=events.append)
    s.events = events
    return s


def test_every_end_token_ends_a_sequence(model):
    greedy = _seq([5, 6, 7], max_tokens=8, temperature=0.0)
    _run(Scheduler(model, eos_ids=[]), [greedy])
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 8
    end = greedy.tokens[3]
    first = greedy.tokens.index(end)
    s = _seq([5, 6, 7], max_tokens=8, temperature=0.0)
    _run(Scheduler(model, eos_ids=[999999, end]), [s])
    assert s.finish_reason == "stop" and s.tokens == greedy.tokens[:first + 1]
    assert [e.kind for e in s.events][-1] == "done"


def test_seeded_sampling_repeats_among_other_sequences(model):
    sched = Scheduler(model, eos_ids=[])
    a = _seq([1, 2, 3, 4], max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    _run(sched, [a])
    others = [_seq([9] * n, max_tokens=4 + n, temperature=1.0) for n in (1, 5, 3)]
    b = _seq([1, 2, 3, 4], max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    _run(sched, [others[0], others[1], b, others[2]])
    assert a.tokens == b.tokens
    c = _seq([1, 2, 3, 4], max_tokens=12, temperature=1.0, seed=8)
    _run(sched, [c])
    assert c.tokens != a.tokens  # the seed matters (12 draws at temperature 1)


def test_cancel_frees_the_row_and_a_full_queue_is_refused(model):
    sched = Scheduler(model, max_queue=2, eos_ids=[])
    long = [_seq([3, 4], max_tokens=50, temperature=0.0) for _ in range(4)]
    for s in long:
        sched.submit([s])
        sched.step()
    assert sched.running == 4 and sched.engine.free_rows() == []
    # greedy: a sampled end token (the tokenizer's eos) would end one of them at random
    sched.submit([_seq([1], max_tokens=20, temperature=0.0), _seq([2], max_tokens=20, temperature=0.0)])
    with pytest.raises(QueueFull):
        sched.submit([_seq([1], max_tokens=2)])
    sched.cancel(long[1])
    sched.step()  # the cancelled row is free for the next admission
    assert long[1].finish_reason == "cancelled" and sched.running == 4 and sched.queue_depth == 1
    for _ in range(200):
        if not sched.step():
            break
    assert sched.running == 0 and sched.engine.free_rows() == [0, 1, 2, 3]
    assert all(s.finish_reason == "length" and len(s.tokens) == 50 for s in long if s is not long[1])
