"""Structure-aware mutations of checkpoint files and an isolated runner for each case, shared by
tests/test_checkpoint_fuzz.py (a seeded sample) and scripts/fuzz_checkpoints.py (the long run).

    gguf_fields(data) -> [Field]          every header field of a GGUF file, by its byte offset
    gguf_makers(data, block_sizes)        makers of Patches: one field, type id, cut, alias, flip
    safetensors_makers(data)              makers of (label, kind, bytes) for a .safetensors file
    draw(makers, rng, n)                  n cases: each maker once, then at random
    Target(path).read(path)               what zoo makes of a file before allocating (fingerprint)
    run_case(target, path, kind, ...)     read() in a forked child under an address-space limit

A case's outcome is "refused" (a zoo error, named, the class recorded), "same" (the file reads
as the good one: the same index, so the same load), "as written" (a value mutation the file
states consistently: another model, as the file says), or a failure: "raw" (an exception that is
not a zoo error), "hang" (past the deadline), "crash" (the child died), "memory" (MemoryError
under the limit), "slow" (a refusal after 1 s of CPU time) or "different" (a structural mutation
that loads as another model: what the readers must never let through).
"""
from __future__ import annotations

import bisect
import json
import os
import pickle
import resource
import select
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

FAILURES = ("raw", "hang", "crash", "memory", "slow", "different")
DEADLINE_S = 1.0  # a refusal must come within this
MEMORY_BUDGET = 2 << 30  # address space a case may add to the parent's


# ----------------------------------------------------------------------------- GGUF structure

@dataclass(frozen=True)
class Field:
    """One fixed-width field of a GGUF header. role: magic, version, count (tensors, keys, array
    elements), length (a string's), vtype / itype (metadata value types), value (a scalar value),
    ndims, dim, ggml_type, offset."""

    at: int
    fmt: str  # struct format without byte order
    role: str
    label: str


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(data: bytes) -> tuple[list[Field], int]:
    """(every field of a little-endian GGUF header, the end of the tensor infos). Arrays of
    strings list their first and last few lengths only (a vocabulary has ~100k)."""
    fields: list[Field] = []
    pos = 0

    def take(fmt, role, label):
        nonlocal pos
        fields.append(Field(pos, fmt, role, label))
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string(label, keep=True):
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        if keep:
            fields.append(Field(pos, "Q", "length", label))
        pos += 8
        s = data[pos:pos + n].decode()
        pos += n
        return s

    take("4s", "magic", "magic")
    take("I", "version", "version")
    n_tensors = take("Q", "count", "tensor count")
    n_kv = take("Q", "count", "metadata key count")
    for _ in range(n_kv):
        key = string("key length")
        vtype = take("I", "vtype", f"{key}: value type")
        if vtype == 8:
            string(f"{key}: string length")
        elif vtype == 9:
            itype = take("I", "itype", f"{key}: array type")
            n = take("Q", "count", f"{key}: array count")
            for i in range(n):
                if itype == 8:
                    string(f"{key}[{i}]: string length", keep=i < 3 or i >= n - 2)
                else:
                    if i < 2:
                        fields.append(Field(pos, _SCALAR[itype], "value", f"{key}[{i}]"))
                    pos += struct.calcsize(_SCALAR[itype])
        else:
            take(_SCALAR[vtype], "value", key)
    for _ in range(n_tensors):
        name = string("tensor name length")
        n_dims = take("I", "ndims", f"{name}: n_dims")
        for d in range(n_dims):
            take("Q", "dim", f"{name}: ne[{d}]")
        take("I", "ggml_type", f"{name}: type")
        take("Q", "offset", f"{name}: offset")
    return fields, pos


def gguf_tensor_spans(data: bytes, block_sizes: dict) -> list[tuple[str, int, int]]:
    """(name, absolute start, end) of each tensor's data, from the good file's own header."""
    fields, end = gguf_fields(data)
    align = 32
    info, spans, name = {}, [], None
    for f in fields:
        if f.role == "ggml_type":
            name = f.label.rsplit(":", 1)[0]
            info[name] = [struct.unpack_from("<I", data, f.at)[0]]
        elif f.role == "offset":
            info[name].append(struct.unpack_from("<Q", data, f.at)[0])
    dims: dict[str, int] = {}
    for f in fields:
        if f.role == "dim":
            n = f.label.rsplit(":", 1)[0]
            dims[n] = dims.get(n, 1) * struct.unpack_from("<Q", data, f.at)[0]
    start = -(-end // align) * align
    for n, (t, off) in info.items():
        block, size = block_sizes[t]
        spans.append((n, start + off, start + off + dims.get(n, 1) * size // block))
    return spans


def _ints(v: int, bits: int, signed: bool) -> list[int]:
    top = 1 << bits
    values = {0, 1, v - 1, v + 1, 2 * v, v + (1 << (bits // 2)), top - 1, top >> 1, (top >> 1) - 1, v ^ (1 << (bits - 1))}
    if bits >= 32:
        values |= {1 << 31, 1 << 20, v << 8}
    out = []
    for x in values:
        x %= top
        if signed and x >= top >> 1:
            x -= top
        out.append(x)
    return sorted(set(out) - {v})


def field_values(f: Field, data: bytes) -> list:
    """The values a field is mutated to: boundaries and near-misses of its width; every type id."""
    (v,) = struct.unpack_from("<" + f.fmt, data, f.at)
    if f.role in ("vtype", "itype"):
        return [t for t in [*range(14), 255, 2**32 - 1] if t != v]
    if f.role == "ggml_type":
        return [t for t in [*range(42), 2**16, 2**32 - 1] if t != v]
    if f.fmt == "4s":
        return [b"GGUF"[::-1], b"GGML", b"\0\0\0\0"]
    if f.fmt in "fd":
        return [float("nan"), float("inf"), -1.0, 0.0, 1e30, v * 2 if v == v else 1.0]
    if f.fmt == "?":
        return [not v]
    bits = struct.calcsize(f.fmt) * 8
    return _ints(v, bits, f.fmt.islower())


def value_kind(f: Field, new, data: bytes, block_sizes: dict) -> str:
    """'value' for a mutation the file then states consistently (a metadata value; a tensor type
    of the same block geometry): the file says another model. 'structure' otherwise."""
    if f.role == "value":
        return "value"
    if f.role == "ggml_type":
        (old,) = struct.unpack_from("<I", data, f.at)
        return "value" if block_sizes.get(new) == block_sizes.get(old) else "structure"
    return "structure"


@dataclass(frozen=True)
class Patch:
    """A GGUF case as a change of the good file: `new` written at `at`, then the file cut to
    `cut` bytes (None: kept whole). A 100 MB file is patched in place, never rewritten."""

    label: str
    kind: str  # "value" or "structure" (value_kind)
    at: int = 0
    new: bytes = b""
    cut: int | None = None

    def apply(self, data: bytes) -> bytes:
        out = data[:self.at] + self.new + data[self.at + len(self.new):]
        return out if self.cut is None else out[:self.cut]


class PatchedFile:
    """A working copy of a good file that each Patch is applied to and undone from in place."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data = path, data
        path.write_bytes(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)

    def write(self, patch: Patch) -> Path:
        with open(self.path, "r+b") as f:
            f.seek(patch.at)
            f.write(patch.new)
            if patch.cut is not None:
                f.truncate(patch.cut)
        return self.path

    def undo(self, patch: Patch) -> None:
        with open(self.path, "r+b") as f:
            if patch.cut is not None:
                f.seek(patch.cut)
                f.write(self.data[patch.cut:])
            f.seek(patch.at)
            f.write(self.data[patch.at:patch.at + len(patch.new)])


def gguf_makers(data: bytes, block_sizes: dict) -> list[Callable[..., Patch]]:
    """One maker per kind of GGUF case, each maker(rng) -> a Patch: every field role (a field of
    the role and its value drawn by rng), every cut point (each header field, the data start, each
    tensor's start and middle), a tensor moved onto another's bytes, a flipped header byte. rng:
    random.Random, or the long run's view of the fuzzer's input (scripts/fuzz_checkpoints.py)."""
    fields, end = gguf_fields(data)
    spans = gguf_tensor_spans(data, block_sizes)
    by_role: dict[str, list[Field]] = {}
    for f in fields:
        by_role.setdefault(f.role, []).append(f)
    offsets = by_role.get("offset", [])
    cuts = sorted({f.at for f in fields} | {f.at + 1 for f in fields} | {end, -(-end // 32) * 32}
                  | {s for _, s, _ in spans} | {(s + e) // 2 for _, s, e in spans} | {len(data) - 1})

    def set_field(f: Field, value, label: str = "") -> Patch:
        return Patch(f"{f.label} = {value!r}{label}", value_kind(f, value, data, block_sizes), f.at,
                     struct.pack("<" + f.fmt, value))

    def pick_field(role):
        def make(rng):
            f = rng.choice(by_role[role])
            return set_field(f, rng.choice(field_values(f, data)))
        return make

    def alias(rng) -> Patch:  # a tensor's data moved onto another's (the shared-bytes case)
        a, b = rng.sample(range(len(offsets)), 2)
        (to,) = struct.unpack_from("<Q", data, offsets[b].at)
        return set_field(offsets[a], to, f" (the offset of {offsets[b].label.split(':')[0]})")

    starts = [f.at for f in fields]

    def flip(rng) -> Patch:
        """A flipped byte: inside a numeric field, a mutation of that field's role; inside a key,
        a string value or a tensor name, a file stating another name or text ("value")."""
        at = rng.randrange(end)
        i = bisect.bisect_right(starts, at) - 1
        inside = i >= 0 and at < fields[i].at + struct.calcsize(fields[i].fmt)
        kind = ("value" if fields[i].role == "value" else "structure") if inside else "value"
        return Patch(f"byte {at} flipped" + (f" (in {fields[i].label})" if inside else " (in a string)"), kind, at,
                     bytes([data[at] ^ 0xFF]))

    makers = [pick_field(role) for role in by_role]
    makers.append(lambda rng: (lambda at: Patch(f"truncated at byte {at}", "structure", cut=at))(rng.choice(cuts)))
    if len(offsets) > 1:
        makers.append(alias)
    makers.append(flip)
    return makers


def draw(makers: list, rng, n: int) -> Iterator:
    """n cases: one of each maker first, then makers drawn at random."""
    for i in range(n):
        yield makers[i](rng) if i < len(makers) else rng.choice(makers)(rng)


def gguf_mutations(data: bytes, block_sizes: dict, rng, n: int) -> Iterator[Patch]:
    return draw(gguf_makers(data, block_sizes), rng, n)


# ----------------------------------------------------------------------------- safetensors

def _st_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_pack(header, body: bytes, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "U16", "X9", "")
_WIDTH = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "U16": 2}


def safetensors_makers(data: bytes) -> list[Callable[..., tuple[str, str, bytes]]]:
    """One maker per kind of safetensors case, each maker(rng) -> (label, kind, bytes): an entry's
    dtype, shape or data_offsets, the header's length, its JSON shape (not an object, duplicate
    keys, NaN, not UTF-8, nested deep), __metadata__, a cut at a tensor's bytes, a trailing byte."""
    header, body = _st_parts(data)
    names = [k for k in header if k != "__metadata__"]
    (hlen,) = struct.unpack_from("<Q", data, 0)

    def edit(label, kind, fn):
        h = json.loads(json.dumps(header))
        fn(h)
        return label, kind, _st_pack(h, body)

    def dtype(rng):
        name, d = rng.choice(names), rng.choice(DTYPES)
        same = _WIDTH.get(d) == _WIDTH.get(header[name]["dtype"])
        return edit(f"{name}.dtype = {d!r}", "value" if same else "structure",
                    lambda h: h[name].__setitem__("dtype", d))

    def shape(rng):
        name = rng.choice(names)
        s = list(header[name]["shape"])
        options = [[], [-1] + s[1:], [s[0] + 1] + s[1:] if s else [1], s[::-1], [2**62] * max(len(s), 2),
                   ["4"] + s[1:], [True] + s[1:], s + [1], [0] + s[1:], 7]
        new = rng.choice(options)
        kind = "value" if new == s[::-1] != s else "structure"  # the same bytes read as another shape
        return edit(f"{name}.shape = {new!r}", kind, lambda h: h[name].__setitem__("shape", new))

    def offsets(rng):
        i = rng.randrange(len(names))
        name, (b, e) = names[i], header[names[i]]["data_offsets"]
        other = header[names[(i + 1) % len(names)]]["data_offsets"]
        options = [[e, b], [b, e + 1], [b + 1, e + 1], [b - 1, e - 1], [-1, e], [b, 2**64], [0, e - b],
                   list(other) if other[1] - other[0] == e - b else [other[0], other[0] + e - b], [b], [b, e, e], "x"]
        new = rng.choice(options)
        return edit(f"{name}.data_offsets = {new!r}", "structure", lambda h: h[name].__setitem__("data_offsets", new))

    def length(rng):
        new = rng.choice([0, 1, hlen - 1, hlen + 1, hlen + 8, 100 * 2**20 + 1, 2**63, 2**64 - 1, len(data)])
        return f"header length = {new}", "structure", struct.pack("<Q", new) + data[8:]

    def json_shape(rng):
        text = json.dumps(header).encode()
        options = [(b"[]", "a list"), (b"7", "a number"), (b'"x"', "a string"), (b"null", "null"),
                   (text[:-1] + b', "' + names[0].encode() + b'": ' + json.dumps(header[names[0]]).encode() + b"}",
                    "a duplicate key"), (text.replace(b"}", b", \"NaN\": NaN}", 1), "NaN"),
                   (b"\xff" + text[1:], "not UTF-8"), (b"[" * 100000, "deeply nested")]
        raw, what = rng.choice(options)
        return f"header is {what}", "structure", _st_pack(None, body, raw)

    def metadata(rng):
        new = rng.choice([{"format": 1}, ["pt"], "pt", {"a": {"b": "c"}}, None])
        return edit(f"__metadata__ = {new!r}", "structure", lambda h: h.__setitem__("__metadata__", new))

    def cut(rng):
        name = rng.choice(names)
        b, e = header[name]["data_offsets"]
        at = 8 + hlen + rng.choice([b, (b + e) // 2, e - 1])
        at = rng.choice([at, rng.randrange(8 + hlen), len(data) - 1, 4])
        return f"truncated at byte {at}", "structure", data[:at]

    def trailing(rng):
        return "trailing byte", "structure", data + b"\0"

    return [dtype, shape, offsets, length, json_shape, metadata, cut, trailing]


def safetensors_mutations(data: bytes, rng, n: int) -> Iterator[tuple[str, str, bytes]]:
    return draw(safetensors_makers(data), rng, n)


# ----------------------------------------------------------------------------- running a case

@dataclass
class Outcome:
    outcome: str
    error: str  # the exception's class, or ""
    message: str
    seconds: float
    max_rss_mb: float


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def isolated(fn: Callable[[], object], timeout_s: float, memory: int = MEMORY_BUDGET) -> tuple[str, object, float, float]:
    """Run fn() in a forked child whose address space may grow by `memory` bytes, killed after
    timeout_s. Returns (status, value or (class, message, is zoo error, is MemoryError), seconds,
    child max RSS MB): status "ok", "error", "hang" or "crash"; seconds: the child's CPU time for
    fn (wall time for a hang or a crash)."""
    from zoo.compiler.errors import ZooError

    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's frames
        status, value = "crash", None
        try:
            os.close(r)
            limit = _vm_size() + memory
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            c0 = time.process_time()
            try:
                status, value = "ok", fn()
            except BaseException as e:  # noqa: BLE001 - every exception is the case's outcome
                status, value = "error", (type(e).__name__, str(e)[:2000], isinstance(e, ZooError),
                                          isinstance(e, MemoryError))
            # CPU seconds: the deadline holds on a machine other work shares
            payload = pickle.dumps((status, value, time.process_time() - c0))
            os.write(w, payload)
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout_s
    with os.fdopen(r, "rb") as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "hang", None, time.perf_counter() - t0, 0.0
            chunk = os.read(f.fileno(), 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    _, status_code, usage = os.wait4(pid, 0)
    rss = usage.ru_maxrss / 1024
    if not chunks:
        return "crash", f"child died (status {status_code})", time.perf_counter() - t0, rss
    status, value, seconds = pickle.loads(b"".join(chunks))
    return status, value, seconds, rss


def classify(status: str, value, seconds: float, rss: float, kind: str, good, deadline_s: float = DEADLINE_S) -> Outcome:
    """A case's Outcome from isolated()'s result; `good` is the good file's fingerprint."""
    if status in ("hang", "crash"):
        return Outcome(status, "", str(value or ""), seconds, rss)
    if status == "error":
        name, message, named, memory = value
        if memory:
            return Outcome("memory", name, message, seconds, rss)
        if not named:
            return Outcome("raw", name, message, seconds, rss)
        return Outcome("slow" if seconds > deadline_s else "refused", name, message, seconds, rss)
    if value == good:
        return Outcome("same", "", "", seconds, rss)
    return Outcome("as written" if kind == "value" else "different", "", "", seconds, rss)


def write_case(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- what a case reads

def fingerprint(obj) -> str:
    """What the reader made of a file, hashed (repr: NaN metadata compares equal to itself)."""
    import hashlib

    return hashlib.sha256(repr(obj).encode()).hexdigest()


class Target:
    """What zoo does with a checkpoint before allocating anything: open the source (the header
    checks), map its config, list its tensors, read its tokenizer (GGUF), and, when the config is
    the good file's, plan the load into the good file's model (built once, on meta). read() runs
    in the case's child and returns the fingerprint of the index, config and entries."""

    def __init__(self, path: Path, plan: bool = True):
        from zoo.compiler.build import cast_stage, spec_stage
        from zoo.compiler.checkpoint.hub import open_source
        from zoo.compiler.hf_import import import_config

        self.path = Path(path)
        source = open_source(str(path))
        self.good_config = source.config()
        self.model = self.spec = None
        if plan:
            s = spec_stage(import_config(self.good_config, source.description), source.description)
            self.spec, self.model = s.spec, cast_stage(s.spec, s.dtype, mtp=s.mtp).module
        self.good = self.read(self.path)

    def read(self, path: Path) -> str:
        from zoo.compiler.checkpoint.gguf import GGUFSource
        from zoo.compiler.checkpoint.hub import open_source
        from zoo.compiler.checkpoint.loader import plan_load
        from zoo.compiler.checkpoint.rules import checkpoint_stages
        from zoo.tokenizer import Tokenizer

        source = open_source(str(path))
        config, entries = source.config(), source.entries()
        layout = None
        if isinstance(source, GGUFSource):
            index = source._index
            layout = (index.fields, [(t.name, t.ggml_type, t.shape, t.offset, t.n_bytes) for t in index.tensors.values()])
            if source.metadata("tokenizer.ggml.model") is not None:
                Tokenizer.from_gguf(source)
        else:  # safetensors: each tensor by its bytes (a header of another length moves them all)
            layout = sorted((name, i.shape, i.dtype, fingerprint(_bytes(i.file, i.offset, i.nbytes)))
                            for name, i in entries.items())
            entries = {}
        if self.model is not None and config == self.good_config:
            plan_load(self.model, source, checkpoint_stages(source, self.spec), strict=True)
        return fingerprint((layout, config, sorted(entries.items())))


def _bytes(file: str, offset: int, n: int) -> bytes:
    with open(file, "rb") as f:
        f.seek(offset)
        return f.read(n)


def run_case(target: Target, path: Path, kind: str, timeout_s: float, deadline_s: float = DEADLINE_S) -> Outcome:
    status, value, seconds, rss = isolated(lambda: target.read(path), timeout_s)
    return classify(status, value, seconds, rss, kind, target.good, deadline_s)
