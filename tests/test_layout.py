"""The installed layout: one top-level package `zoo` (compiler/ and conf/ install as zoo.compiler
and zoo.conf), every concept folder shipped, the conf YAML inside it."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = out.glob("zoo-*.whl")
    return zipfile.ZipFile(path)


def test_one_top_level_package(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"zoo"}, top
    (toplevel,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
    if toplevel is not None:
        assert wheel.read(toplevel).decode().split() == ["zoo"]


def test_every_source_folder_and_conf_file_is_shipped(wheel):
    names = set(wheel.namelist())
    for folder, package in (("zoo", "zoo"), ("compiler", "zoo/compiler"), ("conf", "zoo/conf")):
        for path in (ROOT / folder).rglob("*"):
            shipped_kinds = (".py", ".yaml", ".cpp", ".html", ".js", ".css")  # .html/.js/.css: zoo/serve/static/
            if "__pycache__" in path.parts or not path.is_file() or path.suffix not in shipped_kinds:
                continue
            shipped = f"{package}/{path.relative_to(ROOT / folder).as_posix()}"
            assert shipped in names, f"{path.relative_to(ROOT)} is not in the wheel as {shipped}"
    assert any(n.startswith("zoo/conf/rules/") and n.endswith(".yaml") for n in names)
    assert any(n.startswith("zoo/conf/hf/") and n.endswith(".yaml") for n in names)
    assert {"zoo/serve/static/index.html", "zoo/serve/static/app.js", "zoo/serve/static/style.css"} <= names  # the page at /


def test_no_generic_top_level_names_importable():
    """`import compiler` / `import conf` must not resolve to this project (they collide with other
    projects); the installed names live under zoo."""
    code = ("import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
            "import zoo.compiler, zoo.conf; "
            "print(importlib.util.find_spec('compiler') is None, importlib.util.find_spec('conf') is None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_importing_zoo_changes_no_global_state():
    """Importing zoo and every compiler module leaves the environment and torch's compile
    configuration as they were; a compiling Engine applies zoo's settings when it is built."""
    code = """
import os, importlib, pkgutil, json
import torch
before = {k: getattr(torch._dynamo.config, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit")}
before_env = dict(os.environ)  # after torch._dynamo's own import, which sets inductor's default dir
import zoo, zoo.compiler
for info in pkgutil.walk_packages(zoo.compiler.__path__, "zoo.compiler."):
    importlib.import_module(info.name)
import zoo.cli, zoo.report
after = {k: getattr(torch._dynamo.config, k) for k in before}
changed = sorted(k for k in set(before_env) | set(os.environ) if before_env.get(k) != os.environ.get(k))
print(json.dumps({"env": changed, "dynamo": before == after}))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"env": [], "dynamo": True}, out


def test_architecture_map_names_real_paths():
    """docs/architecture.md names folders and files; every one of them exists."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:zoo|compiler|conf|tests|docs)/[\w./<>-]*|pyproject\.toml)`", text))
    assert len(paths) > 20
    for p in sorted(paths):
        if "<" in p or "my_attention" in p:  # a template: its folder must exist
            p = p.rsplit("/", 1)[0]
        assert (ROOT / p).exists(), f"docs/architecture.md names {p}, which does not exist"


def test_importing_zoo_registers_nothing_global():
    """Nothing runs at import (docs/architecture.md): zoo's OmegaConf resolvers are registered on
    first use (compose, validate, rule loading), in a fresh process."""
    code = ("import zoo, zoo.compiler.spec, zoo.compiler.checkpoint.rules, zoo.compiler.config as c\n"
            "from omegaconf import OmegaConf\n"
            "from zoo.compiler.resolvers import RESOLVERS\n"
            "assert not any(OmegaConf.has_resolver(n) for n in RESOLVERS), 'registered at import'\n"
            "c.compose('gemma2_9b_tiny')\n"
            "assert all(OmegaConf.has_resolver(n) for n in RESOLVERS)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
