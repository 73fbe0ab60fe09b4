"""One rank of a tensor/expert-parallel test run (launched by tests/test_parallel.py through
torchrun, never forked). For each case of the job file it loads the checkpoint with
runtime.parallel overrides, prefills the prompt and decodes the given tokens; each rank saves every
step's logits and the graph counts to OUT.RANK.

    python -m torch.distributed.run --nproc-per-node N tests/parallel_worker.py JOB.json
    JOB: {"out": path, "cases": [{"name", "path", "overrides", "compile", "seq", "prompt", "max_seq",
          "rank_overrides" / "rank_path": {rank: ...}, "quant": runtime.quant, "kernel_weights": bool}]}
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist


@torch.no_grad()
def kernel_weights(module) -> dict:
    """{QuantLinear weight name: the weight [O, I] its kernel applies, float32}, read back through
    the kernel (an identity input, the bias left out, a vocab-parallel head's gather skipped)."""
    from zoo.compiler.quant.linear import QuantLinear

    out = {}
    for name, q in module.named_modules():
        if isinstance(q, QuantLinear):
            # the float GEMM (runtime.quant_prefill=float) applies 1 * w exactly; int8-rounded rows would not
            bias, q.bias, rows, q.float_rows = q.bias, None, q.float_rows, 16
            out[f"{name}.weight"] = QuantLinear.forward(q, torch.eye(q.in_features, dtype=q.compute_dtype)).float().t()
            q.bias, q.float_rows = bias, rows
    return out


def main(job_path: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import zoo

    job = json.loads(open(job_path).read())
    results = {}
    for case in job["cases"]:
        t0 = time.perf_counter()
        try:
            # rank_overrides / rank_path: what one rank gets differently (the disagreement tests)
            overrides = case["overrides"] + case.get("rank_overrides", {}).get(str(rank), [])
            if case["compile"]:  # one decode bucket (the batch's): graph counts are per bucket
                overrides = [f"runtime.decode_buckets=[{len(case['seq'])}]", "runtime.aot=false", *overrides]
            path = case.get("rank_path", {}).get(str(rank), case["path"])
            m = zoo.from_pretrained(path, compile=case["compile"], max_batch=len(case["seq"]),
                                    max_seq=case.get("max_seq", 48), overrides=overrides,
                                    quant=case.get("quant"))
            seq = torch.tensor(case["seq"])
            L = case["prompt"]
            steps = [m.prefill(seq[:, :L])]
            for t in range(L, seq.shape[1]):
                steps.append(m.decode(seq[:, t]))
            results[case["name"]] = {"logits": steps, "graphs": m.engine.graph_counts(),
                                     "param_bytes": m.info.param_bytes, "cache_bytes": m.info.cache_bytes,
                                     "parallel": m.info.parallel}
            if case.get("kernel_weights"):
                results[case["name"]].update(kernel_weights=kernel_weights(m.module), slices={
                    n: (s.full, s.cuts, s.zero) for n, s in m.records.shard.slices.items()})
        except Exception as e:  # reported to the test, which fails with it
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        line = (f"rank {rank}: {case['name']} {'error' if 'error' in results[case['name']] else 'done'} "
                f"in {time.perf_counter() - t0:.1f} s")
        print(line, flush=True)
        with open(f"{job['out']}.{rank}.log", "a") as f:  # progress, readable while the run goes on
            f.write(line + "\n")
    torch.save(results, f"{job['out']}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
