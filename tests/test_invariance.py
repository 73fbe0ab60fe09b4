"""A greedy answer does not depend on the path its cache took (issue #46), on quantized tiny twins
of each cache kind and every kept GGUF block type: a whole prefill, the prompt prefilled in chunks
(1, 5 and 16 tokens), a reused prefix plus the rest (compiler/engine/prefix.py), a decode bucket
with other rows in it, and speculative verification (n-gram drafts) each give the same 64 greedy
tokens, and the logits on the way agree.

What is bit-identical, and why the rest is not: zoo's quantized kernels compute a row the same bits
whatever rows share the call (tests/test_kernel_invariance.py), and on the CPU a plain softmax
attention computes each query as its decode step does, in a prefill, an extend and a decode step
alike: over a full cache from slot 0 (one_query.prefix_attention), over a sliding window its keys in
position order wherever they lie, prompt, ring or ring and chunk (one_query.window_attention), in
chunks of 128 merged in order. So where every layer is such an attention and every linear is on the
kernels, every path gives a row the same logits bit for bit (asserted): the Llama twins at int4 /
int8, all four GGUF mixes (every kept linear type: int4, int5, q6k, int8g from Q8_0, the K-quants,
IQ4, the i-quants, ternaries, NVFP4 and MXFP4, ZQ8), and the Mistral twin's window at int4 (which gave
other greedy tokens on chunks of 1 and under speculative decoding before window_attention). Only the
same greedy tokens (and logits within 5% of the largest), the float order of some part differing
by about 1e-7 per path, which int8 activation rounding can grow to a code's step:
- Gemma 2 (soft-capped attention) and gpt-oss (sinks): the explicit scores / softmax / matmul in
  torch ops, over the prompt, the ring + chunk or the ring, whose sums depend on their lengths;
- MLA (DeepSeek-V3) and recurrent layers (Qwen3-Next's gated deltanet): their prefill / chunk forms
  (absorbed or chunked parallel forms) sum in another order than a decode step;
- MoE routers, and float linears in general (gpt-oss's F32 attention projections): BLAS GEMMs whose
  sums depend on the row count. The MXFP4 expert stacks themselves are on the kernels (invariant).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from zoo.compiler.engine.prefix import PrefixCache
from zoo.compiler.quant import gguf_blocks
from tests.family_harness import tiny_reference

transformers = pytest.importorskip("transformers")

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
    # the i-quants, ternaries and FP4s, kept as int8g codes (gguf_blocks: no gguf-py quantizer for most:
    # _coded_blocks draws valid blocks); q / k / v of one type, so they keep their own layout
    "iq3 iq2 tq": dict(attn_q="IQ3_S", attn_k="IQ3_S", attn_v="IQ3_S", attn_output="IQ3_XXS", ffn_gate="IQ2_XXS",
                       ffn_up="IQ2_XS", ffn_down="IQ2_S", token_embd="TQ1_0", output="TQ2_0"),
    "iq1 fp4 tq": dict(attn_q="IQ1_M", attn_k="IQ1_M", attn_v="IQ1_M", attn_output="IQ1_S", ffn_gate="NVFP4",
                       ffn_up="MXFP4", ffn_down="TQ1_0", token_embd="IQ2_S", output="IQ1_S"),
}
# MoE GGUF twins of tests/test_gguf_families.py whose expert stacks keep their blocks (MOE_KEPT, no
# quant=: the kept default) -> (what it covers, every path bit-identical)
GGUF_MOE_CASES = {
    "gpt_oss": ("MXFP4 expert stacks (int8g), sliding / full layers with sinks, float router", False),
}
# family (tests/test_family_parity.py) -> (quant, what it covers, every path bit-identical)
FAMILY_CASES = {
    "llama/gqa int4": ("llama/gqa", "int4", "attention (full cache), int4 g32", True),
    "llama/gqa int8": ("llama/gqa", "int8", "attention (full cache), int8 per channel", True),
    "deepseek_v3/main int8": ("deepseek_v3/main", "int8", "MLA + MoE experts on the kernels", False),
    "qwen3_next int8": ("qwen3_next", "int8", "gated deltanet (recurrent state) + gated attention + MoE", False),
}
# sliding-window twins (tests/test_attn_families' configs at sizes the kernels take: the parity
# twins' hidden 48 is no multiple of 32, so nothing of theirs quantizes) -> (model_type, quant,
# what it covers, every path bit-identical); the window (6) is far shorter than PROMPT
SLIDING_CASES = {
    "mistral int4": ("mistral", "int4", "sliding window on every layer (ring cache)", True),
    "gemma2 int8": ("gemma2", "int8", "sliding / global layers, soft-capping", False),
}


def _gguf_llama(path, mix: dict):
    """A tiny Llama GGUF (tests/test_gguf_quants' KDIMS) with these block types."""
    from tests.test_gguf_load import write_llama_gguf
    from tests.test_gguf_quants import D_SCALE, KDIMS, Q, scaled_blocks

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**KDIMS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(46)
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    blocks = lambda t, rows, cols: (scaled_blocks if t in D_SCALE else _coded_blocks)(t, rows, cols, rng)
    override = {f"{n}.weight": (blocks(mix[n], 256, 256), Q[mix[n]]) for n in ("token_embd", "output")}
    for i in range(cfg.num_hidden_layers):
        for part, shape in shapes.items():
            override[f"blk.{i}.{part}.weight"] = (blocks(mix[part], *shape), Q[mix[part]])
    return write_llama_gguf(path, model, override_type=override)


def _coded_blocks(ggml_type: str, rows: int, cols: int, rng, rms: float = 0.02) -> np.ndarray:
    """Valid random blocks uint8 [rows, bytes per row] of a type gguf-py cannot quantize (or whose
    quantizer is slow: the i-quants, ternaries, FP4s), their weights of about `rms`: random codes
    (every byte pattern is a valid grid index, sign or nibble), then the scale fields set so that
    the dequantized weights have that size (gguf.quants reads them as zoo's loader does)."""
    from gguf import quants
    from tests.test_gguf_quants import F16_FIELDS, Q

    lay = gguf_blocks.LAYOUTS[ggml_type]
    b = rng.integers(0, 256, (rows * cols // lay.block, lay.nbytes), dtype=np.uint8)
    if ggml_type == "MXFP4":  # E8M0 d = 2^(e - 128) (halved): 2^-10 .. 2^-8 under e2m1 codes up to 6
        b[:, 0] = rng.integers(118, 121, len(b))
        return b.reshape(rows, -1)
    if ggml_type == "NVFP4":  # unsigned E4M3 scales, subnormal: 2^-6 x m/8, m 4..7
        b[:, :4] = rng.integers(0x04, 0x08, (len(b), 4))
        return b.reshape(rows, -1)

    def set_d(d: np.ndarray) -> None:
        h = d.astype(np.float16).view(np.uint16)
        if ggml_type == "IQ1_M":  # d's 16 bits are the top nibbles of the four u16 scales (bytes 48..55)
            sc = b[:, 48:56].view(np.uint16)
            for j in range(4):
                sc[:, j] = (sc[:, j] & 0x0FFF) | (((h >> (4 * j)) & 0xF) << 12).astype(np.uint16)
        else:
            (off,) = F16_FIELDS[ggml_type]
            b[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)

    set_d(np.ones(len(b)))
    size = np.sqrt(np.mean(quants.dequantize(b, Q[ggml_type]) ** 2))
    set_d(rng.uniform(0.5, 1.0, len(b)) * rng.choice([-1, 1], len(b)) * rms / size)
    return b.reshape(rows, -1)


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


@pytest.mark.parametrize("case", list(SLIDING_CASES))
def test_sliding_windows_give_the_same_greedy_tokens(tmp_path, case):
    from tests import test_attn_families as attn

    model_type, quant, what, exact = SLIDING_CASES[case]
    ref = tiny_reference(transformers.AutoModelForCausalLM.from_config,
                         attn.hf_config(model_type, hidden_size=64, intermediate_size=128), attn.randomize)
    ref.save_pretrained(tmp_path)
    m = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=4, max_seq=PROMPT + STEPS + 8, quant=quant)
    assert m.info.quant.quantized, f"{case}: nothing quantized ({m.info.quant.kept_float})"
    assert attn.WINDOW < PROMPT // 3  # the reused prefix, each chunk of 16 and the decode all slide
    _check(m, f"{case} ({what})", exact)


@pytest.mark.parametrize("family", list(GGUF_MOE_CASES))
def test_kept_expert_stacks_give_the_same_greedy_tokens(tmp_path, family):
    from tests.gguf_writer import LAYOUTS, write_gguf
    from tests.test_gguf_families import FAMILIES, MOE_KEPT, twin

    what, exact = GGUF_MOE_CASES[family]
    layout, config_class, kwargs, *_ = FAMILIES[family]
    path = write_gguf(tmp_path / f"{family}.gguf", twin(config_class, kwargs), LAYOUTS[layout],
                      quantize=dict(MOE_KEPT[family]))
    m = zoo.from_pretrained(str(path), compile=False, max_batch=4, max_seq=PROMPT + STEPS + 8)
    kept = {n for n, how in m.info.load.tensors.items() if "kept" in how}
    assert kept == set(MOE_KEPT[family]), kept  # every expert stack as stored
    _check(m, f"GGUF {family} ({what})", exact)


@pytest.mark.parametrize("mix", list(GGUF_MIXES))
def test_every_kept_block_type_gives_the_same_greedy_tokens(tmp_path, mix):
    path = _gguf_llama(tmp_path / "mix.gguf", GGUF_MIXES[mix])
    m = zoo.from_pretrained(str(path), compile=False, max_batch=4, max_seq=PROMPT + STEPS + 8, quant="int4")
    kept = {n: how for n, how in m.info.load.tensors.items() if "kept" in how}
    assert len(kept) == 2 * 7 + 1, kept  # every linear and the head keep their blocks
    _check(m, f"GGUF {mix}", True)
