"""Every twin of tests/test_gguf_families.py's table through llama.cpp's own convert_hf_to_gguf.py
(tests/llama_cpp_converter.py), loaded with zoo.from_pretrained(file.gguf) and compared with
transformers (float32, prefill and 4 greedy decode steps); writes
scripts/results/gguf_converter.json: per family, the architecture the converter wrote and
`ok`, `converter refused` (its error), `zoo refused` (zoo's error) or `mismatch` (the check's error).
tests/test_gguf_converter.py runs a dozen of these in the suite.

    python scripts/gguf_converter_sweep.py [family ...] [--outtype f32|f16]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# why a row is what it is, where zoo refuses a converter's file (each one llama.cpp cannot load either)
NOTES = {
    "nemotron_h": "transformers' NemotronHConfig always writes num_experts_per_tok / n_routed_experts, so the "
                  "converter writes nemotron_h_moe with expert_count, for which llama.cpp builds every MLP layer "
                  "as MoE and needs expert tensors this dense twin lacks; zoo refuses it by expert_count "
                  "(tests/test_gguf_converter.py)",
    "granitemoehybrid": "transformers 5 saves layer_types as linear_attention / full_attention, which this "
                        "converter does not read as attention layers: head_count_kv is 0 on every layer beside "
                        "attention tensors on layer 1 (llama.cpp would look for Mamba2 tensors there)",
}


def bpe_for(config_class: str) -> str:
    """The BPE vocabulary whose known pre-tokenizer the model_type's transformers tokenizer class
    reproduces: Qwen2's for Qwen2Tokenizer, GPT-2's for the others (which may still not be one)."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    model_type = getattr(transformers, config_class).model_type
    return "qwen2" if (TOKENIZER_MAPPING_NAMES.get(model_type) or "").startswith("Qwen2Tokenizer") else "gpt2"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*")
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16"])
    parser.add_argument("--out", default=str(ROOT / "scripts" / "results" / "gguf_converter.json"))
    args = parser.parse_args()

    import torch

    from tests import llama_cpp_converter as conv
    from tests.test_gguf_converter import check_family
    from tests.test_gguf_families import FAMILIES

    tree = conv.find_converter()
    conv.check_imports()
    tokenizers = conv.Tokenizers(tree)
    names = args.families or list(FAMILIES)
    torch.set_num_threads(2)
    results = {}
    out = Path(args.out)
    if args.families and out.is_file():  # a partial sweep updates the table
        results = json.loads(out.read_text()).get("families", {})
    for name in names:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                # the SentencePiece model first (the twin's own vocabulary), then each BPE one where refused
                refusals = {}
                for tokenizer in ("spm", bpe_for(FAMILIES[name][1])):
                    try:
                        arch = check_family(tree, name, Path(tmp) / tokenizer, args.outtype, tokenizers[tokenizer])
                        break
                    except conv.Refused as e:
                        refusals[tokenizer] = e.reason
                else:
                    raise conv.Refused(refusals[tokenizer], "")
                row = {"status": "ok", "architecture": arch, "tokenizer": tokenizer}
            except conv.Refused as e:
                row = {"status": "converter refused", "error": e.reason, "refusals": refusals}
            except AssertionError as e:
                row = {"status": "mismatch", "error": str(e).strip().splitlines()[0][:400]}
            except Exception as e:  # zoo's refusal: its message names what it cannot read
                row = {"status": "zoo refused", "error": f"{type(e).__name__}: {str(e).strip()[:600]}",
                       "where": traceback.format_exc().strip().splitlines()[-3][:300]}
        if name in NOTES:
            row["note"] = NOTES[name]
        row["seconds"] = round(time.time() - t0, 1)
        results[name] = row
        print(f"{name:28s} {row['status']:18s} {row.get('architecture', row.get('error', ''))[:150]}", flush=True)
        out.write_text(json.dumps({"converter": f"llama-cpp-python {conv.LLAMA_CPP_PYTHON} vendor/llama.cpp",
                                   "outtype": args.outtype, "families": results}, indent=1) + "\n")
    counts = {}
    for row in results.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print(counts)


if __name__ == "__main__":
    main()
