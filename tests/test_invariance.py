"""A greedy answer does not depend on the path its cache took (issue #46), on quantized tiny twins
of each cache kind and every kept GGUF block type: a whole prefill, the prompt prefilled in chunks
(1, 5 and 16 tokens), a reused prefix plus the rest (compiler/engine/prefix.py), a decode bucket
with other rows in it, and speculative verification (n-gram drafts) each give the same 64 greedy
tokens, and the logits on the way agree.

What is bit-identical, and why the rest is not: zoo's quantized kernels compute a row the same bits
whatever rows share the call (tests/test_kernel_invariance.py), and on the CPU a softmax attention
over a full cache computes each query as its decode step does (one_query.prefix_attention: slots
from 0 in chunks of 128, merged in order), in a prefill, an extend and a decode step alike. So on a
dense model with such attention every path gives a row the same logits bit for bit (asserted). MLA,
sliding windows and recurrent layers still compute a prefill or a chunk in another order than a
decode step (their parallel forms), and MoE routers are float linears (BLAS: their sums depend on
the row count): a difference of about 1e-7 there, which int8 activation rounding can grow to a
code's step; those twins are held to the same greedy tokens and close logits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from zoo.compiler.engine.prefix import PrefixCache

STEPS = 64  # greedy tokens compared on every path
PROMPT = 40
CHUNKS = (1, 5, 16)

# two Llama GGUF files whose linears hold every kept block type between them (tests/test_gguf_quants'
# scaled blocks): q / k / v of one type join in its layout, of different types as int8 (ZQ8)
GGUF_MIXES = {
    "int4 int5 q6k int8g": dict(attn_q="Q4_0", attn_k="Q4_0", attn_v="Q4_0", attn_output="Q4_K", ffn_gate="Q5_K",
                                ffn_up="Q6_K", ffn_down="Q8_0", token_embd="Q4_1", output="Q5_0"),
    "int5 int8g zq8 int4": dict(attn_q="Q5_1", attn_k="Q2_K", attn_v="Q3_K", attn_output="IQ4_NL", ffn_gate="IQ4_XS",
                                ffn_up="Q4_1", ffn_down="Q5_0", token_embd="Q8_0", output="Q6_K"),
}
# family (tests/test_family_parity.py) -> (quant, what it covers, every path bit-identical)
FAMILY_CASES = {
    "llama/gqa int4": ("llama/gqa", "int4", "attention (full cache), int4 g32", True),
    "llama/gqa int8": ("llama/gqa", "int8", "attention (full cache), int8 per channel", True),
    "deepseek_v3/main int8": ("deepseek_v3/main", "int8", "MLA + MoE experts on the kernels", False),
    "qwen3_next int8": ("qwen3_next", "int8", "gated deltanet (recurrent state) + gated attention + MoE", False),
}


def _gguf_llama(path, mix: dict):
    """A tiny Llama GGUF (tests/test_gguf_quants' KDIMS) with these block types."""
    transformers = pytest.importorskip("transformers")
    from tests.test_gguf_load import write_llama_gguf
    from tests.test_gguf_quants import KDIMS, Q, scaled_blocks

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**KDIMS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(46)
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    override = {f"{n}.weight": (scaled_blocks(mix[n], 256, 256, rng), Q[mix[n]]) for n in ("token_embd", "output")}
    for i in range(cfg.num_hidden_layers):
        for part, shape in shapes.items():
            override[f"blk.{i}.{part}.weight"] = (scaled_blocks(mix[part], *shape, rng), Q[mix[part]])
    return write_llama_gguf(path, model, override_type=override)


def _decode(e, row: int, logits: torch.Tensor, others: tuple = ()) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens of `row` from its last logits, decode_active over rows 0..max(row, others)
    (the others fed tokens of their own) -> (tokens, the logits [STEPS, V] of each step)."""
    toks, out, n = [], [], max((row, *others)) + 1
    for i in range(STEPS):
        toks.append(int(logits.argmax()))
        tok = torch.tensor([(7 * r + i) % e.vocab_size for r in range(n)])
        tok[row] = toks[-1]
        logits = e.decode_active(tok)[row].clone()
        out.append(logits)
    return toks, torch.stack(out)


def _paths(m, prompt: torch.Tensor) -> dict:
    """path -> (first logits [V], greedy tokens, decode logits [STEPS, V]) of row 0."""
    e, g = m.engine, torch.Generator().manual_seed(9)
    got = {}
    e.reset()
    first = e.prefill_row(0, prompt).clone()
    got["whole prefill"] = (first, *_decode(e, 0, first))
    for size in CHUNKS:
        e.reset()
        logits = e.prefill_row(0, prompt[:size]).clone()
        for at in range(size, len(prompt), size):
            logits = e.extend_rows([0], prompt[at:at + size][None], last_only=True)[0].clone()
        got[f"chunks of {size}"] = (logits, *_decode(e, 0, logits))
    e.reset()  # two other rows in the decode bucket, at other positions
    for r in (1, 2):
        e.prefill_row(r, torch.randint(0, e.vocab_size, (PROMPT - 5 * r,), generator=g))
    logits = e.prefill_row(0, prompt).clone()
    got["bucket of 3"] = (logits, *_decode(e, 0, logits, others=(1, 2)))
    e.reset()  # the first 2/3 stored (a shared system prompt), then the whole: that prefix reused, the rest extended
    cache = PrefixCache(e, max_bytes=1 << 28, block=4)
    cache.start(0, prompt[:PROMPT * 2 // 3])  # (recurrent state exists only where stored: a reuse point there)
    e.release_row(0)
    logits = cache.start(0, prompt).clone()
    assert cache.hits == 1, cache.mode
    got["reused prefix"] = (logits, *_decode(e, 0, logits))
    e.reset()
    return got


def _check(m, what: str, exact: bool) -> None:
    prompt = torch.randint(0, m.engine.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1))
    got = _paths(m, prompt)
    first, toks, steps = got["whole prefill"]
    scale = first.abs().max()
    for path, (f, t, s) in got.items():
        assert t == toks, f"{what}, {path}: greedy tokens {t} differ from the whole prefill's {toks}"
        if exact:  # the first logits and every decode step's, bit for bit
            assert torch.equal(f, first) and torch.equal(s, steps), f"{what}, {path}: logits differ"
        err = max((f - first).abs().max().item(), (s - steps).abs().max().item())
        assert err <= 5e-2 * scale, f"{what}, {path}: logits {err:.3g} from the whole prefill's (max {scale:.3g})"
    # speculative verification (Kd + 1 positions extended at once, rolled back per row)
    plain = m.generate(prompt[None], STEPS, speculative="off")
    assert plain[0, PROMPT:].tolist() == toks, f"{what}: generate's greedy tokens differ from the engine's"
    spec = m.generate(prompt[None], STEPS, speculative="ngram", draft_tokens=4)
    assert torch.equal(spec, plain), f"{what}: speculative greedy tokens differ from plain decoding"


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_every_path_gives_the_same_greedy_tokens(families, case):
    name, quant, what, exact = FAMILY_CASES[case]
    family = families.family(name)
    _, path = families.reference(name)
    m = zoo.from_pretrained(str(path), compile=False, max_batch=4, max_seq=PROMPT + STEPS + 8, quant=quant,
                            overrides=list(family.overrides))
    assert m.info.quant.quantized, f"{case}: nothing quantized"
    _check(m, f"{case} ({what})", exact)


@pytest.mark.parametrize("mix", list(GGUF_MIXES))
def test_every_kept_block_type_gives_the_same_greedy_tokens(tmp_path, mix):
    path = _gguf_llama(tmp_path / "mix.gguf", GGUF_MIXES[mix])
    m = zoo.from_pretrained(str(path), compile=False, max_batch=4, max_seq=PROMPT + STEPS + 8, quant="int4")
    kept = {n: how for n, how in m.info.load.tensors.items() if "kept" in how}
    assert len(kept) == 2 * 7 + 1, kept  # every linear and the head keep their blocks
    _check(m, f"GGUF {mix}", True)
