"""The zoo command line.

    zoo build conf=llama3_8b [weights=<repo id|dir|file.gguf>] [Hydra overrides ...]
    zoo generate (conf=NAME weights=... | weights=...) prompt="..." [chat=true] [max_new_tokens=64]
    zoo configs

Arguments are key=value. Keys zoo itself reads are listed in ZOO_KEYS; every other key=value (or
+key=value, ~key) is a Hydra override of the config, e.g. `mixers.attn.n_kv_heads=4 residual=mhc`.
`device=`, `dtype=`, `max_seq=`, `max_batch=`, `compile=` are shortcuts for `runtime.*`.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from compiler.errors import ZooError

ZOO_KEYS = {"conf", "weights", "revision", "prompt", "chat", "system", "max_new_tokens", "temperature",
            "top_k", "top_p", "seed", "dry", "output"}
RUNTIME_KEYS = {"device", "dtype", "max_seq", "max_batch", "compile", "cache_dtype"}
COMMANDS = ("build", "generate", "configs")


def _usage() -> str:
    return (__doc__ or "").strip()


def parse_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Split key=value arguments into zoo options and Hydra overrides."""
    opts: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ZOO_KEYS:
            opts[key] = value
        elif sep and key in RUNTIME_KEYS:
            overrides.append(f"runtime.{key}={value}")
        elif sep or arg.startswith("~"):
            overrides.append(arg)
        else:
            raise ZooError(f"argument {arg!r}: expected key=value (see `zoo --help`)")
    return opts, overrides


def _bool(opts: dict, key: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ZooError(f"{key}={value!r}: expected true or false")


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
    model = _load(opts, overrides, dry=False, progress=True)
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
    out = sys.stdout

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


def cmd_configs(opts: dict, overrides: list[str]) -> int:
    from compiler.config import available_configs

    print("\n".join(available_configs()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    handlers = {"build": cmd_build, "generate": cmd_generate, "configs": cmd_configs}
    if command not in handlers:
        print(f"zoo: unknown command {command!r}; expected one of {', '.join(handlers)}", file=sys.stderr)
        return 2
    try:
        opts, overrides = parse_args(rest)
        return handlers[command](opts, overrides)
    except ZooError as e:
        print(f"zoo {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
