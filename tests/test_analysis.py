"""zoo report / diff / import / check: figures, structure-aware diffs, round trips, header-only checks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import zoo
from compiler.analysis import analyze
from compiler.config import load_config
from tests.test_llama import make_reference
from zoo.cli import main


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_report_json_llama3_8b(capsys):
    code, out = run(capsys, "report", "conf=llama3_8b", "context=8192", "device=h200", "output=json")
    assert code == 0
    r = json.loads(out)
    for key in ("params_total", "params_active", "cache_bytes_per_token", "state_bytes_per_sequence",
                "decode_flops_per_token", "prefill_flops_per_token"):
        assert key in r
    assert r["params_total"] == 8_030_261_248
    assert r["cache_bytes_per_token"] == 131_072  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    assert r["state_bytes_per_sequence"] == 0
    # active: everything but the input embedding table (untied: the head counts)
    assert r["params_active"] == 8_030_261_248 - 128_256 * 4096
    assert r["device"]["decode_bound"] == "memory"


def test_flops_grow_with_context():
    spec = load_config("llama3_8b")
    short, long = analyze(spec, context=1024), analyze(spec, context=8192)
    per_token_attention = 32 * 4 * 32 * 128  # layers x (qk + av) x heads x head_dim, per context token
    assert long["decode_flops_per_token"] - short["decode_flops_per_token"] == per_token_attention * (8192 - 1024)
    assert short["prefill_flops_per_token"] < short["decode_flops_per_token"]  # causal average


def test_report_table_and_tiny(capsys):
    code, out = run(capsys, "report", "conf=llama3_8b_tiny", "residual=mhc", "residual.streams=2")
    assert code == 0 and "2 streams (mHC)" in out and "per layer kind" in out


def test_report_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cache.png"
    code, _ = run(capsys, "report", "conf=llama3_8b,llama3_8b_tiny", f"plot={png}", "context=32768")
    assert code == 0 and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_diff_shows_only_differences(capsys):
    code, out = run(capsys, "diff", "llama3_8b", "llama3_8b mixers.attn.n_kv_heads=4", "output=json")
    assert code == 0
    d = json.loads(out)
    assert [c["key"] for c in d["changed"]] == ["mixers.attn.n_kv_heads"]
    cache = next(f for f in d["figures"] if f["figure"] == "cache_bytes_per_token")
    assert (cache["a"], cache["b"], cache["ratio"]) == (131_072, 65_536, 0.5)
    assert d["layout"]["same"]


def test_diff_layout_as_runs(capsys):
    code, out = run(capsys, "diff", "llama3_8b_tiny", "llama3_8b_tiny n_layers=5", "output=json")
    d = json.loads(out)
    assert d["layout"] == {"a": "attn+mlp x2", "b": "attn+mlp x5", "same": False}
    code, out = run(capsys, "diff", "llama3_8b_tiny", "llama3_8b_tiny n_layers=5")
    assert "attn+mlp x5" in out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("imp")
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True), {})
    return path


def test_import_round_trip(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    code, out = run(capsys, "import", str(ckpt), "name=tiny_imported")
    assert code == 0 and (tmp_path / "confs" / "tiny_imported.yaml").exists()
    built = zoo.build("tiny_imported", weights=str(ckpt), compile=False, max_seq=32)
    direct = zoo.from_pretrained(str(ckpt), compile=False, max_seq=32)
    ids = torch.randint(0, 320, (1, 9))
    torch.testing.assert_close(built.prefill(ids), direct.prefill(ids), rtol=0, atol=0)
    assert built.spec.mixers == direct.spec.mixers and built.spec.tie_embeddings
    # the imported conf composes with groups like any shipped one
    code, out = run(capsys, "diff", "tiny_imported", "tiny_imported residual=mhc", "output=json")
    assert code == 0 and any(c["key"] == "residual.kind" for c in json.loads(out)["changed"])


def test_check_ok_and_reads_no_tensor_data(ckpt, tmp_path, capsys):
    code, out = run(capsys, "check", f"weights={ckpt}")
    assert code == 0 and "OK" in out
    # cut the data section away: a header-only check still verifies every name/shape/dtype
    bad = tmp_path / "cut"
    shutil.copytree(ckpt, bad)
    f = bad / "model.safetensors"
    raw = f.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    f.write_bytes(raw[: 8 + header_len])
    code, out = run(capsys, "check", f"weights={bad}")
    assert code == 1
    assert "mapped to" in out and "unexpected" not in out and "missing" not in out
    assert "data section has 0 bytes" in out


def test_check_lists_offenders(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors.pop("model.norm.weight")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    code, out = run(capsys, "check", f"weights={bad}")
    assert code == 1
    assert "unexpected  model.layers.0.extra.weight" in out
    assert "missing  parameter norm.weight" in out
    assert "mismatched" in out and "does not fit parameter layers.1.ffn.w13.weight" in out
