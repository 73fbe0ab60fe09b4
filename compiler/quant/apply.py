"""Which linears of a built model become QuantLinear, and which stay floating point (and why).

    quantize_linears(model, mode, group) -> QuantReport   (on the meta model, before loading)

Rules, the same for every family:
  - every nn.Linear is quantized unless
      it sits inside a module marked contracts.KeepFloat32 (routing and stream-mixing weights),
        or is one (contracts.Float32Linear)
      its parent kind names it in `float_linears` (its .weight is read directly, e.g. MLA's
        absorbed wkv_b; contracts.FloatLinears)
      it is a small projection (fewer than MIN_OUT outputs: gates, indexer weights; they save
        little and are sensitive)
      int4's kernel cannot take its shape (inputs not a multiple of the group, outputs of 16)
  - the output head is int8 for both modes (llama.cpp's 4-bit files keep theirs at 6-8 bits: the
    logits are the most sensitive product); a tied head becomes a quantized copy of the
    embedding, which stays float for its lookups
  - stacked expert weights (a kind's `quant_stacks`: MoE's w13 / w2) become QuantExperts
    (experts.py) with the same modes, unless int4's kernel cannot take an expert's shape or the
    device is not a CPU (their kernel loops over experts on the host)
  - embeddings, norms, routers and other bare parameters are no nn.Linear and stay as they are
    (listed in the report)

A GGUF file's blocks kept by default (runtime.quant=null on the CPU: keep_stored_blocks, mode
"stored"): the build's quant stage reads off the headers which block format reaches each
parameter unconverted (checkpoint/loader.block_formats), and every linear, expert stack, head and
token embedding whose stored tensors are blocks zoo's CPU kernels hold becomes a sink that takes
them as they are (and only them: `blocks_only`, no float weight is quantized into it); tensors
stored as floats stay float, as do the linears the rules above keep float (routers, a kind's
float_linears), whose blocks are dequantized, each with its reason in the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..contracts import Float32Linear, FloatLinears, KeepFloat32, RowTable
from ..errors import ContractError
from . import cpu_kernels
from .experts import QuantExperts, quantize_experts
from .gguf_blocks import LAYOUTS, MIXED_LAYOUTS
from .linear import INT4_ROWS, INT8_INPUTS, QuantLinear

MIN_OUT = 64  # a linear with fewer outputs is a small projection and stays float
HEAD = "head"  # the output head's attribute on the Decoder
STORED = "stored"  # QuantReport.mode of a build keeping a GGUF file's blocks by default (keep_stored_blocks)
ROWS = "stored"  # the attribute of a token embedding's block sink (keep_stored_blocks: an untied table)


@dataclass
class QuantReport:
    mode: str
    group: Optional[int]
    compute_dtype: str
    quantized: dict[str, str] = field(default_factory=dict)  # module path -> "int8 per channel" / "int4 g32"
    kept_float: dict[str, str] = field(default_factory=dict)  # parameter path -> why
    quantized_params: int = 0  # weights now stored quantized
    float_params: int = 0  # parameters left in floating point
    kernel: str = ""  # what the matmuls run on

    def summary(self) -> str:
        if self.mode == STORED:
            stacks = sum("experts" in what for what in self.quantized.values())
            experts = f" + {stacks} expert stacks" if stacks else ""
            return (f"GGUF blocks kept as stored (compute {self.compute_dtype}, {self.kernel}): "
                    f"{len(self.quantized) - stacks} weights{experts}, {self.quantized_params:,} weights; "
                    f"{self.float_params:,} parameters float (runtime.quant=none: all float)")
        group = f" g{self.group}" if self.mode == "int4" else ""
        stacks = sum("experts" in what for what in self.quantized.values())
        experts = f" + {stacks} expert stacks" if stacks else ""
        return (f"{self.mode}{group} (compute {self.compute_dtype}, {self.kernel}): {len(self.quantized) - stacks} linears{experts}, "
                f"{self.quantized_params:,} weights quantized; {self.float_params:,} parameters float")


def kernel_name(compute_dtype: torch.dtype) -> str:
    if compute_dtype == torch.float32:
        return cpu_kernels.status()
    return f"torch weight-only kernels ({str(compute_dtype).removeprefix('torch.')})"


def compute_dtype_for(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The quantized matmuls' compute dtype, which picks the kernels (linear.py): on CPU float32,
    zoo's kernels, whatever the model's dtype; elsewhere torch's weight-only kernels, float16 for
    float16 models and bfloat16 otherwise."""
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def quantize_linears(model: nn.Module, mode: str, group: int, compute_dtype: torch.dtype,
                     device: torch.device = torch.device("cpu"), prefill: str = "int8") -> QuantReport:
    """Replace the eligible nn.Linear modules of `model` (a model.Decoder, in place) by empty
    QuantLinear ones, and the eligible stacked experts by empty QuantExperts (device: where the
    model will run; prefill: runtime.quant_prefill, the float_rows of zoo's kernels)."""
    float_rows = cpu_kernels.PREFILL_MODES[prefill]
    report = QuantReport(mode, group if mode == "int4" else None, str(compute_dtype).removeprefix("torch."),
                         kernel=kernel_name(compute_dtype))
    report.quantized_params += quantize_experts(model, mode, group, compute_dtype, torch.device(device),
                                                report.quantized, report.kept_float)
    tied = model.spec.tie_embeddings
    _check_float_linears(model)
    for m in model.modules():
        if isinstance(m, QuantExperts):
            m.float_rows = float_rows
    replaced: set[int] = set()
    for path, parent, name, child in _linears(model):
        full = f"{path}.{name}" if path else name
        is_head = parent is model and name == HEAD
        why = _keep_reason(parent, name, child, mode, group, inside_float32=_inside_float32(model, path),
                           is_head=is_head, zoo_kernel=compute_dtype == torch.float32)
        if why:
            report.kept_float[f"{full}.weight"] = why
            continue
        child_mode = "int8" if is_head else mode
        tied_to = "embed.weight" if is_head and tied else None
        q = QuantLinear.from_linear(child, child_mode, group, compute_dtype, tied_to=tied_to)
        q.float_rows = float_rows
        setattr(parent, name, q)
        replaced.add(id(q))
        report.quantized[full] = q._what() + (" (a copy of the tied embed.weight)" if tied_to else "")
        report.quantized_params += q.in_features * q.out_features
    return _count_float(model, report)


def keep_stored_blocks(model: nn.Module, formats: dict[str, list], prefill: str = "int8") -> QuantReport:
    """runtime.quant=null on a GGUF file (CPU): every linear, expert stack, output head and token
    embedding whose stored tensors reach it as blocks zoo's kernels hold becomes an empty sink
    that takes only those blocks (QuantLinear / QuantExperts with `blocks_only`; the layouts are
    set by the load plan's prepare_blocks); the rest stays float. formats: {parameter: the block
    format of each assignment filling it, None where not as blocks} (checkpoint/loader.block_formats
    on the float meta model); prefill: runtime.quant_prefill, as quantize_linears takes it."""
    float_rows = cpu_kernels.PREFILL_MODES[prefill]
    f32 = torch.float32
    report = QuantReport(STORED, None, "float32", kernel=kernel_name(f32))
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)

    def stored(param: str) -> tuple[Optional[list], str]:
        """(the block formats when every assignment of `param` keeps blocks, else None; the
        reason it stays float)."""
        kinds = formats.get(param, [])
        if kinds and all(k in LAYOUTS or k in MIXED_LAYOUTS for k in kinds):
            return sorted(set(kinds)), ""
        floats = sorted({k for k in kinds if k is not None and k not in LAYOUTS and k not in MIXED_LAYOUTS})
        if floats and None not in kinds:
            return None, f"stored as {', '.join(floats)} (float tensors stay float)"
        return None, ("its stored tensors do not reach it as blocks of one format (joined with float parts, or "
                      "through a rule op that moves more than whole rows): dequantized")

    def kept(kinds: list) -> str:
        return f"kept {', '.join(kinds)} blocks as stored"

    _check_float_linears(model)
    for path, module in list(model.named_modules()):  # expert stacks: [E, O, I] parameters
        for name in getattr(module, "quant_stacks", ()):
            full = f"{path}.{name}" if path else name
            p = dict(module.named_parameters(recurse=False)).get(name)
            if p is None or p.dim() != 3:
                continue  # quantize_experts' contract check names it under runtime.quant
            kinds, why = stored(canonical.get(id(p), full))
            if kinds is None:
                report.kept_float[full] = why
                continue
            q = QuantExperts(*p.shape, "int8", None, f32, device=p.device)
            q.blocks_only, q.float_rows = True, float_rows
            delattr(module, name)
            setattr(module, name, q)
            report.quantized[full] = f"{kept(kinds)}, {q.n_experts} experts"
            report.quantized_params += q.numel()
    tied = model.spec.tie_embeddings
    head_kept = False
    for path, parent, name, child in _linears(model):
        full = f"{path}.{name}" if path else name
        is_head = parent is model and name == HEAD
        if isinstance(parent, FloatLinears) and name in parent.float_linears:
            report.kept_float[f"{full}.weight"] = parent.float_linears[name]
            continue
        if _inside_float32(model, path) or isinstance(child, KeepFloat32):
            report.kept_float[f"{full}.weight"] = "inside a float32 module (routing / stream mixing)"
            continue
        kinds, why = stored(canonical.get(id(child.weight), f"{full}.weight"))
        if kinds is None:
            report.kept_float[f"{full}.weight"] = why
            continue
        tied_to = "embed.weight" if is_head and tied else None
        q = QuantLinear.from_linear(child, "int8", None, f32, tied_to=tied_to)
        q.blocks_only, q.float_rows = True, float_rows
        setattr(parent, name, q)
        head_kept |= is_head
        report.quantized[full] = kept(kinds) + (" (the tied embed.weight: its lookups read them)" if tied_to else "")
        report.quantized_params += q.in_features * q.out_features
    served = {"embed.weight"} if tied and head_kept else set()
    for path, table in list(model.named_modules()):  # an untied token embedding: a sink of its own
        if tied or not isinstance(table, RowTable) or not isinstance(table, nn.Embedding):
            continue  # (a tied table is read from the head's blocks when the head keeps them)
        kinds, why = stored(canonical.get(id(table.weight), f"{path}.weight"))
        if kinds is None:
            report.kept_float[f"{path}.weight"] = f"embedding (token lookups): {why}"
            continue
        N, D = table.weight.shape
        q = QuantLinear(D, N, False, "int8", None, f32, tied_to=f"{path}.weight", device=table.weight.device)
        q.blocks_only = True
        setattr(table, ROWS, q)  # owned by the table, which reads its rows there (contracts.RowTable)
        report.quantized[f"{path}.{ROWS}"] = kept(kinds) + f" (the lookups of {path}.weight read them)"
        served.add(f"{path}.weight")
    return _count_float(model, report, served)



def _count_float(model: nn.Module, report: QuantReport, served: set[str] = frozenset()) -> QuantReport:
    """The parameters left float after a quant pass: their count, and each one's reason in
    kept_float (shared parameters once; `served`: tables whose rows a kept sink serves)."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or name in served:
            continue
        seen.add(id(p))
        report.float_params += p.numel()
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if name not in report.kept_float and not _is_quant_bias(model, owner):
            report.kept_float.setdefault(name, _kind_of(model, name))
    return report

def _linears(model: nn.Module):
    """Every plain nn.Linear (a subclass may compute something else: it is not replaced), and
    every Float32Linear (never replaced; listed for its reason)."""
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, Float32Linear):
                yield path, parent, name, child


def _check_float_linears(model: nn.Module) -> None:
    """Every name in a FloatLinears module's `float_linears` is one of its nn.Linear children."""
    for path, module in model.named_modules():
        if isinstance(module, FloatLinears):
            children = dict(module.named_children())
            for name in module.float_linears:
                if not isinstance(children.get(name), nn.Linear):
                    raise ContractError(f"{type(module).__name__}.float_linears names {name!r}, which is no nn.Linear "
                                        f"child of {path or 'the model'} (contracts.FloatLinears)")


def _inside_float32(model: nn.Module, path: str) -> bool:
    module = model
    if isinstance(module, KeepFloat32):
        return True
    for part in path.split(".") if path else ():
        module = module.get_submodule(part)
        if isinstance(module, KeepFloat32):
            return True
    return False


def _keep_reason(parent: nn.Module, name: str, child: nn.Linear, mode: str, group: int,
                 inside_float32: bool, is_head: bool, zoo_kernel: bool) -> Optional[str]:
    if isinstance(parent, FloatLinears) and name in parent.float_linears:
        return parent.float_linears[name]
    if inside_float32 or isinstance(child, KeepFloat32):
        return "inside a float32 module (routing / stream mixing)"
    O, I = child.out_features, child.in_features
    if O < MIN_OUT and not is_head:
        return f"small projection ({O} outputs < {MIN_OUT})"
    if (mode == "int4" and not is_head) and (I % group or O % INT4_ROWS):
        return f"int4 kernel needs inputs divisible by {group} and outputs by {INT4_ROWS}, got [{O}, {I}]"
    if (mode == "int8" or is_head) and zoo_kernel and I % INT8_INPUTS:
        return f"int8 kernel needs inputs divisible by {INT8_INPUTS}, got [{O}, {I}]"
    return None


def _is_quant_bias(model: nn.Module, owner: str) -> bool:
    return isinstance(model.get_submodule(owner) if owner else model, QuantLinear)


def _kind_of(model: nn.Module, name: str) -> str:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    if isinstance(owner, nn.Embedding):
        return "embedding (token lookups)"
    return f"{type(owner).__name__} parameter (no nn.Linear)"


def quantized_bytes(model: nn.Module) -> int:
    return sum(m.quantized_bytes() for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts)))


@torch.no_grad()
def fill_tied(model: nn.Module) -> None:
    """After a random init: quantize each tied QuantLinear from the parameter it copies."""
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.tied_to:
            m.load_weight(model.get_parameter(m.tied_to))
