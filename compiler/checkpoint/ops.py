"""Tensor ops that mapping rules may name (`op:` in conf/rules/*.yaml).

Each op has a shape function (used to check the whole mapping from headers, before any data is
read) and an apply function. Inputs arrive in the order of the rule's `from:` list.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import CheckpointError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    name: str
    shape: Callable[..., Shape]  # (input shapes, **args) -> output shape; raises ValueError
    apply: Callable[..., torch.Tensor]  # (input tensors, **args) -> tensor
    n_inputs: int | None  # None: any number


OPS: dict[str, Op] = {}


def op(name: str, n_inputs: int | None, shape: Callable[..., Shape]):
    def deco(fn):
        OPS[name] = Op(name, shape, fn, n_inputs)
        return fn
    return deco


def get_op(name: str, where: str) -> Op:
    if name not in OPS:
        raise CheckpointError(f"{where}: unknown op {name!r}; expected one of {sorted(OPS)}")
    return OPS[name]


# ---------------------------------------------------------------------------- renames and layout

@op("identity", 1, lambda shapes: shapes[0])
def _identity(xs):
    return xs[0]


@op("add", 1, lambda shapes, value: shapes[0])
def _add(xs, value: float):
    """Every entry plus `value`: e.g. llama.cpp's Gemma norms, stored as 1 + w where the
    checkpoint's zero-centred RMSNorm keeps w."""
    return xs[0] + value


def _cat_shape(shapes, dim: int = 0, order=None):
    shapes = _ordered(shapes, order)
    ref = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != len(ref) or any(a != b for i, (a, b) in enumerate(zip(s, ref)) if i != dim % len(ref)):
            raise ValueError(f"cannot concatenate shapes {[list(s) for s in shapes]} along dim {dim}")
    ref[dim] = sum(s[dim] for s in shapes)
    return tuple(ref)


def _ordered(xs, order):
    """xs in the order `order` gives (order[i]: where input i goes; None: as listed), so a rule's
    first `from` can be a tensor only some layers have (Gemma 4's k_proj) while the result keeps
    the parameter's layout."""
    if order is None:
        return list(xs)
    if sorted(order) != list(range(len(xs))):
        raise ValueError(f"cat order {list(order)}: expected a permutation of 0..{len(xs) - 1}")
    out = [None] * len(xs)
    for x, place in zip(xs, order):
        out[place] = x
    return out


@op("cat", None, _cat_shape)
def _cat(xs, dim: int = 0, order=None):
    return torch.cat(_ordered(xs, order), dim=dim)


def _split_shape(shapes, sizes, index: int, dim: int = 0):
    (shape,) = shapes
    if sum(sizes) != shape[dim]:
        raise ValueError(f"split sizes {list(sizes)} do not add up to {shape[dim]} (dim {dim} of {list(shape)})")
    out = list(shape)
    out[dim] = sizes[index]
    return tuple(out)


@op("split", 1, _split_shape)
def _split(xs, sizes, index: int, dim: int = 0):
    return xs[0].split(list(sizes), dim=dim)[index]


@op("flatten", 1, lambda shapes: (math.prod(shapes[0]),))
def _flatten(xs):
    """One vector of the same values, e.g. a per-head parameter stored as [1, 1, H, 1]."""
    return xs[0].reshape(-1)


def _permute_shape(shapes, dims=None, flatten=None):
    (shape,) = shapes
    if dims is not None:
        if sorted(dims) != list(range(len(shape))):
            raise ValueError(f"dims {list(dims)} is not a permutation of the {len(shape)} dims of {list(shape)}")
        shape = tuple(shape[d] for d in dims)
    if flatten is not None:
        start, end = (d % len(shape) for d in flatten)
        if not start <= end:
            raise ValueError(f"flatten {list(flatten)} is not a dim range of {list(shape)}")
        shape = (*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:])
    return tuple(shape)


@op("permute", 1, _permute_shape)
def _permute(xs, dims=None, flatten=None):
    """Dims reordered (torch.permute), then the inclusive dim range `flatten` [start, end] merged
    into one: llama.cpp's expert stacks [E, F, D] back to a checkpoint's one [E * F, D] matrix
    (flatten [0, 1]), its down stack [E, D, F] to [E * F, D] (dims [0, 2, 1] first: DBRX's w2)."""
    x = xs[0] if dims is None else xs[0].permute(*dims)
    if flatten is not None:
        x = x.flatten(*flatten)
    return x.contiguous()


def _transpose_shape(shapes, deinterleave: bool = False):
    (shape,) = shapes
    if len(shape) < 2:
        raise ValueError(f"cannot transpose a {len(shape)}-D tensor {list(shape)}")
    out = (*shape[:-2], shape[-1], shape[-2])
    if deinterleave and out[-2] % 2:
        raise ValueError(f"cannot de-interleave {out[-2]} rows into two halves")
    return out


@op("transpose", 1, _transpose_shape)
def _transpose(xs, deinterleave: bool = False):
    """[..., I, O] (checkpoints storing x @ W) -> [..., O, I]; with deinterleave, the O rows
    (a0 b0 a1 b1 ...) are regrouped as (a0 a1 ... b0 b1 ...): gpt-oss's fused gate/up columns."""
    w = xs[0].transpose(-1, -2)
    return _deinterleave([w], dim=-2) if deinterleave else w.contiguous()


def _deinterleave_shape(shapes, dim: int = -1):
    (shape,) = shapes
    if shape[dim] % 2:
        raise ValueError(f"cannot de-interleave {shape[dim]} entries (dim {dim} of {list(shape)}) into two halves")
    return tuple(shape)


@op("deinterleave", 1, _deinterleave_shape)
def _deinterleave(xs, dim: int = -1):
    """Entries (a0 b0 a1 b1 ...) along `dim` -> (a0 a1 ... b0 b1 ...)."""
    x = xs[0]
    idx = torch.arange(x.shape[dim], device=x.device)
    return x.index_select(dim, torch.cat((idx[0::2], idx[1::2]))).contiguous()


def _unpermute_shape(shapes, heads: int):
    (shape,) = shapes
    if shape[0] % (2 * heads):
        raise ValueError(f"{shape[0]} rows cannot be split into {heads} heads of rotary pairs")
    return shape


@op("unpermute_rope", 1, _unpermute_shape)
def _unpermute(xs, heads: int):
    """Undo llama.cpp's per-head row permutation of q/k weights (interleaved -> rotate-half)."""
    return unpermute_llama_cpp_rope(xs[0], heads)


def unpermute_llama_cpp_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of a q_proj / k_proj weight (or bias).

    w: [n_heads * head_dim, ...] as read from GGUF (attn_q: n_heads = attention heads; attn_k:
    n_heads = key/value heads). Returns the same shape in Hugging Face row order.

    HF rotates halves: within a head, row h*hd/2 + i (h in {0, 1}, i < hd/2) pairs with its
    partner hd/2 rows away. llama.cpp rotates adjacent pairs, so its converter moved that row to
    2*i + h. Viewing each head as [hd/2, 2] and swapping the two axes moves it back.
    """
    rows = w.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        raise CheckpointError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _kv_b_shape(shapes):
    if len(shapes[0]) != 3 or len(shapes[1]) != 3 or shapes[0][0] != shapes[1][0] or shapes[0][1] != shapes[1][2]:
        raise ValueError(f"k_b {list(shapes[0])} and v_b {list(shapes[1])} are not [heads, rank, nope] and "
                         f"[heads, v, rank] of the same heads and rank")
    (h, r, nope), v = shapes[0], shapes[1][1]
    return (h * (nope + v), r)


@op("join_kv_b", 2, _kv_b_shape)
def _join_kv_b(xs):
    """llama.cpp's MLA split back into one kv_b_proj: k_b [H, R, nope] (the converter transposed
    each head's key part) and v_b [H, v, R] -> [H * (nope + v), R], per head its nope key rows
    then its value rows (DeepSeek's kv_b_proj)."""
    k_b, v_b = xs
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])


@op("unsqueeze", 1, lambda shapes, dim: (*shapes[0][:dim % (len(shapes[0]) + 1)], 1,
                                         *shapes[0][dim % (len(shapes[0]) + 1):]))
def _unsqueeze(xs, dim: int):
    """A dimension of size 1 put back at `dim` (llama.cpp squeezes conv1d weights [C, 1, K] to [C, K])."""
    return xs[0].unsqueeze(dim)


def _reshape_shape(shapes, shape):
    (have,) = shapes
    want = [int(d) for d in shape]
    n, known = math.prod(have), math.prod(d for d in want if d != -1)
    if want.count(-1) > 1 or any(d <= 0 and d != -1 for d in want) or not known or n % known \
            or (-1 not in want and known != n):
        raise ValueError(f"cannot reshape {list(have)} ({n} entries) to {want}")
    return tuple(n // known if d == -1 else d for d in want)


@op("reshape", 1, _reshape_shape)
def _reshape(xs, shape):
    """The same entries in another shape (one dim may be -1: what is left), e.g. llama.cpp's Kimi
    conv weights stored [1, C, 1, K] (or [C, 1, K]) back to the checkpoint's [C, 1, K]."""
    return xs[0].reshape(_reshape_shape([tuple(xs[0].shape)], shape))


@op("log_neg", 1, lambda shapes, flat=False: (math.prod(shapes[0]),) if flat else shapes[0])
def _log_neg(xs, flat: bool = False):
    """log(-x): a decay stored as A = -exp(A_log) (llama.cpp's ssm_a) back to A_log, to float32
    rounding; flat: as one vector (Mamba-2's A is stored [H, 1])."""
    a = torch.log(-xs[0].float())
    return a.reshape(-1) if flat else a


def _transpose_blocks_shape(shapes, blocks, dim: int = 0, start: int = 0):
    (shape,) = shapes
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim {dim} does not exist in a {len(shape)}-D tensor {list(shape)}")
    a, b = (int(n) for n in blocks)
    span = shape[dim] - start
    if a <= 0 or b <= 0 or not 0 <= start <= shape[dim] or span % (a * b):
        raise ValueError(f"entries {start}..{shape[dim]} of dim {dim} of {list(shape)} are not {a} x {b} "
                         f"equal blocks")
    return tuple(shape)


@op("transpose_blocks", 1, _transpose_blocks_shape)
def _transpose_blocks(xs, blocks, dim: int = 0, start: int = 0):
    """Entries start.. of `dim` seen as a x b blocks (blocks = [a, b], each block the same size c)
    -> b x a: block (i, j) moves to (j, i); the entries before `start` stay. llama.cpp stores
    Qwen3.5's value heads tiled ([v of each key head] per value slot: a = value heads per key head,
    b = key heads) where the checkpoint groups them per key head; this puts them back."""
    x = xs[0]
    dim = dim % x.ndim
    a, b = (int(n) for n in blocks)
    head, tail = x.split([start, x.shape[dim] - start], dim=dim)
    c = tail.shape[dim] // (a * b)
    tail = tail.reshape(*x.shape[:dim], a, b, c, *x.shape[dim + 1:]).transpose(dim, dim + 1)
    return torch.cat([head, tail.reshape(tail.shape[:dim] + (a * b * c,) + tail.shape[dim + 3:])], dim=dim)


# ---------------------------------------------------------------------------- dequantization

def _fp8_block_shape(shapes, block=(128, 128)):
    s, w = shapes
    want = tuple(math.ceil(d / b) for d, b in zip(w, block))
    if len(w) != 2 or len(s) != 2 or tuple(s) != want:
        raise ValueError(f"weight {list(w)} with {list(block)} blocks needs a scale of shape {list(want)}, "
                         f"got {list(s)}")
    return tuple(w)


@op("fp8_block_dequant", 2, _fp8_block_shape)
def _fp8_block_dequant(xs, block=(128, 128)):
    """scale_inv [ceil(out/bo), ceil(in/bi)], weight [out, in] (e4m3 codes) -> float32 [out, in],
    each element times the scale of its fixed-size block.

    Inputs come scale first so that a rule's first `from` pattern matches only quantized weights.
    Blocks are always `block` wide; the last row/column block may be partial, so the scale rows are
    expanded to whole blocks and cropped (deriving the block size from the shapes, as out/scale_rows,
    is wrong there). Scaled one column block at a time: no second full-size temporary.
    """
    scale, w = xs
    bo, bi = block
    out, inp = w.shape
    value = w.to(torch.float32)
    rows = scale.to(torch.float32).repeat_interleave(bo, 0)[:out]  # [out, ceil(in/bi)]
    for j in range(rows.shape[1]):
        value[:, j * bi:(j + 1) * bi] *= rows[:, j:j + 1]
    return value


# ops that move whole rows (dim 0) and leave each row as it is: they apply unchanged to a block-
# quantized tensor's stored bytes [rows, bytes per row] (loader.py keeps such weights quantized)
_ROW_OPS = {"identity", "unpermute_rope", "split_groups", "join_groups"}
_ROW_OPS_ON_DIM = {"cat", "split", "transpose_blocks"}  # with dim 0


def is_row_op(name: str, args: dict, ndim: int = 2) -> bool:
    """Whether op `name` moves whole rows of the last dim only (stored blocks pass through it as
    bytes). ndim > 2 (a stack [E, O, I]): cat / split along any dim but the last, and identity; the
    2-D row ops (rope permutes, head groups) are not known to keep a stack's rows whole."""
    if ndim > 2:
        return name == "identity" or (name in ("cat", "split") and args.get("dim", 0) % ndim < ndim - 1)
    if name == "join_groups" and (args.get("stack") or args.get("transpose")):
        return False  # those move data across rows
    return name in _ROW_OPS or (name in _ROW_OPS_ON_DIM and args.get("dim", 0) == 0)


def check_op_args(op_: Op, args: dict, where: str) -> None:
    import inspect

    params = inspect.signature(op_.apply).parameters
    allowed = [p for p in params if p != "xs"]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise CheckpointError(f"{where}: op {op_.name!r} takes no argument(s) {unknown}; it takes {allowed}")


# ---------------------------------------------------------------------------- grouped layouts

def _split_groups_shape(shapes, groups: int, sizes, index: int | None = None, order=None, whole=()):
    if whole:
        if index is not None or order is not None:
            raise ValueError("whole inputs take neither index nor order")
        if any(not 0 <= i < len(shapes) for i in whole):
            raise ValueError(f"whole {list(whole)} names inputs beyond the {len(shapes)} given")
        kept = [i for i in range(len(shapes)) if i not in whole]
        rows, *rest = _split_groups_shape([shapes[i] for i in kept], groups, [sizes[i] for i in kept])
        if any(tuple(shapes[i][1:]) != tuple(rest) for i in whole):
            raise ValueError(f"inputs {[list(s) for s in shapes]} differ beyond dim 0")
        return (rows + sum(shapes[i][0] for i in whole), *rest)
    sizes = _group_sizes(sizes, len(shapes))
    n_parts = sum(len(parts) for parts in sizes)
    if order is not None and sorted(order) != list(range(n_parts)):
        raise ValueError(f"order {list(order)} is not a permutation of the {n_parts} parts 0..{n_parts - 1}")
    rest = tuple(shapes[0][1:])
    for shape, parts in zip(shapes, sizes):
        if tuple(shape[1:]) != rest:
            raise ValueError(f"inputs {[list(s) for s in shapes]} differ beyond dim 0")
        if groups <= 0 or shape[0] != groups * sum(parts):
            raise ValueError(f"{shape[0]} rows are not {groups} groups of {list(parts)} "
                             f"(= {groups * sum(parts)} rows)")
    flat = [p for parts in sizes for p in parts]
    if order is not None:
        flat = [flat[i] for i in order]
    if index is not None and not 0 <= index < len(flat):
        raise ValueError(f"part {index} does not exist; there are {len(flat)} parts {flat}")
    rows = groups * (flat[index] if index is not None else sum(flat))
    return (rows, *rest)


def _group_sizes(sizes, n_inputs: int) -> list[list[int]]:
    """sizes: one list of per-group part sizes per input (a flat list for a single input)."""
    sizes = list(sizes)
    if sizes and not isinstance(sizes[0], (list, tuple)):
        sizes = [sizes]
    if len(sizes) != n_inputs:
        raise ValueError(f"sizes gives part lists for {len(sizes)} input(s), the rule has {n_inputs}")
    return [[int(p) for p in parts] for parts in sizes]


@op("split_groups", None, _split_groups_shape)
def _split_groups(xs, groups: int, sizes, index: int | None = None, order=None, whole=()):
    """Group-major rows -> part-major rows.

    Each input's rows (dim 0) are `groups` equal groups, each the parts `sizes[i]` in order
    (e.g. per key head [q | k | v | z]). The output gathers each part across all groups, part
    after part and input after input ([q of every group | k of every group | ...]); with `index`
    (a rule with several targets) only that part, counted over all inputs' parts. `order` lists
    the parts in the order wanted (CodeGen's groups hold [q | v | k]: order [0, 2, 1]). `whole`:
    inputs already part-major, taken as they are in their place (their sizes entry is []; llama.cpp's
    Qwen3-Next attn_qkv / attn_gate beside the per-head ssm_ba).
    """
    sizes = _group_sizes(sizes, len(xs))
    parts = []
    for i, (x, sz) in enumerate(zip(xs, sizes)):
        if i in whole:
            parts.append(x)
            continue
        grouped = x.reshape(groups, sum(sz), *x.shape[1:])
        parts += [p.reshape(groups * p.shape[1], *x.shape[1:]) for p in grouped.split(sz, dim=1)]
    if order is not None:
        parts = [parts[i] for i in order]
    return parts[index] if index is not None else torch.cat(parts, dim=0)


def _join_groups_parts(shapes, groups: int, sizes):
    """One input's rows, part-major (`sizes` parts, each across all groups): the parts' row counts."""
    (rows, *rest), = shapes
    parts = [int(p) for p in sizes]
    if groups <= 0 or rows != groups * sum(parts):
        raise ValueError(f"{rows} rows are not {groups} groups of {parts} (= {groups * sum(parts)} rows)")
    return [groups * p for p in parts]


def _join_groups_shape(shapes, groups: int, sizes=None, whole=(), stack: bool = False, transpose: bool = False):
    if sizes is not None:
        if len(shapes) != 1 or whole:
            raise ValueError(f"sizes splits one input into its parts: got {len(shapes)} inputs, whole {list(whole)}")
        rest = tuple(shapes[0][1:])
        shapes = [(n, *rest) for n in _join_groups_parts(shapes, groups, sizes)]
    if any(not 0 <= i < len(shapes) for i in whole):
        raise ValueError(f"whole {list(whole)} names inputs beyond the {len(shapes)} given")
    joined = [s for i, s in enumerate(shapes) if i not in whole]
    if not joined:
        raise ValueError("every input is whole: nothing to join per group")
    rest = tuple(joined[0][1:])
    for shape in shapes:
        if tuple(shape[1:]) != rest:
            raise ValueError(f"inputs {[list(s) for s in shapes]} differ beyond dim 0")
    for shape in joined:
        if groups <= 0 or shape[0] % groups:
            raise ValueError(f"{shape[0]} rows are not {groups} equal groups")
    rows = sum(s[0] for s in joined) // groups
    if transpose:
        if len(rest) != 1:
            raise ValueError(f"transpose takes 2-D inputs, got {[list(s) for s in joined]}")
        rest, rows = (rows,), rest[0]
    if stack:
        if whole:
            raise ValueError("stack makes one [groups, rows, ...] block: it takes no whole inputs")
        return (groups, rows, *rest)
    return (groups * rows + sum(shapes[i][0] for i in whole), *rest)


@op("join_groups", None, _join_groups_shape)
def _join_groups(xs, groups: int, sizes=None, whole=(), stack: bool = False, transpose: bool = False):
    """Part-major rows -> group-major rows (split_groups' inverse).

    Each input not in `whole` is `groups` equal row blocks (one per head or per expert); the
    output holds group after group, each the inputs' blocks in input order ([q_h | gate_h] per
    head from separate q_proj / gate_proj: AFMoE's gated attention; [w1_e | v1_e] per expert from
    DBRX's fused expert matrices). `sizes`: one input that is those parts one after the other, each
    `groups` blocks of its size ([q of every head | k ... | v ...], as llama.cpp stores GPT-NeoX's
    query_key_value). `transpose`: each group's [rows, I] block as [I, rows] (DBRX's w2, stored
    [F, D] per expert for x @ w2). `stack`: [groups, rows, ...] (an expert stack) instead of the
    rows flat. `whole` inputs are appended as they are (k and v after the gated q).
    """
    if sizes is not None:
        xs = xs[0].split(_join_groups_parts([xs[0].shape], groups, sizes), dim=0)
    joined = [x for i, x in enumerate(xs) if i not in whole]
    blocks = torch.cat([x.reshape(groups, x.shape[0] // groups, *x.shape[1:]) for x in joined], dim=1)
    if transpose:
        blocks = blocks.transpose(1, 2)
    if stack:
        return blocks.contiguous()
    return torch.cat([blocks.reshape(-1, *blocks.shape[2:]), *(xs[i] for i in whole)], dim=0)


# ---------------------------------------------------------------------------- E8M0-scaled formats

def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8 / int8 bytes or torch.float8_e8m0fnu) -> float32 2^(byte - 127).

    A power of two with no sign and no mantissa: the byte is the biased exponent (byte 255 is NaN
    in the format and comes out as 2^128 = inf, which no real checkpoint stores)."""
    if scale.dtype not in (torch.uint8, torch.int8, torch.float8_e8m0fnu):
        raise CheckpointError(f"E8M0 scale of dtype {scale.dtype}: expected uint8/int8 bytes or float8_e8m0fnu")
    byte = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return torch.exp2(byte.to(torch.float32) - 127.0)


@op("fp8_e8m0_block_dequant", 2, _fp8_block_shape)
def _fp8_e8m0_block_dequant(xs, block=(128, 128)):
    """scale [ceil(out/bo), ceil(in/bi)] (E8M0 codes), weight [out, in] (e4m3 codes) -> float32
    [out, in]: each element times 2^(scale byte - 127) of its fixed-size block (DeepSeek-V4's
    `.scale` tensors; the blocks as in fp8_block_dequant)."""
    scale, w = xs
    return _fp8_block_dequant([e8m0_to_float(scale), w], block)


# e2m1 code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4_shape(shapes, block: int = 32):
    s, w = shapes
    if len(w) != 2 or len(s) != 2:
        raise ValueError(f"MXFP4 needs a 2-d packed weight and a 2-d scale, got {list(w)} and {list(s)}")
    out, packed = w
    cols = 2 * packed
    if cols % block or tuple(s) != (out, cols // block):
        raise ValueError(f"packed weight {list(w)} ({cols} values per row, {block} per scale) needs a scale of "
                         f"shape {[out, cols // block] if cols % block == 0 else f'[{out}, {cols}/{block}]'}, "
                         f"got {list(s)}")
    return (out, cols)


@op("mxfp4_dequant", 2, _mxfp4_shape)
def _mxfp4_dequant(xs, block: int = 32):
    """scale [out, in/block] (E8M0 codes), weight [out, in/2] (int8/uint8, two e2m1 codes per byte,
    the LOW nibble first) -> float32 [out, in]: value(code) * 2^(scale byte - 127), one scale per
    `block` consecutive values of a row (OCP microscaling MXFP4)."""
    scale, w = xs
    if w.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"MXFP4 weight of dtype {w.dtype}: expected int8/uint8 bytes (two codes each)")
    byte = w.view(torch.uint8).to(torch.int64)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)  # [out, in]: low nibble first
    value = torch.tensor(_E2M1, dtype=torch.float32)[codes]
    out, cols = value.shape
    value = value.view(out, cols // block, block) * e8m0_to_float(scale)[..., None]
    return value.view(out, cols)
