"""A tiny random Llama checkpoint with a real tokenizer (byte-level BPE trained here with the
`tokenizers` library), a ChatML chat template and end tokens in config.json and
generation_config.json: what the serve tests talk to."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The capital of France is Paris. The capital of Italy is Rome.",
          "Once upon a time there was a small model that answered every question.",
          "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8 9 10 one two three four five"] * 20


def write_tiny_llama(path: Path, vocab_size: int = 384, chat_template: str = CHATML, added: tuple[str, ...] = ()) -> Path:
    """A save_pretrained directory: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json. The model's vocabulary is the tokenizer's.
    added: more added tokens that are not special (as Qwen's <tool_call>, <think>)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + list(added),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if added:  # the trainer adds them as special: mark them plain, as Qwen's tokenizer.json does
        spec = json.loads((path / "tokenizer.json").read_text())
        for t in spec["added_tokens"]:
            t["special"] = t["content"] in SPECIAL
        (path / "tokenizer.json").write_text(json.dumps(spec))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, eos_token_id=eot, bos_token_id=None,
                                   pad_token_id=None, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": chat_template, "add_bos_token": False}))
    # the list only generation_config.json has (as Llama 3's <|eot_id|>)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc, base: str, log, seconds: float, what: str = "zoo serve") -> None:
    """Until `base`/health answers 200; fails the test (killing proc on a timeout) when the
    server process exits first or does not answer within `seconds`."""
    import time

    import httpx
    import pytest

    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} did not answer /health within {seconds:.0f} s")
        time.sleep(0.5)


@contextlib.contextmanager
def running_server(args: list[str], log_dir: Path, seconds: float = 240):
    """`zoo serve` with these key=value args (plus a free port) in a subprocess, one thread, its
    output in log_dir/server.log -> (base URL, process); stopped (terminated, then killed) on exit."""
    port = free_port()
    with open(log_dir / "server.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "serve", f"port={port}", *args],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for_health(proc, base, log, seconds)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def grammars_for(ckpt):
    """(zoo's tokenizer of a tiny checkpoint, zoo.constrain.Grammars over it); skipped without llguidance."""
    import pytest

    pytest.importorskip("llguidance")
    from zoo.constrain import Grammars
    from zoo.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    return tok, Grammars(tok, tok.vocab_size, tok.eos_ids)
