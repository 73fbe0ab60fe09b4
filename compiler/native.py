"""Build and load zoo's own C++ torch ops (a `.cpp` beside the Python module that uses it).

Each source is compiled on first use with the C++ compiler inductor uses (g++ by default, $CXX)
against the installed torch, into the zoo cache (keyed by the source, torch version, compiler and
flags: a changed file or torch builds a new library), and loaded with torch.ops.load_library.
Where no compiler works, `load` says why and the caller runs its torch-op reference instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .cache_root import zoo_cache_root


def flags() -> list[str]:
    """Vector flags when torch itself dispatches AVX2 or better on this CPU (AVX2 machines have
    FMA and F16C; CPU_CAPABILITY_AVX2 selects ATen's AVX2 `Vectorized`), else portable loops."""
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-DNDEBUG"] + \
        (["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"] if vector else [])


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if found is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
    return found


def build(source: Path) -> Path:
    """source.cpp -> <zoo cache>/kernels/<stem>-<key>.so (built once per key; atomic)."""
    cxx = _compiler()
    torch_dir = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd = [cxx, *flags(), abi, f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}",
           str(source), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch",
           f"-Wl,-rpath,{torch_dir / 'lib'}"]
    key = hashlib.sha256("\0".join([source.read_text(), torch.__version__, *cmd]).encode()).hexdigest()[:16]
    out = zoo_cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.so")
    proc = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines()[-1:]
        raise RuntimeError(f"{cxx} could not build {source.name}: {' / '.join(errors[:3])}")
    tmp.replace(out)  # atomic: a concurrent process sees the whole library or none
    return out


@functools.cache
def load(source: Path) -> str | None:
    """Build (once per cache) and load the library of `source`; None when it works, else why."""
    try:
        torch.ops.load_library(str(build(source)))
    except (RuntimeError, OSError) as e:
        return str(e).splitlines()[0]
    return None
