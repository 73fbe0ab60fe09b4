"""The infrastructure families are built on: the conf search path (shipped, then the user conf
dir), rule-file includes, refusal of config.json keys an import map does not cover, the
generated families table, and docs/adding-a-family.md's worked example run as a user would."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zoo
from zoo.compiler.checkpoint.rules import load_stage
from zoo.compiler.config import compose, conf_dir
from zoo.compiler.errors import CheckpointError, ConfigError
from zoo.compiler.hf_import import covered_keys, import_config, import_specs, key_coverage

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _transformers_config(model_type: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return transformers.AutoConfig.for_model(model_type)
        except (ValueError, KeyError):
            return None


def test_every_key_of_every_family_config_class_is_covered():
    """Each import map whose model_type transformers knows covers every key of that config
    class (fields, expect, rope/layout readers, irrelevant, conf/hf/common.yaml)."""
    checked, missing = [], {}
    for model_type, spec in sorted(import_specs().items()):
        config = _transformers_config(model_type)
        if config is None:
            continue
        checked.append(model_type)
        covered = covered_keys(spec)
        if gaps := sorted(k for k in config.to_dict() if key_coverage(k, covered) is None):
            missing[model_type] = gaps
    assert not missing, f"config.json keys no import map covers: {missing}"
    assert {"llama", "qwen3_next", "deepseek_v3", "qwen2", "qwen3", "smollm3", "granite", "phi3"} <= set(checked)


def _llama_config(**extra) -> dict:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2).to_dict()
    return {**config, **extra}


def test_uncovered_key_is_refused():
    import_config(_llama_config(), "config.json")  # the class's own keys all pass
    with pytest.raises(ConfigError) as e:
        import_config(_llama_config(attn_logit_softcapping=50.0), "config.json")
    msg = str(e.value)
    assert "'attn_logit_softcapping'" in msg and "50.0" in msg and "conf/hf/llama.yaml" in msg
    assert "docs/adding-a-family.md" in msg


def test_rope_key_the_rope_kind_does_not_read_is_refused():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2]}
    with pytest.raises(ConfigError) as e:
        import_config(_llama_config(rope_parameters=rope), "config.json")
    assert "rope_parameters.mrope_section" in str(e.value) and "conf/hf/llama.yaml" in str(e.value)


def test_unknown_model_type_lists_supported_and_points_at_the_doc():
    with pytest.raises(ConfigError) as e:
        import_config({**_llama_config(), "model_type": "no_such_family"}, "config.json")
    msg = str(e.value)
    assert "'no_such_family'" in msg and "llama" in msg and "qwen3" in msg and "docs/adding-a-family.md" in msg


def test_qwen3_rules_are_llamas_plus_qk_norms():
    cfg = compose("qwen3_8b_tiny")
    llama, qwen3 = load_stage("llama", cfg), load_stage("qwen3", cfg)
    assert qwen3.rules[:len(llama.rules)] == tuple(r for r in llama.rules)
    assert [r.sources[0] for r in qwen3.rules[len(llama.rules):]] == [
        "model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight"]
    assert qwen3.ignores == llama.ignores


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_include_override_and_conflicts(tmp_path, monkeypatch):
    """An entry with an included entry's first `from` pattern replaces it in place; conflicts are loud."""
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    cfg = compose("llama3_8b_tiny")
    _write(tmp_path, {
        "rules/mine.yaml": "include: [llama]\nmap:\n"
                           "  - {from: model.norm.weight, to: layers.0.ffn_norm.weight}\n"
                           "  - {from: extra.weight, to: norm.weight}\n",
        "rules/a.yaml": "map:\n  - {from: x.weight, to: norm.weight}\n",
        "rules/b.yaml": "map:\n  - {from: x.weight, to: head.weight}\n",
        "rules/both.yaml": "include: [a, b]\n",
        "rules/both_chosen.yaml": "include: [a, b]\nmap:\n  - {from: x.weight, to: embed.weight}\n",
        "rules/twice.yaml": "map:\n  - {from: x.weight, to: a}\n  - {from: x.weight, to: b}\n",
        "rules/cycle1.yaml": "include: [cycle2]\n",
        "rules/cycle2.yaml": "include: [cycle1]\n",
        "rules/renames.yaml": "stage: rename\nmap:\n  - {from: y, to: z}\n",
        "rules/mixed.yaml": "include: [renames]\n",
        "rules/diamond.yaml": "include: [qwen3, qwen2]\n",
    })
    llama, mine = load_stage("llama", cfg), load_stage("mine", cfg)
    at = [r.sources[0] for r in llama.rules].index("model.norm.weight")
    assert [r.sources[0] for r in mine.rules] == [r.sources[0] for r in llama.rules] + ["extra.weight"]
    assert mine.rules[at].targets == ("layers.0.ffn_norm.weight",) and "mine.yaml" in mine.rules[at].where
    assert mine.rules[:at] == llama.rules[:at] and mine.ignores == llama.ignores
    assert load_stage("both_chosen", cfg).rules[0].targets == ("embed.weight",)
    assert len(load_stage("diamond", cfg).rules) == len(llama.rules) + 2  # llama's entries once
    for name, words in [("both", ["x.weight", "a.yaml", "b.yaml"]), ("twice", ["x.weight", "already"]),
                        ("cycle1", ["cycle1 -> cycle2 -> cycle1"]), ("mixed", ["'rename'", "'params'"]),
                        ("absent", ["'absent'", "available"])]:
        with pytest.raises(CheckpointError) as e:
            load_stage(name, cfg)
        assert all(w in str(e.value) for w in words), str(e.value)


def test_user_file_may_not_reuse_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    _write(tmp_path, {"rules/llama.yaml": "map: []\n"})
    with pytest.raises(ConfigError) as e:
        load_stage("qwen3", compose("llama3_8b_tiny"))
    assert "conf/rules/llama.yaml" in str(e.value) and str(tmp_path / "rules" / "llama.yaml") in str(e.value)


def test_readme_table_is_the_generated_one(tmp_path, monkeypatch):
    from zoo.families import families, markdown_table, readme_table

    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))  # an empty user conf dir: every map is shipped
    rows = families(shipped_only=True)
    assert {f.model_type for f in rows} == set(import_specs())
    assert readme_table((ROOT / "README.md").read_text()) == markdown_table(rows), \
        "README's table is stale: paste `python -m zoo.families --markdown --shipped` between the markers"
    smol = next(f for f in rows if f.model_type == "smollm3")
    assert smol.preset == "smollm3_3b" and smol.mixers == ("gqa",) and smol.residual == "prenorm"


def test_zoo_families_cli(capsys, tmp_path, monkeypatch):
    from zoo.cli import main

    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    _write(tmp_path, {"hf/mine.yaml": "model_type: mine\nbase: llama3_8b_tiny\nrules: [llama]\nfields: {}\n"})
    assert main(["families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines[1:]} == set(import_specs()) | {"mine"}
    assert str(tmp_path / "hf" / "mine.yaml") in next(line for line in lines if line.startswith("mine "))


# ---------------------------------------------------------------- docs/adding-a-family.md's example

WORKED = """
import json, sys, torch, transformers, zoo
from tests.helpers import check_decode_equals_prefill, check_parity
from zoo.compiler.config import conf_dir, find_conf
from zoo.families import families

reference, path = sys.argv[1], sys.argv[2]  # Helium's checkpoint; the same weights as helium_lab
ref = transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
m = zoo.from_pretrained(path, compile=False, max_batch=2, max_seq=32)
check_parity(ref, m, torch.randint(0, 97, (2, 7)), steps=5)
check_decode_equals_prefill(m, torch.randint(0, 97, (2, 16)), prompt_len=5)
row = next(f for f in families() if f.model_type == "helium_lab")
assert not find_conf("hf", "helium_lab").is_relative_to(conf_dir())
print(json.dumps({"preset": row.preset, "import_map": row.import_map, "mixers": row.mixers,
                  "params": zoo.build("helium_lab_2b", dry=True).info.params}))
"""

def doc_files() -> dict[str, str]:
    """The files docs/adding-a-family.md shows: yaml blocks whose first line is `# file: NAME`."""
    text = (ROOT / "docs" / "adding-a-family.md").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"```yaml\n# file: (\S+)\n(.*?)```", text, re.S)}


def test_adding_a_family_worked_example(tmp_path):
    """The doc's files in a fresh ZOO_CONF_DIR: a family zoo does not ship (helium_lab, Helium's
    config.json under a made-up model_type) loads a checkpoint and matches transformers' Helium
    on the same weights, with nothing under the package changed."""
    import json
    import shutil

    files = doc_files()
    assert set(files) == {"helium_lab_2b.yaml", "hf/helium_lab.yaml", "rules/helium_lab.yaml"}
    assert not any((conf_dir() / name).exists() for name in files)
    _write(tmp_path / "conf", files)
    torch.manual_seed(0)
    config = transformers.HeliumConfig(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                       attention_bias=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    ref = transformers.HeliumForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path / "helium")
    shutil.copytree(tmp_path / "helium", tmp_path / "ckpt")
    published = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**published, "model_type": "helium_lab"}))
    env = {**os.environ, "ZOO_CONF_DIR": str(tmp_path / "conf")}
    proc = subprocess.run([sys.executable, "-c", WORKED, str(tmp_path / "helium"), str(tmp_path / "ckpt")],
                          env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["preset"] == "helium_lab_2b" and out["mixers"] == ["gqa"]
    assert out["import_map"] == str(tmp_path / "conf" / "hf" / "helium_lab.yaml")
    with torch.device("meta"):  # the doc's preset is Helium-1-2B's published size
        flagship = transformers.HeliumForCausalLM(transformers.HeliumConfig())
    assert out["params"] == sum(p.numel() for p in flagship.parameters())
