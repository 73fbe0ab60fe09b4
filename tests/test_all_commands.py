"""Every command on every shipped conf (scripts/all_commands.py): the committed sweep holds every
conf of conf/ and every command, with no traceback and no timeout anywhere (an unsupported
combination is a named refusal, compiler/errors.py); a fast sample of the sweep runs here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results" / "all_commands.json"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("all_commands_script", ROOT / "scripts" / "all_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_sweep_covers_every_conf_without_a_traceback(sweep):
    data = json.loads(RESULTS.read_text())
    confs = data["confs"]
    assert sorted(confs) == sweep._all_confs(), "rerun scripts/all_commands.py: the confs changed"
    bad = {f"{name}.{command}": e.get("message") or e.get("status")
           for name, row in confs.items() for command, e in sweep._bad(row)}
    assert not bad, bad
    for name, row in confs.items():
        assert set(sweep.COMMANDS) <= set(row), (name, sorted(row))
    # every outcome is one of the sweep's classes; a refusal names a zoo error class
    for name, row in confs.items():
        for command, entry in row.items():
            if not isinstance(entry, dict):
                continue
            for e in [entry] if "status" in entry else entry.values():
                assert e["status"] in ("ok", "refused", "failed", "not applicable"), (name, command, e)
                if e["status"] == "refused":
                    assert e["error"].endswith("Error") and e["message"], (name, command, e)


def test_sample(sweep):
    """kimi_linear_tiny: every command, patterns included (its NoPE MLA probe once raised
    KeyError 'rope:6'); deepseek_v3 at full size: a dry build and the report, patterns not
    applicable."""
    row = sweep.one("kimi_linear_tiny")
    assert not list(sweep._bad(row)), row
    assert row["patterns"]["status"] == "ok" and row["verify"]["kimi_linear"]["status"] == "ok", row
    assert row["check"]["kimi_linear"]["status"] == "ok", row
    big = sweep.one("deepseek_v3", ("build", "report", "patterns"))
    assert not list(sweep._bad(big)), big
    assert big["build"]["status"] == "ok" and big["build"]["args"] == ["dry=true"], big
    assert big["patterns"]["status"] == "not applicable"


def test_a_conf_too_large_builds_dry_by_itself():
    """`zoo build conf=X` (no dry=) on a model larger than the machine: the build goes on meta."""
    import zoo

    m = zoo.build("deepseek_v3", dry=None)
    assert m.info.dry and m.info.device == "meta" and m.info.needed_bytes > m.info.available_bytes
