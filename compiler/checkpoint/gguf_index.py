"""The header of a GGUF file (metadata and tensor index), read in one pass with `struct`.

    read_index(path) -> GGUFIndex(version, fields {key: Python value}, tensors {name: GGUFTensor})

gguf-py's GGUFReader builds a numpy view for every part of every metadata value: a 49k-token
vocabulary with its merges is ~250k views, a visible part of every start-up of a small model
(scripts/profile_startup.py; scripts/results/design-measurements.md). This reader decodes values straight into Python objects (what
GGUFReader's `ReaderField.contents()` returns: int, float, bool, str, or a list of them) and maps
tensor data lazily, as the same numpy arrays GGUFReader hands out (typed for F32/F16/..., uint8
[..., bytes per row] for block types). llama.cpp's format spec: gguf.md in ggml's repository.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (little-endian prefix added per file)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
# GGML types stored as plain elements (everything else is blocks: uint8 rows of bytes)
_PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file (bad magic, version, truncated header, ...)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the index. shape: GGUF order (fastest-varying dim first); offset: absolute
    byte offset of its data in the file; n_bytes: stored bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass
class GGUFIndex:
    version: int
    byte_order: str  # "<" or ">"
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_offset: int
    memmap: np.memmap  # tensor data views share this one mapping


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0
        self._structs: dict[str, struct.Struct] = {}
        self._u64 = struct.Struct(order + "Q")

    def take(self, fmt: str):
        s = self._structs.get(fmt) or self._structs.setdefault(fmt, struct.Struct(self.order + fmt))
        try:
            values = s.unpack_from(self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError(f"truncated header at byte {self.pos}") from None
        self.pos += s.size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        try:
            n = self._u64.unpack_from(self.buf, self.pos)[0]
        except struct.error:
            raise GGUFFormatError(f"truncated header at byte {self.pos}") from None
        self.pos += 8
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"truncated string of {n} bytes at byte {self.pos}")
        raw = bytes(self.buf[self.pos:end])
        self.pos = end
        return raw.decode("utf-8")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _ARRAY:
            itype, n = self.take("IQ")
            if itype == _STRING:
                return [self.string() for _ in range(n)]
            if itype in _NUMPY:  # one numpy read, then Python values
                dt = np.dtype(_NUMPY[itype]).newbyteorder(self.order)
                end = self.pos + n * dt.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"truncated array of {n} values at byte {self.pos}")
                out = np.frombuffer(self.buf, dt, n, self.pos).tolist()
                self.pos = end
                return out
            return [self.value(itype) for _ in range(n)]  # arrays of arrays
        raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")


def read_index(path: str, block_sizes: dict[int, tuple[int, int]]) -> GGUFIndex:
    """Parse the header of the GGUF file at `path`. block_sizes: GGML type -> (elements per
    block, bytes per block) (gguf.GGML_QUANT_SIZES). Raises GGUFFormatError for a malformed file,
    OSError when it cannot be read."""
    try:
        # read-only and shared, as llama.cpp maps it: no commit charge, so a file larger than the
        # machine maps (and the fit check, not mmap, refuses it); views handed to modules are never written
        data = np.memmap(path, mode="r")
    except ValueError as e:  # an empty file
        raise GGUFFormatError(str(e)) from None
    buf = memoryview(data)
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError("GGUF magic invalid")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0] if len(buf) >= 8 else 0
    if version & 0xFFFF == 0 and version:  # written on a big-endian host
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (supported: {', '.join(map(str, VERSIONS))})")
    cur = _Cursor(buf, order)
    cur.pos = 8
    n_tensors, n_fields = cur.take("QQ")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        if key in fields:
            raise GGUFFormatError(f"duplicate metadata key {key!r}")
        fields[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("I")
        shape = tuple(cur.take("Q") for _ in range(n_dims))
        ggml_type, offset = cur.take("IQ")
        infos.append((name, ggml_type, shape, offset))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"general.alignment={align!r}: expected a power of two")
    start = -(-cur.pos // align) * align
    tensors: dict[str, GGUFTensor] = {}
    for name, ggml_type, shape, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"duplicate tensor {name!r}")
        if ggml_type not in block_sizes:
            raise GGUFFormatError(f"tensor {name!r}: unknown GGML type {ggml_type}")
        block, size = block_sizes[ggml_type]
        if offset % align:
            raise GGUFFormatError(f"tensor {name!r}: data offset {offset} is not a multiple of the file's "
                                  f"alignment ({align})")
        if shape and shape[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: rows of {shape[0]} values are not whole blocks of "
                                  f"{_type_name(ggml_type)} ({block} values per block)")
        n_bytes = int(np.prod(shape, dtype=np.int64)) * size // block
        if start + offset + n_bytes > len(buf):
            raise GGUFFormatError(f"tensor {name!r}: data at {start + offset}+{n_bytes} bytes lies past the "
                                  f"end of the file ({len(buf)} bytes)")
        tensors[name] = GGUFTensor(name, ggml_type, shape, start + offset, n_bytes)
    return GGUFIndex(version, order, fields, tensors, start, data)


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"GGML type {ggml_type}"


def tensor_data(index: GGUFIndex, t: GGUFTensor, block_sizes: dict[int, tuple[int, int]]) -> np.ndarray:
    """The stored data of `t` as GGUFReader presents it: typed elements in torch order for plain
    types, uint8 [..., bytes per row] for block types (a view of the memory map)."""
    raw = index.memmap[t.offset:t.offset + t.n_bytes]
    dims = tuple(reversed(t.shape))
    if t.ggml_type in _PLAIN:
        return raw.view(np.dtype(_PLAIN[t.ggml_type]).newbyteorder(index.byte_order)).reshape(dims)
    block, size = block_sizes[t.ggml_type]
    return raw.reshape(*dims[:-1], dims[-1] // block * size)
