"""Where the start-up of `zoo generate conf=smollm2_135m prompt=... chat=true` goes (not a test).

    python scripts/profile_startup.py [--runs 3] [conf overrides, e.g. runtime.quant=int4]
    python scripts/profile_startup.py --cli [--runs 5] [overrides]   the command end to end

Each run is a fresh process that goes through the same steps as the command (runtime.build), timed
phase by phase: imports, Hydra composition, opening the GGUF file (header, metadata, tokenizer),
the build (validation, modules on meta, the load plan), the weight load (GGUF dequantization or
conversion), the engine (caches and the compiled graphs' first runs: cache lookups once the
compile cache is warm) and a short chat generation. The first run may fill the compile cache;
the rest are the warm runs. Shares of the total are printed too: on a busy machine they are
steadier than the seconds.

Both wall and cpu seconds are printed per phase (cpu: this process's user + system time, all its
threads), and per run whether the weights came from the weight cache, the graph counts (1 + 1:
no recompiles) and which of transformers / gguf / jinja2 / hydra were imported (transformers
must never be).

Measured on the idle 2-core AMD EPYC box (32 MiB L3), weight cache hit, the warm runs, wall s
(`--runs 3 [runtime.quant=int4]`, bytecode written):

    float32: imports 2.9-3.1, compose 0.03, open GGUF + tokenizer 0.37-0.49, validate + build +
    plan 0.27-0.31, load weights 0.05, engine 0.03-0.06, generate 16 tokens 0.8-1.0; total 4.7
    int4:    imports 2.6-2.9, ... engine 0.05, generate 16 tokens 0.45-0.55; total 4.1-4.3
    `--cli --runs 7`: float32 4.72 / 4.95 / 5.22 s (min / median / max), int4 (16 tokens)
    3.89 / 4.38 / 4.84 s, while `python -c "import torch"` alone took 2.4-3.0 s.

What bought it, from the 11-12 s of the session before (imports 3.1, build 2.6-2.8, engine
4.5-4.9): (1) runtime.aot (compiler/engine/aot.py; the preset sets `auto`): prefill and decode
layers as AOTInductor packages loaded by torch's C++ runner, so a warm process neither imports
dynamo nor inductor (~4 s of torch's Python) nor traces: engine 4.5 -> 0.05 s; (2) the meta-device
build no longer runs nn.Embedding's normal_ init, which on meta goes through torch._refs and
imported torch._dynamo (2.6 s of the build); (3) materialize allocates with empty_strided instead
of Module.to_empty's empty_like (Python meta path, 0.9 s with the symbolic-shapes import); (4)
composed configs cached (compiler/config.py): 0.3-0.5 -> 0.03 s; (5) the `zoo` command exits with
os._exit after flushing (Python's shutdown after torch: ~1 s); (6) under runtime.aot the warm-up
loads the packages without a dummy forward over every weight (~0.3 s float32).

## What each change bought (an earlier session, measured on the same box while 3-4 other jobs
## ran, load average 4-6: the seconds are inflated 2-5x and noisy; compare within a column)

| phase (warm run) | before | after | change |
|---|---|---|---|
| open GGUF + tokenizer | 5.4, 7.9 s | 0.44-1.1 s | the header read in one `struct` pass (compiler/checkpoint/gguf_index.py) instead of gguf-py's GGUFReader, which makes ~250k numpy views for the 49k-token vocabulary and its merges: GGUFReader 4.6-11 s, gguf_index 0.27-0.48 s on the same file back to back |
| load weights | 4.4, 5.8 s | 0.07-0.5 s | converted weights cached (compiler/checkpoint/weight_cache.py): the Q4_1 -> float32 dequantization with gguf.quants runs once; later builds map the 538 MB entry copy-on-write (no copy; pages come from the page cache in the first forward) |
| load weights, first run | 4.4, 5.8 s | 9.5-11.9 s | the dequantization plus writing the 538 MB entry (float32), measured at busier moments than the before column; ZOO_WEIGHT_CACHE=0 turns the cache off |

Cpu seconds of a warm run after both changes (3 runs): imports 3.0, compose 0.3-0.4, GGUF +
tokenizer 0.4-0.5, build (validation, modules on meta, weights, engine) 11.6-11.9, generate
16 tokens 7.7-8.7 (the decode compute, inflated by the two cores being shared). What is left is
torch's: importing torch (~1.7 s of -X importtime here), torch._dynamo (~2.0 s, pulled in by the
first meta-device init) and inductor's compile_fx (~1.6 s, of which ~1 s compiles select_algorithm's
jinja kernel templates at import), dynamo tracing both block functions (prefill, decode) in every
process, and loading their ~12 kernel libraries. Both graphs already hit inductor's FX graph
cache and the AOTAutograd cache on a warm run (counters fxgraph_cache_hit 2, autograd_cache_hit
2), so Mega-cache (`torch.compiler.save_cache_artifacts`) adds nothing on one machine (it packs
the same artifacts for another machine). Dynamo's `caching_precompile`, which would skip the
tracing, refuses zoo's graphs: the kinds' nested `Spec` dataclasses, guarded on, cannot be
saved into a compile package ("defined in local scope").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(overrides: list[str]) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal t0, c0
        now, cnow = time.perf_counter(), time.process_time()
        phases[name], cpu[name] = now - t0, cnow - c0
        t0, c0 = now, cnow

    import torch

    import zoo  # noqa: F401
    from zoo.compiler.checkpoint.hub import open_source
    from zoo.compiler.config import compose
    from zoo.runtime import _eos_ids, build_from_config, load_tokenizer_for

    lap("imports")
    cfg = compose("smollm2_135m", overrides)
    lap("compose")
    source = open_source(str(cfg.checkpoint.weights))
    eos, tok = _eos_ids(source.config()), load_tokenizer_for(source)
    lap("open GGUF + tokenizer")
    model = build_from_config(cfg, "conf/smollm2_135m.yaml", source, eos_ids=eos, tokenizer=tok, dry=False)
    total = time.perf_counter() - t0
    load, engine = model.info.load_seconds, sum(model.info.compile_seconds.values())
    lap("build")
    phases["validate + build + plan"] = total - load - engine
    phases["load weights"] = load
    phases["engine (graphs)"] = engine
    del phases["build"]  # cpu time of the build is reported whole
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True), add_special_tokens=False)
    model.generate(torch.tensor([ids]), 16)
    lap("generate 16 tokens")
    return {"wall": phases, "cpu": cpu, "weight cache": model.info.load.cache,
            "graphs": model.engine.graph_counts(),
            "imported": sorted(m for m in ("transformers", "gguf", "jinja2", "hydra") if m in sys.modules)}


def cli_runs(runs: int, overrides: list[str]) -> int:
    """The command itself, end to end as a user runs it (`python -m zoo generate ...`, what the
    `zoo` script runs): wall seconds from the process start to its exit, the answer included."""
    cmd = [sys.executable, "-m", "zoo", "generate", "conf=smollm2_135m", *overrides,
           "prompt=What is the capital of France?", "chat=true"]
    print("$ " + " ".join(cmd[1:]))
    walls = []
    for i in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        walls.append(time.perf_counter() - t0)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        print(f"run {i + 1}: {walls[-1]:.2f} s  {out.stdout.strip()[:80]!r}")
    warm = walls[1:] or walls
    print(f"warm runs (2..{runs}): min {min(warm):.2f} s, median {sorted(warm)[len(warm) // 2]:.2f} s, "
          f"max {max(warm):.2f} s")
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--worker"]:
        print(json.dumps(one_run(args[1:])))
        return 0
    runs, cli = 3, False
    if args[:1] == ["--cli"]:
        cli, args = True, args[1:]
    if args[:1] == ["--runs"]:
        runs, args = int(args[1]), args[2:]
    if cli:
        return cli_runs(runs, args)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = []
    for i in range(runs):
        out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for what in ("wall", "cpu"):
        rows = [r[what] for r in results]
        print(f"\n{what} seconds (cpu: this process's user + system time, all its threads)\n")
        print("| phase | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " | share (last run) |")
        print("|---|" + "---|" * (runs + 1))
        for n in rows[0]:
            last = rows[-1][n] / sum(rows[-1].values())
            print(f"| {n} | " + " | ".join(f"{r[n]:.2f}" for r in rows) + f" | {last:.0%} |")
        print("| total | " + " | ".join(f"{sum(r.values()):.2f}" for r in rows) + " | |")
    for i, r in enumerate(results):
        print(f"run {i + 1}: weight cache {r['weight cache']}, graphs {r['graphs']}, "
              f"imported {r['imported']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
