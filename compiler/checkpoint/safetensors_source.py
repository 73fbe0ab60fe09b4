"""Safetensors checkpoints: a single file, a directory, or a sharded directory with an index.

Headers are parsed by hand (8-byte little-endian length + JSON) so that a truncated or corrupt
file is reported with its name before any tensor is read. Data is read by offset with plain
reads, one tensor at a time, straight into its parameter where no rule transforms it: no memory
map, so a shard's pages never count against the process (peak memory stays near the weights).
Pickle checkpoints are refused, never loaded.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..contracts import Source, TensorInfo
from ..errors import CheckpointError, CheckpointFormatError

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
_DTYPE_BYTES = {name: dt.itemsize for name, dt in _DTYPES.items()}


def read_header(path: Path, problems: list[str] | None = None) -> dict[str, TensorInfo]:
    """Tensor infos of one .safetensors file, from its header, checked as the format's own
    reader checks it (docs/security.md) before any tensor is read or allocated: a header of at
    most 100 MB inside the file, UTF-8 JSON, an object without duplicate keys; each tensor a known
    dtype, a shape of non-negative ints and data_offsets [begin, end] holding exactly its bytes;
    the tensors tiling the data section with no gap or overlap (two tensors sharing bytes would
    load as another model), the last ending where the file does; `__metadata__` a str -> str map.

    A data section whose size is not the one the header declares is an error, or, when
    `problems` is given, a line appended to it (`zoo check` reports it and goes on: it never
    reads tensor data). Every other fault raises CheckpointFormatError naming the file and field.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointFormatError(f"{path}: corrupt safetensors header (declares {n} header bytes, "
                                            f"expected at most {min(_MAX_HEADER, size - 8)}: the file has {size})")
            text = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    header = _parse(path, text)
    data_size = size - 8 - n
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header: __metadata__ = {str(meta)[:200]}: "
                                    f"expected a map of strings to strings")
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        dtype, shape, (start, end) = _entry(path, name, entry)
        width = _DTYPE_BYTES[dtype]
        numel = 0 if 0 in shape else 1
        for s in shape if numel else ():  # checked multiplication: stops once past the declared bytes
            numel *= s
            if numel * width > end - start:
                break
        if numel * width != end - start:
            expected = "more than that" if numel * width > end - start else numel * width
            raise CheckpointFormatError(f"{path}: tensor {name!r} {dtype}{list(shape)} declares {end - start} "
                                        f"bytes (data_offsets [{start}, {end}]), expected {expected} "
                                        f"(corrupt header)")
        spans.append((start, end, name))
        out[name] = TensorInfo(shape=shape, dtype=dtype, file=str(path), nbytes=end - start, offset=8 + n + start)
    at, before = 0, None
    for start, end, name in sorted(spans):  # the tensors tile [0, declared end) in offset order
        if start != at:
            what = f"overlaps {before!r}" if start < at else f"leaves bytes [{at}, {start}) unused"
            raise CheckpointFormatError(f"{path}: tensor {name!r} data_offsets [{start}, {end}] {what}; expected "
                                        f"it to start at {at} (tensors stored back to back, no gaps or overlaps)")
        at, before = end, name
    if at != data_size:
        cut = at > data_size
        line = (f"{path}: the header declares {at} bytes of data but the data section has {data_size} bytes "
                f"({'truncated or corrupt file' if cut else 'trailing bytes no tensor holds: corrupt file'})")
        if problems is None or not cut:
            raise CheckpointFormatError(line)
        short = [name for start, end, name in spans if end > data_size]
        problems.append(f"{line}: {len(short)} of {len(out)} tensors cut off, e.g. {short[0]!r}")
    return out


def _parse(path: Path, text: bytes) -> dict:
    """The header's JSON object; duplicate keys, non-UTF-8 bytes, NaN literals and anything but
    an object are refused (json would keep the last duplicate silently)."""
    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise CheckpointFormatError(f"{path}: corrupt safetensors header: key {key!r} appears twice")
            seen[key] = value
        return seen

    def constant(name):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header: {name} is not JSON")

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: corrupt safetensors header ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, expected "
                                    f"an object {{tensor name: {{dtype, shape, data_offsets}}}}")
    return header


def _entry(path: Path, name: str, entry) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one header entry, each of the type the format states."""
    def bad(what: str):
        return CheckpointFormatError(f"{path}: corrupt header entry for tensor {name!r}: {what} "
                                     f"(entry {str(entry)[:200]})")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise bad("expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPE_BYTES:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has unsupported dtype {str(dtype)[:50]} "
                                    f"(supported: {', '.join(_DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise bad(f"shape {str(shape)[:100]}: expected a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {str(offsets)[:100]}: expected [begin, end], integers with 0 <= begin <= end")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def refuse_pickles(directory: Path) -> None:
    """Raise if the directory holds only pickle weights (which can run code when loaded)."""
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle checkpoint files found ({', '.join(pickles[:5])}); zoo never "
            f"loads pickles (they can execute code). Convert them to safetensors first.")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor: shard file}; a shard must be a file name in the index's directory
    (never a path that leaves it: `../` or absolute)."""
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: not a valid safetensors index: expected an object whose weight_map maps "
                              f"tensor names to shard file names")
    for name, shard in weight_map.items():
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: tensor {name!r} is listed in shard {shard!r}: expected a file name in "
                                  f"{index.parent} (no directories)")
    return weight_map


class SafetensorsSource(Source):
    """A directory with model.safetensors, or shards listed by model.safetensors.index.json."""

    reads_parts = True  # read_part: one rank's part by offset

    def __init__(self, directory: str | Path, verify_data: bool = True):
        self.directory = Path(directory)
        self.data_problems: list[str] | None = None if verify_data else []
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        index = self.directory / INDEX
        if index.exists():
            weight_map: dict[str, str] = _weight_map(index)
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).exists()]
            if missing:
                raise CheckpointError(f"{index}: shard(s) listed in the index are missing: {missing}")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                refuse_pickles(self.directory)
                raise CheckpointError(f"{self.directory}: no *.safetensors files and no {INDEX}")
            weight_map = None
        self._entries: dict[str, TensorInfo] = {}
        self._order: list[list[str]] = []
        for fname in files:
            infos = read_header(self.directory / fname, self.data_problems)
            names = []
            for name, info in infos.items():
                if weight_map is not None and weight_map.get(name) != fname:
                    raise CheckpointError(f"{self.directory / fname}: tensor {name!r} is not listed for this "
                                          f"shard in {INDEX}")
                if name in self._entries:
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is stored twice "
                                          f"({self._entries[name].file} and {fname})")
                self._entries[name] = info
                names.append(name)
            self._order.append(names)
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self._entries))
            if absent:
                raise CheckpointError(f"{index}: tensors listed but absent from their shards: {absent[:10]}")
        self.description = f"{self.directory} ({len(files)} safetensors file{'s' if len(files) > 1 else ''})"
        self._open: tuple[str, object] | None = None  # (path, file object): one file open at a time

    def entries(self) -> dict[str, TensorInfo]:
        return self._entries

    def read_order(self) -> list[list[str]]:
        return self._order

    def read(self, name: str) -> torch.Tensor:
        info = self._entries[name]
        out = torch.empty(info.shape, dtype=_DTYPES[info.dtype])
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` (contiguous, CPU, the stored dtype and shape) with the tensor's bytes."""
        info = self._entries[name]
        if (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != _DTYPES[info.dtype]
                or tuple(out.shape) != info.shape):
            return False
        if self._open is None or self._open[0] != info.file:
            self.close()
            self._open = (info.file, open(info.file, "rb", buffering=0))
        f = self._open[1]
        f.seek(info.offset)
        view = memoryview(out.detach().view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        done = 0
        while done < info.nbytes:  # readinto may return short counts on large reads
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{info.file}: tensor {name!r} is cut short at byte {done} of "
                                      f"{info.nbytes} (file truncated while loading?)")
            done += n
        return True

    def read_part(self, name: str, part) -> torch.Tensor:
        """One rank's part of a tensor (a contracts.Slice): only its bytes are read, by offset.
        Along the outermost cut dimension each range is read for every outer index (one read per
        range when that dimension is the first); cuts on inner dimensions are applied afterwards."""
        info = self._entries[name]
        shape = info.shape
        d, ranges = part.cuts[0]
        outer = 1
        for n in shape[:d]:
            outer *= n
        inner = 1
        for n in shape[d + 1:]:
            inner *= n
        width = _DTYPE_BYTES[info.dtype]
        local = sum(b - a for a, b in ranges)
        out = torch.empty(outer, local, inner, dtype=_DTYPES[info.dtype])
        flat = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
        self._file(info.file)
        f = self._open[1]
        row = shape[d] * inner * width  # bytes of one outer index
        for o in range(outer):
            pos = 0
            for a, b in ranges:
                n = (b - a) * inner * width
                start = (o * local + pos) * inner * width
                f.seek(info.offset + o * row + a * inner * width)
                view = memoryview(flat[start:start + n])
                done = 0
                while done < n:
                    got = f.readinto(view[done:])
                    if not got:
                        raise CheckpointError(f"{info.file}: tensor {name!r} is cut short (file truncated "
                                              f"while loading?)")
                    done += got
                pos += b - a
        t = out.view(*shape[:d], local, *shape[d + 1:])
        rest = type(part)(part.local_shape(), part.cuts[1:]) if len(part.cuts) > 1 else None
        return t if rest is None else rest.apply(t)

    def _file(self, path: str) -> None:
        if self._open is None or self._open[0] != path:
            self.close()
            self._open = (path, open(path, "rb", buffering=0))

    def config(self) -> dict:
        path = self.directory / "config.json"
        if not path.exists():
            raise CheckpointError(f"{self.directory}: no config.json")
        try:
            config = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: a JSON {type(config).__name__}, expected an object of config keys")
        return config

    def format_stages(self) -> list[str]:
        return []  # safetensors checkpoints carry the Hub names

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
        self._open = None
