"""The cache of composed configs (compiler/config.py compose): a hit is what Hydra composes, and
any edit of a conf file on the search path misses."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from zoo.compiler.config import available_configs, compose


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "conf"))
    return tmp_path / "cache" / "compose"


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=False)


def test_a_hit_is_what_hydra_composes(cache):
    """Every shipped conf file, and overrides of several kinds (a group choice, a value, a new key
    path), read back from the cache equal to Hydra's composition, values and types: each tiny twin
    (its flagship preset is its first default: every value of that file but the few it overrides
    goes through the cache with it) and each preset without one (CI time: a Hydra composition
    each)."""
    names = available_configs()
    cases = [(name, []) for name in names if name.endswith("_tiny") or f"{name}_tiny" not in names]
    cases += [("llama3_8b_tiny", ["residual=mhc", "mixers.attn.n_kv_heads=4", "runtime.max_seq=64"]),
              ("smollm2_135m", ["runtime.quant=int4", "runtime.aot=auto", "norm.eps=1e-6"])]
    for name, overrides in cases:
        hydra = compose(name, overrides)  # a miss: Hydra's composition, written to the cache
        hit = compose(name, overrides)
        assert _plain(hit) == _plain(hydra), name
        assert OmegaConf.to_yaml(hit) == OmegaConf.to_yaml(hydra), name
    assert len(list(cache.glob("*.yaml"))) == len(cases)


def test_an_edited_conf_file_misses(cache, tmp_path):
    """A user preset, edited between two composes: the second sees the edit (and so does a
    change of a shipped group file, which is on the same search path)."""
    user = tmp_path / "conf"
    user.mkdir()
    (user / "my_tiny.yaml").write_text("defaults:\n  - llama3_8b_tiny\n  - _self_\nname: my_tiny\ndim: 64\n")
    assert compose("my_tiny").dim == 64
    assert compose("my_tiny").dim == 64
    (user / "my_tiny.yaml").write_text("defaults:\n  - llama3_8b_tiny\n  - _self_\nname: my_tiny\ndim: 128\n")
    assert compose("my_tiny").dim == 128
    assert len(list(cache.glob("*.yaml"))) == 2
    (user / "unrelated.yaml").write_text("name: unrelated\n")  # a file added on the search path misses too
    assert compose("my_tiny").dim == 128
    assert len(list(cache.glob("*.yaml"))) == 3
