"""The import-map language (compiler/import_expr.py, compiler/hf_import.py): every operator, null
versus absent keys, errors that name the key, its value and the file, expressions refused
before anything is evaluated, inclusive layer ranges and every layout fill, `require`, `cases`
on null, and docs/adding-a-family.md's examples (layout rules, `- override group: x`) run as
written."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from zoo.compiler.config import compose
from zoo.compiler.errors import ConfigError
from zoo.compiler.hf_import import import_config, import_specs, layout_from_hf
from zoo.compiler.import_expr import parse, parse_range
from zoo.compiler.spec import validate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-family.md"
CONFIG = {"hidden_size": 48, "num_attention_heads": 4, "rotary_dim": 6, "head_dim": 12, "sliding_window": None,
          "hidden_act": "silu", "layer_types": ["a", "b"], "rope_parameters": {"factor": 4.0, "rope_type": "yarn"},
          "flag": True, "zero": 0}


def value(source: str, config: dict = CONFIG, **local):
    return parse(source, "hf/toy.yaml", "fields.x", local=tuple(local)).evaluate(config, "config.json", local)


# ----------------------------------------------------------------------------- the language


@pytest.mark.parametrize("source, expected", [
    ("hidden_size", 48),
    ("rope_parameters.factor", 4.0),  # dotted keys reach into sub-dicts
    ("rotary_dim / head_dim", 0.5),  # true division
    ("hidden_size // num_attention_heads", 12),
    ("hidden_size % 5", 3),
    ("hidden_size + 2 * head_dim - 1", 71),
    ("-head_dim", -12),
    ("head_dim == 12", True), ("head_dim != 12", False), ("head_dim < 12", False), ("head_dim <= 12", True),
    ("head_dim > 11", True), ("head_dim >= 13", False), ("1 < head_dim < 20", True),
    ("hidden_act in ['silu', 'swish']", True), ("hidden_act not in ['silu']", False),
    ("flag and head_dim > 3", True), ("zero or 7", 7), ("not flag", False),
    ("sliding_window is None", True), ("sliding_window is not None", False),
    ("head_dim if flag else 0", 12), ("1 if sliding_window is not None else 2", 2),
    ("sliding_window ?? 4096", 4096),  # null -> the default
    ("missing ?? 4096", 4096),  # absent -> the default
    ("head_dim ?? 64", 12),
    ("missing ?? sliding_window ?? head_dim ?? 1", 12),  # the first present, non-null
    ("head_dim ?? 64 == 12", True),  # ?? binds tighter than comparisons
    ("default(sliding_window, 4096)", None),  # an explicit null stays null
    ("default(missing, 4096)", 4096),
    ("has(sliding_window)", True), ("has(missing)", False), ("has(rope_parameters.factor)", True),
    ("has(missing) and missing > 3", False),  # short circuit: `missing` is never read
    ("min(head_dim, 8)", 8), ("max(head_dim, 8)", 12), ("abs(-3)", 3), ("len(layer_types)", 2),
    ("int(rope_parameters.factor)", 4), ("float(head_dim)", 12.0), ("round(2.6)", 3),
    ("null", None), ("true", True), ("false", False), ("'a??b'", "a??b"), ("[1, 2]", [1, 2]),
    (128, 128), (0.5, 0.5), (None, None),  # YAML numbers and null are literals
    ("layer_types[1]", "b"), ("layer_types[-2]", "a"), ("(missing ?? [3, 4])[1]", 4),  # one item of a list
])
def test_each_form(source, expected):
    got = value(source)
    assert got == expected and type(got) is type(expected)


def test_an_index_outside_the_list_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"index \[2\] of \['a', 'b'\] \(expected a list with an item there\)"):
        value("layer_types[2]")
    with pytest.raises(ConfigError, match=r"index \[0\] of 48"):
        value("hidden_size[0]")


def test_layer_is_a_local_name():
    assert value("(layer + 1) % 2 == 0", layer=3) is True
    assert parse("layer >= head_dim", "f", "e", local=("layer",)).keys == {"head_dim"}


def test_keys_read():
    expr = parse("rotary_dim / (head_dim ?? hidden_size // num_attention_heads)", "f", "e")
    assert expr.keys == {"rotary_dim", "head_dim", "hidden_size", "num_attention_heads"}
    assert parse("rope_parameters.factor * 2", "f", "e").roots == {"rope_parameters"}
    assert parse("head_dim ?? null", "f", "e").keys == {"head_dim"}  # literals are not keys


def test_missing_key_names_it_the_entry_and_the_file():
    with pytest.raises(ConfigError) as e:
        value("rotary_dim / head_size")
    msg = str(e.value)
    assert "lacks required key 'head_size'" in msg and "fields.x" in msg and "hf/toy.yaml" in msg
    assert "head_size ?? VALUE" in msg


def test_null_key_in_arithmetic_names_the_value():
    with pytest.raises(ConfigError) as e:
        value("sliding_window < 4096")
    msg = str(e.value)
    assert "sliding_window=None" in msg and "hf/toy.yaml" in msg and "fields.x" in msg and "lacks" not in msg
    with pytest.raises(ConfigError, match=r"division by zero \(with head_dim=12, zero=0\)"):
        value("head_dim / zero")
    with pytest.raises(ConfigError, match="not a number"):
        value("hidden_act * 1000000000")  # no string arithmetic


@pytest.mark.parametrize("source, words", [
    ("__import__('os').system('echo hi')", "the call"),
    ("open('/etc/passwd')", "the call open(...)"),
    ("hidden_size.__class__", None),  # a dotted key, never an attribute: refused as absent at run time
    ("(1).real", "an attribute of a computed value"),
    ("layer_types[n]", "an index other than an integer literal"),
    ("layer_types[0:2]", "an index other than an integer literal"),
    ("head_dim ** 2", "Pow"),
    ("lambda: 1", "Lambda"),
    ("[x for x in layer_types]", "ListComp"),
    ("head_dim | 1", "`|` is not an operator here"),
    ("head_dim is 12", "`is` against something other than None"),
    ("3 ?? 4", "`??` after something other than a config key"),
    ("default(3, 4)", "without a config key"),
    ("max(a=1)", "keyword arguments"),
    ("head_dim +", "not an expression"),
    ("x" * 500, "longer than 400"),
])
def test_bad_expressions_are_refused_when_parsed(source, words):
    if words is None:
        with pytest.raises(ConfigError, match="lacks required key 'hidden_size.__class__'"):
            value(source)
        return
    with pytest.raises(ConfigError) as e:
        parse(source, "hf/toy.yaml", "fields.mixers.attn.window")
    msg = str(e.value)
    assert words in msg and "hf/toy.yaml" in msg and "fields.mixers.attn.window" in msg


def test_inclusive_range():
    start, end = parse_range("first_k..num_hidden_layers - 1", "f", "e")
    config = {"first_k": 2, "num_hidden_layers": 6}
    assert (start.evaluate(config, "c"), end.evaluate(config, "c")) == (2, 5)
    with pytest.raises(ConfigError, match="inclusive layer range `START..END`"):
        parse_range("2...5", "f", "e")


# ----------------------------------------------------------------------------- layout rules

KINDS = {"dense": {"mixer": "attn", "ffn": "dense"}, "moe": {"mixer": "attn", "ffn": "moe"}}


def layers(layout: list[dict], n: int) -> list[str]:
    """compress_layout's output back to one `mixer+ffn` per layer."""
    if len(layout) == 1 and "pattern" in layout[0]:
        pattern = layout[0]["pattern"]
        return [f"{pattern[i % len(pattern)]['mixer']}+{pattern[i % len(pattern)]['ffn']}" for i in range(n)]
    out = []
    for run in layout:
        out += [f"{run['mixer']}+{run['ffn']}"] * run.get("repeat", n)
    return out


def ffns(config: dict, rule: dict, n: int) -> list[str]:
    return [k.split("+")[1] for k in layers(layout_from_hf(config, rule, n, "config.json", "hf/toy.yaml"), n)]


@pytest.mark.parametrize("ranges, expected", [
    ("1..3", ["dense", "moe", "moe", "moe", "dense"]),
    ("0..4", ["moe"] * 5),
    ("start..start + 1", ["dense", "dense", "moe", "moe", "dense"]),
    ("start..start - 1", ["dense"] * 5),  # end = start - 1: empty
    (["0..0", "3..4"], ["moe", "dense", "dense", "moe", "moe"]),
])
def test_range_fill_is_inclusive(ranges, expected):
    rule = {"range": {"layers": ranges, "kind": "moe", "other": "dense"}, "kinds": KINDS}
    assert ffns({"start": 2}, rule, 5) == expected


@pytest.mark.parametrize("ranges", ["2..5", "-1..2", "3..1", "start..2"])
def test_range_outside_the_model_names_the_values(ranges):
    rule = {"range": {"layers": ranges, "kind": "moe", "other": "dense"}, "kinds": KINDS}
    with pytest.raises(ConfigError) as e:
        ffns({"start": 2.5}, rule, 5)
    msg = str(e.value)
    assert "hf/toy.yaml" in msg and repr(ranges) in msg and "0 <= start <= end + 1 <= 5" in msg
    if "start" in ranges:
        assert "start=2.5" in msg


def test_when_fill_and_its_errors():
    rule = {"when": {"test": "layer >= first and (layer + 1) % every == 0", "kind": "moe", "other": "dense"},
            "kinds": KINDS}
    assert ffns({"first": 1, "every": 2}, rule, 6) == ["dense", "moe", "dense", "moe", "dense", "moe"]
    with pytest.raises(ConfigError, match=r"lacks required key 'every'.*layout_from.when.test.*hf/toy.yaml"):
        ffns({"first": 1}, rule, 6)
    rule["when"]["test"] = "layer + first"
    with pytest.raises(ConfigError, match=r"gives 1 for layer 0 \(with first=1\); expected true or false"):
        ffns({"first": 1}, rule, 6)


def test_first_n_and_every_nth_take_expressions_and_defaults():
    rule = {"first_n": {"key": "n_dense + 1", "kind": "dense", "other": "moe"}, "kinds": KINDS}
    assert ffns({"n_dense": 1}, rule, 4) == ["dense", "dense", "moe", "moe"]
    rule = {"key": "mlp_types", "every_nth": {"key": "step", "default": 2, "kind": "moe", "other": "dense"},
            "kinds": KINDS}
    assert ffns({"step": None}, rule, 4) == ["dense", "moe", "dense", "moe"]  # null takes the default
    assert ffns({"mlp_types": ["moe"] * 4}, rule, 4) == ["moe"] * 4  # the list wins
    del rule["every_nth"]["default"]
    with pytest.raises(ConfigError, match=r"lacks 'mlp_types' or 'step' \(for layout; see hf/toy.yaml\)"):
        ffns({}, rule, 4)


def test_an_empty_list_is_absent_only_where_the_rule_says_so():
    """Llama 4's `no_rope_layers: []`: its config class takes the default schedule."""
    rule = {"key": "mlp_types", "every_nth": {"key": "step", "default": 2, "kind": "moe", "other": "dense"},
            "kinds": KINDS}
    with pytest.raises(ConfigError, match=r"mlp_types has 0 entries but the model has 4 layers"):
        ffns({"mlp_types": []}, rule, 4)
    assert ffns({"mlp_types": []}, {**rule, "empty_is_absent": True}, 4) == ["dense", "moe", "dense", "moe"]


def test_layout_rule_without_key_or_fill_is_a_clear_error():
    with pytest.raises(ConfigError) as e:
        layout_from_hf({}, {"kinds": KINDS}, 4, "config.json", "hf/toy.yaml")
    msg = str(e.value)
    assert "hf/toy.yaml" in msg and "layout_from has no `key:`" in msg and "range" in msg and "KeyError" not in msg
    with pytest.raises(ConfigError, match=r"layout_from: unknown key\(s\) \['every_n'\]"):
        layout_from_hf({}, {"every_n": {}, "kinds": KINDS}, 4, "config.json", "hf/toy.yaml")
    with pytest.raises(ConfigError, match=r"layout_from.range: expected a mapping with \['kind', 'layers', 'other'\]"):
        layout_from_hf({}, {"range": "1..2", "kinds": KINDS}, 4, "config.json", "hf/toy.yaml")


# ----------------------------------------------------------------------------- whole import maps

TOY = {"model_type": "toy", "base": "llama3_8b_tiny", "rules": ["llama"],
       "fields": {"dim": "hidden_size", "n_layers": "num_hidden_layers", "vocab_size": "vocab_size",
                  "max_position": "max_position_embeddings ?? 256",
                  "mixers.attn.n_heads": "num_attention_heads",
                  "mixers.attn.n_kv_heads": {"key": "num_key_value_heads", "default": None},
                  "mixers.attn.rotary_fraction": "rotary_dim / (head_dim ?? hidden_size // num_attention_heads)",
                  "mixers.attn.window": "sliding_window if use_window else null",
                  "ffns.mlp.ffn_dim": "intermediate_size"},
       "require": {"num_attention_heads % (num_key_value_heads ?? num_attention_heads) == 0":
                   "GQA groups whole query heads"},
       # a case on an expression: its value (true / false, never 1 / 0) picks the entry
       "cases": {"sliding_window is None": {"values": {True: {}, False: {"mixers.attn.qkv_bias": False}}}},
       "rope": {"to": "rope", "theta_default": 10000.0},
       "irrelevant": {"initializer_range": "training-time init"}}
TOY_CONFIG = {"model_type": "toy", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rotary_dim": 8, "intermediate_size": 96,
              "use_window": True, "sliding_window": 8, "initializer_range": 0.02}


@pytest.fixture
def toy_map(tmp_path, monkeypatch):
    """Write an import map into a fresh user conf dir; returns a function (map dict) -> its label."""
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    (tmp_path / "hf").mkdir()

    def write(spec: dict) -> str:
        path = tmp_path / "hf" / "toy.yaml"
        path.write_text(yaml.safe_dump(spec))
        return str(path)
    return write


def test_toy_map_imports(toy_map):
    toy_map(TOY)
    spec = validate(import_config(TOY_CONFIG, "config.json"), "config.json")
    attn = spec.mixers["attn"]
    assert (attn.rotary_fraction, attn.window, spec.max_position, attn.n_kv_heads) == (0.5, 8, 256, 2)
    off = validate(import_config({**TOY_CONFIG, "use_window": False, "sliding_window": None}, "c"), "c")
    assert off.mixers["attn"].window is None


def test_null_present_is_not_reported_as_lacking(toy_map):
    file = toy_map(TOY)
    with pytest.raises(ConfigError) as e:
        import_config({**TOY_CONFIG, "hidden_size": None}, "config.json")
    msg = str(e.value)
    assert "hidden_size = null" in msg and "lacks" not in msg and file in msg and "for dim" in msg
    with pytest.raises(ConfigError) as e:
        import_config({k: v for k, v in TOY_CONFIG.items() if k != "hidden_size"}, "config.json")
    assert "lacks required key 'hidden_size'" in str(e.value) and file in str(e.value)
    with pytest.raises(ConfigError) as e:  # cases: a present null with no `null:` entry
        spec = {**TOY, "cases": {"sliding_window": {"default": 8, "values": {8: {}}}}}
        toy_map(spec)
        import_config({**TOY_CONFIG, "use_window": False, "sliding_window": None}, "config.json")
    assert "sliding_window=None is not supported (expected one of [8]" in str(e.value)
    assert "lacks" not in str(e.value)


def test_require_names_the_condition_its_values_and_reason(toy_map):
    file = toy_map(TOY)
    with pytest.raises(ConfigError) as e:
        import_config({**TOY_CONFIG, "num_key_value_heads": 3}, "config.json")
    msg = str(e.value)
    assert "num_attention_heads=4" in msg and "num_key_value_heads=3" in msg
    assert "GQA groups whole query heads" in msg and file in msg


def test_expression_keys_are_covered(toy_map):
    """Keys an expression reads count as covered; a key nobody reads is still an error."""
    toy_map(TOY)
    import_config({**TOY_CONFIG, "head_dim": 16}, "config.json")
    with pytest.raises(ConfigError, match=r"config.json key 'rope_dim' = 8 is not covered by .*toy.yaml"):
        import_config({**TOY_CONFIG, "rope_dim": 8}, "config.json")
    # transformers' private keys are metadata
    import_config({**TOY_CONFIG, "_model_name_or_path": "x.gguf", "_anything": 1}, "config.json")


def test_a_bad_map_is_refused_when_loaded(toy_map):
    file = toy_map({**TOY, "fields": {**TOY["fields"], "dim": "__import__('os').getcwd()"}})
    with pytest.raises(ConfigError) as e:
        import_specs()
    assert file in str(e.value) and "fields.dim" in str(e.value) and "the call __import__" in str(e.value)
    toy_map({**TOY, "layout_from": {"kinds": {"x": {"mixer": "attn", "ffn": "mlp"}}}})
    with pytest.raises(ConfigError, match=r"toy.yaml: layout_from has no `key:`"):
        import_specs()
    toy_map({**TOY, "rope": {"to": "rope", "theta": 1.0}})
    with pytest.raises(ConfigError, match=r"toy.yaml: rope rule has unknown key\(s\) \['theta'\]"):
        import_specs()


# ----------------------------------------------------------------------------- the doc's examples


def _doc_layout_examples() -> list[tuple[dict, list[str], dict]]:
    """docs/adding-a-family.md's layout examples: (config.json, layers, layout_from)."""
    text = DOC.read_text()
    out = []
    for block in re.findall(r"```yaml\n(# config.json: .*?)```", text, re.S):
        config = json.loads(re.search(r"# config.json: (.*)", block).group(1))
        want = [s.strip() for s in re.search(r"# layers: (.*)", block).group(1).split(",")]
        out.append((config, want, yaml.safe_load(block)["layout_from"]))
    return out


def test_doc_layout_examples_produce_their_layers():
    examples = _doc_layout_examples()
    fills = {f for _, _, rule in examples for r in (rule if isinstance(rule, list) else [rule])
             for f in ("key", "absent", "every_nth", "first_n", "listed", "range", "when") if f in r}
    assert fills == {"key", "absent", "every_nth", "first_n", "listed", "range", "when"}  # every rule shown
    for config, want, rule in examples:
        n = config["num_hidden_layers"]
        assert layers(layout_from_hf(config, rule, n, "doc", "docs/adding-a-family.md"), n) == want, rule


def test_doc_override_example_composes(tmp_path, monkeypatch):
    """The doc's user preset with `- override rope: llama3` composes to Llama 3.1's rope."""
    block = re.search(r"```yaml\n# user conf dir: (\S+)\n(.*?)```", DOC.read_text(), re.S)
    name, text = block.group(1), block.group(2)
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    (tmp_path / name).write_text(text)
    mine = compose(Path(name).stem)
    assert mine.rope == compose("llama3_1_8b").rope and mine.rope.kind == "llama3"
    (tmp_path / name).write_text(text.replace("- override rope: llama3", "- rope: llama3"))
    with pytest.raises(ConfigError, match="Multiple values for rope. To override a value use 'override rope: llama3'"):
        compose(Path(name).stem)


def test_a_rope_parameter_the_type_needs_is_named_not_a_key_error():
    """A llama3 rope_parameters without high_freq_factor: an error naming it and the map (it
    was a bare KeyError)."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2).to_dict()
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192}
    with pytest.raises(ConfigError, match=r"rope_parameters.high_freq_factor = None: the 'llama3' rope needs a "
                                          r"number there \(see conf/hf/llama.yaml\)"):
        import_config(config, "config.json")
