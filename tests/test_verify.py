"""`zoo verify` (zoo/verify.py): a tiny transformers twin loaded through zoo's own import path,
prefill and every greedy decode step compared; the verdicts ok / mismatch / refused; the
coverage table (docs/coverage.md, scripts/coverage.py) in agreement with the shipped import maps.
Eager (a twin is a few seconds) except the one test about compile=true."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zoo
from zoo.cli import main
from zoo.compiler.hf_import import import_config
from zoo.verify import OK_RTOL, STEPS, resolve, verify

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_next"])  # dense; sliding + softcap; linear
def test_shipped_family_ok(model_type):
    v = verify(model_type)
    assert v.status == "ok", (v.message, v.steps)
    assert [s for s, _ in v.steps] == ["prefill"] + [f"decode {k + 1}" for k in range(STEPS)]
    assert v.worst <= OK_RTOL
    # the twin is tiny and keeps every layer kind of the family
    assert v.twin["hidden_size"] == 48 and v.twin["vocab_size"] == 301
    if "layer_types" in v.twin:
        assert len(set(v.twin["layer_types"])) > 1


def test_compiled():
    """compile=true: the same comparison through the compiled prefill and decode graphs."""
    v = verify("qwen3", overrides=["runtime.aot=false"], compile=True)
    assert v.status == "ok" and v.compiled, (v.message, v.steps)


def test_cli_prints_table_and_verdict(capsys):
    assert main(["verify", "mistral"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode 5" in out and "ok: worst relative error" in out and "eager" in out


def test_targets():
    assert resolve("llama3_8b") == [("llama", None)]  # a conf name: the import maps based on it
    assert resolve("qwen3") == [("qwen3", None)]
    with pytest.raises(Exception, match="expected a model_type"):
        resolve("no_such_family_or_conf")


def test_checkpoint_dir_target(tmp_path):
    """A checkpoint dir's config.json, shrunk: its own non-default values survive."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 3584,
                                                      "num_hidden_layers": 28, "rope_theta": 1234567.0}))
    [(model_type, config)] = resolve(str(tmp_path))
    v = verify(model_type, config)
    assert v.status == "ok", (v.message, v.steps)
    assert v.twin["rope_parameters"]["rope_theta"] == 1234567.0 and v.twin["hidden_size"] == 48


def test_silently_different_model_is_a_mismatch():
    """An override that builds and loads (every tensor fits) but computes another model."""
    v = verify("llama", overrides=["norm.eps=0.5"])
    assert v.status == "mismatch"
    assert v.worst > OK_RTOL
    assert main(["verify", "llama", "norm.eps=0.5"]) == 1


def test_refused_names_the_reason(capsys):
    v = verify("cpmant")  # transformers has it (CPM-Ant); zoo ships no import map for it
    assert v.status == "refused"
    assert "model_type 'cpmant' is not supported" in v.message and "adding-a-family" in v.message
    assert main(["verify", "cpmant"]) == 1
    assert "refused" in capsys.readouterr().out


def test_user_dir_family(tmp_path, monkeypatch):
    """A family added in the user conf dir only (an import map reusing a shipped preset and rules)
    verifies the same way. Its model_type, helium_lab, is made up (zoo ships helium): transformers
    is given the class, Helium's under that name, as a lab's own package would register it; the
    import map is Llama's with the rotary in interleaved pairs (a `set:` entry)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    lab = type("HeliumLabConfig", (transformers.HeliumConfig,), {"model_type": "helium_lab"})
    monkeypatch.setitem(transformers.CONFIG_MAPPING._extra_content, "helium_lab", lab)
    monkeypatch.setitem(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "helium_lab", "HeliumForCausalLM")
    llama = (ROOT / "conf" / "hf" / "llama.yaml").read_text()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "helium_lab.yaml").write_text(
        re.sub(r"^model_type: llama$", "model_type: helium_lab", llama, flags=re.M)
        + "set: {mixers.attn.rope_interleaved: true}\n"
        "verify: {config: {head_dim: 12}}\n")  # Helium's o_proj is [D, D]: heads * head_dim == D
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path))
    v = verify("helium_lab")
    assert v.status == "ok", (v.message, v.steps)


def test_transformers_missing_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from zoo.cli import main\n"
            "sys.exit(main(['verify', 'llama']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ})
    assert p.returncode == 2, p.stderr
    assert "transformers" in p.stderr and "pip install 'zoo[verify]'" in p.stderr


def _coverage_rows() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "coverage.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("model_type", "---") and not cells[0].startswith("---"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_coverage_table_agrees_with_shipped_import_maps():
    """docs/coverage.md (scripts/coverage.py) and conf/hf/: every ok row has a shipped import map,
    every shipped map of a transformers causal-LM type has a row that is not 'no import map' and
    not a mismatch or a broken twin; the README's count is the table's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from zoo.compiler.hf_import import import_specs

    rows = _coverage_rows()
    assert set(rows) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    shipped = {t for t, s in import_specs().items() if s["file"].startswith("conf/")}
    ok = {t for t, (status, _) in rows.items() if status == "ok"}
    assert ok <= shipped, f"ok without a shipped import map: {sorted(ok - shipped)}"
    for t in shipped & set(rows):
        status, detail = rows[t]
        assert status in ("ok", "refused"), (t, status, detail)
        assert "no import map" not in detail, t
    for t in set(rows) - shipped:
        assert rows[t][0] != "ok", t
    readme = (ROOT / "README.md").read_text()
    assert f"**{len(ok)} of the" in readme


def test_lacks_table_names_only_unmapped_types():
    """conf/hf/_lacks.yaml: each entry a transformers causal-LM type with no import map, and the
    coverage table's refused row for it gives that concept; refusing such a type names it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from zoo.compiler.hf_import import import_specs, lacks

    table = lacks()
    assert table and not set(table) & set(import_specs()), sorted(set(table) & set(import_specs()))
    assert set(table) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), sorted(set(table) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    rows = _coverage_rows()
    for t, phrase in table.items():
        if rows[t][0] == "refused":
            assert rows[t][1] == f"lacks {phrase}", (t, rows[t])
    with pytest.raises(zoo.ConfigError, match=r"'cpmant' is not supported \(zoo lacks: segment-relative"):
        import_config({"model_type": "cpmant"}, "test")


def _coverage_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coverage_script", ROOT / "scripts" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_sample():
    """scripts/coverage.py's classes on a sample (the full run is the script, outside the tests):
    one twin in its own process, the static classes, zoo's refusal made one line."""
    cov = _coverage_script()
    row = cov.run_one("smollm3", timeout=600)
    assert row["status"] == "ok" and row["worst"] <= OK_RTOL, row
    assert "encoder-decoder" in cov.not_decoder_reason("bart")
    assert "is_decoder" in cov.not_decoder_reason("bert")
    assert "vision_config" in cov.not_decoder_reason("gemma3")
    assert cov.not_decoder_reason("llama") is None
    assert cov.static("cpmant")["detail"].startswith("lacks segment-relative position buckets")
    assert cov.concept("/tmp/zoo-verify-x-abc (1 safetensors file): model_type 'cpmant' is not supported (zoo lacks: "
                       "a thing, conf/hf/_lacks.yaml); supported: llama. A new family ...") == "lacks a thing"
    assert cov.concept("/tmp/zoo-verify-x-abc (1 safetensors file): mixers.swa: o_groups=8\n does not divide") == \
        "mixers.swa: o_groups=8 does not divide"
