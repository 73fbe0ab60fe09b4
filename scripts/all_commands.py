"""Every command on every shipped conf: `zoo build | report | patterns | check | verify` over each
top-level conf of conf/, each outcome recorded as data.

    python scripts/all_commands.py [--only NAME,...] [--commands build,report,...] [--timeout 900]
                                   [--out scripts/results/all_commands.json]
    python scripts/all_commands.py --one NAME       # one conf in this process: its JSON row

Each conf runs in its own process (`--one`) with a time limit; inside it every command is called
through zoo/cli.py's own handler (the code `zoo COMMAND` runs), its output captured. The outcome of
each (conf, command):

    ok              the command finished (exit 0)
    refused         a named zoo error (compiler/errors.py): its class and message
    failed          the command finished with a nonzero exit and no exception (a verify mismatch,
                    a check that found misfits): its output's tail
    not applicable  the command does not apply to this conf, and why
    traceback       any other exception: a bug (the test fails on any)
    timeout         the conf's process ran past --timeout

What runs where:
  build     tiny confs (under SMALL_PARAMS parameters): a real, eager build (runtime.compile=false:
            compilation has its own tests); larger ones `zoo build dry=true` (meta + shape check:
            what `zoo build conf=X` does by itself when X does not fit, without building a
            7B model for real on a shared machine).
  report    every conf (analysis on meta).
  patterns  tiny confs (random weights, eager); larger ones not applicable (the probes need
            built weights).
  verify    each model_type whose import map's base is the conf (or, for NAME_tiny, is NAME):
            `zoo verify MODEL_TYPE` (a transformers twin); a full-size conf whose NAME_tiny exists
            defers to it; no import map: not applicable.
  check     for the same model_types: the transformers twin saved to a temporary dir, then
            `zoo check weights=DIR` on it (headers against the rules).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results" / "all_commands.json"
COMMANDS = ("build", "report", "patterns", "check", "verify")
SMALL_PARAMS = 600_000_000  # at or under: built for real (float32 random weights, a few GiB at most)
TAIL = 2000  # characters of output / traceback kept per entry


def _tail(text: str) -> str:
    return text if len(text) <= TAIL else "..." + text[-TAIL:]


def _call(fn) -> dict:
    """Run fn() with stdout/stderr captured -> an outcome entry."""
    from zoo.compiler.errors import ZooError

    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = fn()
    except ZooError as e:
        return {"status": "refused", "error": type(e).__name__, "message": str(e),
                "seconds": round(time.perf_counter() - t0, 2)}
    except BaseException as e:  # noqa: BLE001 - the sweep records every failure, SystemExit included
        if isinstance(e, KeyboardInterrupt):
            raise
        return {"status": "traceback", "error": type(e).__name__, "message": str(e)[:500],
                "traceback": _tail(traceback.format_exc()), "seconds": round(time.perf_counter() - t0, 2)}
    entry = {"status": "ok" if code == 0 else "failed", "seconds": round(time.perf_counter() - t0, 2)}
    if code != 0:
        entry["exit"] = code
        entry["output"] = _tail(out.getvalue())
    return entry


def _na(reason: str) -> dict:
    return {"status": "not applicable", "reason": reason}


def _params(name: str) -> int:
    """The conf's exact parameter count (the count stage on meta)."""
    from zoo.compiler.build import cast_stage, count_stage, spec_stage
    from zoo.compiler.config import compose

    s = spec_stage(compose(name), f"conf/{name}.yaml")
    return count_stage(cast_stage(s.spec, s.dtype, mtp=s.mtp).module).params


def _model_types(name: str, names: set[str]) -> tuple[list[str], str]:
    """(model_types to verify / check for this conf, why none when empty)."""
    from zoo.compiler.hf_import import import_specs

    specs = import_specs()
    bases = {name}
    if name.endswith("_tiny"):
        bases.add(name.removesuffix("_tiny"))
    elif f"{name}_tiny" in names:
        own = sorted(t for t, s in specs.items() if s["base"] == name)
        return [], (f"checked and verified on its tiny twin {name}_tiny" if own
                    else "no import map (conf/hf/) has it as base: no transformers model_type")
    types = sorted(t for t, s in specs.items() if s["base"] in bases)
    return types, "" if types else "no import map (conf/hf/) has it as base: no transformers model_type"


def one(name: str, commands=COMMANDS) -> dict:
    """Every command of `commands` on conf `name`: {command: outcome}."""
    from zoo import cli

    names = set(_all_confs())
    row: dict = {}
    counted: dict = {}
    row["spec"] = _call(lambda: counted.setdefault("params", _params(name)) and 0)
    params = counted.get("params")  # None: the conf gives no spec (every command then says why)
    small = params is not None and params <= SMALL_PARAMS
    row["params"] = params
    if "build" in commands:
        args = ["runtime.compile=false"] if small else ["dry=true"]
        row["build"] = {"args": args, **_call(lambda: cli.cmd_build(*cli.parse_args([f"conf={name}", *args], "build")))}
    if "report" in commands:
        row["report"] = _call(lambda: cli.cmd_report(*cli.parse_args([f"conf={name}", "output=json"], "report")))
    if "patterns" in commands:
        row["patterns"] = (_call(lambda: cli.cmd_patterns(*cli.parse_args([f"conf={name}", "output=json"], "patterns")))
                           if small else _na(f"{params} parameters: the probes need built weights; "
                                             f"its tiny twin runs them"))
    if "check" in commands or "verify" in commands:
        types, why = _model_types(name, names)
        for command in ("check", "verify"):
            if command in commands and not types:
                row[command] = _na(why)
        if types:
            if "verify" in commands:
                row["verify"] = {t: _call(lambda t=t: cli.cmd_verify({"output": "json"}, [], [t])) for t in types}
            if "check" in commands:
                row["check"] = {t: _check(t) for t in types}
    return row


def _check(model_type: str) -> dict:
    """`zoo check weights=DIR` on model_type's transformers twin, written by this script."""
    from zoo import cli
    from zoo.verify import build_twin, twin_config

    with tempfile.TemporaryDirectory(prefix=f"zoo-all-commands-{model_type}-") as tmp:
        made = _call(lambda: build_twin(model_type, twin_config(model_type), Path(tmp)) and 0)
        if made["status"] != "ok":
            return {**made, "where": "writing the twin checkpoint"}
        return _call(lambda: cli.cmd_check(*cli.parse_args([f"weights={tmp}"], "check")))


def _all_confs() -> list[str]:
    from zoo.compiler.config import conf_dir

    return sorted(p.stem for p in conf_dir().glob("*.yaml"))


def _bad(row: dict):
    """(command, entry) for each traceback / timeout in a row."""
    for command, entry in row.items():
        if not isinstance(entry, dict):
            continue
        entries = entry.items() if "status" not in entry else [(None, entry)]
        for sub, e in entries:
            if isinstance(e, dict) and e.get("status") in ("traceback", "timeout"):
                yield (command if sub is None else f"{command}:{sub}"), e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help="run one conf in this process and print its JSON row")
    ap.add_argument("--only", help="comma-separated conf names (default: every conf of conf/)")
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per conf")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    commands = tuple(c for c in args.commands.split(",") if c)
    unknown = sorted(set(commands) - set(COMMANDS))
    if unknown:
        ap.error(f"--commands: unknown {unknown}; expected some of {', '.join(COMMANDS)}")
    if args.one:
        print(json.dumps(one(args.one, commands)))
        return 0
    names = args.only.split(",") if args.only else _all_confs()
    out = Path(args.out)
    results = json.loads(out.read_text())["confs"] if out.exists() and args.only else {}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t_all = time.perf_counter()
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--one", name, "--commands", ",".join(commands)],
                               capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = (json.loads(lines[-1]) if p.returncode == 0 and lines else
                   {"process": {"status": "traceback", "error": f"exit {p.returncode}",
                                "traceback": _tail(p.stderr)}})
        except subprocess.TimeoutExpired:
            row = {"process": {"status": "timeout", "seconds": args.timeout}}
        results[name] = row
        bad = [c for c, _ in _bad(row)]
        print(f"[{i + 1}/{len(names)}] {name}: {time.perf_counter() - t0:.0f} s"
              + (f"  BAD: {', '.join(bad)}" if bad else ""), flush=True)
        _write(out, results, commands)
    print(f"{len(names)} confs in {time.perf_counter() - t_all:.0f} s; wrote {out}")
    return 1 if any(True for row in results.values() for _ in _bad(row)) else 0


def _write(out: Path, results: dict, commands) -> None:
    counts: dict = {}
    for row in results.values():
        for command, entry in row.items():
            if not isinstance(entry, dict):
                continue
            for e in ([entry] if "status" in entry else entry.values()):
                if isinstance(e, dict) and "status" in e:
                    counts.setdefault(command, {}).setdefault(e["status"], 0)
                    counts[command][e["status"]] += 1
    import torch
    import transformers

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                               "small_params": SMALL_PARAMS, "counts": counts,
                               "confs": dict(sorted(results.items()))}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
