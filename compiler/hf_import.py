"""config.json -> zoo config, declaratively: conf/hf/*.yaml say which conf a model_type starts
from and which config.json key fills which zoo key. Nothing here names a family.

    fields:                      # zoo key: config.json key (dotted keys reach into sub-dicts)
      dim: hidden_size           #   required in config.json
      mixers.attn.head_dim: {key: head_dim, default: null}   # optional
    expect: {hidden_act: silu}   # values the zoo modules assume; anything else is an error
    rope: rope                   # zoo key that receives the rope spec
"""
from __future__ import annotations

from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from .config import compose, conf_dir
from .errors import ConfigError

_ABSENT = object()
QUANTIZATION_TABLE = "quantization.yaml"  # conf/hf/: quant_method -> rule stages


def import_specs() -> dict[str, dict]:
    """model_type -> its import spec (conf/hf/*.yaml)."""
    out = {}
    for path in sorted((conf_dir() / "hf").glob("*.yaml")):
        if path.name == QUANTIZATION_TABLE:  # the quantization table, not a model_type
            continue
        data = OmegaConf.to_container(OmegaConf.load(path))
        data["file"] = f"conf/hf/{path.name}"
        out[data["model_type"]] = data
    return out


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def rope_from_hf(config: dict, where: str) -> dict:
    """The zoo rope spec of a config.json: `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling`."""
    params = config.get("rope_parameters")
    if not params:
        scaling = config.get("rope_scaling") or {}
        params = {**scaling, "rope_theta": config.get("rope_theta", scaling.get("rope_theta", 10000.0))}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return {"kind": "default", "theta": theta}
    if rope_type == "linear":
        return {"kind": "linear", "theta": theta, "factor": float(params["factor"])}
    if rope_type == "llama3":
        return {"kind": "llama3", "theta": theta, "factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_position": int(params["original_max_position_embeddings"])}
    if rope_type == "yarn":
        original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        spec = {"kind": "yarn", "theta": theta, "factor": float(params["factor"]),
                "original_max_position": int(original),
                "beta_fast": float(params.get("beta_fast") or 32.0),
                "beta_slow": float(params.get("beta_slow") or 1.0),
                # absent mscale: transformers scales cos/sin by mscale(factor) alone, which the
                # zoo spec expresses as mscale 0 (see YarnRope.cos_sin_scale)
                "mscale": float(params.get("mscale") or 0.0),
                "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
                "truncate": bool(params.get("truncate", True))}
        if params.get("attention_factor") is not None:
            spec["attention_factor"] = float(params["attention_factor"])
        return spec
    raise ConfigError(f"{where}: unsupported rope type {rope_type!r} (supported: default, linear, llama3, yarn)")


def import_config(config: dict, where: str, overrides: Sequence[str] = ()) -> DictConfig:
    """A composed zoo config (DictConfig) reproducing config.json's architecture."""
    specs = import_specs()
    model_type = config.get("model_type")
    if model_type not in specs:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {sorted(specs)}")
    spec = specs[model_type]
    for key, expected in (spec.get("expect") or {}).items():
        value = _get(config, key)
        if value is not _ABSENT and value != expected:
            raise ConfigError(f"{where}: {key}={value!r} is not supported for model_type {model_type!r} "
                              f"(expected {expected!r}; see {spec['file']})")
    cfg = compose(spec["base"])
    for zoo_key, rule in spec["fields"].items():
        key, default = (rule["key"], rule.get("default", _ABSENT)) if isinstance(rule, dict) else (rule, _ABSENT)
        value = _get(config, key)
        if value is _ABSENT or value is None:
            if default is _ABSENT:
                raise ConfigError(f"{where}: config.json lacks required key {key!r} (for {zoo_key}; "
                                  f"see {spec['file']})")
            value = default
        OmegaConf.update(cfg, zoo_key, value, merge=False)
    if spec.get("rope"):
        OmegaConf.update(cfg, spec["rope"], rope_from_hf(config, where), merge=False)
    quant = config.get("quantization_config")
    stages = list(spec["rules"])
    if quant:
        stages = quantization_stages(quant, where) + stages
    OmegaConf.update(cfg, "checkpoint.rules", stages, merge=False)
    cfg.name = str(config.get("_name_or_path") or model_type).rstrip("/").split("/")[-1] or model_type
    if overrides:
        from .config import apply_overrides

        cfg = apply_overrides(cfg, overrides, where)
    return cfg


def quantization_stages(quant: dict, where: str) -> list[str]:
    """Rule stages that turn a quantized checkpoint's stored codes into values (conf/hf/quantization.yaml)."""
    path = conf_dir() / "hf" / QUANTIZATION_TABLE
    table = OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else {}
    method = quant.get("quant_method")
    if method not in table:
        raise ConfigError(f"{where}: quantization_config.quant_method={method!r} is not supported "
                          f"(supported: {sorted(table)})")
    entry = table[method]
    for key, expected in (entry.get("expect") or {}).items():
        if quant.get(key) != expected:
            raise ConfigError(f"{where}: quantization_config.{key}={quant.get(key)!r} is not supported "
                              f"(expected {expected!r})")
    return list(entry["rules"])
