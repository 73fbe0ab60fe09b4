"""Compose configs from conf/ with Hydra and validate them into a ModelSpec.

    load_config("llama3_8b", ["mixers.attn.n_kv_heads=4", "residual=mhc"]) -> ModelSpec

Hydra does the composition (defaults lists, groups, `${...}` interpolation, overrides); the
structured schemas in spec.py and each kind's Spec check every node.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .spec import ModelSpec, validate


def conf_dir() -> Path:
    """The conf/ tree shipped with the project (installed as the package zoo.conf)."""
    return Path(str(resources.files("zoo.conf")))


def rules_dir() -> Path:
    """Checkpoint rule files (conf/rules/NAME.yaml)."""
    return conf_dir() / "rules"


def user_conf_dir() -> Path:
    """Where `zoo import` writes configs: $ZOO_CONF_DIR, else ~/.config/zoo/conf. Its YAML files
    are usable as conf=NAME next to the shipped ones, with the shipped groups."""
    return Path(os.environ.get("ZOO_CONF_DIR") or Path.home() / ".config" / "zoo" / "conf")


def available_configs() -> list[str]:
    """Names usable as conf=NAME (top-level YAML files of conf/ and of the user conf dir)."""
    user = user_conf_dir()
    names = {p.stem for p in conf_dir().glob("*.yaml")}
    if user.is_dir():
        names |= {p.stem for p in user.glob("*.yaml")}
    return sorted(names)


def compose(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Hydra-compose conf/NAME.yaml with command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if name not in available_configs():
        raise ConfigError(f"unknown conf {name!r}; available: {', '.join(available_configs())}")
    primary, extra = conf_dir(), []
    if not (primary / f"{name}.yaml").exists():
        # an imported conf: its own directory first, the shipped groups on the search path
        primary, extra = user_conf_dir(), [f"hydra.searchpath=[file://{conf_dir()}]"]
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None, job_name="zoo"):
            cfg = hydra_compose(config_name=name, overrides=extra + list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"conf {name!r} with overrides {list(overrides)}: {_hydra_message(e)}") from None
    OmegaConf.set_struct(cfg, False)
    return cfg


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
