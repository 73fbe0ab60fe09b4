"""`zoo verify`: does zoo's import of a family compute what transformers computes?

    target (model_type | checkpoint dir | conf name) -> model_type (+ config.json)
      -> tiny twin config (odd sizes, every layer kind kept; conf/hf/common.yaml `verify:` and the
         import map's own `verify:`) -> transformers model, seeded, save_pretrained to a temp dir
      -> zoo.from_pretrained (the user's import path) -> prefill + every greedy decode step
         against transformers' full forward over the same tokens -> worst relative error per step

The verdict: "ok" (every step's worst relative error <= OK_RTOL), "mismatch" (zoo built the
model and computes something else: the "silently different model" case), or "refused" (zoo
raised a ZooError: the message names the missing concept or key). transformers is the oracle, an
optional dependency (`pip install 'zoo[verify]'`); it is imported only when a twin is built.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from .compiler.errors import ConfigError, ZooError

OK_RTOL = 1e-4
BATCH, PROMPT, STEPS = 2, 7, 5  # an odd prompt; with the twin's window of 5 every window slides
SEED = 0
EXTRA = "verify"  # pyproject's optional dependency group that brings transformers


def require_transformers():
    """transformers, or a ZooError naming the extra that installs it."""
    try:
        import transformers
    except ImportError as e:
        raise ZooError(f"zoo verify compares against transformers, which is not installed ({e}); install "
                       f"the `{EXTRA}` extra: pip install 'zoo[{EXTRA}]' (transformers==5.24.*)") from None
    return transformers


@dataclass
class Verdict:
    model_type: str
    status: str  # "ok" | "mismatch" | "refused"
    steps: list[tuple[str, float]] = field(default_factory=list)  # (prefill | decode k, worst rel err)
    message: str = ""  # zoo's error for "refused"
    twin: dict = field(default_factory=dict)  # the twin's config.json
    compiled: bool = False

    @property
    def worst(self) -> Optional[float]:
        return max(e for _, e in self.steps) if self.steps else None

    def to_json(self) -> dict:
        return {"model_type": self.model_type, "status": self.status, "worst": self.worst, "compiled": self.compiled,
                "steps": [{"step": s, "rel_err": e} for s, e in self.steps], "message": self.message}


# --------------------------------------------------------------------------- targets

def resolve(target: str) -> list[tuple[str, Optional[dict]]]:
    """`target` -> [(model_type, config.json or None)]: a checkpoint dir (its config.json), a
    model_type, or a conf name (every import map whose `base` it is)."""
    from .compiler.config import available_configs
    from .compiler.hf_import import import_specs

    path = Path(target)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ZooError(f"{target}: a checkpoint dir needs a config.json (none there)")
        config = json.loads(cfg_file.read_text())
        if "model_type" not in config:
            raise ZooError(f"{cfg_file}: config.json has no model_type")
        return [(config["model_type"], config)]
    specs = import_specs()
    if target in specs:
        return [(target, None)]
    if target in available_configs():
        types = [t for t, s in specs.items() if s["base"] == target]
        if not types:
            raise ZooError(f"conf {target!r}: no import map (conf/hf/*.yaml or the user conf dir's hf/) has "
                           f"base: {target}, so no transformers model_type to compare it with")
        return [(t, None) for t in sorted(types)]
    transformers = require_transformers()
    if target in transformers.CONFIG_MAPPING:
        return [(target, None)]
    raise ZooError(f"{target!r}: expected a model_type (zoo imports {', '.join(sorted(specs))}; or any of "
                   f"transformers'), a checkpoint dir with config.json, or a conf name (see `zoo configs`)")


# --------------------------------------------------------------------------- the twin

def _verify_section(model_type: str) -> tuple[dict, dict, int]:
    """The twin's config.json sizes: common.yaml's `verify.config` (applied where the config
    class sets the key), the import map's `verify.config` (the family's keys, always applied),
    and the least number of layers."""
    from .compiler.config import find_conf
    from .compiler.hf_import import COMMON_KEYS, import_specs

    path = find_conf("hf", COMMON_KEYS)
    common = ((OmegaConf.to_container(OmegaConf.load(path)) or {}).get("verify") or {}) if path else {}
    spec = import_specs().get(model_type) or {}
    own = spec.get("verify") or {}
    unknown = sorted(set(own) - {"config", "min_layers"})
    if unknown:
        raise ConfigError(f"{spec.get('file')}: verify has unknown key(s) {unknown}; it has config (the "
                          f"twin's config.json keys) and min_layers")
    return (dict(common.get("config") or {}), dict(own.get("config") or {}),
            int(own.get("min_layers", common.get("min_layers", 3))))


def _per_layer_lists(cfg, n_layers: int) -> dict[str, list]:
    """The config's attributes that hold one entry per layer (layer_types, mlp_layer_types,
    no_rope_layers, ...)."""
    return {k: v for k, v in vars(cfg).items() if isinstance(v, list) and len(v) == n_layers and n_layers > 1
            and all(isinstance(x, (str, int, bool)) for x in v)}


def _class_sets(full, key: str) -> bool:
    """Whether the config class gives `key` a value (not None). A key it holds per layer (Gemma 4's
    head_dim, which transformers refuses to read globally) counts as set."""
    try:
        return getattr(full, key, None) is not None
    except Exception as e:  # transformers' AmbiguousGlobalPerLayerAttributeError: set, per layer
        if "per-layer" in str(e) or "per_layer" in str(e):
            return True
        raise


def twin_config(model_type: str, config: Optional[dict] = None):
    """A tiny transformers config of `model_type` (from `config`, else the config class's
    defaults): sizes from the verify sections, every per-layer kind kept (the shortest prefix of
    each per-layer list that shows every value, and at least min_layers layers)."""
    transformers = require_transformers()
    if model_type not in transformers.CONFIG_MAPPING:
        raise ZooError(f"model_type {model_type!r} is not one of transformers {transformers.__version__}'s "
                       f"config classes: no oracle to compare with")
    cls = transformers.CONFIG_MAPPING[model_type]
    # the twin is float32 with random weights: a checkpoint's storage format does not carry over
    base = {k: v for k, v in (config or {}).items()
            if k not in ("model_type", "architectures", "transformers_version", "_name_or_path",
                         "quantization_config", "dtype", "torch_dtype")}
    full = cls(**base)
    common, own, min_layers = _verify_section(model_type)
    kw = dict(base)
    # a key the class computes (a property without a setter, e.g. a derived head_dim) is not an input
    settable = {k for k in common if not (isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None)}
    kw.update({k: v for k, v in common.items() if k in settable and _class_sets(full, k)})
    n = int(getattr(full, "num_hidden_layers", 0) or 0)
    lists = _per_layer_lists(full, n)
    need = min_layers
    for values in lists.values():
        firsts = {}
        for i, v in enumerate(values):
            firsts.setdefault(v, i)
        need = max(need, max(firsts.values()) + 1)
    if n and "num_hidden_layers" not in own:
        need = min(need, n) if lists else need
        kw["num_hidden_layers"] = need
        kw.update({k: v[:need] for k, v in lists.items()})
    kw.update(own)
    vocab = kw.get("vocab_size", getattr(full, "vocab_size", None))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids past the twin's vocab
        value = kw.get(key, getattr(full, key, None))
        if vocab is not None and any(isinstance(i, int) and i >= vocab
                                     for i in (value if isinstance(value, list) else [value])):
            kw[key] = None
    return cls(**kw)


def _perturb(model) -> None:
    """Norm weights away from their init (1 or 0) so that a misplaced or offset norm weight shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))


def build_twin(model_type: str, twin, path: Path):
    """The seeded transformers model of config `twin` (eval, float32), saved to `path`."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers = require_transformers()
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if cls_name is None:
        raise ZooError(f"model_type {model_type!r} has no causal-LM class in transformers "
                       f"{transformers.__version__} (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)")
    torch.manual_seed(SEED)
    model = getattr(transformers, cls_name)(twin).eval().float()
    _perturb(model)
    model.save_pretrained(path)
    return model


# --------------------------------------------------------------------------- the comparison

def rel_err(actual, expected) -> float:
    """Logits [B, L, V] or [B, V] -> max |a - e| / max |e|: the error at the logits' scale
    (tests/helpers.py's floor)."""
    expected = expected.float()
    return float((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def verify(target_type: str, config: Optional[dict] = None, overrides: Sequence[str] = (),
           compile: bool = False, steps: int = STEPS, workdir: Optional[Path] = None) -> Verdict:
    """Build `target_type`'s twin, load it with zoo.from_pretrained (with `overrides`) and compare
    prefill and every greedy decode step (batch 2, float32) with transformers."""
    import torch

    from .runtime import from_pretrained

    require_transformers()
    with tempfile.TemporaryDirectory(prefix=f"zoo-verify-{target_type}-", dir=workdir) as tmp:
        path = Path(tmp)
        twin = _transformers_step(target_type, "config", lambda: twin_config(target_type, config))
        twin.save_pretrained(path)
        twin_cfg = json.loads((path / "config.json").read_text())
        try:  # zoo's refusal first, from the twin's config.json alone (cheap: no model built)
            from .compiler.hf_import import import_config

            import_config(twin_cfg, f"{target_type} twin", overrides)
        except ZooError as e:
            return Verdict(target_type, "refused", message=str(e), twin=twin_cfg)
        ref = _transformers_step(target_type, "model", lambda: build_twin(target_type, twin, path))
        try:
            model = from_pretrained(str(path), compile=compile, max_batch=BATCH, max_seq=PROMPT + steps + 1,
                                    overrides=list(overrides))
        except ZooError as e:
            return Verdict(target_type, "refused", message=str(e), twin=twin_cfg)
        vocab = int(twin.vocab_size)
        gen = torch.Generator().manual_seed(SEED)
        seq = torch.randint(0, vocab, (BATCH, PROMPT), generator=gen)
        out = []
        with torch.no_grad():
            expected = ref(seq).logits
            out.append(("prefill", rel_err(model.prefill(seq), expected)))
            for k in range(steps):
                tok = expected[:, -1].argmax(-1)  # transformers' greedy choice feeds both
                seq = torch.cat((seq, tok[:, None]), dim=1)
                expected = ref(seq).logits
                out.append((f"decode {k + 1}", rel_err(model.decode(tok), expected[:, -1])))
        worst = max(e for _, e in out)
        ok = worst <= OK_RTOL and all(e == e for _, e in out)  # NaN is never ok
        return Verdict(target_type, "ok" if ok else "mismatch", out, twin=twin_cfg, compiled=compile)


def _transformers_step(model_type: str, what: str, fn):
    """fn(), with transformers' own failure to build the twin's config or model (not zoo's) as a
    ZooError that says where the family's twin sizes go."""
    try:
        return fn()
    except ZooError:
        raise
    except Exception as e:
        line = (str(e).strip().splitlines() or [""])[-1].strip()
        raise ZooError(f"transformers could not build the {what} of {model_type!r}'s tiny twin "
                       f"({type(e).__name__}: {line}); give its import map a `verify: {{config: {{...}}}}` "
                       f"section with sizes its config class accepts (docs/adding-a-family.md)") from e


def print_verdict(v: Verdict, label: str = "") -> None:
    """A rich table of the worst relative error per step, then the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = (f"zoo verify {v.model_type}" + (f" ({label})" if label and label != v.model_type else "")
             + (", compiled" if v.compiled else ", eager"))
    if v.status == "refused":
        console.print(f"[bold]{title}[/bold]: [yellow]refused[/yellow]: {v.message}")
        return
    table = Table(title=title)
    table.add_column("step")
    table.add_column("worst rel err", justify="right")
    for step, err in v.steps:
        table.add_row(step, f"{err:.2e}", style=None if err <= OK_RTOL else "red")
    console.print(table)
    colour = "green" if v.status == "ok" else "red"
    console.print(f"[{colour}]{v.status}[/{colour}]: worst relative error {v.worst:.2e} "
                  f"({'<=' if v.status == 'ok' else '>'} {OK_RTOL:g})")
