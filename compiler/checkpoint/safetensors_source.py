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
from ..errors import CheckpointError

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
_DTYPE_BYTES = {name: dt.itemsize for name, dt in _DTYPES.items()}


def read_header(path: Path, problems: list[str] | None = None) -> dict[str, TensorInfo]:
    """Tensor infos of one .safetensors file, from its header; checks the data section's size.

    A data section too short for the header is an error, or, when `problems` is given, a line
    appended to it (`zoo check` reports it and goes on: it never reads tensor data).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (declares {n} header bytes, "
                                      f"file has {size})")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    short: list[str] = []  # tensors whose bytes lie beyond the data section
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {meta!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        width = _DTYPE_BYTES.get(dtype)
        if width is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if end - start != numel * width:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} declares {end - start} bytes, "
                                  f"expected {numel * width} (corrupt header)")
        if end > data_size:
            if problems is None:
                raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs bytes [{start}, {end}) "
                                      f"but the data section has {data_size} bytes (truncated or corrupt file)")
            short.append(name)
        out[name] = TensorInfo(shape=shape, dtype=dtype, file=str(path), nbytes=end - start, offset=8 + n + start)
    if short:  # one line per file, however many tensors it cuts off
        needed = max(info.nbytes + int(header[k]["data_offsets"][0]) for k, info in out.items())
        problems.append(f"{path}: the header declares {needed} bytes of data but the data section has "
                        f"{data_size} bytes (truncated or corrupt file): {len(short)} of {len(out)} tensors "
                        f"cut off, e.g. {short[0]!r}")
    return out


def refuse_pickles(directory: Path) -> None:
    """Raise if the directory holds only pickle weights (which can run code when loaded)."""
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle checkpoint files found ({', '.join(pickles[:5])}); zoo never "
            f"loads pickles (they can execute code). Convert them to safetensors first.")


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
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
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
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from None

    def format_stages(self) -> list[str]:
        return []  # safetensors checkpoints carry the Hub names

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
        self._open = None
