"""The zoo command line.

    zoo build conf=llama3_8b [weights=<repo id|dir|file.gguf>] [Hydra overrides ...]
    zoo generate (conf=NAME weights=... | weights=...) prompt="..." [chat=true] [max_new_tokens=64]
                 [speculative=ngram|mtp|off] [draft_tokens=4]    (speculative decoding; serve too)
    zoo report conf=NAME[,NAME...] [overrides] [context=T] [batch=B] [device=h200] [output=json]
               [plot=cache.png]
    zoo diff "llama3_8b" "llama3_8b residual=mhc"      (conf names + overrides, dirs or Hub ids)
    zoo import <repo id | dir> [name=NAME] [out=FILE]
    zoo check weights=<dir | repo id> [conf=NAME]
    zoo patterns (conf=NAME | weights=...) [text="..."] [repeat=N] [seed=S] [output=json] [plot=DIR]
    zoo serve (conf=NAME | weights=...) [host=127.0.0.1] [port=8000] [max_batch=8] [max_seq=...]
              [api_key=KEY] [max_queue=64] [model_name=NAME] [step_tokens=N]
                                                                   (OpenAI-compatible HTTP server)
              [prefix_cache_mib=1024]            (host memory for reused prompt caches; 0: off)
              [tool_format=hermes|llama3_json|mistral|...]      (else the chat template's, zoo/tools)
    zoo configs
    zoo families [markdown=true]                        (every model_type zoo imports, and its kinds)
    zoo cache [clear]                                  (where compiled graphs persist; clear them)
    zoo verify <model_type | checkpoint dir | conf name> [compile=true] [output=json] [overrides]
                                     (a tiny random twin against transformers: needs zoo[verify])

Arguments are key=value. Each command reads the keys COMMAND_KEYS lists for it; a key only another
command reads is an error (`zoo build temperature=0.7`); every other key=value (or +key=value, ~key)
is a Hydra override of the config, e.g. `mixers.attn.n_kv_heads=4 residual=mhc`.
`device=`, `dtype=`, `max_seq=`, `max_batch=`, `compile=`, `decode_buckets=`, `step_tokens=`, `quant=`,
`memory_limit=` (bytes), `force_load=` are shortcuts for `runtime.*`. A model whose weights and caches
exceed the memory available (or memory_limit=, $ZOO_MEMORY_LIMIT) is refused before anything is read,
naming the sizes; force_load=true loads it anyway.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .compiler.errors import ZooError

# The keys each command reads itself. A key another command reads is an error here (`zoo build
# temperature=0.7` would otherwise be ignored); every other key=value is a Hydra override of the config.
_LOAD_KEYS = {"conf", "weights", "revision", "seed"}  # _load: a conf (+ weights) or a checkpoint
COMMAND_KEYS: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "build": _LOAD_KEYS | {"dry"},
    "generate": _LOAD_KEYS | {"prompt", "chat", "system", "max_new_tokens", "temperature", "top_k", "top_p",
                              "speculative", "draft_tokens"},
    # report/diff take device= (a device profile) and dtype= (weights and cache) as their own options
    "report": {"conf", "weights", "revision", "context", "batch", "device", "dtype", "tp", "ep", "output", "plot"},
    "diff": {"revision", "context", "dtype", "output"},
    "import": {"revision", "name", "out"},
    "check": {"conf", "weights", "revision"},
    "patterns": _LOAD_KEYS | {"text", "repeat", "output", "plot"},
    "serve": _LOAD_KEYS | {"host", "port", "api_key", "max_queue", "model_name", "log_level", "tool_format",
                           "speculative", "draft_tokens", "prefix_cache_mib"},
    "configs": set(),
    "families": {"markdown"},
    "cache": set(),
    "verify": {"output"},
}.items()}
ZOO_KEYS = frozenset().union(*COMMAND_KEYS.values())
# commands that read no config: an override would be ignored, so it is refused
NO_OVERRIDES = {"configs", "families", "cache"}
RUNTIME_KEYS = {"device", "dtype", "max_seq", "max_batch", "compile", "cache_dtype", "quant", "quant_group",
                "quant_prefill", "decode_buckets", "step_tokens", "memory_limit", "force_load"}


def _usage() -> str:
    return (__doc__ or "").strip()


def parse_args(argv: Sequence[str], command: str) -> tuple[dict[str, str], list[str]]:
    """Split key=value arguments into `command`'s options and Hydra overrides. A key another
    command reads (and that is no config key) is an error naming the key, the command and the
    keys it takes; so is any override for a command that reads no config."""
    keys = COMMAND_KEYS[command]
    opts: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys:
            opts[key] = value
        elif sep and key in RUNTIME_KEYS:
            overrides.append(f"runtime.{key}={value}")
        elif sep and key in ("tp", "ep"):  # shortcuts for runtime.parallel.tp / ep
            overrides.append(f"runtime.parallel.{key}={value}")
        elif sep and key in ZOO_KEYS and not _is_config_key(key):
            readers = ", ".join(c for c, ks in COMMAND_KEYS.items() if key in ks)
            raise ZooError(f"zoo {command} does not use {key}={value!r} (a key of zoo {readers}); "
                           f"{command} takes {_accepted(command)}")
        elif sep or arg.startswith("~"):
            overrides.append(arg)
        else:
            raise ZooError(f"argument {arg!r}: expected key=value (see `zoo --help`)")
    if overrides and command in NO_OVERRIDES:
        raise ZooError(f"zoo {command} reads no config, so {overrides} would be ignored; "
                       f"{command} takes {_accepted(command)}")
    return opts, overrides


def _accepted(command: str) -> str:
    keys = sorted(COMMAND_KEYS[command])
    listed = ", ".join(f"{k}=" for k in keys) if keys else "no key=value options"
    if command in NO_OVERRIDES:
        return listed
    return (f"{listed}, the runtime shortcuts {', '.join(f'{k}=' for k in sorted(RUNTIME_KEYS - set(keys)))}"
            f" and Hydra overrides of config keys (e.g. mixers.attn.n_kv_heads=4, +key=value, ~key)")


def _is_config_key(key: str) -> bool:
    """`key` names a top-level field of the config schema (e.g. name=): a Hydra override."""
    import dataclasses

    from .compiler.spec import ConfigSchema

    return key in {f.name for f in dataclasses.fields(ConfigSchema)}


def _bool(opts: dict, key: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ZooError(f"{key}={value!r}: expected true or false")


def _speculative(opts: dict, overrides: list[str]) -> list[str]:
    """speculative=ngram|mtp|off and draft_tokens=K (generate, serve): runtime.speculative's keys."""
    out = list(overrides)
    if "speculative" in opts:
        value = opts["speculative"]
        if value not in ("ngram", "mtp", "off"):
            raise ZooError(f"speculative={value!r}: expected ngram (prompt lookup), mtp (the model's MTP layer, "
                           f"with checkpoint.mtp=true) or off")
        out.append(f"runtime.speculative.drafter={'null' if value == 'off' else value}")
    if "draft_tokens" in opts:
        out.append(f"runtime.speculative.draft_tokens={opts['draft_tokens']}")
    return out


def _load(opts: dict, overrides: list[str], dry: Optional[bool], progress: bool):
    from .runtime import build, from_pretrained_config

    if "conf" in opts:
        return build(opts["conf"], overrides, weights=opts.get("weights"), dry=dry, progress=progress,
                     seed=int(opts.get("seed", 0)))
    if "weights" in opts:
        return from_pretrained_config(opts["weights"], overrides, revision=opts.get("revision"),
                                      dry=dry, progress=progress)
    raise ZooError("give conf=NAME (see `zoo configs`) or weights=<repo id|dir|file.gguf>")


def cmd_build(opts: dict, overrides: list[str]) -> int:
    from .report import print_build_report
    from .runtime import shape_check

    dry = True if _bool(opts, "dry", False) else None
    model = _load(opts, overrides, dry=dry, progress=True)
    shapes = shape_check(model)
    print_build_report(model, shapes)
    return 0


def cmd_generate(opts: dict, overrides: list[str]) -> int:
    import torch

    if "prompt" not in opts:
        raise ZooError("generate needs prompt=\"...\"")
    model = _load(opts, _speculative(opts, overrides), dry=False, progress=True)
    _print_load_line(model)
    tok = model.tokenizer
    if tok is None:
        raise ZooError("generate needs a tokenizer: give weights= a checkpoint with tokenizer.json or a GGUF file")
    text = opts["prompt"]
    if _bool(opts, "chat", False):
        messages = ([{"role": "system", "content": opts["system"]}] if "system" in opts else []) + \
                   [{"role": "user", "content": text}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    else:
        ids = tok.encode(text)
    stream = tok.stream()
    # under torchrun every rank generates (each step's collectives need all of them); rank 0 prints
    out = sys.stdout if not model.info.parallel or model.info.parallel["rank"] == 0 else open(os.devnull, "w")

    def emit(t: torch.Tensor) -> None:
        out.write(stream.feed(int(t[0])))
        out.flush()

    gen = torch.Generator().manual_seed(int(opts.get("seed", 0)))
    top_k = int(opts["top_k"]) if "top_k" in opts else None
    top_p = float(opts["top_p"]) if "top_p" in opts else None
    model.generate(torch.tensor([ids]), int(opts.get("max_new_tokens", 128)),
                   temperature=float(opts.get("temperature", 0.0)), top_k=top_k, top_p=top_p,
                   generator=gen, stream=emit, eos_ids=sorted(set(model.eos_ids) | set(tok.eos_ids)))
    out.write(stream.flush() + "\n")
    return 0


def _print_load_line(model) -> None:
    """What the model holds of its checkpoint, on stderr (stdout carries only the command's output)."""
    from .report import load_line

    line = load_line(model)
    if line and (not model.info.parallel or model.info.parallel["rank"] == 0):
        print(line, file=sys.stderr)


def cmd_serve(opts: dict, overrides: list[str]) -> int:
    from .serve.api import serve
    from .serve.scheduler import PREFIX_CACHE_BYTES

    mib = opts.get("prefix_cache_mib", str(PREFIX_CACHE_BYTES >> 20))
    if not mib.isdigit():  # checked before the model loads
        raise ZooError(f"prefix_cache_mib={mib!r}: expected a whole number of MiB >= 0 (host memory for "
                       f"reused prompt caches; 0 turns prefix reuse off)")
    if not any(o.startswith("runtime.max_batch=") for o in overrides):
        overrides = [*overrides, "runtime.max_batch=8"]  # rows of the continuous batch
    _check_serve_budget(opts, _speculative(opts, overrides), int(mib) << 20)
    model = _load(opts, _speculative(opts, overrides), dry=False, progress=True)
    _print_load_line(model)
    name = opts.get("model_name") or opts.get("conf") or Path(opts["weights"].rstrip("/")).name
    api_key = opts.get("api_key") or None
    serve(model, model_name=name, host=opts.get("host", "127.0.0.1"), port=int(opts.get("port", 8000)),
          api_key=api_key, max_queue=int(opts.get("max_queue", 64)), log_level=opts.get("log_level", "info"),
          tool_format=opts.get("tool_format") or None, prefix_cache_bytes=int(mib) << 20)
    return 0


def _check_serve_budget(opts: dict, overrides: list[str], prefix_cache_bytes: int) -> None:
    """Before anything is allocated: the weights, the caches of max_batch x max_seq (the cache
    plan of a dry build: headers only) and the prefix cache against the build's budget (the host's
    available memory, or memory_limit= / $ZOO_MEMORY_LIMIT: compiler/memory.py), a named refusal
    with the sizes (zoo/serve/limits.py); force_load=true skips it. A build on another device
    checks its own memory in the build's fit stage; under torchrun each rank holds a share: not
    checked here."""
    from .serve.limits import check_kv_budget

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    probe = _load(opts, overrides, dry=True, progress=False)
    rt = probe.spec.runtime
    if str(rt.device) != "cpu" or rt.force_load:
        return
    check_kv_budget(probe.info, int(rt.max_batch), int(rt.max_seq), prefix_cache_bytes, probe.info.available_bytes,
                    where=f"zoo serve {probe.spec.source} ({probe.spec.name})",
                    available_from=probe.records.fit.available_from)


def resolve_target(text: str, revision=None):
    """'NAME [overrides]' (a conf), or 'DIR|REPO [overrides]' (a checkpoint) -> (DictConfig, label)."""
    import shlex

    from .compiler.checkpoint.hub import open_source
    from .compiler.config import available_configs, compose
    from .compiler.hf_import import import_config

    head, *rest = shlex.split(text)
    if head in available_configs():
        return compose(head, rest), text
    source = open_source(head, revision=revision)
    return import_config(source.config(), source.description, rest), text


def cmd_report(opts: dict, overrides: list[str]) -> int:
    from .compiler.analysis import analyze
    from .compiler.build import spec_stage

    from .report import plot_cache, print_analysis

    targets = [c for c in opts.get("conf", "").split(",") if c] if "conf" in opts else []
    if "weights" in opts:
        targets.append(opts["weights"])
    if not targets:
        raise ZooError("report needs conf=NAME (or several, comma-separated) or weights=<dir|repo id>")
    results, specs = [], []
    dtype = opts.get("dtype", "bfloat16")
    for target in targets:
        cfg, label = resolve_target(" ".join([target, *overrides]), opts.get("revision"))
        specs.append(spec_stage(cfg, label).spec)
        results.append(analyze(specs[-1], context=int(opts.get("context", 4096)), batch=int(opts.get("batch", 1)),
                               cache_dtype=dtype, weight_dtype=dtype, device=opts.get("device")))
        if "tp" in opts or "ep" in opts:
            from .compiler.analysis import parallel_plan

            results[-1]["parallel"] = parallel_plan(
                specs[-1], int(opts.get("tp", 1)), int(opts.get("ep", 1)), context=int(opts.get("context", 4096)),
                batch=int(opts.get("batch", 1)), cache_dtype=dtype, weight_dtype=dtype, device=opts.get("device"))
    if "plot" in opts:
        plot_cache(specs, opts["plot"], max_context=int(opts.get("context", 131072)), dtype=dtype, reports=results)
    if opts.get("output") == "json":
        import json

        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        for r in results:
            print_analysis(r)
    return 0


def cmd_diff(opts: dict, overrides: list[str], positional: list[str]) -> int:
    from .compiler.analysis import analyze
    from .compiler.build import spec_stage

    from .report import config_diff, print_diff

    if len(positional) != 2:
        raise ZooError('diff needs two targets, e.g. zoo diff llama3_8b "llama3_8b residual=mhc"')
    if overrides:  # they would apply to neither side
        raise ZooError(f"diff takes overrides inside a target, e.g. zoo diff llama3_8b \"llama3_8b residual=mhc\"; "
                       f"got {overrides} outside both")
    sides = []
    for text in positional:
        cfg, label = resolve_target(text, opts.get("revision"))
        spec = spec_stage(cfg, label).spec
        dtype = opts.get("dtype", "bfloat16")
        sides.append((label, spec, analyze(spec, context=int(opts.get("context", 4096)), cache_dtype=dtype,
                                           weight_dtype=dtype)))
    diff = config_diff(sides[0][1], sides[1][1], sides[0][2], sides[1][2])
    if opts.get("output") == "json":
        import json

        print(json.dumps({"a": sides[0][0], "b": sides[1][0], **diff}, indent=2))
    else:
        print_diff(sides[0][0], sides[1][0], diff)
    return 0


def cmd_import(opts: dict, overrides: list[str], positional: list[str]) -> int:
    from pathlib import Path

    from .compiler.checkpoint.hub import open_source
    from .compiler.config import conf_dir, user_conf_dir
    from .compiler.hf_import import conf_yaml, import_config
    from .compiler.plugins import PLUGINS_FILE
    from .compiler.spec import validate

    if len(positional) != 1:
        raise ZooError("import needs one checkpoint: zoo import <repo id | dir> [name=NAME] [out=FILE]")
    source = open_source(positional[0], revision=opts.get("revision"))
    cfg = import_config(source.config(), source.description, overrides)
    name = opts.get("name") or str(cfg.name).lower().replace("-", "_").replace(".", "_")
    cfg.name = name
    validate(cfg.copy(), source=source.description)  # never write a conf that would not build
    out = Path(opts["out"]) if "out" in opts else user_conf_dir() / f"{name}.yaml"
    if "out" not in opts and (conf_dir() / f"{name}.yaml").exists():
        raise ZooError(f"name={name!r} is a shipped conf (conf/{name}.yaml); give the import another name=")
    if "out" not in opts and f"{name}.yaml" == PLUGINS_FILE:
        raise ZooError(f"name={name!r}: {out} is the user conf dir's plugins list (docs/adding-a-family.md, "
                       f"\"Kinds outside the package\"), not a preset; give the import another name=")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(conf_yaml(cfg, f"Imported by `zoo import {positional[0]}` ({source.description}).\n"
                                  f"Rebuild with: zoo build conf={name} weights={positional[0]}"))
    print(f"wrote {out}  (use: zoo build conf={name} weights={positional[0]})")
    return 0


def cmd_check(opts: dict, overrides: list[str]) -> int:
    from .compiler.checkpoint.hub import open_source
    from .compiler.checkpoint.loader import plan_load
    from .compiler.build import cast_stage, spec_stage
    from .compiler.checkpoint.rules import checkpoint_stages
    from .compiler.config import compose
    from .compiler.hf_import import import_config

    from .report import print_check

    if "weights" not in opts:
        raise ZooError("check needs weights=<dir | repo id>")
    source = open_source(opts["weights"], revision=opts.get("revision"), verify_data=False)
    if "conf" in opts:
        cfg, label = compose(opts["conf"], overrides), f"conf/{opts['conf']}.yaml"
    else:
        cfg, label = import_config(source.config(), source.description, overrides), source.description
    s = spec_stage(cfg, label)
    spec = s.spec
    model = cast_stage(spec, s.dtype, mtp=s.mtp).module
    plan = plan_load(model, source, checkpoint_stages(source, spec), strict=False)
    data = list(source.data_problems or [])  # contracts.Source declares it (None: verified on open)
    print_check(source.description, label, plan, data)
    return 0 if plan.ok and not data else 1


def cmd_patterns(opts: dict, overrides: list[str]) -> int:
    """Attention sinks, previous-token and induction heads, ... (zoo/patterns.py), eagerly."""
    from .patterns import DEFAULT_REPEAT, plot_patterns, print_patterns, run, token_labels

    repeat = int(opts.get("repeat", DEFAULT_REPEAT))
    extra = ["runtime.compile=false"]  # the probes run the layers eagerly: nothing to compile
    if "text" not in opts and not any(o.startswith("runtime.max_seq=") for o in overrides):
        extra.append(f"runtime.max_seq={1 + 2 * repeat}")
    model = _load(opts, [*overrides, *extra], dry=False, progress=opts.get("output") != "json")
    seed = int(opts.get("seed", 0))
    patterns = run(model, opts.get("text"), repeat, seed)
    labels = token_labels(model, patterns.tokens)
    if "plot" in opts:
        files = plot_patterns(patterns, labels, opts["plot"], title=model.spec.name)
        print("wrote " + " ".join(str(f) for f in files), file=sys.stderr)
    if opts.get("output") == "json":
        import json

        print(json.dumps({"model": model.spec.name, **patterns.to_json()}))
    else:
        print_patterns(patterns, labels)
    return 0


def cmd_configs(opts: dict, overrides: list[str]) -> int:
    from .compiler.config import available_configs

    print("\n".join(available_configs()))
    return 0


def cmd_families(opts: dict, overrides: list[str]) -> int:
    from .families import families, markdown_table, text_table

    if overrides:
        raise ZooError(f"zoo families takes no overrides, got {overrides}")
    rows = families()
    print(markdown_table(rows) if _bool(opts, "markdown", False) else text_table(rows))
    return 0


def cmd_cache(opts: dict, overrides: list[str], positional: list[str]) -> int:
    """Where compiled graphs persist (inductor's FX graph, AOTAutograd and kernel caches under
    $ZOO_CACHE_DIR/compile/torch-<version>, default ~/.cache/zoo) and converted weights
    ($ZOO_CACHE_DIR/weights, compiler/checkpoint/weight_cache.py); `clear` deletes them."""
    import shutil

    from .compiler.checkpoint.weight_cache import cache_dir as weight_cache_dir
    from .compiler.engine.compiling import compile_cache_dir, inductor_cache_dir

    if overrides or opts or positional not in ([], ["clear"]):
        raise ZooError(f"zoo cache takes no options and at most the word 'clear', got "
                       f"{[*positional, *overrides, *opts]}")
    here = compile_cache_dir()
    inductor = inductor_cache_dir()
    weights = weight_cache_dir()
    if positional == ["clear"]:
        # every torch version's folder, an explicit inductor one, the converted weights
        for d in {here.parent, inductor, *([weights] if weights else [])}:
            if d.exists():
                shutil.rmtree(d)
                print(f"removed {d}")
        return 0
    listed = [("zoo compile cache", here)] + ([("inductor writes to", inductor)] if inductor != here else [])
    for label, d in listed + ([("converted weights", weights)] if weights else []):
        files = [f for f in d.rglob("*") if f.is_file()] if d.exists() else []
        size = sum(f.stat().st_size for f in files)
        print(f"{label:20s} {d}  ({len(files)} files, {size / 2**20:.1f} MiB)")
    return 0


def cmd_verify(opts: dict, overrides: list[str], positional: list[str]) -> int:
    """zoo/verify.py: prefill and every greedy decode step of a tiny twin against transformers;
    exit 0 only when every target's verdict is ok."""
    from .verify import print_verdict, resolve, verify

    if len(positional) != 1:
        raise ZooError("verify needs one target: zoo verify <model_type | checkpoint dir | conf name>")
    compile_ = [o for o in overrides if o.startswith("runtime.compile=")]  # the compile= shortcut
    compiled = _bool({"compile": compile_[-1].partition("=")[2]}, "compile", False) if compile_ else False
    overrides = [o for o in overrides if o not in compile_]
    verdicts = [verify(model_type, config, overrides, compile=compiled)
                for model_type, config in resolve(positional[0])]
    if opts.get("output") == "json":
        import json

        print(json.dumps([v.to_json() for v in verdicts], indent=2))
    else:
        for v in verdicts:
            print_verdict(v, positional[0])
    return 0 if all(v.status == "ok" for v in verdicts) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    handlers = {"build": cmd_build, "generate": cmd_generate, "report": cmd_report, "check": cmd_check,
                "configs": cmd_configs, "families": cmd_families, "patterns": cmd_patterns,
                "serve": cmd_serve}
    positional_handlers = {"diff": cmd_diff, "import": cmd_import, "cache": cmd_cache, "verify": cmd_verify}
    if command not in handlers and command not in positional_handlers:
        known = ", ".join([*handlers, *positional_handlers])
        print(f"zoo: unknown command {command!r}; expected one of {known}", file=sys.stderr)
        return 2
    try:
        if command in positional_handlers:
            # targets are free text (a conf with overrides, a dir, a repo id); key=value options
            # that zoo reads are taken out, the rest are overrides applied to the import
            positional = [a for a in rest if "=" not in a.split(" ")[0] or " " in a]
            opts, overrides = parse_args([a for a in rest if a not in positional], command)
            return positional_handlers[command](opts, overrides, positional)
        opts, overrides = parse_args(rest, command)
        return handlers[command](opts, overrides)
    except ZooError as e:
        print(f"zoo {command}: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `zoo` command (and `python -m zoo`): main, then a fast exit. Python's orderly shutdown
    after importing torch takes about 1 s (freeing every module's objects), a fifth of a warm
    `zoo generate`; the work is done and written by then, so the process flushes its output and
    ends at once. Under torch.distributed (torchrun) the ranks exit the orderly way."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "torch.distributed" in sys.modules:
        from .compiler.parallel.mesh import shutdown

        if sys.modules["torch.distributed"].is_initialized():
            # every rank's connections closed together (a barrier while all succeeded): a rank
            # that exits with its group's threads running is aborted by the C++ runtime
            shutdown(wait=code == 0)
            sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    run()
