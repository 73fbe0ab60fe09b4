"""The build pipeline as named stages (compiler/build.py): frozen records, each stage run once per
build, dry and real builds (and `zoo report`) through the same stage functions, the build report
read from the records, and the structure-changing inputs (MTP layers, the checkpoint) explicit."""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch

import zoo
from zoo.compiler.engine.runners import runner_kinds
from zoo.compiler import build as stages
from zoo.compiler.analysis import analyze
from zoo.compiler.build import (STAGES, BuildRecords, BuildReport, CountStage, ShardStage, cast_stage,
                                report_from, runner_stage, spec_stage)
from zoo.compiler.config import compose
from zoo.compiler.errors import ConfigError, InputError
from zoo.compiler.model import count_parameters

TINY = "llama3_8b_tiny"


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """Every stage function of compiler/build.py wrapped (the real function still runs) to count
    its calls; the driver looks them up in the module at call time."""
    counts = {name: 0 for name in STAGES}

    def counting(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            counts[name] += 1
            return fn(*args, **kw)
        return wrapper

    for name in STAGES:
        monkeypatch.setattr(stages, name, counting(name, getattr(stages, name)))
    return counts


def _frozen(obj) -> bool:
    return dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen


def test_stage_list_is_the_driver_order():
    """STAGES names every stage function, in the order run_build calls them."""
    import inspect

    body = inspect.getsource(stages.run_build)
    assert all(callable(getattr(stages, name)) for name in STAGES)
    called = [m for m in re.findall(r"\b(\w+_stage)\(", body) if m in STAGES]
    assert called == list(STAGES)


def test_records_are_frozen(calls):
    m = zoo.build(TINY, compile=False, max_seq=16)
    assert isinstance(m.records, BuildRecords) and _frozen(m.records)
    for f in dataclasses.fields(BuildRecords):
        record = getattr(m.records, f.name)
        assert _frozen(record), f.name
        first = dataclasses.fields(record)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, first, None)
    assert _frozen(m.info) and isinstance(m.info, BuildReport)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.info.params = 0


def test_real_build_runs_each_stage_once(calls):
    m = zoo.build(TINY, compile=False, max_seq=16)
    assert calls == {name: 1 for name in STAGES}
    assert not m.info.dry and m.records.weights.module is m.module is m.records.cast.module
    assert m.engine is m.records.engine.engine
    assert m.records.runner.runner == m.info.runner == "eager"


def test_dry_build_shares_the_stages(calls):
    """A dry build runs the same stage functions as a real one up to the fit (the load stage plans
    from headers only: nothing here), and the runner and engine, and never reads weights or
    allocates; its figures are the real build's."""
    real = zoo.build(TINY, compile=False, max_seq=16)
    for name in STAGES:
        calls[name] = 0
    dry = zoo.build(TINY, compile=False, max_seq=16, dry=True)
    skipped = {"weights_stage"}
    assert calls == {name: 0 if name in skipped else 1 for name in STAGES}
    assert dry.info.dry and dry.info.device == "meta" and dry.module.embed.weight.is_meta
    assert dry.records.runner.runner == "eager" and dry.info.load is None
    for key in ("params", "param_bytes", "cache_bytes", "cache_bytes_per_token", "state_bytes_per_sequence"):
        assert getattr(dry.info, key) == getattr(real.info, key), key


def test_report_analysis_uses_the_build_stages(calls):
    """`zoo report` (analysis.analyze) builds through cast_stage / count_stage / cache_stage and
    agrees with a dry build's records."""
    dry = zoo.build(TINY, dry=True, dtype="bfloat16", cache_dtype="bfloat16")
    for name in STAGES:
        calls[name] = 0
    r = analyze(dry.spec, context=16)
    assert calls["cast_stage"] >= 1 and calls["count_stage"] == 1 and calls["cache_stage"] >= 1
    assert calls["spec_stage"] == calls["load_stage"] == calls["weights_stage"] == calls["engine_stage"] == 0
    assert r["params_total"] == dry.records.count.params
    assert r["weight_bytes"] == dry.records.count.param_bytes


def test_report_is_assembled_from_records():
    m = zoo.build(TINY, compile=False, max_seq=16)
    r = m.records
    assert report_from(r) == m.info
    assert (m.info.params, m.info.param_bytes) == (r.count.params, r.count.param_bytes)
    assert (m.info.cache_bytes, m.info.cache_bytes_per_token, m.info.state_bytes_per_sequence) == \
        (r.cache.total_bytes, r.cache.bytes_per_token, r.cache.state_bytes_per_sequence)
    assert (m.info.available_bytes, m.info.dry) == (r.fit.available_bytes, r.fit.dry)
    assert m.info.needed_bytes == r.fit.needed_bytes
    assert m.info.parallel is None and r.shard == ShardStage(None, None, None)
    # a record that says otherwise gives a report that says otherwise: nothing is recomputed
    other = report_from(dataclasses.replace(r, count=CountStage(params=7, param_bytes=28)))
    assert (other.params, other.param_bytes, other.needed_bytes) == (7, 28, 28 + r.cache.total_bytes)


def test_mtp_is_an_explicit_input_deepseek_v3():
    """The MTP layers are an input of cast_stage, not a field patched into the spec: the same
    spec gives 671,026,419,200 parameters without them and 684,489,845,504 with them (the Hub's
    "685B"), and `zoo report` counts the main model and the MTP layers apart."""
    spec = spec_stage(compose("deepseek_v3", []), "conf/deepseek_v3.yaml").spec
    assert not spec.checkpoint.mtp and len(spec.mtp_layers) == 1
    without = cast_stage(spec, torch.bfloat16, mtp=False)
    with_mtp = cast_stage(spec, torch.bfloat16, mtp=True)
    assert (without.mtp, len(without.module.mtp), with_mtp.mtp, len(with_mtp.module.mtp)) == (False, 0, True, 1)
    assert stages.count_stage(without.module).params == 671_026_419_200
    assert stages.count_stage(with_mtp.module).params == 684_489_845_504
    assert not spec.checkpoint.mtp  # nothing patched
    r = analyze(spec, context=128)
    assert r["params_total"] == 671_026_419_200 and r["params_mtp"] == 684_489_845_504 - 671_026_419_200
    # a build reads the input from checkpoint.mtp, through the spec stage
    on = spec_stage(compose("deepseek_v3", ["checkpoint.mtp=true"]), "conf/deepseek_v3.yaml")
    assert on.mtp and count_parameters(cast_stage(on.spec, torch.bfloat16, mtp=on.mtp).module.mtp) == \
        r["params_mtp"]


def test_mtp_without_mtp_layers_is_an_error():
    with pytest.raises(ConfigError, match=r"checkpoint.mtp=true but the config declares no multi-token-"
                                          r"prediction layers \(mtp.n_layers=0\)"):
        spec_stage(compose(TINY, ["+checkpoint.mtp=true"]), f"conf/{TINY}.yaml")


@pytest.mark.parametrize("weights", [123, object(), Path.home])
def test_weights_that_are_no_source_are_refused(weights):
    with pytest.raises(InputError, match=r"is neither a path / repo id nor a checkpoint source \(a \w+, not a "
                                         r"zoo.compiler.contracts.Source\)"):
        zoo.runtime.build_from_config(compose(TINY, []), f"conf/{TINY}.yaml", weights)


@pytest.mark.parametrize("overrides, device, dry, want", [
    (["runtime.compile=false"], "cpu", False, ("eager", False, False, False)),
    (["runtime.compile=true"], "cpu", False, ("aot", True, False, True)),  # runtime.aot=auto by default
    (["runtime.compile=true", "runtime.aot=false"], "cpu", False, ("compiled", True, False, False)),
    (["runtime.compile=true", "runtime.parallel.tp=2"], "cpu", False, ("compiled", True, False, False)),
    (["runtime.compile=true", "runtime.aot=true"], "cpu", False, ("aot", True, False, True)),
    (["runtime.compile=true", "runtime.aot=auto"], "cpu", False, ("aot", True, False, True)),
    (["runtime.compile=true", "runtime.device=cuda"], "cuda", False, ("cuda_graph", True, True, False)),
    (["runtime.compile=false", "runtime.device=cuda"], "cuda", False, ("cuda_graph", False, True, False)),
    (["runtime.compile=true", "runtime.device=cuda", "runtime.cuda_graph=false"], "cuda", False,
     ("compiled", True, False, False)),
    (["runtime.compile=true", "runtime.aot=true"], "cpu", True, ("eager", False, False, False)),
])
def test_runner_stage(overrides, device, dry, want):
    """Which runner the engine uses, from runtime settings and the device (no engine is made)."""
    spec = spec_stage(compose(TINY, overrides), f"conf/{TINY}.yaml").spec
    r = runner_stage(spec, torch.device(device), dry)
    assert (r.runner, r.compile, r.cuda_graph, r.aot) == want and r.runner in runner_kinds()
    assert r.warmup == (r.compile or r.cuda_graph)


def test_engine_made_in_one_place():
    """The API, CLI, reports and server make no Engine of their own: compiler/build.py's
    engine_stage is the one place outside compiler/engine/."""
    root = Path(stages.__file__).resolve().parent.parent
    found = sorted(str(p.relative_to(root)) for folder in ("compiler", "zoo") for p in (root / folder).rglob("*.py")
                   if "engine" not in p.relative_to(root).parts and re.search(r"\bEngine\(", p.read_text()))
    assert found == ["compiler/build.py"]
