"""scripts/gpu_check.py (the prepared GPU check of issue #8) still runs: its smoke mode on the CPU,
compile off, tiny sizes, writes the markdown result with a passing parity section."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_writes_passing_result(tmp_path, capsys):
    gpu_check = _load_script()
    rc = gpu_check.main(["--device", "cpu", "--smoke", "--no-compile", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    files = list(tmp_path.glob("gpu_check_*_smoke.md"))
    assert len(files) == 1, files
    text = files[0].read_text()
    assert rc == 0, text
    assert printed.strip() == text.strip()
    assert "**Correctness: PASS**" in text and "**FAIL**" not in text and "## Errors" not in text
    assert "- complete: True" in text
    parity = text.split("## 1. bf16 parity against float32")[1].split("\n## ")[0]
    rows = [line for line in parity.splitlines() if line.startswith("| llama3_8b_tiny |")]
    assert any("bfloat16" in r and "prefill" in r for r in rows) and any("bfloat16" in r and "decode" in r for r in rows)
    assert rows and all(r.endswith("| PASS |") for r in rows), rows
    for family in ("deepseek_v3_tiny", "qwen3_next_tiny"):
        assert f"| {family} | bfloat16" in parity
    assert "skipped: no CUDA" in text
    for section in ("## 0. Probes", "## 3. Decode tok/s vs the HBM roofline", "## 4. Prefill throughput"):
        assert section in text
    assert "tok/s" in text.split("## 3.")[1] and "TFLOP/s" in text.split("## 4.")[1]
