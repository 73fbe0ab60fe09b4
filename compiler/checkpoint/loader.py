"""Plan a checkpoint load from headers alone, then fill every parameter exactly once.

    plan_load(model, source, stages) -> LoadPlan   (no tensor data read; every check happens here)
    execute(plan, source)                          (reads file by file, copies into parameters)

The plan accounts for every stored tensor (mapped or explicitly ignored) and every parameter
(filled once: whole, or row by row for stacked experts), with shapes and dtypes checked. Data
flows one tensor at a time from the source's memory map into the already-allocated parameter,
so the checkpoint is never held twice.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

from ..contracts import RowTable, Slice, Source, StoredBlocks, TensorInfo, WeightSink
from ..errors import CheckpointError
from .ops import get_op, is_row_op
from .rules import Rule, Stage, fill

# Stored dtypes that are codes, not values: they only reach a parameter through an op.
_NEEDS_OP = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8"}
_MAX_LISTED = 20
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def weight_sinks(model: nn.Module) -> dict[str, WeightSink]:
    """The model's weight sinks (contracts.WeightSink) by the name the plan addresses them with."""
    return {name + m.sink_suffix: m for name, m in model.named_modules() if isinstance(m, WeightSink)}


@dataclass(frozen=True)
class Node:
    """A tensor of the mapping graph: a stored tensor (op None) or an op over other nodes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    inputs: tuple["Node", ...] = ()
    op: Optional[str] = None
    args: tuple = ()  # sorted (key, value) pairs
    info: Optional[TensorInfo] = None  # stored tensors only

    def stored(self) -> list["Node"]:
        if self.op is None:
            return [self]
        return [s for x in self.inputs for s in x.stored()]


@dataclass(frozen=True)
class Assignment:
    param: str  # canonical parameter name
    index: Optional[int]  # row of a stacked parameter, or None for the whole parameter
    node: Node
    rule: str
    part: Optional[Slice] = None  # the part of node this rank reads (None: all)
    # block format whose bytes go unconverted to a WeightSink: the stored GGML type, or the format a
    # source re-blocks parts of different types into (Source.mixed_blocks)
    blocks: Optional[str] = None


@dataclass
class LoadPlan:
    assignments: list[Assignment]
    ignored: list[tuple[str, str]]  # (stored name, why)
    bytes_to_read: int
    n_stored: int
    # what does not fit, by kind: "unexpected" (stored, no rule), "missing" (parameter unfilled),
    # "mismatched" (shape / dtype / rows), "invalid" (rule targets that are no parameter)
    problems: dict[str, list[str]] = field(default_factory=dict)
    # lookup tables read from the sink tied to them, which keeps their blocks: {table: sink}
    tables: dict[str, str] = field(default_factory=dict)
    # the CheckpointError a strict plan raises, kept by a lenient one (check() raises it)
    refusal: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def check(self) -> None:
        """Raise what a strict plan_load would have raised (a plan made with strict=False)."""
        if self.refusal is not None:
            raise CheckpointError(self.refusal)


@dataclass
class LoadReport:
    tensors_read: int = 0
    params_filled: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    ignored: list[tuple[str, str]] = field(default_factory=list)
    # stored tensor -> what the load did with it ("BF16 -> float32", "kept Q4_1 blocks as int4 g32")
    tensors: dict[str, str] = field(default_factory=dict)
    cache: Optional[str] = None  # weight_cache.py: "hit PATH" (state copied from there), "wrote PATH"
    # what the model holds of the stored tensors, per outcome and stored type: {"kept": {"Q4_K":
    # [tensors, stored bytes]}, ...}; outcomes: kept (blocks as stored, by a weight sink), quantized
    # (values quantized at load), float (stored as floats), dequantized (blocks read as floats)
    held: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def count(self, outcome: str, ggml_type: str, nbytes: int) -> None:
        row = self.held.setdefault(outcome, {}).setdefault(ggml_type, [0, 0])
        row[0] += 1
        row[1] += nbytes


def _listing(items: list[str]) -> str:
    head = "\n  ".join(items[:_MAX_LISTED])
    more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"\n  {head}{more}"


def _apply_rules(stage: Stage, nodes: dict[str, Node], source_desc: str
                 ) -> tuple[list[tuple[Rule, dict, list[Node], str | int | None]], list[tuple[str, str]], dict[str, Node]]:
    """Match a stage's rules. Returns (matches, ignored, unmatched nodes)."""
    left = dict(nodes)
    matches, ignored = [], []
    for rule in stage.rules + stage.ignores:
        regex = rule.regex
        for name in sorted(left):
            if name not in left:
                continue
            m = regex.fullmatch(name)
            if m is None:
                continue
            binds = m.groupdict()
            names = [name] + [fill(p, binds, rule.where) for p in rule.sources[1:]]
            absent = [n for n in names if n not in left]
            if absent:
                raise CheckpointError(f"{source_desc}: rule {rule.where} matched {name!r} but needs "
                                      f"{absent} too, which the checkpoint does not have (or another "
                                      f"rule took)")
            inputs = [left.pop(n) for n in names]
            if rule.targets:
                matches.append((rule, binds, inputs))
            else:
                # reported under the stored names (an earlier stage may have renamed or combined them)
                ignored.extend((s.name, rule.why) for x in inputs for s in x.stored())
    return matches, ignored, left


def _derive(rule: Rule, inputs: list[Node], target: str, index: Optional[int], source_desc: str) -> Node:
    args = dict(rule.args)
    if index is not None:
        args["index"] = index
    node = _op_node(rule, rule.op, args, inputs, target, source_desc, "")
    for i, (op, then_args) in enumerate(rule.then):  # then: each step on the result before it
        node = _op_node(rule, op, then_args, [node], target, source_desc, f" then[{i}] ({op})")
    return node


def _op_node(rule: Rule, op: str, args: dict, inputs: list[Node], target: str, source_desc: str, step: str) -> Node:
    if op == "identity":
        return inputs[0]
    try:
        shape = tuple(get_op(op, rule.where).shape([x.shape for x in inputs], **args))
    except (ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"{source_desc}: rule {rule.where}{step} on {[x.name for x in inputs]}: {e}") from None
    dtype = "F32" if any(x.dtype in _NEEDS_OP for x in inputs) else inputs[0].dtype
    return Node(target, shape, dtype, tuple(inputs), op, tuple(sorted(args.items())))


def plan_load(model: nn.Module, source: Source, stages: list[Stage], strict: bool = True,
              slices: Optional[dict] = None) -> LoadPlan:
    """Check the whole mapping from headers: every stored tensor used or ignored, every
    parameter filled exactly once with the right shape. strict: raise CheckpointError listing
    every offender; otherwise return them in `plan.problems` (what `zoo check` prints).

    slices: {parameter: contracts.Slice} for a rank of a parallel run: the parameter holds
    that part of the full tensor, shapes are checked against the full one, and only the part is
    read (rows of a stacked parameter held by other ranks are not read at all)."""
    slices = slices or {}
    desc = source.description
    entries = source.entries()
    nodes = {n: Node(n, tuple(i.shape), i.dtype, info=i) for n, i in entries.items()}
    ignored: list[tuple[str, str]] = []
    if not stages or stages[-1].kind != "params":
        raise CheckpointError(f"{desc}: the last rule stage must be a 'params' stage")
    for stage in stages[:-1]:
        matches, ign, left = _apply_rules(stage, nodes, desc)
        ignored += ign
        nodes = dict(left)
        for rule, binds, inputs in matches:
            for i, pattern in enumerate(rule.targets):
                name = fill(pattern, binds, rule.where)
                if name in nodes:
                    raise CheckpointError(f"{desc}: rule {rule.where} produces {name!r}, which exists already")
                nodes[name] = _derive(rule, inputs, name, i if len(rule.targets) > 1 else None, desc)

    final = stages[-1]
    matches, ign, left = _apply_rules(final, nodes, desc)
    ignored += ign
    problems: dict[str, list[str]] = {
        "unexpected": [f"{n} {list(x.shape)} {x.dtype}" for n, x in sorted(left.items())],
        "missing": [], "mismatched": [], "invalid": []}
    refusal = None
    if left:
        refusal = (f"{desc}: {len(left)} checkpoint tensor(s) match no rule in "
                   f"{[f'conf/rules/{s.name}.yaml' for s in stages]} (map or ignore them):"
                   + _listing(problems["unexpected"]))
        if strict:
            raise CheckpointError(refusal)

    params = dict(model.named_parameters(remove_duplicate=False))
    sinks = weight_sinks(model)
    canonical = {}
    first_name: dict[int, str] = {}
    for name, p in params.items():
        canonical[name] = first_name.setdefault(id(p), name)
    canonical.update({name: name for name in sinks})
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    shapes.update({name: tuple(s.weight_shape) for name, s in sinks.items()})

    assignments: list[Assignment] = []
    errors = problems["mismatched"]
    for rule, binds, inputs in matches:
        for i, pattern in enumerate(rule.targets):
            target = fill(pattern, binds, rule.where)
            if target not in canonical:
                problems["invalid"].append(f"{rule.where}: target {target!r} (from {inputs[0].name!r}) is not a "
                                           f"parameter")
                continue
            node = _derive(rule, inputs, target, i if len(rule.targets) > 1 else None, desc)
            index = int(binds[rule.stack]) if rule.stack else None
            assignments.append(Assignment(canonical[target], index, node, rule.where))
    assignments = _sink_assignments(assignments, sinks, canonical, source)
    served = {} if slices else _tables_from_sinks(model, assignments, sinks, canonical)
    assignments = [a for a in assignments if a.param not in served]
    shapes = {name: shape for name, shape in shapes.items() if canonical[name] not in served}

    by_param: dict[str, list[Assignment]] = defaultdict(list)
    for a in assignments:
        by_param[a.param].append(a)
    for name, shape in shapes.items():
        if canonical[name] != name:
            continue
        got = by_param.get(name, [])
        if not got:
            problems["missing"].append(f"parameter {name} {list(shape)} is not filled by any rule")
            continue
        whole = [a for a in got if a.index is None]
        rows = [a for a in got if a.index is not None]
        if whole and (len(whole) > 1 or rows):
            errors.append(f"parameter {name} is filled {len(got)} times: from "
                          f"{[a.node.name for a in got][:4]}")
            continue
        if rows and name in sinks and not sinks[name].stacked:
            errors.append(f"parameter {name} is a quantized weight, which takes whole tensors, not rows")
            continue
        floating = name in sinks or params[name].dtype.is_floating_point
        full = slices[name].full if name in slices else shape  # a sliced parameter: checked whole
        for a in got:
            want = full if a.index is None else full[1:]
            if a.index is not None and not 0 <= a.index < full[0]:
                errors.append(f"{a.node.name}: row {a.index} is outside parameter {name} {list(full)}")
            elif a.node.shape != want:
                errors.append(f"{a.node.name}: shape {list(a.node.shape)} does not fit parameter {name} "
                              f"(expected {list(want)}; rule {a.rule})")
            elif a.node.dtype in _NEEDS_OP and floating:
                errors.append(f"{a.node.name}: stored as {a.node.dtype}, which needs a dequantization rule "
                              f"before it can fill {name}")
        if rows:
            seen = sorted(a.index for a in rows)
            if seen != list(range(full[0])):
                dup = sorted({i for i in seen if seen.count(i) > 1})
                missing = sorted(set(range(full[0])) - set(seen))
                errors.append(f"parameter {name} rows: missing {missing[:8]}, duplicated {dup[:8]}")
    found = problems["invalid"] + problems["missing"] + problems["mismatched"]
    if found and refusal is None:
        refusal = f"{desc}: the checkpoint does not fit the model:" + _listing(found)
        if strict:
            raise CheckpointError(refusal)

    if slices and refusal is None:  # (a refused plan is never executed: check() raises first)
        assignments = _parts(assignments, slices)
    order = {n: i for i, group in enumerate(source.read_order()) for n in group}
    assignments.sort(key=lambda a: min(order[s.name] for s in a.node.stored()))
    stored = {s.name: s.info.nbytes for a in assignments if a.part is None for s in a.node.stored()}
    for a in assignments:  # parts: the share of each stored tensor read (whole when an op needs it)
        if a.part is not None and not a.part.zero:
            share = _numel(a.part.local_shape()) / max(_numel(a.part.full), 1) if _sliceable(a.node, a.part) else 1
            for s in a.node.stored():
                stored[s.name] = stored.get(s.name, 0) + int(s.info.nbytes * share)
    return LoadPlan(assignments, ignored, bytes_to_read=sum(stored.values()), n_stored=len(entries),
                    problems=problems, tables=served, refusal=refusal)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _parts(assignments: list[Assignment], slices: dict) -> list[Assignment]:
    """Attach each sliced parameter's part; a stacked parameter split on its row dimension keeps
    only this rank's rows (renumbered from 0), the others are dropped unread."""
    out = []
    for a in assignments:
        part = slices.get(a.param)
        if part is None:
            out.append(a)
        elif a.index is None:
            out.append(replace(a, part=part))
        else:
            rows, index = part.ranges(0), a.index
            if rows is not None:
                local = [i for lo, hi in rows for i in range(lo, hi)]
                if index not in local:
                    continue
                index = local.index(index)
            row = part.without(0)
            out.append(replace(a, index=index, part=row if row.cuts or row.zero else None))
    return out


def _sliceable(node: Node, part) -> bool:
    """Whether a part of `node` can be read without reading all of it (stored, or a cat of such
    whose pieces come in input order); otherwise it is evaluated whole and then cut."""
    if node.op is None:
        return True
    return node.op == "cat" and _cat_parts(node, part) is not None


def _cat_parts(node: Node, part) -> Optional[list]:
    """For a cat node, the part of each input (None where an input contributes nothing), or
    None when the pieces along the cat dim do not come in input order."""
    dim = dict(node.args).get("dim", 0)
    ranges = part.ranges(dim)
    others = tuple((d, r) for d, r in part.cuts if d != dim)
    bounds, off = [], 0
    for x in node.inputs:
        bounds.append((off, off + x.shape[dim]))
        off += x.shape[dim]
    pieces: list[list[tuple[int, int]]] = [[] for _ in node.inputs]
    last = 0
    for a, b in ranges or ((0, off),):
        for i, (lo, hi) in enumerate(bounds):
            if a < hi and b > lo:
                if i < last:
                    return None
                last = i
                pieces[i].append((max(a, lo) - lo, min(b, hi) - lo))
    out = []
    for x, p in zip(node.inputs, pieces):
        cuts = tuple(sorted(others + (((dim, tuple(p)),) if ranges is not None else ())))
        out.append(None if not p else Slice(x.shape, cuts))
    return out


def _evaluate_part(node: Node, part, source: Source, memo: dict) -> torch.Tensor:
    """This rank's part of a node, reading only that part of stored tensors where it can."""
    if node.op is None and source.reads_parts and (node.name, None) not in memo:
        if not part.cuts:
            return _evaluate(node, source, memo)
        t = source.read_part(node.name, part)
        if tuple(t.shape) != part.local_shape():
            raise CheckpointError(f"{node.info.file}: tensor {node.name!r}: read part {list(t.shape)}, "
                                  f"expected {list(part.local_shape())}")
        return t
    if node.op == "cat":
        inputs = _cat_parts(node, part)
        if inputs is not None:
            dim = dict(node.args).get("dim", 0)
            return torch.cat([_evaluate_part(x, p, source, memo) for x, p in zip(node.inputs, inputs)
                              if p is not None], dim=dim)
    return part.apply(_evaluate(node, source, memo))


def _sink_assignments(assignments: list[Assignment], sinks: dict, canonical: dict, source: Source
                      ) -> list[Assignment]:
    """Assignments into weight sinks learn whether the stored blocks can go to them unconverted
    (one block type the sink takes, only row-wise ops on the way, a source that reads bytes), and
    tied sinks get the assignment of the parameter they copy."""
    by_param = {a.param: a for a in assignments if a.index is None}
    for name, sink in sinks.items():
        src = by_param.get(canonical.get(sink.tied_to)) if sink.tied_to else None
        if src is not None and name not in by_param:
            assignments.append(Assignment(name, None, src.node, f"{src.rule} (quantized copy of {sink.tied_to})"))
    out = []
    for a in assignments:
        if a.param in sinks:
            kind = _block_format(a, sinks[a.param].stacked, source)
            if kind is not None and sinks[a.param].accepts_blocks(kind):
                a = Assignment(a.param, a.index, a.node, a.rule, blocks=kind)
                sinks[a.param].prepare_blocks(kind)  # its buffers' layout for these blocks, before the model is allocated
        out.append(a)
    return out


def _block_format(a: Assignment, stacked: bool, source: Source) -> Optional[str]:
    """The block format `a`'s stored tensors could reach its parameter in unconverted: their one
    stored type (or the source's re-blocking of several), 2-D weights or a whole stack [E, O, I]
    (GGUF's ffn_*_exps) for a stacked parameter, through row-wise ops only, from a source that
    reads bytes; None otherwise. A float type (F16, ...) is returned too: the sink decides."""
    if not source.reads_blocks or not _rows_only(a.node):
        return None
    types = {s.dtype for s in a.node.stored()}
    kind = next(iter(types)) if len(types) == 1 else source.mixed_blocks(sorted(types))
    dims_ok = len(a.node.shape) == 2 or (len(a.node.shape) == 3 and a.index is None and stacked)
    return kind if dims_ok else None


def block_formats(plan: LoadPlan, source: Source, model: nn.Module) -> dict[str, list[Optional[str]]]:
    """For a plan made on the float model: {parameter: the block format of each assignment that
    fills it (None: not as blocks; see _block_format)}, parameters of 3 dims taken as stacks.
    What a build that keeps a file's blocks by default (runtime.quant=null) reads off the headers
    to choose which linears and stacks hold blocks (compiler/build.py's quant stage)."""
    dims = {name: p.dim() for name, p in model.named_parameters(remove_duplicate=False)}
    out: dict[str, list[Optional[str]]] = defaultdict(list)
    for a in plan.assignments:
        out[a.param].append(_block_format(a, dims.get(a.param) == 3, source))
    return dict(out)


def _tables_from_sinks(model: nn.Module, assignments: list[Assignment], sinks: dict, canonical: dict) -> dict[str, str]:
    """A lookup table (contracts.RowTable: the token embedding) that a sink keeping its stored
    blocks is tied to reads its rows there (read_rows_from, on meta): the table's float copy is
    neither allocated nor filled. Returns {table parameter: the sink serving it}."""
    kept = {a.param for a in assignments if a.blocks is not None and a.index is None}
    served = {}
    for name, sink in sinks.items():
        table = canonical.get(sink.tied_to) if sink.tied_to else None
        if table is None or name not in kept or not sink.serves_rows():
            continue
        owner, _, attr = table.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if isinstance(module, RowTable) and attr == "weight":
            module.read_rows_from(sink)
            served[table] = name
    return served


def _rows_only(node: Node) -> bool:
    """Whether every op from the stored tensors to `node` moves whole rows (of the last dim) only."""
    if node.op is None:
        return True
    return is_row_op(node.op, dict(node.args), len(node.shape)) and all(_rows_only(x) for x in node.inputs)


def _evaluate(node: Node, source: Source, memo: dict, blocks: Optional[str] = None) -> torch.Tensor:
    """The value of `node` (blocks: its bytes [..., rows, bytes per row] in that block format, the
    stored one or a source's re-blocking, through row-wise ops)."""
    if node.op is None:
        key = (node.name, blocks)
        if key not in memo:
            if blocks is None:
                t = source.read(node.name)
            elif blocks == node.dtype:
                t = source.read_blocks(node.name)
            else:
                t = source.read_blocks(node.name, as_format=blocks)
            want = node.shape[:-1] if blocks else node.shape
            if tuple(t.shape[:len(want)]) != want:
                raise CheckpointError(f"{node.info.file}: tensor {node.name!r} has shape {list(t.shape)} "
                                      f"but its header says {list(node.shape)}")
            memo[key] = t
        return memo[key]
    return get_op(node.op, node.name).apply([_evaluate(x, source, memo, blocks) for x in node.inputs],
                                            **dict(node.args))


def _block_parts(a: Assignment, source: Source, memo: dict) -> Optional[tuple[list[StoredBlocks], int]]:
    """A whole sink's blocks that a rule joins by `cat` from stored tensors of the one block type
    kept (GGUF's gate and up stacks into w13): (each part as StoredBlocks, the cat's dim), else None."""
    node = a.node
    if a.blocks is None or a.index is not None or node.op != "cat" or \
            any(x.op is not None or x.dtype != a.blocks for x in node.inputs):
        return None
    dim = dict(node.args).get("dim", 0) % len(node.shape)
    if dim == len(node.shape) - 1:
        return None  # along the inputs: not whole rows
    return [StoredBlocks(a.blocks, _evaluate(x, source, memo, blocks=a.blocks), x.shape) for x in node.inputs], dim


def _why_not_kept(a: Assignment, s: Node, sink, source: Source) -> Optional[str]:
    """For the load report: why stored tensor `s`'s blocks were dequantized for a sink that can
    keep blocks (None when they were kept, or there were none)."""
    if a.blocks is not None or s.dtype in _FLOAT_DTYPES or not source.reads_blocks:
        return None
    if not sink.accepts_blocks(s.dtype):
        return sink.why_not_kept(s.dtype)
    others = sorted({x.dtype for x in a.node.stored()} - {s.dtype})
    if others:
        return f"blocks not kept: joined with parts stored as {', '.join(others)}, which no block format holds with it"
    return "blocks not kept: a rule op on the way moves more than whole rows"


def _describe(stored_dtype: str, dest: torch.Tensor) -> str:
    to = str(dest.dtype).removeprefix("torch.")
    return f"{stored_dtype} -> {to}" if stored_dtype in _FLOAT_DTYPES else f"dequantized {stored_dtype} -> {to}"


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Weights quantized at load pass through temporaries of many sizes; glibc keeps what they
    freed in its heap (its mmap threshold rises after the first large free), so without a trim per
    shard and per quantized weight the process would keep those pages on top of the quantized model."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


@torch.no_grad()
def execute(plan: LoadPlan, model: nn.Module, source: Source, progress=None, row_absmax=None) -> LoadReport:
    """Copy every planned tensor into its parameter (dtype cast and device transfer on copy).

    row_absmax: for a parallel rank, x [O] -> the elementwise max over the ranks (Mesh.max_over_ranks):
    a weight sink that gets only some of its inputs (a row-parallel slice) is told each whole
    row's max |w|, which a per-output-channel scale needs (compiler/parallel/plan.py)."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    sinks = weight_sinks(model)
    report = LoadReport(ignored=list(plan.ignored))
    # a stored tensor stays in memory only until the last assignment that uses it is done
    uses: dict[str, int] = defaultdict(int)
    for a in plan.assignments:
        for s in {s.name for s in a.node.stored()}:
            uses[s] += 1
    memo: dict[str, torch.Tensor] = {}
    counted: set[tuple[str, str]] = set()  # (stored tensor, outcome) already in report.held
    shard = None
    for a in plan.assignments:
        stored = a.node.stored()
        # a quantized weight leaves temporaries (one expert's, filling a stack by rows, are small)
        if stored[0].info.file != shard or (a.param in sinks and a.index is None):
            shard = stored[0].info.file
            _release_freed_memory()
        if a.param in sinks:  # quantized as it is read, or its stored blocks kept
            extra, done, value = {}, None, None
            if a.part is not None and a.blocks is not None:
                if a.part.ranges(1) is not None:
                    raise CheckpointError(f"{a.param}: {a.blocks} blocks kept as stored cannot be cut along the "
                                          f"inputs yet (runtime.quant with runtime.parallel on a GGUF file); use a "
                                          f"safetensors checkpoint or runtime.quant=null")
                value = StoredBlocks(a.blocks, a.part.apply(_evaluate(a.node, source, memo, blocks=a.blocks)),
                                     a.part.local_shape())  # whole rows of blocks
            elif a.part is not None:
                value = _evaluate_part(a.node, a.part, source, memo)  # this rank's slice, quantized here
                if a.part.ranges(1) is not None:
                    if row_absmax is None:
                        raise CheckpointError(f"{a.param}: a weight sink cut along its inputs needs "
                                              f"execute(row_absmax=...) (a parallel load)")
                    extra["absmax"] = row_absmax(value.abs().amax(dim=1).float())
            else:
                joined = _block_parts(a, source, memo)
                # a cat of stored block tensors: each part straight into its rows, if the sink can
                done = sinks[a.param].load_row_parts(*joined) if joined is not None else None
                if done is None:
                    value = _evaluate(a.node, source, memo, blocks=a.blocks)
                    if a.blocks is not None:
                        value = StoredBlocks(a.blocks, value, a.node.shape)
            sink = sinks[a.param]
            if done is None:
                done = sink.load_weight(value, **extra) if a.index is None else sink.load_weight(value, a.index)
            how = {}
            serves = [t for t, by in plan.tables.items() if by == a.param]
            for s in stored:
                why = _why_not_kept(a, s, sink, source)
                how[s.name] = ((done if a.blocks == s.dtype else f"{s.dtype} {done}") + (f" ({why})" if why else "")
                               + "".join(f"; {t} looks its rows up in them (no float copy)" for t in serves))
            del value
        else:
            dest = params[a.param] if a.index is None else params[a.param][a.index]
            # a stored tensor that fills its parameter unchanged is read straight into it: no copy
            direct = (a.part is None and a.node.op is None and uses[a.node.name] == 1
                      and source.read_into(a.node.name, dest))
            if a.part is not None and a.part.zero:
                dest.zero_()  # another rank adds this (a row-parallel bias)
            elif a.part is not None:
                value = _evaluate_part(a.node, a.part, source, memo)
                dest.copy_(value)
                del value
            elif not direct:
                value = _evaluate(a.node, source, memo)
                dest.copy_(value)
                del value
            how = {s.name: _describe(s.dtype, dest) for s in stored}
        for s in stored:
            outcome = ("kept" if a.blocks is not None else "quantized") if a.param in sinks else \
                ("float" if s.dtype in _FLOAT_DTYPES else "dequantized")
            if (s.name, outcome) not in counted:  # (a tensor read for two parameters: once per outcome)
                counted.add((s.name, outcome))
                report.count(outcome, s.dtype, s.info.nbytes)
        for name, h in how.items():
            report.tensors[name] = h if name not in report.tensors else f"{report.tensors[name]}; {h}"
        for name in {s.name for s in stored}:
            uses[name] -= 1
            if uses[name] == 0:
                for key in [k for k in memo if k[0] == name]:
                    memo.pop(key)
                source.release(name)  # a mapped file's pages of it leave the process (peak RSS: model + one tensor)
        report.params_filled += 1
        if progress is not None:
            progress(sum(s.info.nbytes for s in stored))
    source.close()
    _release_freed_memory()
    report.tensors_read = len({s.name for a in plan.assignments for s in a.node.stored()})
    report.bytes_read = plan.bytes_to_read
    report.seconds = time.perf_counter() - t0
    return report
