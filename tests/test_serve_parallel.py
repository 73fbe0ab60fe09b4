"""`zoo serve` under torchrun (zoo/serve/parallel.py): a 2-rank tensor-parallel server (gloo, CPU,
127.0.0.1; rank 0 serves HTTP, rank 1 follows its engine calls) answers /v1/completions with the
same tokens as one process: greedy, two requests at once (two rows of the continuous batch, one
admitted while the other decodes), the logprobs of every chosen token to float32 rounding. Over a
recording stand-in engine: every engine call is replayed with its arguments, and a call that fails
on some ranks only stops the group. With prefix reuse, chunked prefill and n-gram speculation on,
the scheduler on 2 ranks gives one process's tokens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serve_fixtures import free_port, wait_for_health, write_tiny_llama

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
NAME, MAX_SEQ, MAX_BATCH = "tiny", 64, 2
REQUESTS = [{"model": NAME, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "echo": True},  # echo: every prompt position's logits too
            {"model": NAME, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
             "logprobs": 0}]


def _answers(post) -> list[dict]:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(post, REQUESTS))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("serve_tp") / "ckpt")


@pytest.fixture(scope="module")
def one_process(checkpoint):
    from fastapi.testclient import TestClient

    import zoo
    from zoo.serve.api import create_app

    model = zoo.from_pretrained(str(checkpoint), compile=False, max_batch=MAX_BATCH, max_seq=MAX_SEQ)
    with TestClient(create_app(model, NAME)) as client:
        return _answers(lambda body: client.post("/v1/completions", json=body).json())


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve_tp_log") / "server.log", "w+")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zoo.cli",
           "serve", f"weights={checkpoint}", f"port={port}", f"model_name={NAME}", f"max_seq={MAX_SEQ}",
           f"max_batch={MAX_BATCH}", "compile=false", "tp=2", "log_level=warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base, log, 300, "torchrun zoo serve (2 ranks)")
        answers = _answers(lambda body: httpx.post(f"{base}/v1/completions", json=body, timeout=120).json())
        # Ctrl-C: SIGINT to rank 0's server, which shuts down and then tells rank 1 to stop
        rank0 = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "0"]
        assert len(rank0) == 1
        rank0[0].send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.seek(0)
        return answers, proc.returncode, log.read()
    finally:
        try:  # the workers too (their own session), whatever became of torchrun
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        log.close()


def test_two_rank_server_answers_as_one_process(one_process, two_ranks):
    answers, _, log = two_ranks
    for got, want, body in zip(answers, one_process, REQUESTS):
        assert "error" not in got, (got, log[-3000:])
        a, b = got["choices"][0], want["choices"][0]
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"] == "length"
        assert got["usage"] == want["usage"] and got["usage"]["completion_tokens"] == body["max_tokens"]
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], rel=1e-4, abs=1e-5)


def test_two_rank_server_stops_on_sigint(two_ranks):
    _, returncode, log = two_ranks
    assert returncode == 0 and "Traceback" not in log, log[-3000:]


# ----------------------------------------------------------------------------- a rank that fails alone

FAIL_WORKER = r"""
import json, sys, torch, torch.distributed as dist
from zoo.compiler.parallel.mesh import shutdown
from zoo.serve.parallel import LeaderEngine, RankFailed, control_group, follow

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")


class Engine:
    # prefill_row fails for the rows in fail[rank]; every call is recorded
    def __init__(self, fail):
        self.fail, self.calls = fail, []

    def prefill_row(self, row, ids, return_hidden=False, last_only=True):
        if row in self.fail.get(rank, ()):
            raise RuntimeError(f"row {row} does not fit on rank {rank}")
        self.calls.append(["prefill", row, ids.tolist()])
        return ids.float()

    def decode_rows(self, tok):
        self.calls.append(["decode", tok.tolist()])
        return tok.float()

    def release_row(self, row):
        self.calls.append(["release", row])

    def reset(self):
        self.calls.append(["reset"])


out = {}
for case, fail in [("everywhere", {0: [1], 1: [1]}), ("follower", {1: [1]}), ("leader", {0: [1]})]:
    engine, group, seen = Engine(fail), control_group(), {}
    if rank == 0:
        leader = LeaderEngine(engine, group, on_failure=lambda e: seen.setdefault("on_failure", str(e)))
        leader.prefill_row(0, torch.tensor([5, 6]))
        try:
            leader.prefill_row(1, torch.tensor([7]))
        except Exception as e:
            seen["raised"] = [type(e).__name__, str(e)]
        try:
            leader.decode_rows(torch.tensor([1, 2]))
            seen["after"] = "ran"
        except RankFailed as e:
            seen["after"] = "refused"
        leader.stop()
    else:
        try:
            follow(engine, group)
            seen["follow"] = "returned"
        except RankFailed as e:
            seen["follow"] = ["RankFailed", str(e)]
    out[case] = {**seen, "calls": engine.calls}
print(json.dumps(out))
shutdown()
"""


def test_a_rank_that_fails_alone_stops_the_group(tmp_path):
    """Two gloo ranks on CPU run LeaderEngine / follow over a stand-in engine. A call that fails
    on every rank is that request's error and both go on; one that fails on the follower only, or
    on rank 0 only, raises RankFailed naming the rank and its error on both, and rank 0 refuses
    every later call (no rank carries on with a state the others lack)."""
    import json

    from tests.serve_fixtures import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", FAIL_WORKER, str(rank), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    leader, follower = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results)

    # failed everywhere: rank 0 raises the engine's own error, both ranks go on and stay alike
    case = leader["everywhere"]
    assert case["raised"] == ["RuntimeError", "row 1 does not fit on rank 0"] and "on_failure" not in case
    assert case["after"] == "ran" and follower["everywhere"]["follow"] == "returned"
    assert case["calls"] == follower["everywhere"]["calls"] == [["prefill", 0, [5, 6]], ["decode", [1, 2]]]

    for name, bad, good in (("follower", 1, 0), ("leader", 0, 1)):
        lead, follow = leader[name], follower[name]
        assert lead["raised"][0] == "RankFailed" and follow["follow"][0] == "RankFailed"
        for text in (lead["raised"][1], follow["follow"][1], lead["on_failure"]):
            assert f"failed on rank(s) [{bad}] and not on rank(s) [{good}]" in text, text
            assert f"rank {bad}: RuntimeError: row 1 does not fit on rank {bad}" in text, text
            assert "prefill_row (row 1)" in text and "every rank stops" in text, text
        # nothing ran after the failure on either rank
        assert lead["after"] == "refused"
        assert [c[0] for c in lead["calls"]] == ["prefill"] * (1 + (bad == 1))
        assert [c[0] for c in follow["calls"]] == ["prefill"] * (1 + (bad == 0))


# ----------------------------------------------------------------------------- every row call replays

REPLAY_WORKER = r"""
import gc, json, sys, torch, torch.distributed as dist
from zoo.compiler.parallel.mesh import shutdown
from zoo.serve.parallel import LeaderEngine, control_group, follow

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")


class Kept:
    # what save_state / export_row return: records when the rank lets go of it
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __del__(self):
        self.calls.append(["freed", self.name])


class Engine:
    # records every call, with its arguments as the follower receives them
    def __init__(self):
        self.calls, self.n = [], 0

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append([name, [a.tolist() if isinstance(a, torch.Tensor) else
                                      a.name if isinstance(a, Kept) else a for a in args], kwargs])
            if name in ("save_state", "export_row"):
                self.n += 1
                return Kept(self.calls, f"{name}{self.n}")
            return torch.zeros(1)
        return call


engine, group = Engine(), control_group()
if rank == 0:
    leader = LeaderEngine(engine, group)
    leader.prefill_row(3, torch.tensor([5, 6, 7]))
    leader.prefill_row(2, torch.tensor([4]), return_hidden=True)
    leader.prefill_row(1, torch.tensor([6, 7]), last_only=False)  # every position's logits (echo)
    leader.extend_rows([3], torch.tensor([[8, 9]]))
    leader.extend_rows([1, 2], torch.tensor([[1, 2, 3], [4, 5, 6]]), last_only=True, return_hidden=True)
    leader.truncate_row(3, 4)
    state = leader.save_state([1, 3])
    snap = leader.export_row(3, torch.ones(4))
    assert snap.name == "export_row2"  # the snapshot's own attributes read through
    leader.restore_state([2, 0], state)
    del state  # rank 0 lets go of the handle: so does the follower, before its next call
    gc.collect()
    leader.import_row(0, snap, 2)
    leader.mtp_extend(0, [1, 2], torch.tensor([[[0.5, -1.25]], [[3.0, 2.0]]], dtype=torch.bfloat16),
                      torch.tensor([[7], [8]]), torch.tensor([4, 6]))
    leader.move_row(3, 0)
    leader.decode_active(torch.tensor([11, 12, 13])[:2])
    leader.decode_rows(torch.tensor([1, 2, 3, 4]))
    leader.release_row(0)
    del snap  # an evicted prefix: the follower's copy goes before the next call
    leader.reset()
    leader.stop()
else:
    follow(engine, group)
print(json.dumps(engine.calls))
shutdown()
"""


def test_every_row_call_the_scheduler_makes_is_replayed_on_the_followers(tmp_path):
    """Two gloo ranks over a recording stand-in engine: every engine call of the scheduler (with
    chunked prefill, the prefix cache and speculative decoding) reaches rank 1 with the arguments
    rank 0 ran it with: prefill_row with return_hidden / last_only, extend_rows with last_only /
    return_hidden, truncate_row, save_state / restore_state and export_row / import_row (what
    they return stays on each rank under one key; rank 1 lets go of its copy when rank 0 does),
    an MTP step with its bfloat16 hidden states, move_row, decode_active."""
    import json

    from tests.serve_fixtures import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", REPLAY_WORKER, str(rank), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    leader, follower = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results)
    plain, hidden = {"return_hidden": False}, {"return_hidden": True}
    last, every = {"last_only": True}, {"last_only": False}
    assert leader == [["prefill_row", [3, [5, 6, 7]], {**plain, **last}],
                      ["prefill_row", [2, [4]], {**hidden, **last}], ["prefill_row", [1, [6, 7]], {**plain, **every}],
                      ["extend_rows", [[3], [[8, 9]]], {"last_only": False, **plain}],
                      ["extend_rows", [[1, 2], [[1, 2, 3], [4, 5, 6]]], {"last_only": True, **hidden}],
                      ["truncate_row", [3, 4], {}], ["save_state", [[1, 3]], {}],
                      ["export_row", [3, [1.0] * 4], {}], ["restore_state", [[2, 0], "save_state1"], {}],
                      ["freed", "save_state1"], ["import_row", [0, "export_row2", 2], {}],
                      ["mtp_extend", [0, [1, 2], [[[0.5, -1.25]], [[3.0, 2.0]]], [[7], [8]], [4, 6]], {}],
                      ["move_row", [3, 0], {}], ["decode_active", [[11, 12]], {}], ["decode_rows", [[1, 2, 3, 4]], {}],
                      ["release_row", [0], {}], ["freed", "export_row2"], ["reset", [], {}]]
    # rank 1 exported without logits (only rank 0's prefix cache reads them); all else alike
    assert follower[7] == ["export_row", [3], {}]
    assert follower[:7] + follower[8:] == leader[:7] + leader[8:]


# ----------------------------------------------------------------------------- every policy, two real ranks

def test_prefix_reuse_chunked_prefill_and_speculation_under_two_ranks_equal_one_process(checkpoint):
    """The scheduler with prefix reuse, chunked prefill (step_tokens) and n-gram speculative
    decoding on 2 gloo ranks (tp=2, the tiny twin, eager; tests/serve_tp_worker.py) gives the
    same greedy tokens as one process, with the same policy decisions: a prompt prefilled in two
    chunks from a reused prefix while another decodes, a reused prompt, drafts accepted and
    rolled back (truncate_row)."""
    import json

    from tests.serve_fixtures import free_port
    from tests.serve_tp_worker import drive, load

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "serve_tp_worker.py"), str(checkpoint),
                               str(rank), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        want = drive(load(str(checkpoint)))
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    got = json.loads(results[0][0].strip().splitlines()[-1])
    # every policy ran: a reused prefix twice (the chunked prompt's and the third one's), a
    # prompt in chunks, drafts both kept and dropped
    assert want["prefix_hits"] == 2 and want["chunked_steps"] >= 1
    assert 0 < want["accepted"] < want["drafted"]
    assert got == want
