"""Compose configs from conf/ with Hydra and validate them into a ModelSpec.

    load_config("llama3_8b", ["mixers.attn.n_kv_heads=4", "residual=mhc"]) -> ModelSpec

Hydra does the composition (defaults lists, groups, `${...}` interpolation, overrides); the
structured schemas in spec.py and each kind's Spec check every node.
"""
from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from .cache_root import zoo_cache_root
from .conf_root import user_conf_dir
from .errors import ConfigError
from .plugins import PLUGINS_FILE
from .resolvers import register_resolvers
from .spec import ModelSpec, validate


def conf_dir() -> Path:
    """The conf/ tree shipped with the project (installed as the package zoo.conf)."""
    return Path(str(resources.files("zoo.conf")))


# The kinds of conf file looked up by name over the search path: "" (presets, conf=NAME),
# "hf" (import maps), "rules" (checkpoint rules), "gguf" (GGUF metadata maps).
CONF_KINDS = ("", "hf", "rules", "gguf")


def conf_search_path() -> list[Path]:
    """Where conf files are looked up, in order: the shipped conf/, then the user conf dir."""
    return [conf_dir(), user_conf_dir()]


def conf_label(path: Path) -> str:
    """How messages name a conf file: conf/KIND/NAME.yaml when shipped, else its full path."""
    try:
        return "conf/" + path.relative_to(conf_dir()).as_posix()
    except ValueError:
        return str(path)


def conf_files(kind: str) -> dict[str, Path]:
    """Every conf file of `kind` (one of CONF_KINDS) by name, over the search path: the shipped
    ones, then the user conf dir's. A user file may not reuse a shipped name (it would shadow or
    be shadowed silently): that is a ConfigError naming both; build on a shipped file instead
    (`defaults:` for presets, `include:` for rules). plugins.yaml is no preset (plugins.py)."""
    if kind not in CONF_KINDS:
        raise ValueError(f"conf kind {kind!r}: expected one of {CONF_KINDS}")
    found: dict[str, Path] = {}
    for root in conf_search_path():
        folder = root / kind if kind else root
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            if not kind and path.name == PLUGINS_FILE:
                continue  # the user conf dir's plugins list (plugins.py), not a preset
            if path.stem in found and found[path.stem] != path:
                raise ConfigError(f"{path} has the same name as {conf_label(found[path.stem])}; a user conf "
                                  f"file may not replace a shipped one: give it another name")
            found.setdefault(path.stem, path)
    return found


def find_conf(kind: str, name: str) -> Path | None:
    """"The conf file NAME of kind K": its path over the search path, or None."""
    return conf_files(kind).get(name)


def available_configs() -> list[str]:
    """Names usable as conf=NAME (top-level YAML files of conf/ and of the user conf dir)."""
    return sorted(conf_files(""))


def compose(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Hydra-compose conf/NAME.yaml with command-line style overrides.

    The composed (unresolved) config is kept in the zoo cache (compose/<key>.yaml): Hydra's
    composition is a visible part of every start-up, a cached one is read in milliseconds
    (scripts/results/design-measurements.md). Key:
    the name, the overrides, omegaconf's version and every conf file on the search path (its
    path and bytes), so an edited, added or removed file misses. Interpolations stay as written
    (resolved later by validate, against the environment of that moment)."""
    register_resolvers()
    path = find_conf("", name)
    if path is None:
        raise ConfigError(f"unknown conf {name!r}; available: {', '.join(available_configs())}")
    primary, extra = conf_dir(), []
    if path.parent != primary:
        # a user conf: its own directory first, the shipped groups and presets on the search path
        primary, extra = path.parent, [f"hydra.searchpath=[file://{conf_dir()}]"]
    cached = _compose_cache() / f"{_compose_key(name, primary, extra + list(overrides))}.yaml"
    if cached.is_file():
        cfg = OmegaConf.load(cached)
    else:
        cfg = _hydra_compose(name, primary, extra, overrides)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp")
        tmp.write_text(OmegaConf.to_yaml(cfg))
        tmp.replace(cached)
    OmegaConf.set_struct(cfg, False)
    return cfg


def _compose_cache() -> Path:
    return zoo_cache_root() / "compose"


def _compose_key(name: str, primary: Path, overrides: list[str]) -> str:
    import omegaconf

    h = hashlib.sha256(repr((1, name, str(primary), overrides, omegaconf.__version__)).encode())
    for root in dict.fromkeys([primary, *conf_search_path()]):
        for p in sorted(root.rglob("*.yaml")) if root.is_dir() else []:
            h.update(str(p).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:40]


def _hydra_compose(name: str, primary: Path, extra: list[str], overrides: Sequence[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None, job_name="zoo"):
            return hydra_compose(config_name=name, overrides=extra + list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"conf {name!r} with overrides {list(overrides)}: {_hydra_message(e)}") from None


def _hydra_message(e: Exception) -> str:
    msg = str(e).strip()
    cause = e.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg += f" ({str(cause).strip().splitlines()[0]})"
    return msg.replace("\n", " ")


def load_config(name: str, overrides: Sequence[str] = ()) -> ModelSpec:
    """Compose and validate conf/NAME.yaml; errors name the key and conf/NAME.yaml."""
    cfg = compose(name, overrides)
    return validate(cfg, source=f"conf/{name}.yaml" + (f" (overrides {list(overrides)})" if overrides else ""))


def apply_overrides(cfg: DictConfig, overrides: Sequence[str], source: str) -> DictConfig:
    """Dotted `key=value` overrides on an already composed config (e.g. one imported from a
    checkpoint); unknown keys are errors, like Hydra's."""
    cfg = cfg.copy()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{source}: bad override {item!r}; expected key=value")
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            raise ConfigError(f"{source}: override {item!r}: key {key!r} is not in the config")
        OmegaConf.update(cfg, key, OmegaConf.create({"v": _parse_value(value)}).v if value else value,
                         merge=False)
    return cfg


_MISSING = object()


def _parse_value(text: str):
    """YAML scalar/flow syntax, as Hydra reads override values."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
