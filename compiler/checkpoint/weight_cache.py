"""A cache of converted weights: the state a converting load produced, reused by later processes.

    cached_execute(plan, module, source, settings) -> LoadReport    (execute() through the cache)

A load that converts (GGUF blocks dequantized or repacked, weights quantized at load) redoes the
same seconds of work in every process. After such a load the module's whole state (every
parameter and persistent buffer, in whatever layout its modules chose: nothing here knows what a
quantized linear keeps) is written as one safetensors file under $ZOO_CACHE_DIR/weights/; a later
build with the same key copies that state back instead of reading the checkpoint.

The key is a sha256 over
  - this cache's format, zoo's and torch's versions;
  - each checkpoint file's identity: real path, size and mtime (ns);
  - the load plan: every parameter, the stored tensors, ops and rules that fill it;
  - the module state before the load: every name, shape and dtype (the buffers' layout);
  - the source code of every module class in the model and of compiler/checkpoint and
    compiler/quant (a new packing with unchanged shapes still changes the key);
  - the settings: dtype, quant mode and group, device.
Any change misses and writes a new entry. A file that does not read back (truncated, not
safetensors, another key, other names, shapes or dtypes) is reported with a warning, deleted and
rebuilt from the checkpoint. Files are written to a temporary name and renamed (atomic), and the
oldest are evicted beyond ZOO_WEIGHT_CACHE_GB (default 8). Only converting loads are cached: a
checkpoint of plain float tensors loaded as it is would only be duplicated on disk. A load that
changes a buffer's shape (CUDA's tinygemm int4 tiles) is not cached. ZOO_WEIGHT_CACHE=0 turns the
cache off; ZOO_WEIGHT_CACHE=<dir> puts it elsewhere.

What it assumes of a module: whatever a load fills lives in its state_dict (parameters and
persistent buffers). A kind that kept loaded values elsewhere (a plain tensor attribute, a
non-persistent buffer) would come back without them from a hit: give such values a buffer.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .loader import LoadPlan, LoadReport, execute
from .safetensors_source import _DTYPES

FORMAT = 1  # bump when what is stored or how it is keyed changes
_FLOAT = {"F64", "F32", "F16", "BF16"}
_META_KEY = "zoo_weight_cache"
_PAD = "__pad__."  # padding tensors of the file (not state)
ALIGN = 64  # bytes: where every tensor of an entry starts


class WeightCacheWarning(UserWarning):
    """A cache entry could not be used (it is rebuilt from the checkpoint)."""


def cache_dir() -> Optional[Path]:
    """Where converted weights persist: ZOO_WEIGHT_CACHE (a directory; 0/off/false: no cache),
    else $ZOO_CACHE_DIR/weights (default ~/.cache/zoo/weights)."""
    choice = os.environ.get("ZOO_WEIGHT_CACHE", "")
    if choice.lower() in ("0", "off", "false", "no"):
        return None
    if choice and choice.lower() not in ("1", "on", "true", "yes"):
        return Path(choice)
    return Path(os.environ.get("ZOO_CACHE_DIR") or Path.home() / ".cache" / "zoo") / "weights"


def _max_bytes() -> int:
    return int(float(os.environ.get("ZOO_WEIGHT_CACHE_GB", "8")) * 2**30)


def converts(plan: LoadPlan, settings: dict) -> bool:
    """Whether the load does work worth caching: a stored dtype that is not a plain float, or
    quantization at load."""
    stored = {s.dtype for a in plan.assignments for s in a.node.stored()}
    return bool(settings.get("quant")) or not stored <= _FLOAT


def _signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in module.state_dict().items()]


@functools.cache
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _code_digest(module: nn.Module) -> str:
    """The source of every module class in `module` and of the packages that load and pack."""
    here = Path(__file__).resolve().parent
    files = {str(p) for d in (here, here.parent / "quant") for p in d.glob("*.py")}
    for cls in {type(m) for m in module.modules()}:  # each class once (inspect is slow per call)
        try:
            files.add(str(Path(inspect.getsourcefile(cls)).resolve()))
        except (TypeError, OSError):
            pass
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{Path(f).name}:{_file_digest(f)}\n".encode())
    return h.hexdigest()


def _versions() -> str:
    from importlib import metadata

    try:
        zoo = metadata.version("zoo")
    except metadata.PackageNotFoundError:
        zoo = "unknown"
    return f"zoo {zoo}, torch {torch.__version__}"


def cache_key(plan: LoadPlan, module: nn.Module, settings: dict) -> str:
    """The sha256 (hex) that names the cache entry of this load (see the module docstring)."""
    files = sorted({s.info.file for a in plan.assignments for s in a.node.stored()})
    ident = []
    for f in files:
        st = os.stat(f)
        ident.append((os.path.realpath(f), st.st_size, st.st_mtime_ns))
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", _versions(), repr(ident), repr(plan.assignments), repr(_signature(module)),
                 _code_digest(module), json.dumps(settings, sort_keys=True, default=str)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@torch.no_grad()
def cached_execute(plan: LoadPlan, module: nn.Module, source, settings: dict, enabled: bool = True,
                   progress=None, **execute_kw) -> LoadReport:
    """`execute(plan, module, source)`, served from the cache when an entry for this key exists,
    and writing one after a converting load. settings: what else shapes the converted values
    (dtype, quant, quant_group, device); enabled=False: a plain execute. report.cache says what
    happened ("hit PATH", "wrote PATH"; None when the cache was not used). execute_kw go to
    `execute` as they are."""
    root = cache_dir()
    if not enabled or root is None or not converts(plan, settings):
        return execute(plan, module, source, progress=progress, **execute_kw)
    before = _signature(module)
    key = cache_key(plan, module, settings)
    path = root / f"{key[:40]}.safetensors"
    if path.exists():
        t0 = time.perf_counter()
        report = _restore(path, key, module)
        if report is not None:
            source.close()
            if progress is not None:
                progress(plan.bytes_to_read)
            report.seconds = time.perf_counter() - t0
            report.cache = f"hit {path}"
            return report
    report = execute(plan, module, source, progress=progress, **execute_kw)
    if _signature(module) != before:
        return report  # the load re-laid out a buffer: the next build's state would not match
    if _write(path, key, module, report):
        report.cache = f"wrote {path}"
    return report


def _restore(path: Path, key: str, module: nn.Module) -> Optional[LoadReport]:
    """Put the entry at `path` into `module`'s state; None (with a warning, the file deleted)
    when it does not read back as the entry of `key` for this state.

    On CPU the parameters and buffers become views of a private (copy-on-write) memory map of the
    file: nothing is copied, pages come from the page cache as the first forward touches them.
    Elsewhere the values are copied to the device."""
    state = module.state_dict(keep_vars=True)
    try:
        header, base, size = _read_header(path)
        meta = header.pop("__metadata__", {})
        header = {name: h for name, h in header.items() if not name.startswith(_PAD)}
        if meta.get(_META_KEY) != key:
            raise ValueError(f"the file's key {meta.get(_META_KEY)!r} is not this load's")
        aliases = json.loads(meta["aliases"])
        if set(header) | set(aliases) != set(state) or set(header) & set(aliases):
            missing, extra = set(state) - set(header) - set(aliases), set(header) - set(state)
            raise ValueError(f"names differ from the model's (missing {sorted(missing)[:3]}, "
                             f"extra {sorted(extra)[:3]})")
        end = 0
        for name, h in header.items():
            dest, (lo, hi) = state[name], h["data_offsets"]
            if h["shape"] != list(dest.shape) or h["dtype"] != _dtype_name(dest):
                raise ValueError(f"{name}: stored {h['dtype']} {h['shape']}, the model has {dest.dtype} "
                                 f"{list(dest.shape)}")
            if hi - lo != dest.numel() * dest.element_size() or lo < 0:
                raise ValueError(f"{name}: {hi - lo} bytes for {dest.numel()} values of {dest.dtype}")
            end = max(end, hi)
        if base + end != size:
            raise ValueError(f"{size} bytes on disk, the header describes {base + end}")
        report = LoadReport(**json.loads(meta["report"]))
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        for name, h in header.items():
            dest, at = state[name], base + h["data_offsets"][0]
            if dest.device.type == "cpu" and at % dest.element_size() == 0:
                dest.data = torch.empty(0, dtype=dest.dtype).set_(storage, at // dest.element_size(), dest.shape)
            else:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage, at, (dest.numel() * dest.element_size(),))
                dest.copy_(raw.clone().view(dest.dtype).view(dest.shape))  # clone: aligns
        for name, target in aliases.items():
            if state[name] is not state[target]:
                state[name].data = state[target].data
    except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt, never fatal
        warnings.warn(f"weight cache entry {path} is unusable ({type(e).__name__}: {e}); rebuilding it "
                      f"from the checkpoint", WeightCacheWarning, stacklevel=3)
        path.unlink(missing_ok=True)
        return None
    report.ignored = [tuple(x) for x in report.ignored]
    os.utime(path)  # recently used: evicted last
    return report


def _read_header(path: Path) -> tuple[dict, int, int]:
    """A safetensors file's header (JSON), where its data starts, and the file's size."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
        if not 0 < n <= size - 8:
            raise ValueError(f"header length {n} in a file of {size} bytes")
        return json.loads(f.read(n)), 8 + n, size


def _dtype_name(t: torch.Tensor) -> str:
    return next((k for k, v in _DTYPES.items() if v == t.dtype), str(t.dtype))


def _write(path: Path, key: str, module: nn.Module, report: LoadReport) -> bool:
    """Write the entry atomically; False (with a warning) when it cannot be written.

    A safetensors file whose every tensor starts at a multiple of ALIGN bytes (padding tensors
    `__pad__.N` fill the gaps; the format allows no holes): mapped back, each tensor has the
    alignment a fresh allocation has, and CPU kernels, whose summation order may follow the
    alignment (MKL's vector paths), give the very same results as after a fresh load."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in module.state_dict().items():
        ident = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:  # a tied parameter: stored once
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        tensors[name] = t
    if sum(t.numel() * t.element_size() for t in tensors.values()) > _max_bytes():
        return False  # checked before any copy to the host
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    header, offset, parts = {}, 0, []
    for name, t in tensors.items():
        if pad := -offset % ALIGN:
            header[f"{_PAD}{len(parts)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            parts.append(bytes(pad))
            offset += pad
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _dtype_name(t), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        parts.append(t.reshape(-1).view(torch.uint8).numpy())
        offset += n
    info = {**asdict(report), "cache": None}
    header["__metadata__"] = {_META_KEY: key, "aliases": json.dumps(aliases), "report": json.dumps(info)}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % ALIGN)  # the data starts aligned too
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"could not write the weight cache entry {path} ({e})", WeightCacheWarning, stacklevel=3)
        return False
    _evict(path.parent, keep=path)
    return True


def _evict(root: Path, keep: Path) -> None:
    """Delete the least recently used entries beyond ZOO_WEIGHT_CACHE_GB."""
    entries = []
    for p in root.glob("*.safetensors"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= _max_bytes():
            break
        if p != keep:
            p.unlink(missing_ok=True)
            total -= size
