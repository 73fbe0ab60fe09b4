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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CheckpointFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (little-endian prefix added per file)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
# GGML types stored as plain elements (everything else is blocks: uint8 rows of bytes)
_PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


class GGUFFormatError(CheckpointFormatError, ValueError):
    """The file is not a well-formed GGUF file (bad magic, version, truncated header, a length,
    count, type id, shape or offset the format does not allow). The message names the field and
    what was expected; GGUFSource adds the file."""


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
    # each key's GGUF value type: a type id, or (9, element type id) for an array
    types: dict[str, Any] = field(default_factory=dict)


# llama.cpp's limits after CVE-2025-53630 / CVE-2026-27940 (ggml/src/gguf.cpp), checked before any
# count or length is used to allocate or loop
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays (ggml refuses any; gguf-py writes them)
_INT64_MAX = 2**63 - 1
_MIN_KV = 8 + 4 + 1  # the fewest bytes one metadata pair takes: key length, value type, a u8
_MIN_TENSOR = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_MIN_ITEM = {_STRING: 8, _ARRAY: 12}  # an empty string; an empty array (type, count)


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0
        self._structs: dict[str, struct.Struct] = {}
        self._u64 = struct.Struct(order + "Q")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, fmt: str, what: str = "header"):
        s = self._structs.get(fmt) or self._structs.setdefault(fmt, struct.Struct(self.order + fmt))
        try:
            values = s.unpack_from(self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError(f"truncated {what} at byte {self.pos} (the file has {len(self.buf)} bytes)") from None
        self.pos += s.size
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.take("Q", f"{what} length")
        if n > self.left():
            raise GGUFFormatError(f"truncated {what}: declares {n} bytes at byte {self.pos}, {self.left()} left")
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            out = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} at byte {self.pos} is not UTF-8 ({e.reason} at its byte {e.start})") from None
        self.pos += n
        return out

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype == _STRING:
            return self.string(f"string value of {key!r}")
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], f"value of {key!r}")
        if vtype == _ARRAY:
            at = self.pos
            itype, n = self.take("IQ", f"array header of {key!r}")
            if itype not in _SCALARS and itype not in _MIN_ITEM:
                raise GGUFFormatError(f"{key!r}: array of unknown value type {itype} at byte {at} "
                                      f"(expected 0-12)")
            if itype == _ARRAY and depth + 1 >= MAX_NESTING:
                raise GGUFFormatError(f"{key!r}: arrays nested more than {MAX_NESTING} deep at byte {at}")
            width = struct.calcsize(_SCALARS[itype]) if itype in _SCALARS else _MIN_ITEM[itype]
            if n * width > self.left():  # before looping or allocating n of anything
                raise GGUFFormatError(f"truncated array {key!r}: declares {n} values at byte {at}, at least "
                                      f"{n * width} bytes, {self.left()} left")
            if itype == _STRING:
                return [self.string(f"string {i} of {key!r}") for i in range(n)]
            if itype in _NUMPY:  # one numpy read, then Python values
                dt = np.dtype(_NUMPY[itype]).newbyteorder(self.order)
                out = np.frombuffer(self.buf, dt, n, self.pos).tolist()
                self.pos += n * dt.itemsize
                return out
            return [self.value(itype, key, depth + 1) for _ in range(n)]  # arrays of arrays
        raise GGUFFormatError(f"{key!r}: unknown metadata value type {vtype} at byte {self.pos - 4} (expected 0-12)")


def read_index(path: str, block_sizes: dict[int, tuple[int, int]]) -> GGUFIndex:
    """Parse the header of the GGUF file at `path`. block_sizes: GGML type -> (elements per
    block, bytes per block) (gguf.GGML_QUANT_SIZES). Raises GGUFFormatError for a malformed file,
    OSError when it cannot be read.

    Every count and length is checked against the bytes left before it is used, every tensor's
    shape, type and offset as llama.cpp's gguf.cpp checks them (docs/security.md): nothing of the
    header is trusted to size a loop or an allocation, and no two tensors share a byte."""
    try:
        # read-only and shared, as llama.cpp maps it: no commit charge, so a file larger than the
        # machine maps (and the fit check, not mmap, refuses it); views handed to modules are never written
        data = np.memmap(path, mode="r")
    except ValueError as e:  # an empty file
        raise GGUFFormatError(str(e)) from None
    buf = memoryview(data)
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError(f"GGUF magic invalid (bytes 0-3 are {bytes(buf[:4])!r}, expected {MAGIC!r})")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0] if len(buf) >= 8 else 0
    if version & 0xFFFF == 0 and version:  # written on a big-endian host
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in VERSIONS:
        endian = " (read big-endian: its low bytes are zero)" if order == ">" else ""
        raise GGUFFormatError(f"GGUF version {version}{endian} (supported: {', '.join(map(str, VERSIONS))})")
    cur = _Cursor(buf, order)
    cur.pos = 8
    n_tensors, n_fields = cur.take("QQ", "tensor and metadata counts")
    if n_tensors * _MIN_TENSOR + n_fields * _MIN_KV > cur.left():
        raise GGUFFormatError(f"the header declares {n_tensors} tensors and {n_fields} metadata keys, more than "
                              f"the {cur.left()} bytes after the counts can hold (truncated or corrupt file)")
    fields: dict[str, Any] = {}
    types: dict[str, Any] = {}
    for i in range(n_fields):
        key = cur.string(f"metadata key {i}")
        if key in fields:
            raise GGUFFormatError(f"duplicate metadata key {key!r}")
        vtype = cur.take("I", f"value type of {key!r}")
        if vtype == _ARRAY:  # the element type, read again by value()
            types[key] = (vtype, cur.take("I", f"array type of {key!r}"))
            cur.pos -= 4
        else:
            types[key] = vtype
        fields[key] = cur.value(vtype, key)
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        n_dims = cur.take("I", f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r}: n_dims={n_dims}, expected at most {MAX_DIMS} (GGML_MAX_DIMS)")
        shape = tuple(cur.take("Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        ggml_type, offset = cur.take("IQ", f"type and offset of tensor {name!r}")
        infos.append((name, ggml_type, shape, offset))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in types and types["general.alignment"] != 4:
        raise GGUFFormatError(f"general.alignment is stored as GGUF type {types['general.alignment']}: expected "
                              f"4 (UINT32)")
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"general.alignment={align!r}: expected a power of two")
    start = -(-cur.pos // align) * align
    tensors: dict[str, GGUFTensor] = {}
    expected = 0  # where the next tensor's data must start: gguf-py and llama.cpp lay them out in order
    for name, ggml_type, shape, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"duplicate tensor {name!r}")
        if ggml_type not in block_sizes:
            raise GGUFFormatError(f"tensor {name!r}: unknown GGML type {ggml_type}")
        block, size = block_sizes[ggml_type]
        numel = 1
        for d in shape:  # ggml's overflow checks: every count fits int64
            numel *= d
            if numel > _INT64_MAX:
                raise GGUFFormatError(f"tensor {name!r}: shape {list(shape)} has more than 2^63-1 elements")
        if (shape[0] if shape else 1) % block:
            raise GGUFFormatError(f"tensor {name!r}: rows of {shape[0] if shape else 1} values are not whole "
                                  f"blocks of {_type_name(ggml_type)} ({block} values per block)")
        n_bytes = numel * size // block
        if offset != expected:
            why = "overlaps the tensor before it" if offset < expected else "leaves a gap after the tensor before it"
            if offset % align:
                why = f"is not a multiple of the file's alignment ({align})"
            raise GGUFFormatError(f"tensor {name!r}: data offset {offset} {why}; expected {expected} (tensors "
                                  f"stored in order, each padded to general.alignment={align})")
        if start + offset + n_bytes > len(buf):
            raise GGUFFormatError(f"tensor {name!r}: data at {start + offset}+{n_bytes} bytes lies past the "
                                  f"end of the file ({len(buf)} bytes)")
        expected = offset + -(-n_bytes // align) * align
        tensors[name] = GGUFTensor(name, ggml_type, shape, start + offset, n_bytes)
        last_end = start + offset + n_bytes
    if tensors and len(buf) not in (last_end, start + expected):
        # the file ends with its last tensor (padded or not): bytes beyond it are a type or shape
        # that does not match what was written (an F32 norm read as Q8_0 would fit otherwise)
        raise GGUFFormatError(f"the file has {len(buf)} bytes, but its tensors end at byte {last_end} (padded: "
                              f"{start + expected}): {len(buf) - last_end} trailing bytes no tensor holds")
    return GGUFIndex(version, order, fields, tensors, start, data, types)


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
