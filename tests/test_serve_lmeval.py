"""/v1/completions as lm-evaluation-harness uses it, and /tokenize, /detokenize, against a real
`zoo serve` process on a tiny random float32 Llama (tests/serve_fixtures.py), with chunked
prefill (step_tokens=16), prefix reuse and n-gram speculation on:

- echo: the prompt's log-probabilities equal transformers' log_softmax (1e-4), whole or prefilled
  in chunks, the same prompt again (a stored prefix is not reused for them), max_tokens 0 and 1,
  streamed; a token that is the greedy one is exactly its top entry (lm-eval's is_greedy);
- lm-eval itself (tests/data/lmeval: a multiple-choice task and a generate_until task) with
  `local-completions` against the server and its own `hf` model on the same weights: equal
  accuracy, per-request log-likelihoods to 1e-4, equal generations; `local-chat-completions`
  against transformers' chat-templated generation.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.serve_fixtures import running_server, write_tiny_llama

httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"
MAX_SEQ = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("lmeval") / "ckpt")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    args = [f"weights={ckpt}", f"model_name={NAME}", f"max_seq={MAX_SEQ}", "max_batch=4", "compile=false",
            "dtype=float32", "log_level=warning", "step_tokens=16", "speculative=ngram", "draft_tokens=3"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, _):
        yield base


@pytest.fixture(scope="module")
def hf(ckpt):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(ckpt)


def _post(base, path, body, status=200):
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _hf_logprobs(model, ids):
    """log_softmax of transformers' logits [L, V] (float32) at each position of ids."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


LONG = list(range(3, 43))  # 40 tokens: three pieces of step_tokens=16


def test_echo_prompt_logprobs_equal_transformers(server, hf):
    model, tok = hf
    text = "The capital of France is Paris."
    prompts = [[5, 6, 7, 8, 9], LONG, tok.encode(text)]
    body = {"model": NAME, "prompt": [prompts[0], prompts[1], text], "echo": True, "logprobs": 3,
            "max_tokens": 1, "temperature": 0}
    for attempt in range(2):  # the second time the prompts are in the prefix cache: recomputed, not reused
        out = _post(server, "/v1/completions", body)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"]["completion_tokens"] == 3
        for ids, c in zip(prompts, out["choices"]):
            lp = c["logprobs"]
            ref = _hf_logprobs(model, ids)
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
            assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
            for pos, top in enumerate(lp["top_logprobs"][1:len(ids)]):
                best = ref[pos].topk(3).values.tolist()
                # keyed by token text, so tokens that decode alike (a partial UTF-8 byte) share an entry
                assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0], abs=1e-4)
                assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
            # the generated token, last: greedy, so its logprob is its top entry's
            assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)
            assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
            assert c["text"].startswith(tok.decode(ids))
            assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]

    echo_only = _post(server, "/v1/completions", {**body, "max_tokens": 0})
    assert echo_only["usage"]["completion_tokens"] == 0
    for ids, c, before in zip(prompts, echo_only["choices"], out["choices"]):
        assert c["finish_reason"] == "length" and c["text"] == tok.decode(ids)
        assert c["logprobs"]["token_logprobs"] == before["logprobs"]["token_logprobs"][:-1]
    # alone (nothing decodes, so admitted whole): its logits computed step_tokens positions at a time
    solo = _post(server, "/v1/completions", {"model": NAME, "prompt": LONG, "echo": True, "logprobs": 1,
                                             "max_tokens": 0})["choices"][0]["logprobs"]["token_logprobs"]
    ref = _hf_logprobs(model, LONG)
    assert solo[1:] == pytest.approx(ref[torch.arange(len(LONG) - 1), torch.tensor(LONG[1:])].tolist(), abs=1e-4)
    plain = _post(server, "/v1/completions", {"model": NAME, "prompt": text, "echo": True, "max_tokens": 0})
    assert plain["choices"][0]["text"] == text and plain["choices"][0]["logprobs"] is None


def test_echo_marks_greedy_tokens_exactly_and_streams(server):
    prompt = [10, 11, 12, 13]
    gen = _post(server, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            "logprobs": 1, "return_token_ids": True,
                                            "ignore_eos": True})
    ids = gen["choices"][0]["token_ids"]
    assert len(ids) == 6
    body = {"model": NAME, "prompt": prompt + ids, "echo": True, "logprobs": 1, "max_tokens": 0}
    lp = _post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    scored = lp["token_logprobs"][len(prompt):]
    # lm-eval's is_greedy: the token's logprob equals the top entry's, compared exactly
    assert all(v == max(top.values()) for v, top in zip(scored, lp["top_logprobs"][len(prompt):]))
    assert scored == pytest.approx(gen["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)

    whole = _post(server, "/v1/completions", {**body, "max_tokens": 3, "temperature": 0})["choices"][0]
    with httpx.stream("POST", server + "/v1/completions", json={**body, "max_tokens": 3, "temperature": 0,
                                                                 "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:len(prompt) + 6]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21, "echo": True}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_completion_fields_are_400_naming_them(server, body, param):
    out = _post(server, "/v1/completions", {"model": NAME, "prompt": [5, 6], **body}, status=400)
    assert out["error"]["param"] == param


def test_chat_refuses_max_tokens_zero(server):
    out = _post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 0}, status=400)
    assert out["error"]["param"] == "max_tokens"


def test_tokenize_detokenize(server, hf):
    _, tok = hf
    text = "Once upon a time"
    out = _post(server, "/tokenize", {"prompt": text})
    assert out == {"tokens": tok.encode(text), "count": len(tok.encode(text)), "max_model_len": MAX_SEQ}
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = _post(server, "/tokenize", {"model": NAME, "messages": chat})
    assert out["tokens"] == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert _post(server, "/detokenize", {"tokens": out["tokens"]})["prompt"] == \
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert _post(server, "/tokenize", {"prompt": text, "messages": chat}, 400)["error"]["param"] == "prompt"
    assert _post(server, "/tokenize", {"prompt": 5}, 400)["error"]["param"] == "prompt"
    assert _post(server, "/detokenize", {"tokens": [1, 10 ** 6]}, 400)["error"]["param"] == "tokens"
    assert _post(server, "/detokenize", {"tokens": "abc"}, 400)["error"]["param"] == "tokens"
    assert _post(server, "/detokenize", {"model": "other", "tokens": [1]}, 404)["error"]["code"] == "model_not_found"
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == MAX_SEQ


# ---------------------------------------------------------------------------- lm-eval itself

@pytest.fixture(scope="module")
def lm_eval():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    # only the tasks here: indexing lm-eval's own thousands of task files costs seconds per call
    return lm_eval, TaskManager(include_path=str(ROOT / "tests/data/lmeval"), include_defaults=False)


def _evaluate(lm_eval, monkeypatch, tmp_path, model, model_args, tasks, **kw):
    lm_eval, tasks_here = lm_eval
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=tasks_here, **kw)


def test_lm_eval_local_completions_equals_hf(server, ckpt, lm_eval, monkeypatch, tmp_path):
    tasks = ["zoo_tiny_mc", "zoo_tiny_gen"]
    zoo = _evaluate(lm_eval, monkeypatch, tmp_path, "local-completions",
                    dict(model=NAME, base_url=server + "/v1/completions", tokenizer=str(ckpt),
                         tokenizer_backend="huggingface", tokenized_requests=True, max_length=MAX_SEQ,
                         batch_size=4), tasks)
    ref = _evaluate(lm_eval, monkeypatch, tmp_path, "hf",
                    dict(pretrained=str(ckpt), dtype="float32", device="cpu", max_length=MAX_SEQ), tasks,
                    batch_size=4)
    assert zoo["results"]["zoo_tiny_mc"]["acc,none"] == ref["results"]["zoo_tiny_mc"]["acc,none"]
    assert zoo["results"]["zoo_tiny_gen"]["exact_match,none"] == ref["results"]["zoo_tiny_gen"]["exact_match,none"]
    mc = list(zip(zoo["samples"]["zoo_tiny_mc"], ref["samples"]["zoo_tiny_mc"]))
    assert len(mc) == 6
    for a, b in mc:
        assert a["arguments"] == b["arguments"]  # the same requests (context, continuation)
        ll_a, ll_b = [r[0][0] for r in a["resps"]], [r[0][0] for r in b["resps"]]
        assert ll_a == pytest.approx(ll_b, abs=1e-4)
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]  # is_greedy
    gen = list(zip(zoo["samples"]["zoo_tiny_gen"], ref["samples"]["zoo_tiny_gen"]))
    assert len(gen) == 4 and all(a["resps"] == b["resps"] for a, b in gen)

    # no local tokenizer: lm-eval's auto backend finds /tokenizer_info and tokenizes through the server
    remote = _evaluate(lm_eval, monkeypatch, tmp_path, "local-completions",
                       dict(model=NAME, base_url=server + "/v1/completions", tokenized_requests=True,
                            max_length=MAX_SEQ, batch_size=4), ["zoo_tiny_mc"])
    assert remote["results"]["zoo_tiny_mc"]["acc,none"] == ref["results"]["zoo_tiny_mc"]["acc,none"]
    for a, b in zip(remote["samples"]["zoo_tiny_mc"], ref["samples"]["zoo_tiny_mc"]):
        assert [r[0][0] for r in a["resps"]] == pytest.approx([r[0][0] for r in b["resps"]], abs=1e-4)


def test_lm_eval_local_chat_completions_equals_hf(server, ckpt, lm_eval, monkeypatch, tmp_path):
    zoo = _evaluate(lm_eval, monkeypatch, tmp_path, "local-chat-completions",
                    dict(model=NAME, base_url=server + "/v1/chat/completions", tokenizer=str(ckpt),
                         tokenizer_backend="huggingface", max_length=MAX_SEQ), ["zoo_tiny_gen"],
                    apply_chat_template=True)
    ref = _evaluate(lm_eval, monkeypatch, tmp_path, "hf",
                    dict(pretrained=str(ckpt), dtype="float32", device="cpu", max_length=MAX_SEQ), ["zoo_tiny_gen"],
                    apply_chat_template=True)
    pairs = list(zip(zoo["samples"]["zoo_tiny_gen"], ref["samples"]["zoo_tiny_gen"]))
    assert len(pairs) == 4 and all(a["resps"] == b["resps"] for a, b in pairs)
    assert zoo["results"]["zoo_tiny_gen"]["exact_match,none"] == ref["results"]["zoo_tiny_gen"]["exact_match,none"]
