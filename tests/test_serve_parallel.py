"""`zoo serve` under torchrun (zoo/serve/parallel.py): a 2-rank tensor-parallel server (gloo, CPU,
127.0.0.1; rank 0 serves HTTP, rank 1 follows its engine calls) answers /v1/completions with the
same tokens as one process: greedy, two requests at once (two rows of the continuous batch, one
admitted while the other decodes), the logprobs of every chosen token to float32 rounding."""
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
             "ignore_eos": True, "logprobs": 0},
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
