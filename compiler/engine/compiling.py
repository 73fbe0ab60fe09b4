"""Compile settings and the compile backend of the two graphs, in one place.

Nothing here runs at import. `apply_compile_settings()` (when a compiling Engine is built) points
inductor's persistent caches at the zoo cache unless the user chose a directory; the dynamo
limits apply only inside zoo's graph calls (`dynamo_settings()`); inductor patches for CPU graphs
travel with the backend (`GraphCounter.config_patches`), not through global config.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import sys
import time
from pathlib import Path

import torch

from ..cache_root import zoo_cache_root


def compile_cache_dir() -> Path:
    """Where compiled graphs persist between processes: <zoo cache>/compile/torch-<version>.
    Inductor keys each artifact by its graph, shapes, dtypes and device; delete the folder to
    clear it."""
    return zoo_cache_root() / "compile" / f"torch-{torch.__version__}"


def inductor_cache_dir() -> Path:
    """Where inductor writes once zoo's settings apply: an explicit TORCHINDUCTOR_CACHE_DIR,
    else the zoo cache."""
    return Path(_user_cache_dir() or compile_cache_dir())


def _user_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR when the user chose it; None when unset or inductor's default."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        return None
    return current


def _use_compile_cache_dir() -> None:
    """Point inductor (FX graph, AOTAutograd and kernel caches) at the zoo cache. Inductor reads
    TORCHINDUCTOR_CACHE_DIR on every lookup but writes its default (/tmp/torchinductor_$USER)
    back into the environment the first time it runs, so an unset value and that default both
    mean "not chosen by the user"; anything else is an explicit setting and wins."""
    if _user_cache_dir() is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


def structure(block: torch.nn.Module, cache: dict) -> tuple:
    """What a layer's decode graph depends on besides tensor values: its submodules' classes and
    plain attributes (ints, flags, specs), its tensors' shapes, dtypes and strides, and its cache
    fields'. Layers with equal structures share one compiled decode function
    (runners/compiled.py) and one package (aot.py)."""
    parts: list = []
    for name, mod in block.named_modules():
        attrs = []
        for k, v in sorted(vars(mod).items()):
            if k.startswith("_") or isinstance(v, (torch.Tensor, torch.nn.Module)) or callable(v):
                continue
            try:
                hash(v)
            except TypeError:
                v = repr(v)
            attrs.append((k, v))
        parts.append((name, type(mod).__qualname__, tuple(attrs)))
    for name, t in itertools.chain(block.named_parameters(), block.named_buffers(), sorted(cache.items())):
        parts.append((name, tuple(t.shape), t.dtype, t.stride()))
    return tuple(parts)


def outside_source_digest(block: torch.nn.Module) -> str:
    """sha256 over the source of the code outside zoo and torch that a layer runs: for every
    class in its module tree (bases included) from another package (a plugin's kind, registry.py),
    every loaded module of that class's top-level package. A package kept on disk (aot.py) is
    keyed by it, as by zoo's own source, so an edited plugin rebuilds its packages instead of
    running the old code. A plugin's code is its module or package (a helper in another
    top-level module is not seen)."""
    tops = sorted({c.__module__.split(".")[0] for mod in block.modules() for c in type(mod).__mro__}
                  - {"zoo", "torch", "builtins", "typing", "abc"})
    return _package_digest(tuple(tops)) if tops else ""


def _package_digest(tops: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in tops and path and os.path.isfile(path):
            h.update(name.encode())
            h.update(Path(path).read_bytes())
    return h.hexdigest()


# Every engine compiles the same two functions; distinct models add cache entries to them.
RECOMPILE_LIMIT = 256


def dynamo_settings():
    """The dynamo config zoo's graph calls run under, as a context (the user's own settings stay
    as they are outside it): room for every engine's entries in the two compiled functions, and
    hitting the limit fails loudly rather than falling back to eager."""
    cfg = torch._dynamo.config
    return cfg.patch(recompile_limit=max(cfg.recompile_limit, RECOMPILE_LIMIT), fail_on_recompile_limit_hit=True)


def apply_compile_settings() -> None:
    """The one place zoo sets process-wide compile state, called when a compiling Engine is
    built (never at import): the persistent compile cache, unless the user chose another."""
    _use_compile_cache_dir()


def cpu_compile_patches() -> dict:
    """Inductor config for CPU graphs: skip the per-process vector-ISA probe once it has passed.

    Inductor proves that each SIMD instruction set the CPU reports (avx2, avx512, ...) compiles
    and loads by building a probe library and dlopen-ing it in a child process, in every process
    (about 1 s, a third of a warm build). The verdict depends only on the CPU, the C++ compiler
    and torch, so it is recorded once in the compile cache; when every reported ISA passed,
    later processes tell inductor so (cpp.vec_isa_ok). Cold and warm processes make the same
    choice, which matters because the setting is part of inductor's cache key."""
    import json
    import platform

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_cpp_compiler

    if inductor_config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return {}  # the user decided, or a platform whose ISA list inductor does not probe
    flags = cpu_vec_isa.x86_isa_checker()  # what the CPU reports (cpuid), without probing
    reported = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in flags for flag in str(isa).split())]
    key = json.dumps({"isa": reported, "compiler": get_cpp_compiler(), "python": platform.python_version()})
    record = compile_cache_dir() / "vec_isa.json"
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # inductor's own probe
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(record)
    return {"cpp.vec_isa_ok": True} if known[key] == reported else {}


@functools.cache
def kernel_sources_digest() -> str:
    """sha256 (16 hex) over zoo's C++ op sources: inductor's cache key sees a custom op's name in
    the graph, not what the op computes or which arguments it takes, so a graph compiled against
    another version of the kernels must not be served from the persistent cache."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.cpp")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def _cache_key_pass() -> type:
    """The post-grad pass class below, defined on first use: importing inductor's pass module
    writes inductor's default cache dir into the environment, which importing zoo must not."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CacheKey(CustomGraphPass):
        """A no-op post-grad pass whose uuid joins inductor's cache key. Prefill graphs carry the
        prompt-length range [2, max_seq] of the engine that compiled them; a graph whose inputs do
        not depend on max_seq (a ring-buffer or recurrent layer) would otherwise be served from the
        persistent cache to an engine with another range, and the replayed range conflicts with it."""

        def __init__(self, key: str):
            self.key = key

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return self.key

    return CacheKey


class GraphCounter:
    """A torch.compile backend that counts the graphs it is asked to compile (then runs inductor)."""

    def __init__(self, name: str, cache_key: str, patches: dict):
        self.name = name
        self.graphs = 0
        self.seconds = 0.0
        self.cache_key, self.patches = cache_key, patches

    @functools.cached_property
    def config_patches(self) -> dict:
        """Inductor config of its graphs (made on the first compile: the pass imports inductor)."""
        return {"post_grad_custom_post_pass": _cache_key_pass()(self.cache_key), **self.patches}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        t0 = time.perf_counter()
        out = compile_fx(gm, example_inputs, config_patches=self.config_patches)
        self.seconds += time.perf_counter() - t0
        return out
