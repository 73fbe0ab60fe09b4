"""config.json -> zoo config, declaratively: conf/hf/*.yaml say which conf a model_type starts
from and which config.json key fills which zoo key. Nothing here names a family.

    fields:                      # zoo key: config.json key (dotted keys reach into sub-dicts)
      dim: hidden_size           #   required in config.json
      mixers.attn.head_dim: {key: head_dim, default: null}   # optional
      mixers.attn.q_lora_rank: {key: q_lora_rank, default: 1536, nullable: true}  # null kept as null
      mixers.attn.rotary_fraction: {key: [rope_parameters.partial_rotary_factor,
                                          partial_rotary_factor], default: 1.0}  # first present
      mixers.attn.window: "sliding_window ?? null"   # an expression (compiler/import_expr.py):
                                 #   keys, arithmetic, comparisons, and/or/not, x if c else y,
                                 #   `k ?? v`, default(k, v), has(k), min/max/...
    expect: {hidden_act: silu}   # values the zoo modules assume; anything else is an error
    require: {"num_attention_heads % num_key_value_heads == 0": why}   # conditions that must hold
    set: {mixers.attn.index_rope_interleaved: false}   # fixed for this model_type (config.json never says)
    cases:                       # a config.json value -> the zoo settings it implies (after fields)
      topk_method:
        default: greedy          #   the config class's value when config.json leaves the key out
        values:                  #   any other value is an error naming the accepted ones
          greedy: {ffns.moe.n_group: 1, ffns.moe.topk_group: 1}
          group_limited_greedy: {ffns.moe.group_score: max}
    rope: rope                   # zoo key that receives the rope spec
    rope: {to: rope, aliases: {su: longrope}, original_max_position: "original_max_position_embeddings ?? 4096"}
    # per layer kind (Gemma 3): rope_parameters holds one dict per layer type; `params` names the
    # one a slot reads; older configs give the slot's theta in its own key (`legacy_theta`)
    rope: {to: rope, params: full_attention, theta_default: 1.0e6}
    ropes: {local: {params: sliding_attention, legacy_theta: rope_local_base_freq, theta_default: 1.0e4}}
    layout_from:                 # per-layer kinds -> `layout` (compressed into a pattern or runs)
      key: layer_types           #   a list with one kind name per layer, or else
      every_nth: {key: full_attention_interval, kind: full_attention, other: linear_attention}
      kinds:                     #   kind name -> zoo layer kind
        linear_attention: {mixer: linear, ffn: moe}
        full_attention: {mixer: attn, ffn: moe}
    # or a list of such rules, one per schedule, each giving part of the kind (merged per layer):
    #   - {key: [layer_types, compress_ratios], trim: true, kinds: {...: {mixer: swa}},
    #      pending: {compressed_sparse_attention: "why not yet"}}    # -> "not yet supported"
    #   - {key: mlp_layer_types, first_n: {key: num_hash_layers, kind: hash_moe, other: moe},
    #      kinds: {hash_moe: {ffn: moe_hash}, moe: {ffn: moe}}}
    #   - {key: layer_types, absent: full_attention, kinds: {...}}  # no such key: every layer that kind
    # or `listed: {key: linear_attn_config.full_attn_layers, base: 1, kind: full_attention,
    #              other: linear_attention}`: `kind` on the layers a list of indices names
    # or `range: {layers: "moe_layer_start_index..moe_layer_end_index", kind: moe, other: dense}`
    #   (inclusive, each end an expression; a list of ranges for several)
    # or `when: {test: "(layer + 1) % moe_layer_interval == 0", kind: moe, other: dense}`
    #   (a test over `layer`, the 0-based index); a rule may have only a fill, no `key`
    irrelevant:                  # config.json keys that do not change inference, with the reason
      initializer_range: training-time init
    # Every config.json key must be covered: by fields, expect, require, cases, the rope / layout
    # readers, irrelevant, or conf/hf/common.yaml (keys of every PretrainedConfig, and key
    # patterns such as `*_token_id`, listed there once for every family); keys with a leading
    # underscore are transformers' metadata; any other key is an error. docs/adding-a-family.md
    # documents each form with an example.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from .config import compose, conf_dir
from .errors import ConfigError
from .import_expr import ABSENT as _ABSENT, Expr, lookup as _get, parse, parse_range

# conf/hf/ files that are not import maps: the quantization table and the keys every config has
QUANTIZATION_TABLE = "quantization"  # quant_method -> rule stages
COMMON_KEYS = "common"  # config.json keys of every PretrainedConfig, covered for every family
LACKS_TABLE = "_lacks"  # model_type -> the concept zoo lacks, for types with no import map
IMPORT_MAP_KEYS = {"model_type", "base", "rules", "fields", "expect", "require", "set", "rope", "ropes", "verify",
                   "layout_from", "irrelevant", "cases"}
# a `layout_from` rule: `key` (config.json's per-layer list) and at most one fill, used when
# config.json lacks the list (a rule without `key` needs its fill)
LAYOUT_FILLS = ("absent", "listed", "every_nth", "first_n", "range", "when")
LAYOUT_RULE_KEYS = {"key", "kinds", "pending", "trim", "empty_is_absent", *LAYOUT_FILLS}
ROPE_RULE_KEYS = {"to", "params", "theta_default", "legacy_theta", "aliases", "original_max_position"}
# config.json keys the rope reader consumes (rope_from_hf), and the keys it reads inside
# rope_parameters / rope_scaling for each rope type
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
ROPE_PARAM_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "proportional": {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"},
    "longrope": {"rope_type", "type", "rope_theta", "short_factor", "long_factor", "factor", "attention_factor",
                 "original_max_position_embeddings"},
}
ADDING_A_FAMILY = "docs/adding-a-family.md"


def import_specs() -> dict[str, dict]:
    """model_type -> its import map (conf/hf/*.yaml, then the user conf dir's hf/*.yaml), with
    `file` naming where it came from. Two files for one model_type are an error."""
    from .config import conf_files, conf_label

    out: dict[str, dict] = {}
    for name, path in conf_files("hf").items():
        if name in (QUANTIZATION_TABLE, COMMON_KEYS, LACKS_TABLE):
            continue
        data = OmegaConf.to_container(OmegaConf.load(path)) or {}
        label = conf_label(path)
        unknown = sorted(set(data) - IMPORT_MAP_KEYS)
        if unknown:
            raise ConfigError(f"{label}: unknown key(s) {unknown}; an import map has {sorted(IMPORT_MAP_KEYS)} "
                              f"(see {ADDING_A_FAMILY})")
        if "model_type" not in data:
            raise ConfigError(f"{label}: an import map needs model_type (see {ADDING_A_FAMILY})")
        if data["model_type"] in out:
            raise ConfigError(f"{label}: model_type {data['model_type']!r} is already imported by "
                              f"{out[data['model_type']]['file']}")
        data["file"] = label
        check_import_map(data, label)
        out[data["model_type"]] = data
    return out


def lacks() -> dict[str, str]:
    """model_type -> the concept zoo lacks for it (conf/hf/_lacks.yaml): why a transformers type
    has no import map, for refusals and docs/coverage.md."""
    from .config import find_conf

    data = OmegaConf.to_container(OmegaConf.load(find_conf("hf", LACKS_TABLE))) or {}
    return dict(data.get("lacks") or {})


def check_import_map(spec: dict, file: str) -> None:
    """Parse every expression of an import map and check its layout rules, so that a mistake in
    the map is reported (naming the file and the entry) before any config.json is read."""
    for zoo_key, rule in (spec.get("fields") or {}).items():
        if isinstance(rule, dict):
            unknown = sorted(set(rule) - {"key", "default", "nullable"})
            if "key" not in rule or unknown:
                raise ConfigError(f"{file}: fields.{zoo_key}: a mapping entry has `key` (a config.json key or a "
                                  f"list of them), optional `default` and `nullable`; got {sorted(rule)} "
                                  f"(see {ADDING_A_FAMILY})")
            for key in _keys_of(rule["key"]):
                _key_expr(key, file, f"fields.{zoo_key}.key")
        elif isinstance(rule, list):
            for key in rule:
                _key_expr(key, file, f"fields.{zoo_key}")
        else:
            parse(rule, file, f"fields.{zoo_key}")
    for cond in spec.get("require") or {}:
        parse(cond, file, f"require[{cond!r}]")
    for key in spec.get("cases") or {}:
        parse(key, file, f"cases.{key}")
    ropes = ([spec["rope"]] if spec.get("rope") else []) + list((spec.get("ropes") or {}).values())
    for rope in ropes:
        if isinstance(rope, dict):
            unknown = sorted(set(rope) - ROPE_RULE_KEYS)
            if unknown:
                raise ConfigError(f"{file}: rope rule has unknown key(s) {unknown}; it has {sorted(ROPE_RULE_KEYS)}")
            if rope.get("original_max_position") is not None:
                parse(rope["original_max_position"], file, "rope.original_max_position")
    for i, rule in enumerate(_layout_rules(spec)):
        _check_layout_rule(rule, file, f"layout_from[{i}]" if isinstance(spec["layout_from"], list) else "layout_from")


def _key_expr(key: Any, file: str, entry: str) -> Expr:
    """A config.json key (dotted) written where only a key is allowed."""
    expr = parse(key, file, entry)
    if expr.bare_key is None:
        raise ConfigError(f"{file}: {entry} = {key!r}: expected a config.json key here (an expression is "
                          f"written as the field's whole value: `zoo.key: \"a / b\"`)")
    return expr


def _layout_rules(spec: dict) -> list:
    rules = spec.get("layout_from") or []
    return rules if isinstance(rules, list) else [rules]


def _check_layout_rule(rule: Any, file: str, entry: str) -> None:
    if not isinstance(rule, dict):
        raise ConfigError(f"{file}: {entry}: expected a mapping (key, kinds, a fill), got {rule!r}")
    unknown = sorted(set(rule) - LAYOUT_RULE_KEYS)
    if unknown:
        raise ConfigError(f"{file}: {entry}: unknown key(s) {unknown}; a layout rule has "
                          f"{sorted(LAYOUT_RULE_KEYS)} (see {ADDING_A_FAMILY})")
    fills = [f for f in LAYOUT_FILLS if f in rule]
    if "key" not in rule and not fills:
        raise ConfigError(f"{file}: {entry} has no `key:` (the config.json list naming each layer's kind) and "
                          f"no fill ({', '.join(LAYOUT_FILLS)}) to compute the kinds from; give one "
                          f"(see {ADDING_A_FAMILY})")
    if len(fills) > 1:
        raise ConfigError(f"{file}: {entry} has several fills {fills}; give one (several schedules are a list "
                          f"of rules, merged per layer)")
    if not isinstance(rule.get("kinds"), dict) or not rule["kinds"]:
        raise ConfigError(f"{file}: {entry} needs `kinds:` (kind name -> {{mixer, ffn}} or part of it)")
    if "key" in rule:
        for key in _keys_of(rule["key"]):
            _key_expr(key, file, f"{entry}.key")
    for fill in fills:
        value = rule[fill]
        if fill == "absent":
            continue
        need = {"listed": {"key", "kind", "other"}, "every_nth": {"key", "kind", "other"},
                "first_n": {"key", "kind", "other"}, "range": {"layers", "kind", "other"},
                "when": {"test", "kind", "other"}}[fill]
        allowed = need | {"listed": {"base"}, "every_nth": {"default"}, "first_n": {"default"}}.get(fill, set())
        if not isinstance(value, dict) or need - set(value) or set(value) - allowed:
            raise ConfigError(f"{file}: {entry}.{fill}: expected a mapping with {sorted(need)}"
                              f"{' (optional ' + ', '.join(sorted(allowed - need)) + ')' if allowed - need else ''}, "
                              f"got {value!r} (see {ADDING_A_FAMILY})")
        if fill == "listed":
            _key_expr(value["key"], file, f"{entry}.listed.key")
        elif fill in ("every_nth", "first_n"):
            parse(value["key"], file, f"{entry}.{fill}.key")
        elif fill == "range":
            for layers in _keys_of(value["layers"]):
                parse_range(layers, file, f"{entry}.range.layers")
        else:
            parse(value["test"], file, f"{entry}.when.test", local=("layer",))


def _layout_exprs(rule: dict, file: str, entry: str) -> list[Expr]:
    """The expressions of one layout rule (for key coverage)."""
    out = [parse(k, file, f"{entry}.key") for k in _keys_of(rule.get("key", []))]
    for fill in ("listed", "every_nth", "first_n"):
        if isinstance(rule.get(fill), dict):
            out.append(parse(rule[fill]["key"], file, f"{entry}.{fill}.key"))
    if isinstance(rule.get("range"), dict):
        out += [e for layers in _keys_of(rule["range"]["layers"])
                for e in parse_range(layers, file, f"{entry}.range.layers")]
    if isinstance(rule.get("when"), dict):
        out.append(parse(rule["when"]["test"], file, f"{entry}.when.test", local=("layer",)))
    return out


def _common_table() -> dict:
    from .config import find_conf

    path = find_conf("hf", COMMON_KEYS)
    return (OmegaConf.to_container(OmegaConf.load(path)) or {}) if path else {}


def common_keys() -> dict[str, str]:
    """config.json keys every PretrainedConfig has (conf/hf/common.yaml): key -> why it needs no import."""
    return dict(_common_table().get("irrelevant") or {})


def common_patterns() -> dict[str, str]:
    """conf/hf/common.yaml's `irrelevant_patterns`: shell-style key patterns (`*_token_id`) of
    config.json keys that never change the computation, for every family -> why."""
    return dict(_common_table().get("irrelevant_patterns") or {})


def key_coverage(key: str, covered: dict[str, str]) -> str | None:
    """How a top-level config.json key is covered (`covered`: covered_keys of an import map), or
    None: an entry of the map or of common.yaml, a common pattern, or a leading underscore
    (transformers' private metadata: _name_or_path, the _model_name_or_path it writes after
    loading a GGUF), never read as architecture."""
    if key in covered:
        return covered[key]
    if key.startswith("_"):
        return "transformers' private metadata"
    pattern = next((p for p in common_patterns() if fnmatch.fnmatchcase(key, p)), None)
    return f"common pattern {pattern!r}" if pattern else None


def _keys_of(keys: Any) -> list[str]:
    return keys if isinstance(keys, list) else [keys]


def covered_keys(spec: dict) -> dict[str, str]:
    """Top-level config.json key -> how the import map `spec` covers it: `fields`, `expect`, the
    rope and layout readers, `irrelevant` (with its reason), or conf/hf/common.yaml."""
    out = {k: f"common ({why})" for k, why in common_keys().items()}
    out.update({"model_type": "import map choice", "quantization_config": "quantization stages"})
    for k, why in (spec.get("irrelevant") or {}).items():
        out[k] = f"irrelevant ({why})"
    if spec.get("rope"):
        out.update({k: "rope" for k in ROPE_KEYS})
    file = spec.get("file", "the import map")
    for rope in [spec["rope"]] + list((spec.get("ropes") or {}).values()) if spec.get("rope") else []:
        if isinstance(rope, dict) and rope.get("legacy_theta"):
            out[rope["legacy_theta"]] = "rope (an older config's theta for this slot)"
        if isinstance(rope, dict) and rope.get("original_max_position") is not None:
            for k in parse(rope["original_max_position"], file, "rope.original_max_position").roots:
                out[k] = "rope (original_max_position)"
    for i, rule in enumerate(_layout_rules(spec)):
        for expr in _layout_exprs(rule, file, f"layout_from[{i}]"):
            out.update({k: "layout" for k in expr.roots})
    for k in spec.get("expect") or {}:
        out[k.split(".")[0]] = "expect"
    for cond in spec.get("require") or {}:
        out.update({k: "require" for k in parse(cond, file, "require").roots})
    for k in spec.get("cases") or {}:
        out.update({r: "cases" for r in parse(k, file, f"cases.{k}").roots})
    for zoo_key, rule in (spec.get("fields") or {}).items():
        sources = _keys_of(rule["key"]) if isinstance(rule, dict) else rule if isinstance(rule, list) else [rule]
        for source in sources:
            out.update({k: f"fields ({zoo_key})" for k in parse(source, file, f"fields.{zoo_key}").roots})
    return out


def check_keys(config: dict, spec: dict, where: str) -> None:
    """Every config.json key must be covered by the import map (covered_keys); an uncovered one
    may change the model in a way the zoo would not reproduce, so it is an error."""
    covered = covered_keys(spec)
    for key in config:
        if key_coverage(key, covered) is None:
            value = repr(config[key])
            value = value if len(value) <= 80 else value[:77] + "..."
            raise ConfigError(f"{where}: config.json key {key!r} = {value} is not covered by {spec['file']} for "
                              f"model_type {config.get('model_type')!r}: map it (fields), require a value (expect), "
                              f"or list it under irrelevant: with the reason it does not change inference "
                              f"(see {ADDING_A_FAMILY})")


def _get_first(config: dict, keys: Any) -> Any:
    """The value of the first of `keys` (one dotted key or a list of them) that config.json has."""
    for key in keys if isinstance(keys, list) else [keys]:
        value = _get(config, key)
        if value is not _ABSENT and value is not None:
            return value
    return _ABSENT


def layout_from_hf(config: dict, rule: dict | list, n_layers: int, where: str, file: str) -> list[dict]:
    """The zoo `layout` of a config.json that names each layer's kind (`rule['key']`, a list; or
    the first present of several keys), or else fills the kinds by one rule (docs/adding-a-family.md):
    `absent` (every layer one kind), `listed` (the layers a list of indices names), `every_nth`
    (every n-th layer, 1-based), `first_n` (the first n layers), `range` (inclusive `start..end`
    layer ranges), `when` (a test over `layer`, the 0-based index), with `other` elsewhere.
    `rule['kinds']` maps kind names to zoo layer kinds {mixer, ffn}; `rule['pending']` maps the
    kind names the zoo does not build yet to a note (they raise "not yet supported"); with
    `trim: true` a longer list is cut to n_layers (entries for the MTP layers). `rule` may be a
    list of such rules, each giving part of a layer's kind ({mixer} from the attention schedule,
    {ffn} from the FFN schedule): the parts are merged per layer. The result is compressed."""
    rules = rule if isinstance(rule, list) else [rule]
    layers: list[dict] = [{} for _ in range(n_layers)]
    for i, r in enumerate(rules):
        entry = f"layout_from[{i}]" if isinstance(rule, list) else "layout_from"
        _check_layout_rule(r, file, entry)
        for merged, part in zip(layers, _layer_kinds(config, r, n_layers, where, file, entry)):
            merged.update(part)
    for i, kind in enumerate(layers):
        if set(kind) != {"mixer", "ffn"}:
            raise ConfigError(f"{where}: layer {i} gets {kind} from layout_from in {file}; expected both a "
                              f"mixer and an ffn")
    return compress_layout(layers)


def _layer_kinds(config: dict, rule: dict, n_layers: int, where: str, file: str, entry: str) -> list[dict]:
    """One rule of `layout_from`: the zoo kind (part) of every layer."""
    keys = _keys_of(rule.get("key", []))
    name = next((k for k in keys if _get(config, k) not in (_ABSENT, None)), " or ".join(keys))
    types = _get_first(config, keys) if keys else _ABSENT
    if types == [] and rule.get("empty_is_absent"):  # a config class that reads [] as "not given"
        types = _ABSENT
    fill = next((f for f in LAYOUT_FILLS if f in rule), None)
    if types is _ABSENT and fill is None:
        raise ConfigError(f"{where}: config.json lacks {' or '.join(map(repr, keys))} (for {entry}; see {file})")
    if types is _ABSENT:
        name = f"{entry}.{fill}"
        types = _fill_kinds(config, fill, rule[fill], keys, n_layers, where, file, f"{entry}.{fill}")
    if isinstance(types, list) and rule.get("trim") and len(types) > n_layers:
        types = types[:n_layers]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{where}: {name} has {len(types) if isinstance(types, list) else types!r} "
                          f"entries but the model has {n_layers} layers (see {file})")
    pending = rule.get("pending") or {}
    later = {t: [i for i, x in enumerate(types) if x == t] for t in sorted({t for t in types if t in pending}, key=str)}
    if later:
        listed = "; ".join(f"{t!r} at layers {at} ({pending[t]})" for t, at in later.items())
        raise ConfigError(f"{where}: {name} has layer kind(s) not yet supported by the zoo: {listed}; "
                          f"supported: {sorted(rule['kinds'], key=str)} (see {file})")
    unknown = sorted({t for t in types if t not in rule["kinds"]}, key=str)
    if unknown:
        raise ConfigError(f"{where}: {name} has unsupported layer kind(s) {unknown}; supported: "
                          f"{sorted(rule['kinds'], key=str)} (see {file})")
    return [dict(rule["kinds"][t]) for t in types]


def _fill_kinds(config: dict, fill: str, spec: Any, keys: list[str], n_layers: int, where: str, file: str,
                entry: str) -> list:
    """Per-layer kind names computed by one fill (config.json lacks the rule's list `keys`)."""
    if fill == "absent":  # a config.json without the list: every layer that kind
        return [spec] * n_layers
    kind, other = (spec["kind"], spec["other"])
    if fill == "listed":
        types = _listed_kinds(config, spec, n_layers, where, file)
        if types is _ABSENT:
            raise ConfigError(f"{where}: config.json lacks {' or '.join(map(repr, keys + [spec['key']]))} "
                              f"(for layout; see {file})")
        return types
    if fill in ("every_nth", "first_n"):
        expr = parse(spec["key"], file, f"{entry}.key")
        if expr.bare_key is not None:  # a key: absent or null takes `default`
            n = _get(config, expr.bare_key)
            if n is _ABSENT or n is None:
                n = spec.get("default", _ABSENT)
            if n is _ABSENT:
                raise ConfigError(f"{where}: config.json lacks {' or '.join(map(repr, keys + [expr.bare_key]))} "
                                  f"(for layout; see {file})")
        else:
            n = expr.evaluate(config, where)
        if fill == "every_nth":
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ConfigError(f"{where}: {spec['key']}={n!r}: expected a positive integer (for {entry} in {file})")
            return [kind if (i + 1) % n == 0 else other for i in range(n_layers)]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"{where}: {spec['key']}={n!r}: expected an integer >= 0 (for {entry} in {file})")
        return [kind if i < n else other for i in range(n_layers)]
    if fill == "range":
        chosen: set[int] = set()
        for layers in _keys_of(spec["layers"]):
            ends = [e.evaluate(config, where) for e in parse_range(layers, file, f"{entry}.layers")]
            start, end = ends
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in ends) \
                    or not (0 <= start <= end + 1 <= n_layers):
                got = ", ".join(e.describe(config) for e in parse_range(layers, file, entry))
                raise ConfigError(f"{where}: {entry}.layers = {layers!r} in {file} gives {start!r}..{end!r} "
                                  f"(with {got}); expected integers 0 <= start <= end + 1 <= {n_layers} "
                                  f"(inclusive layer indices of a {n_layers}-layer model; end = start - 1 is empty)")
            chosen.update(range(start, end + 1))
        return [kind if i in chosen else other for i in range(n_layers)]
    test = parse(spec["test"], file, f"{entry}.test", local=("layer",))
    types = []
    for i in range(n_layers):
        hit = test.evaluate(config, where, {"layer": i})
        if not isinstance(hit, bool):
            raise ConfigError(f"{where}: {entry}.test = {spec['test']!r} in {file} gives {hit!r} for layer {i} "
                              f"(with {test.describe(config, {'layer': i})}); expected true or false")
        types.append(kind if hit else other)
    return types


def _listed_kinds(config: dict, listed: dict, n_layers: int, where: str, file: str) -> Any:
    """Per-layer kind names from a list of layer indices (counted from `base`) that get
    `kind`, every other layer `other`; _ABSENT when config.json lacks the list."""
    indices = _get(config, listed["key"])
    if indices is _ABSENT or indices is None:
        return _ABSENT
    base = listed.get("base", 0)
    if not isinstance(indices, list) or not all(isinstance(i, int) and base <= i < n_layers + base for i in indices):
        raise ConfigError(f"{where}: {listed['key']}={indices!r}: expected a list of layer indices "
                          f"{base}..{n_layers - 1 + base} (see {file})")
    chosen = {i - base for i in indices}
    return [listed["kind"] if i in chosen else listed["other"] for i in range(n_layers)]


def compress_layout(kinds: list[dict]) -> list[dict]:
    """Per-layer {mixer, ffn} -> layout runs: one kind for all layers, else the shortest repeating
    pattern (repeat omitted: it fills n_layers), else runs of identical kinds."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))
    if period == 1:
        return [dict(kinds[0])]
    if period < n:
        return [{"pattern": kinds[:period]}]
    runs: list[dict] = []
    for kind in kinds:
        if runs and {k: runs[-1][k] for k in kind} == kind:
            runs[-1]["repeat"] += 1
        else:
            runs.append({**kind, "repeat": 1})
    return runs


def _present(d: dict, *keys: str) -> Any:
    """The value of the first of `keys` that `d` has and is not None (0 and False count), else _ABSENT."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return _ABSENT


def _field_subkeys(spec: dict) -> set[str]:
    """Keys inside rope_parameters / rope_scaling that the import map's `fields` read, or that it
    lists as irrelevant (`irrelevant: {rope_parameters.mrope_section: why}`)."""
    file = spec.get("file", "the import map")
    keys = [k for zoo_key, rule in (spec.get("fields") or {}).items()
            for source in (_keys_of(rule["key"]) if isinstance(rule, dict) else _keys_of(rule))
            for k in parse(source, file, f"fields.{zoo_key}").keys]
    keys += list(spec.get("irrelevant") or {})
    return {k.split(".", 1)[1] for k in keys if k.split(".")[0] in ("rope_parameters", "rope_scaling") and "." in k}


def rope_from_hf(config: dict, where: str, theta_default: Any = _ABSENT, file: str = "the import map",
                 also_read: set[str] = frozenset(), rule: dict | None = None) -> dict:
    """The zoo rope spec of a config.json: `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling`. A config.json without rope_theta takes `theta_default` (the
    import map's `rope.theta_default`, the family's transformers default) or is an error.
    Optional YaRN keys config.json leaves out keep the rope kind's own defaults (YarnRope.Spec).
    The import map's rope `rule` may rename rope types (`aliases: {su: longrope}`: the names a
    family's config class accepts for one schedule) and give an expression for the pre-training
    length (`original_max_position`) where the config class reads it outside rope_parameters."""
    rule = rule or {}
    params = config.get("rope_parameters")
    if params is None:
        scaling = config.get("rope_scaling")
        params = dict(scaling) if scaling is not None else {}
    rope_type = _present(params, "rope_type", "type")
    rope_type = "default" if rope_type is _ABSENT else rope_type
    rope_type = (rule.get("aliases") or {}).get(rope_type, rope_type)
    if rope_type in ROPE_PARAM_KEYS:  # a key the rope kind would not read changes the model silently
        extra = sorted(set(params) - ROPE_PARAM_KEYS[rope_type] - set(also_read))
        if extra:
            which = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
            raise ConfigError(f"{where}: config.json {which}.{extra[0]} = {params[extra[0]]!r} is not read by the "
                              f"{rope_type!r} rope (it reads {sorted(ROPE_PARAM_KEYS[rope_type])}; see {file})")
    theta = _present(params, "rope_theta")
    if theta is _ABSENT:
        theta = _present(config, "rope_theta")
    if theta is _ABSENT:
        theta = theta_default
    if theta is _ABSENT:
        raise ConfigError(f"{where}: config.json has no rope_theta (in rope_parameters or at the top level) and "
                          f"{file} gives no rope.theta_default")
    theta = float(theta)
    which = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"

    def need(key: str, cast):
        """A number the rope type requires: absent or not a number is an error naming it."""
        value = params.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: config.json {which}.{key} = {value!r}: the {rope_type!r} rope needs a "
                              f"number there (see {file})")
        return cast(value)

    if rope_type == "default":
        return {"kind": "default", "theta": theta}
    if rope_type == "linear":
        return {"kind": "linear", "theta": theta, "factor": need("factor", float)}
    if rope_type == "proportional":  # Gemma 4: its partial_rotary_factor is the rope's own (rope.py)
        out = {"kind": "proportional", "theta": theta}
        for hf_key, zoo_key in (("partial_rotary_factor", "fraction"), ("factor", "factor")):
            if (value := _present(params, hf_key)) is not _ABSENT:
                out[zoo_key] = float(value)
        return out
    if rope_type == "llama3":
        return {"kind": "llama3", "theta": theta, "factor": need("factor", float),
                "low_freq_factor": need("low_freq_factor", float),
                "high_freq_factor": need("high_freq_factor", float),
                "original_max_position": need("original_max_position_embeddings", int)}
    if rope_type == "yarn":
        original = _present(params, "original_max_position_embeddings")
        if original is _ABSENT:
            original = _present(config, "max_position_embeddings")
        if original is _ABSENT:
            raise ConfigError(f"{where}: yarn rope without original_max_position_embeddings or "
                              f"max_position_embeddings in config.json (see {file})")
        spec = {"kind": "yarn", "theta": theta, "factor": need("factor", float),
                "original_max_position": int(original),
                # absent mscale: transformers scales cos/sin by mscale(factor) alone, which the
                # zoo spec expresses as mscale 0 (see YarnRope.cos_sin_scale)
                "mscale": 0.0, "mscale_all_dim": 0.0}
        for hf_key, zoo_key, cast in (("beta_fast", "beta_fast", float), ("beta_slow", "beta_slow", float),
                                      ("mscale", "mscale", float), ("mscale_all_dim", "mscale_all_dim", float),
                                      ("truncate", "truncate", bool), ("attention_factor", "attention_factor", float)):
            if (value := _present(params, hf_key)) is not _ABSENT:
                spec[zoo_key] = cast(value)
        return spec
    if rope_type == "longrope":
        return _longrope_from_hf(config, params, theta, rule, where, file)
    raise ConfigError(f"{where}: unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_PARAM_KEYS)}; "
                      f"see {file})")


def _longrope_from_hf(config: dict, params: dict, theta: float, rule: dict, where: str, file: str) -> dict:
    """LongRoPE as transformers reads it (modeling_rope_utils._compute_longrope_parameters):
    the pre-training length from the rule's `original_max_position` expression when the map
    gives one (Phi-3's config class reads its top-level key over rope_parameters'), else from
    rope_parameters, else max_position_embeddings; `factor` absent means max_position_embeddings
    / that length; `attention_factor` absent is derived from factor by the rope kind."""
    which = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    if rule.get("original_max_position") is not None:
        original = parse(rule["original_max_position"], file, "rope.original_max_position").evaluate(config, where)
    else:
        original = _present(params, "original_max_position_embeddings")
        original = _present(config, "max_position_embeddings") if original is _ABSENT else original
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ConfigError(f"{where}: longrope needs the pre-training length as a positive integer "
                          f"({which}.original_max_position_embeddings or max_position_embeddings), got "
                          f"{original!r} (see {file})")
    # long: null (pick by the engine's max_seq), present so that `rope.long=true` can override it
    spec: dict = {"kind": "longrope", "theta": theta, "original_max_position": original, "long": None}
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or not factors or \
                not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
            raise ConfigError(f"{where}: config.json {which}.{key} = {factors!r}: longrope needs a list of "
                              f"numbers, one per rotated channel pair (see {file})")
        spec[key] = [float(f) for f in factors]
    factor = _present(params, "factor")
    if factor is _ABSENT:
        max_position = _present(config, "max_position_embeddings")
        if max_position is _ABSENT:
            raise ConfigError(f"{where}: longrope without {which}.factor or max_position_embeddings (see {file})")
        factor = max_position / original
    spec["factor"] = float(factor)
    if (attention := _present(params, "attention_factor")) is not _ABSENT:
        spec["attention_factor"] = float(attention)
    return spec


def cases_from_hf(config: dict, cases: dict, where: str, file: str) -> dict:
    """The zoo settings the import map's `cases` give for config.json's values: {zoo key: value}.
    A case is a key or an expression (`"sliding_window is not None"`); its value selects one
    entry of `values` (`true:` / `false:` keys match booleans, never 1 / 0); an absent key takes
    `default`; a value with no entry is an error (the modules would build a different model)."""
    out: dict = {}
    for key, case in cases.items():
        expr = parse(key, file, f"cases.{key}")
        if expr.bare_key is not None:
            value = _get(config, expr.bare_key)
            if value is _ABSENT:
                value = case.get("default", _ABSENT)
                if value is _ABSENT:
                    raise ConfigError(f"{where}: config.json lacks required key {key!r} (see {file})")
        else:
            value = expr.evaluate(config, where)
        if not isinstance(case.get("values"), dict):
            raise ConfigError(f"{file}: cases.{key}: expected `values:` (config.json value -> zoo settings)")
        # true is not 1 here (Python's dicts would match them)
        match = next((k for k in case["values"] if k == value and isinstance(k, bool) == isinstance(value, bool)),
                     _ABSENT)
        if match is _ABSENT:
            raise ConfigError(f"{where}: {key}={value!r} is not supported (expected one of "
                              f"{sorted(case['values'], key=repr)}; see {file})")
        out.update(case["values"][match])
    return out


def require_from_hf(config: dict, require: dict, where: str, file: str) -> None:
    """`require: {condition: why}`: each condition over config.json must hold; one that does not
    is an error naming it, the values it read and the reason."""
    for cond, why in require.items():
        expr = parse(cond, file, f"require[{cond!r}]")
        if expr.evaluate(config, where) is not True:
            raise ConfigError(f"{where}: {cond} does not hold for this config.json ({expr.describe(config)}): "
                              f"{why} (see {file})")


def field_from_hf(config: dict, zoo_key: str, rule: Any, where: str, file: str) -> Any:
    """The value of one `fields` entry: an expression (a bare key is required and must not be
    null), a list of keys (the first present and non-null), or {key, default, nullable}."""
    if not isinstance(rule, (dict, list)):
        expr = parse(rule, file, f"fields.{zoo_key}")
        if expr.bare_key is None:
            return expr.evaluate(config, where)
        rule = expr.bare_key
    key, default = (rule["key"], rule.get("default", _ABSENT)) if isinstance(rule, dict) else (rule, _ABSENT)
    value = _get_first(config, key)
    if value is not _ABSENT:
        return value
    nulls = [k for k in _keys_of(key) if _get(config, k) is None]
    if isinstance(rule, dict) and rule.get("nullable") and nulls:
        return None  # nullable: an explicit null means null; the default is for an absent key
    if default is not _ABSENT:
        return default
    if nulls:
        raise ConfigError(f"{where}: config.json {nulls[0]} = null, but {file} needs a value for {zoo_key} "
                          f"(`{nulls[0]} ?? VALUE` states the value null and an absent key mean; "
                          f"`default({nulls[0]}, null)` keeps null)")
    raise ConfigError(f"{where}: config.json lacks required key {key!r} (for {zoo_key}; see {file})")


def _rope_view(config: dict, rule: dict, where: str, file: str) -> dict:
    """The part of config.json one rope slot reads: config.json itself, or (rule `params: T`) a
    view whose rope_parameters are rope_parameters[T] (transformers 5 nests them per layer type);
    an older config without that nesting gives `legacy_theta`'s value (no scaling) when the rule
    names one, else its own rope_theta / rope_scaling."""
    sub = rule.get("params")
    if sub is None:
        return config
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(sub), dict):
        return {**config, "rope_parameters": params[sub]}
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: rope_parameters has no entry {sub!r} (has {sorted(params)}; see {file})")
    if rule.get("legacy_theta"):
        view = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        if config.get(rule["legacy_theta"]) is not None:
            view["rope_theta"] = config[rule["legacy_theta"]]
        return view
    return config


def _json_floats(value):
    """transformers writes non-finite floats into config.json as {"__float__": "Infinity"} (Mamba2's
    time_step_limit): those back to floats, everywhere in the config."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: _json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def import_config(config: dict, where: str, overrides: Sequence[str] = ()) -> DictConfig:
    """A composed zoo config (DictConfig) reproducing config.json's architecture."""
    config = _json_floats(config)
    specs = import_specs()
    model_type = config.get("model_type")
    if model_type not in specs:
        missing = lacks().get(model_type)
        why = f" (zoo lacks: {missing}, conf/hf/{LACKS_TABLE}.yaml)" if missing else ""
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported{why}; supported: {', '.join(sorted(specs))}. "
                          f"A new family is a preset, an import map and rules, in the user conf dir "
                          f"if you like: see {ADDING_A_FAMILY}")
    spec = specs[model_type]
    check_keys(config, spec, where)
    for key, expected in (spec.get("expect") or {}).items():
        value = _get(config, key)
        if value is not _ABSENT and value != expected:
            raise ConfigError(f"{where}: {key}={value!r} is not supported for model_type {model_type!r} "
                              f"(expected {expected!r}; see {spec['file']})")
    require_from_hf(config, spec.get("require") or {}, where, spec["file"])
    cfg = compose(spec["base"])
    for zoo_key, rule in spec["fields"].items():
        OmegaConf.update(cfg, zoo_key, field_from_hf(config, zoo_key, rule, where, spec["file"]), merge=False)
    for zoo_key, value in (spec.get("set") or {}).items():
        OmegaConf.update(cfg, zoo_key, value, merge=False)
    for zoo_key, value in cases_from_hf(config, spec.get("cases") or {}, where, spec["file"]).items():
        OmegaConf.update(cfg, zoo_key, value, merge=False)
    if spec.get("rope"):
        # `rope: KEY` or `rope: {to: KEY, theta_default: X}` (the value a config.json without
        # rope_theta means, as the family's transformers config class defaults it)
        rope = spec["rope"] if isinstance(spec["rope"], dict) else {"to": spec["rope"]}
        view = _rope_view(config, rope, where, spec["file"])
        OmegaConf.update(cfg, rope["to"], rope_from_hf(view, where, rope.get("theta_default", _ABSENT),
                                                       spec["file"], _field_subkeys(spec), rope), merge=False)
    for slot, rope in (spec.get("ropes") or {}).items():  # extra rope slots (per layer kind)
        view = _rope_view(config, rope, where, spec["file"])
        OmegaConf.update(cfg, f"ropes.{slot}", rope_from_hf(view, where, rope.get("theta_default", _ABSENT),
                                                            spec["file"], _field_subkeys(spec), rope), merge=False)
    if spec.get("layout_from"):
        layout = layout_from_hf(config, spec["layout_from"], int(cfg.n_layers), where, spec["file"])
        OmegaConf.update(cfg, "layout", layout, merge=False)
    quant = config.get("quantization_config")
    stages = list(spec["rules"])
    if quant:
        stages = quantization_stages(quant, where, config) + stages
    OmegaConf.update(cfg, "checkpoint.rules", stages, merge=False)
    cfg.name = str(config.get("_name_or_path") or model_type).rstrip("/").split("/")[-1] or model_type
    if overrides:
        from .config import apply_overrides

        cfg = apply_overrides(cfg, overrides, where)
    return cfg


def quantization_stages(quant: dict, where: str, config: dict | None = None) -> list[str]:
    """Rule stages that turn a quantized checkpoint's stored codes into values (conf/hf/quantization.yaml).
    A method maps to one entry, or to a list of variants: the first whose `when` values all match
    (looked up in quantization_config, else at config.json's top level) is used."""
    from .config import find_conf

    path = find_conf("hf", QUANTIZATION_TABLE)
    table = OmegaConf.to_container(OmegaConf.load(path)) if path else {}
    method = quant.get("quant_method")
    if method not in table:
        raise ConfigError(f"{where}: quantization_config.quant_method={method!r} is not supported "
                          f"(supported: {sorted(table)})")
    entry = table[method]
    if isinstance(entry, list):
        def value(key):
            return quant[key] if key in quant else (config or {}).get(key)
        entry = next((e for e in entry if all(value(k) == v for k, v in (e.get("when") or {}).items())), None)
        if entry is None:
            raise ConfigError(f"{where}: no variant of quant_method {method!r} in conf/hf/{QUANTIZATION_TABLE}.yaml "
                              f"matches this quantization_config")
    for key, expected in (entry.get("expect") or {}).items():
        if quant.get(key) != expected:
            raise ConfigError(f"{where}: quantization_config.{key}={quant.get(key)!r} is not supported "
                              f"(expected {expected!r})")
    return list(entry["rules"])


def _group_option(group: str, kind: str) -> str | None:
    """The conf/<group>/ option whose `kind` is `kind` (the file named after the kind first)."""
    folder = conf_dir() / group
    files = sorted(folder.glob("*.yaml"), key=lambda p: (p.stem != kind, p.stem))
    for path in files:
        if OmegaConf.load(path).get("kind") == kind:
            return path.stem
    return None


def conf_yaml(cfg: DictConfig, header: str) -> str:
    """A conf/ YAML reproducing `cfg` exactly. Its defaults list names the group option of each
    kind node, and `_self_` holds only what differs from those options, so group overrides on the
    command line (`residual=mhc`) replace a node exactly as they do on the shipped confs."""
    body = OmegaConf.to_container(cfg, resolve=True)
    defaults: list = []
    slots = [("norm", "norm"), ("rope", "rope"), ("residual", "residual")]
    slots += [("mixer", f"mixers.{k}") for k in cfg.mixers] + [("ffn", f"ffns.{k}") for k in cfg.ffns]
    for group, key in slots:
        node = OmegaConf.select(cfg, key)
        option = _group_option(group, node.kind)
        if option is None:
            continue
        defaults.append({group if group == key else f"{group}@{key}": option})
        base = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{option}.yaml"))
        delta = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if base.get(k, _ABSENT) != v}
        parent, _, leaf = key.rpartition(".")
        holder = body[parent] if parent else body
        if delta:
            holder[leaf] = delta
        else:
            del holder[leaf]
    for parent in ("mixers", "ffns"):
        if not body.get(parent):
            body.pop(parent, None)
    defaults += [{"runtime": "default"}, "_self_"]
    text = OmegaConf.to_yaml(OmegaConf.create({"defaults": defaults, **body}))
    return "".join(f"# {line}\n" for line in header.splitlines()) + text
