"""Where the start-up of `zoo generate conf=smollm2_135m prompt=... chat=true` goes (not a test).

    python scripts/profile_startup.py [--runs 3] [conf overrides, e.g. runtime.quant=int4]

Each run is a fresh process that goes through the same steps as the command (runtime.build), timed
phase by phase: imports, Hydra composition, opening the GGUF file (header, metadata, tokenizer),
the build (validation, modules on meta, the load plan), the weight load (GGUF dequantization or
conversion), the engine (caches and the compiled graphs' first runs: cache lookups once the
compile cache is warm) and a short chat generation. The first run may fill the compile cache;
the rest are the warm runs. Shares of the total are printed too: on a busy machine they are
steadier than the seconds.
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


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--worker"]:
        print(json.dumps(one_run(args[1:])))
        return 0
    runs = 3
    if args[:1] == ["--runs"]:
        runs, args = int(args[1]), args[2:]
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
