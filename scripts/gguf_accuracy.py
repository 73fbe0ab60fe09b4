"""Accuracy of GGUF files kept quantized (not a test; tests/test_gguf_accuracy.py holds the margins):
SmolLM2-135M-Instruct in the file types llama.cpp users download, each made from the shipped Q4_1
file by llama.cpp's own quantizer (scripts/bench_quant.py requantized(); needs the `bench` extra),
scored on tests/data/quant_eval.txt (the first 512 tokens): perplexity of zoo with every block
kept on its kernels (quant=int4: the load report says per tensor what was kept) against
transformers float32 on the same file (its own dequantization), prefill and 64 teacher-forced
decode steps, and top-1 agreement. The prefill twice: the default (runtime.quant_prefill=int8, the
activations rounded to int8 per 32 inputs as decode does: batch-invariant, issue #46) and
quant_prefill=float (float GEMMs over the dequantized blocks: transformers' model to float rounding).

    python scripts/gguf_accuracy.py [--types Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0] [--json scripts/results/gguf_accuracy.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
TEXT = ROOT / "tests" / "data" / "quant_eval.txt"
TOKENS, DECODED = 512, 64


def file_for(ftype: str, threads: int = 2) -> Path:
    from bench_quant import GGUF, requantized
    from zoo.compiler.checkpoint.hub import resolve_local

    path = str(resolve_local(GGUF))
    return Path(path if ftype == "Q4_1" else requantized(path, ftype, threads))


def score(path: Path, tokens: int = TOKENS) -> dict:
    """Perplexities and agreement of zoo (blocks kept) vs transformers float32 on one file, over
    the text's first `tokens` tokens (decode: 64 steps after the first half)."""
    prompt = tokens // 2
    import transformers

    import zoo

    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = torch.tensor(tok(TEXT.read_text())["input_ids"][:tokens])
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0, :-1].float()
    del ref
    m = zoo.from_pretrained(str(path), compile=False, max_seq=tokens, quant="int4", quant_prefill="float")
    got_float = m.prefill(ids[None])[0, :-1].float()
    del m
    m = zoo.from_pretrained(str(path), compile=False, max_seq=tokens, quant="int4")  # the default: int8 prefill
    got = m.prefill(ids[None])[0, :-1].float()
    steps = [m.prefill(ids[None, :prompt], last_only=True)[0, -1]]
    for t in range(prompt, prompt + DECODED - 1):
        steps.append(m.decode(ids[t:t + 1])[0])
    steps = torch.stack(steps).float()
    kept = collections.Counter(how.split(" (")[0] for how in m.info.load.tensors.values())
    ppl = lambda logits, target: math.exp(torch.nn.functional.cross_entropy(logits, target).item())
    target, dtarget = ids[1:], ids[prompt:prompt + DECODED]
    return {
        "transformers_ppl": ppl(want, target), "zoo_ppl": ppl(got, target),
        "zoo_float_prefill_ppl": ppl(got_float, target),
        "float_prefill_top1_agreement": (got_float.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "transformers_decode_ppl": ppl(want[prompt - 1:prompt - 1 + DECODED], dtarget),
        "zoo_decode_ppl": ppl(steps, dtarget),
        "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "decode_top1_agreement": (steps.argmax(-1) == want[prompt - 1:prompt - 1 + DECODED].argmax(-1)).float().mean().item(),
        "tensors": dict(sorted(kept.items())),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    ap.add_argument("--json", default=str(ROOT / "scripts" / "results" / "gguf_accuracy.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out = {}
    for ftype in args.types.split(","):
        out[ftype] = r = score(file_for(ftype))
        print(f"{ftype}: perplexity zoo {r['zoo_ppl']:.4f} (float prefill {r['zoo_float_prefill_ppl']:.4f}) / "
              f"transformers {r['transformers_ppl']:.4f}, decode "
              f"{r['zoo_decode_ppl']:.4f} / {r['transformers_decode_ppl']:.4f}, top-1 {r['top1_agreement']:.4f} "
              f"(decode {r['decode_top1_agreement']:.4f}); {r['tensors']}")
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
