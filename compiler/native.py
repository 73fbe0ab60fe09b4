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


# instruction-set levels zoo's kernels are built for, best first: the CPU flags each needs
# (/proc/cpuinfo's names) and the compiler flags it builds with
ISAS = {
    "avx512_vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                    ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    # (Skylake-X, Cascade Lake without VNNI): 512-bit vectors, maddubs + madd for the integer dots
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
               ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "portable": ((), []),
}
ISA_ENV = "ZOO_CPU_ISA"  # forces a level (tests run the AVX2 kernels on an AVX512 machine this way)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def isa() -> str:
    """The instruction-set level the kernels are built for: $ZOO_CPU_ISA if set (it must be one
    this CPU runs), else the best level of ISAS this CPU has. AVX2 and up also need torch itself
    to dispatch AVX2 or better (its `Vectorized` headers are compiled for CPU_CAPABILITY_AVX2)."""
    have = cpu_flags()
    torch_vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    usable = [name for name, (need, _) in ISAS.items() if set(need) <= have and (torch_vector or not need)]
    forced = os.environ.get(ISA_ENV)
    if forced is not None:
        if forced not in ISAS:
            raise ValueError(f"${ISA_ENV}={forced!r}: expected one of {', '.join(ISAS)}")
        if forced not in usable:
            raise ValueError(f"${ISA_ENV}={forced!r}: this CPU lacks "
                             f"{', '.join(sorted(set(ISAS[forced][0]) - have)) or 'torch AVX2 dispatch'}; "
                             f"it runs {', '.join(usable)}")
        return forced
    return usable[0]


def flags() -> list[str]:
    """Compiler flags for this process's ISA level (isa()): the vector extensions, and
    CPU_CAPABILITY_AVX2 (ATen's AVX2 `Vectorized`) from AVX2 up, else portable loops."""
    vector = ISAS[isa()][1]
    return ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-DNDEBUG"] + \
        (vector + ["-DCPU_CAPABILITY_AVX2"] if vector else [])


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
