"""QuantExperts: a stack of expert weights [E, O, I] (MoE's w13 / w2) stored weight-only quantized.

    grouped_mm(x [N, I] rows sorted by expert, offs [E]) -> [N, O], row n = x[n] W[e]^T for the
      expert e owning row n (the contract of ffn/moe.py's expert_mm, which it replaces)
    held as
      int8  qweight [E, O, I] int8, scales [E, O]:          W[e, o, i] = qweight[e, o, i] * scales[e, o]
      int4  qweight [E, O, I/2] uint8, each expert packed for torch's CPU int4 kernel
            (aten._convert_weight_to_int4pack_for_cpu), scales_zeros [E, I/g, O, 2] (group g along I):
            W[e, o, i] = (q - 8) * scales_zeros[e, i // g, o, 0] + scales_zeros[e, i // g, o, 1]

GGUF blocks (a file's Q4_0 / Q4_K ... expert stacks) are kept exactly instead, on zoo's float32
CPU kernels (cpu_kernels.py; x cast to float32 and back), in the layout `block_layout` names (the
buffers are re-made for it on the meta model, prepare_blocks), the linears' layouts (linear.py)
with an expert dimension in front:
      q4     Q4_0 / Q4_1 / Q4_K: qweight [E, O, I/2] uint8 in llama.cpp's Q4 byte order, scales
             [E, O, 2, I/32] (d, m) float16 as Q4_0 / Q4_1 store them, float32 for Q4_K (d * sc):
             W[e] = q * d + m (int4_linear's numerics)
      int5   Q5_0 / Q5_1 / Q5_K at their stored width: q4's qweight and scales (float32 with a
             Q5_K) plus qhigh [E, O, I/8] uint8, the codes' fifth bits (gguf_blocks.int5_parts)
      q6k    Q6_K: qweight [E, O, I/256 * 210] uint8, the blocks' bytes as stored (no scales)
      int8g  every other block type, and types mixed in one stack (per-expert tensors of
             different types, or gate and up parts of different types: gguf_blocks' ZQ8):
             qweight [E, O, I] int8 codes, scales [E, O, ns, I/g] float32 (d, m; ns 1: d only) per
             group of g = 16 or 32: W[e] = q * d (+ m)
(A GGUF expert stack is one tensor per projection, so one type per stack: a mix comes only from
per-expert tensors or from w13's two parts.) All dequantize to gguf.quants.dequantize's values
(`dequantize`; signed zeros aside). A float expert in a stack of block experts is quantized into
their layout (int4_quantize's codes for q4 / int5, int8 per channel as int8g; q6k has no quantizer:
refused).

The product is one native call per stack, `zoo::block_expert_mm` -> zoo_quant.expert_linear
(cpu_kernels.py): the rows' activations rounded to int8 once, one parallel region over the (active
expert, output tile) pairs, each expert's weights read once for all the rows that chose it; only
the chosen experts' bytes are read. w13 (gate rows, then up rows) can take the activation in the
same call (`grouped_act`: act(gate) * up, SwiGLU and gpt-oss's clamped variant), so the [N, 2F]
pre-activations are not written out as floats. Each (row, output) is the linear kernels' own sum:
a row's output is the same bits whatever other rows chose its expert (batch invariance).

Float experts quantized on the CPU (runtime.quant with zoo's float32 kernels, the default) take
the same layouts: int4 as q4 (its group, float16 d and m), int8 per channel as int8g g32 (the row's
scale in every group): one kernel numerics for every expert product, whatever rows chose the
expert (batch invariance, cpu_kernels.py). With a bfloat16 / float16 compute dtype they are held
for torch's kernels instead:

The quantization is linear.py's (int8_quantize: per output channel; int4_quantize: groupwise
asymmetric), applied expert by expert. The matmul is one op in the graph, `zoo::quant_expert_mm`,
looping inside over the experts that own rows and calling torch's weight-only kernel on views of
their quantized weights (`torch._weight_int8pack_mm` / `torch._weight_int4pack_mm_for_cpu`): a
decode step reads only the chosen experts' quantized bytes, and the graph holds one op whatever E
is. The alternative, gathering the chosen experts' codes into the graph and dequantizing them
before a batched matmul, copies the gathered bytes and then reads them again as floats, which
is slower (scripts/bench_quant_experts.py).

Plain buffers, no tensor subclass; the loader fills them one expert at a time (`load_weight(value,
index)`, the rows of a `stack: expert` rule), or a whole stacked tensor expert by expert.
CPU only: the CUDA decode graph is a CUDA graph, and the op's per-expert loop reads the routing on
the host (a sync); apply.py keeps experts float on CUDA and says so in the build report.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..contracts import QuantStacks, StoredBlocks, WeightSink
from ..errors import CheckpointError, ContractError
from . import cpu_kernels, repack
from ..activation import swiglu
from .gguf_blocks import (INT4_TYPES, INT5_TYPES, LAYOUTS, MIXED_LAYOUTS, Q6K_TYPES, block_bytes, block_codes,
                          has_offset, layout)
from .linear import chunk_rows, int4_quantize, int8_quantize

INT4_OUT = 16  # torch's int4 kernel needs O to be a multiple of this


@torch.library.custom_op("zoo::quant_expert_mm", mutates_args=())
def quant_expert_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
                    group: int) -> torch.Tensor:
    """x [N, I] (the scales' dtype) rows sorted by expert, offs [E] int64 (end row of each expert's
    segment, cumulative), group 0 for int8 -> [N, O]; rows past offs[-1] are left unwritten."""
    out = x.new_empty(x.shape[0], qweight.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            if group:
                out[start:end] = torch._weight_int4pack_mm_for_cpu(x[start:end], qweight[e], group, scales[e])
            else:
                out[start:end] = torch._weight_int8pack_mm(x[start:end], qweight[e], scales[e])
        start = end
    return out


@quant_expert_mm.register_fake
def _quant_expert_mm_fake(x, qweight, scales, offs, group):
    return x.new_empty(x.shape[0], qweight.shape[1])


BLOCK_KINDS = ("q4", "int5", "q6k", "int8g")  # the layouts that hold GGUF blocks exactly (module docstring)
KERNEL_KIND = {"q4": "int4", "int5": "int5", "q6k": "q6k", "int8g": "int8g"}  # -> cpu_kernels.EXPERT_KINDS


@torch.library.custom_op("zoo::block_expert_mm", mutates_args=())
def block_expert_mm(x: torch.Tensor, qweight: torch.Tensor, qhigh: Optional[torch.Tensor],
                    scales: Optional[torch.Tensor], offs: torch.Tensor, kind: str, group: int, float_rows: int = 0,
                    act: int = 0, limit: float = 0.0, alpha: float = 1.0, up_offset: float = 0.0) -> torch.Tensor:
    """x [N, I] float32 rows sorted by expert, offs [E] int64 (as quant_expert_mm), kind one of
    BLOCK_KINDS (the module docstring's layouts; qhigh int5's, scales none for q6k) -> [N, O]
    float32, or with act 1 (gated) [N, O/2] = act(gate) * (up + up_offset) (cpu_kernels.py's
    expert_linear: limit 0 no clamp, alpha 1 silu). zoo's CPU kernel, or its torch reference where
    it did not build (the same numbers). float_rows: the kernels' (0: a row's output is the same
    bits however many rows chose its expert: batch invariance). Rows past offs[-1] are unwritten."""
    k = KERNEL_KIND[kind]
    if cpu_kernels.available():
        return torch.ops.zoo_quant.expert_linear(x, offs, cpu_kernels.EXPERT_KINDS[k], qweight, qhigh, scales, group,
                                                 act, limit, alpha, up_offset, float_rows)
    return cpu_kernels.expert_reference(x, offs, k, qweight, qhigh, scales, group, act, limit, alpha, up_offset,
                                        float_rows)


@block_expert_mm.register_fake
def _block_expert_mm_fake(x, qweight, qhigh, scales, offs, kind, group, float_rows=0, act=0, limit=0.0, alpha=1.0,
                          up_offset=0.0):
    return x.new_empty(x.shape[0], qweight.shape[1] // (2 if act else 1))


def int4_fits(out_features: int, in_features: int, group: int) -> bool:
    return in_features % group == 0 and out_features % INT4_OUT == 0


class QuantExperts(nn.Module, WeightSink):
    """See the module docstring. Stands in for a stacked parameter [E, O, I]: the loader addresses
    it by that parameter's name (`sink_name`), and fills it row by row (`stacked`)."""

    stacked = True  # takes one expert (a row of the stack) per load_weight call
    blocks_only = False  # takes a GGUF file's blocks only (apply.keep_stored_blocks): no float expert
    sink_suffix = ""  # addressed as the parameter it replaces (`{path}.ffn.w13`), not `.weight`

    def __init__(self, n_experts: int, out_features: int, in_features: int, mode: str, group: Optional[int],
                 compute_dtype: torch.dtype, device=None, zoo_kernel: bool = False):
        super().__init__()
        E, O, I = n_experts, out_features, in_features
        self.n_experts, self.out_features, self.in_features = E, O, I
        self.mode, self.group = mode, (group if mode == "int4" else None)
        self.mode_group = self.group  # the configured group (self.group follows the layout)
        self.layout = mode  # what the buffers hold: int8 | int4 (torch's kernels) or a BLOCK_KINDS one
        self.block_types: set[str] = set()  # the GGUF block types the plan hands it (prepare_blocks)
        self.float_rows = 0  # the block layouts' kernels: as QuantLinear.float_rows (runtime.quant_prefill)
        if zoo_kernel and (mode == "int4" or I % cpu_kernels.BLOCK == 0):
            # zoo's float32 CPU kernels (the CPU default): float experts quantized into the block
            # layouts (int4: q4 g, float16 d and m; int8 per channel: int8g g32 with the row's scale
            # in every group, d only), so their products are the kernels' one numerics at every row
            # count (batch invariance), as the linears'
            g = group if mode == "int4" else cpu_kernels.BLOCK
            self.layout, self.group = ("q4", g) if mode == "int4" else ("int8g", g)
            codes = (E, O, I // 2, torch.uint8) if mode == "int4" else (E, O, I, torch.int8)
            self.register_buffer("qweight", torch.empty(codes[:3], dtype=codes[3], device=device))
            self.register_buffer("scales", torch.empty(E, O, 2 if mode == "int4" else 1, I // g,
                                                       dtype=torch.float16 if mode == "int4" else torch.float32,
                                                       device=device))
        elif mode == "int8":
            self.register_buffer("qweight", torch.empty(E, O, I, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(E, O, dtype=compute_dtype, device=device))
        elif mode == "int4":
            if not int4_fits(O, I, group):
                raise ValueError(f"int4 experts need inputs ({I}) divisible by the group ({group}) and outputs ({O}) "
                                 f"by {INT4_OUT}")
            self.register_buffer("qweight", torch.empty(E, O, I // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(E, I // group, O, 2, dtype=compute_dtype, device=device))
        else:
            raise ValueError(f"quant mode {mode!r}: expected int8 or int4")

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.n_experts, self.out_features, self.in_features)

    @property
    def shape(self) -> torch.Size:
        """The float stack's shape ([E, O, I]), as the MoE reads it off its parameter."""
        return torch.Size(self.weight_shape)

    def numel(self) -> int:
        return self.n_experts * self.out_features * self.in_features

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.layout in BLOCK_KINDS else self.scales.dtype

    def what(self) -> str:
        if self.layout == "q6k":
            held = "Q6_K as stored (6.5625 bits a weight)"
        elif self.layout in BLOCK_KINDS and self.block_types:  # GGUF blocks (float experts: as quantized)
            bits = {"q4": "int4", "int5": "int5"}.get(self.layout, "int8")
            held = f"{bits} g{self.group} ({str(self.scales.dtype).removeprefix('torch.')} scales)"
        else:
            held = "int8 per channel" if self.mode == "int8" else f"int4 g{self.group}"
        return f"{held}, {self.n_experts} experts"

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, out={self.out_features}, in={self.in_features}, {self.what()}"

    def quantized_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` casts floating buffers; the scales keep the kernel's compute dtype (q6k: none)
        dtype = self.scales.dtype if "scales" in self._buffers else None
        super()._apply(fn, recurse)
        if dtype is not None and self.scales.dtype != dtype:
            self.scales = self.scales.to(dtype)
        return self

    # ------------------------------------------------------------------ compute

    def grouped_mm(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, I] rows sorted by expert, offs [E] -> [N, O] in x's dtype (see expert_mm)."""
        if self.layout in BLOCK_KINDS:
            y = self._blocks_mm(x, offs)
        else:
            y = quant_expert_mm(x.to(self.compute_dtype), self.qweight, self.scales, offs, self.group or 0)
        return y.to(x.dtype)

    def grouped_act(self, x: torch.Tensor, offs: torch.Tensor, limit: Optional[float] = None,
                    alpha: Optional[float] = None, up_offset: float = 0.0) -> torch.Tensor:
        """A gated stack (w13: O = 2F, gate rows then up rows): x [N, I] -> [N, F] in x's dtype,
        dense.swiglu(gate, up, limit, alpha=alpha, up_offset=up_offset) of grouped_mm's output;
        the block layouts compute it inside the kernel call (the [N, 2F] floats never written)."""
        if self.layout in BLOCK_KINDS:
            return self._blocks_mm(x, offs, 1, limit or 0.0, 1.0 if alpha is None else alpha, up_offset).to(x.dtype)
        gate, up = self.grouped_mm(x, offs).chunk(2, dim=-1)
        return swiglu(gate, up, limit, alpha=alpha, up_offset=up_offset)

    def _blocks_mm(self, x: torch.Tensor, offs: torch.Tensor, act: int = 0, limit: float = 0.0, alpha: float = 1.0,
                   up_offset: float = 0.0) -> torch.Tensor:
        return block_expert_mm(x.float(), self.qweight, self._buffers.get("qhigh"), self._buffers.get("scales"), offs,
                               self.layout, self.group, self.float_rows, act, limit, alpha, up_offset)

    @torch.no_grad()
    def dequantize(self, e: int) -> torch.Tensor:
        """Expert e's weight [O, I] float32 as the block layouts hold it (W = q * d + m; for GGUF
        blocks gguf.quants.dequantize's values bit for bit)."""
        if self.layout in ("q4", "int5"):
            return cpu_kernels.int4_dequantize(self.qweight[e], self.scales[e],
                                               self.qhigh[e] if self.layout == "int5" else None)
        if self.layout == "q6k":
            return cpu_kernels.int8g_dequantize(*cpu_kernels.q6k_codes(self.qweight[e]))
        if self.layout == "int8g":
            return cpu_kernels.int8g_dequantize(self.qweight[e], self.scales[e])
        raise ContractError(f"QuantExperts.dequantize reads the GGUF block layouts {BLOCK_KINDS}, not {self.layout}")

    # ------------------------------------------------------------------ filling

    def block_layout(self, ggml_type: str) -> Optional[str]:
        """How `load_weight` keeps stored GGUF blocks of this type in a stack of this type alone: "q4"
        (INT4_TYPES: their codes and scales), "int5" (INT5_TYPES), "q6k" (Q6K_TYPES: the bytes),
        "int8g" (any other block type or re-blocking: codes as int8, group scales float32; a stack
        mixing types takes it too, prepare_blocks), or None (int4 with a group other than 32: the
        loader dequantizes, and they are quantized)."""
        if self.mode == "int4" and self.mode_group != 32:
            return None
        if ggml_type in INT4_TYPES:
            return "q4"
        if ggml_type in INT5_TYPES:
            return "int5"
        if ggml_type in Q6K_TYPES:
            return "q6k"
        return "int8g" if ggml_type in LAYOUTS or ggml_type in MIXED_LAYOUTS else None

    def accepts_blocks(self, ggml_type: str) -> bool:
        """Stored GGUF blocks taken without float weights, kept exactly (block_layout)."""
        return self.block_layout(ggml_type) is not None

    def why_not_kept(self, ggml_type: str) -> str:
        if self.mode == "int4" and self.mode_group != 32:
            return (f"{ggml_type} blocks not kept: int4 g{self.mode_group} experts do not hold groups of 32 "
                    f"(runtime.quant_group=32 keeps them)")
        return f"{ggml_type} has no block layout zoo keeps"

    def prepare_blocks(self, ggml_type: str) -> None:
        """The plan hands this stack blocks of `ggml_type` (for the whole stack, or one expert of
        it): the buffers take the layout that holds every type planned so far exactly (on meta).
        Only INT4_TYPES: q4 (float32 scales with a Q4_K); only INT5_TYPES: int5 (float32 with a Q5_K);
        only Q6_K: q6k (the bytes); else int8g with the smallest group."""
        self.block_types.add(ggml_type)
        types = sorted(self.block_types)
        E, O, I = self.weight_shape
        dev = self.qweight.device
        self._buffers.pop("qhigh", None)
        if all(t in Q6K_TYPES for t in types):
            lay = layout(ggml_type)
            if I % lay.block:
                raise CheckpointError(f"stacked experts {list(self.weight_shape)}: {ggml_type} blocks of {lay.block} do "
                                      f"not divide the {I} inputs")
            self.layout, self.group = "q6k", lay.group
            self._buffers["qweight"] = torch.empty(E, O, I // lay.block * lay.nbytes, dtype=torch.uint8, device=dev)
            self._buffers.pop("scales", None)
            return
        if all(t in INT4_TYPES for t in types) or all(t in INT5_TYPES for t in types):
            kind, g, ns = ("q4" if types[0] in INT4_TYPES else "int5"), 32, 2
            codes = (E, O, I // 2, torch.uint8)
            scales = torch.float32 if {"Q4_K", "Q5_K"} & set(types) else torch.float16
        else:
            kind, g = "int8g", min(layout(t).group for t in types)
            ns = 2 if any(has_offset(t) for t in types) else 1
            codes, scales = (E, O, I, torch.int8), torch.float32
        if I % g:
            raise CheckpointError(f"stacked experts {list(self.weight_shape)}: {ggml_type} blocks of {g} do not "
                                  f"divide the {I} inputs")
        self.layout, self.group = kind, g
        self._buffers["qweight"] = torch.empty(codes[:3], dtype=codes[3], device=dev)
        self._buffers["scales"] = torch.empty(E, O, ns, I // g, dtype=scales, device=dev)
        if kind == "int5":
            self._buffers["qhigh"] = torch.empty(E, O, I // 8, dtype=torch.uint8, device=dev)

    @torch.no_grad()
    def load_weight(self, value, index: Optional[int] = None) -> str:
        """Fill expert `index` from a float tensor [O, I] or StoredBlocks, or every expert from a
        float [E, O, I] or StoredBlocks of the whole stack (index None); returns what happened, for
        the load report."""
        if index is None:
            if tuple(value.shape) != self.weight_shape:
                raise CheckpointError(f"stacked experts {list(self.weight_shape)}: got a whole tensor of shape "
                                      f"{list(value.shape)}")
            if isinstance(value, StoredBlocks) and self._store_stack(value):
                return self._kept_line(value.ggml_type)
            for e in range(self.n_experts):
                part = (StoredBlocks(value.ggml_type, value.data[e], value.shape[1:])
                        if isinstance(value, StoredBlocks) else value[e])
                what = self.load_weight(part, e)
            return what
        if tuple(value.shape) != self.weight_shape[1:] or not 0 <= index < self.n_experts:
            raise CheckpointError(f"expert {index} of shape {list(value.shape)} for stacked experts "
                                  f"{list(self.weight_shape)}")
        if isinstance(value, StoredBlocks):
            kind = self.block_layout(value.ggml_type)
            if kind is None or self.layout not in BLOCK_KINDS or value.ggml_type not in self.block_types:
                raise CheckpointError(f"experts ({self.what()}) cannot take {value.ggml_type} blocks as they are"
                                      + ("" if kind else f": {self.why_not_kept(value.ggml_type)}")
                                      + ("" if kind is None or value.ggml_type in self.block_types
                                         else " (prepare_blocks was not told of them)"))
            self._store_blocks(index, value)
            return self._kept_line(value.ggml_type)
        if self.blocks_only:
            raise CheckpointError(f"expert {index} of stacked experts {list(self.weight_shape)}: the stack keeps a "
                                  f"GGUF file's blocks as stored (runtime.quant=null) and takes no float weight; "
                                  f"runtime.quant=none loads float weights")
        self._fill(index, value)  # (a stack whose other experts are blocks: quantized into their layout)
        return f"quantized -> {self.what()}"

    def _kept_line(self, ggml_type: str) -> str:
        if ggml_type in MIXED_LAYOUTS:  # the loader names each part's own type
            return f"kept (with parts of other types) as {self.what()}"
        if self.layout == "q6k":
            return f"kept {ggml_type} blocks as stored (6.5625 bits a weight), {self.n_experts} experts"
        return f"kept {ggml_type} blocks as {self.what()}"

    def _own_bytes(self) -> None:
        """Before writing into qweight: bytes of its own if it is an adopted (read-only) file map."""
        if getattr(self, "_adopted", False):
            self._buffers["qweight"], self._adopted = torch.empty_like(self.qweight), False

    def _store_stack(self, b: StoredBlocks) -> bool:
        """The whole stack from blocks b [E, O, I] at once (a view of the mapped file): q6k holds
        the contiguous stored bytes themselves (no copy: the view keeps the map open, and nothing
        writes a loaded weight; a later load gives the stack bytes of its own first, _own_bytes),
        q4 / int5 are repacked in one pass over all E * O rows into the buffers (repack.py);
        False where it does not apply (the per-expert path then runs)."""
        kind = self.block_layout(b.ggml_type)
        if kind is None or kind != self.layout or b.ggml_type not in self.block_types or kind == "int8g":
            return False
        E, O, I = self.weight_shape
        data = b.data
        if data.device.type != "cpu" or self.qweight.device.type != "cpu" or data.dim() != 3 or data.shape[:2] != (E, O):
            return False
        if kind == "q6k":
            if tuple(data.shape) == tuple(self.qweight.shape) and data.is_contiguous():
                self._buffers["qweight"], self._adopted = data, True
            else:
                self._own_bytes()
                self.qweight.copy_(block_bytes(StoredBlocks(b.ggml_type, data.reshape(E * O, -1), (E * O, I)))
                                   .reshape(self.qweight.shape))
            return True
        self._own_bytes()
        rows = StoredBlocks(b.ggml_type, data.reshape(E * O, -1), (E * O, I))
        block_bytes(rows)  # checks the bytes against the shape
        sc = self.scales.view(E * O, 2, -1)
        if kind == "q4":
            repack.into_int4(rows, self.qweight.view(E * O, -1), sc[:, 0], sc[:, 1])
        else:
            repack.into_int5(rows, self.qweight.view(E * O, -1), self.qhigh.view(E * O, -1), sc[:, 0], sc[:, 1])
        return True

    def load_row_parts(self, parts: list, dim: int) -> Optional[str]:
        """w13 from its gate and up stacks [E, O_k, I] (contracts.WeightSink): q4 / int5 stacks
        repack each part into its own rows, expert by expert, without the joined copy; None for the
        other layouts (the loader joins the parts and calls load_weight)."""
        E, O, I = self.weight_shape
        if (dim != 1 or self.layout not in ("q4", "int5") or not parts
                or any(p.ggml_type not in self.block_types or self.block_layout(p.ggml_type) != self.layout
                       or len(p.shape) != 3 or tuple(p.shape[::2]) != (E, I) or p.data.dim() != 3
                       or p.data.device.type != "cpu" for p in parts)
                or sum(p.shape[1] for p in parts) != O):
            return None
        self._own_bytes()
        o = 0
        for p in parts:  # one call per part over its E * n rows (strided per expert in the buffers)
            n = p.shape[1]
            block_bytes(StoredBlocks(p.ggml_type, p.data.reshape(E * n, -1), (E * n, I)))  # checks the bytes
            sc = self.scales[:, o:o + n]
            if self.layout == "q4":
                repack.into_int4(p, self.qweight[:, o:o + n], sc[:, :, 0], sc[:, :, 1])
            else:
                repack.into_int5(p, self.qweight[:, o:o + n], self.qhigh[:, o:o + n], sc[:, :, 0], sc[:, :, 1])
            o += n
        return self._kept_line(parts[0].ggml_type)

    def _store_blocks(self, e: int, b: StoredBlocks) -> None:
        """Expert e from blocks b [O, I]: their codes and group scales exactly, chunk_rows rows at a time."""
        self._own_bytes()
        if self.layout == "q4":  # (repack.py: natively for Q4_K / Q5_K, into the buffers)
            block_bytes(b)
            repack.into_int4(b, self.qweight[e], self.scales[e, :, 0], self.scales[e, :, 1])
            return
        if self.layout == "int5":
            block_bytes(b)
            repack.into_int5(b, self.qweight[e], self.qhigh[e], self.scales[e, :, 0], self.scales[e, :, 1])
            return
        step = chunk_rows(self.in_features)
        for r in range(0, self.out_features, step):
            part = StoredBlocks(b.ggml_type, b.data[r:r + step], (min(step, self.out_features - r), self.in_features))
            if self.layout == "q6k":
                data = block_bytes(part)
                self.qweight[e, r:r + len(data)].copy_(data)
                continue
            q, d, m = block_codes(part)
            rep = layout(b.ggml_type).group // self.group  # a group of 32's scales for its two 16s: exact
            n = len(q)
            self.qweight[e, r:r + n].copy_(q)
            self.scales[e, r:r + n, 0].copy_(d.repeat_interleave(rep, dim=1))
            if self.scales.shape[2] == 2:
                self.scales[e, r:r + n, 1].copy_(0.0 if m is None else m.repeat_interleave(rep, dim=1))

    def _fill(self, e: int, w: torch.Tensor) -> None:
        """Expert e from float values w [O, I], chunk_rows(I) rows at a time (small temporaries)."""
        self._own_bytes()
        if self.layout == "q6k":
            raise CheckpointError(f"expert {e} of stacked experts {list(self.weight_shape)}: a float weight next to "
                                  f"Q6_K block experts (kept as stored bytes, which zoo has no quantizer for); "
                                  f"runtime.quant=none loads the stack float")
        step = chunk_rows(self.in_features)
        for r in range(0, self.out_features, step):
            part = w[r:r + step]
            n = len(part)
            if self.layout in ("q4", "int5"):  # int4_quantize's codes in the Q4 byte order, d = scale, m = zero - 8 scale
                q, scale, zero = int4_quantize(part, self.group)  # (int5: fifth bits 0)
                qs, _ = cpu_kernels.pack_int4(q, scale, zero - 8.0 * scale)
                self.qweight[e, r:r + n].copy_(qs)
                self.scales[e, r:r + n].copy_(torch.stack((scale, zero - 8.0 * scale), dim=1))
                if self.layout == "int5":
                    self.qhigh[e, r:r + n].zero_()
            elif self.layout == "int8g":  # int8 per channel: the row's scale for each of its groups
                q, scale = int8_quantize(part)
                self.qweight[e, r:r + n].copy_(q)
                self.scales[e, r:r + n].zero_()
                self.scales[e, r:r + n, 0].copy_(scale[:, None].expand(n, self.scales.shape[-1]))
            elif self.mode == "int8":
                q, scale = int8_quantize(part)
                self.qweight[e, r:r + len(q)].copy_(q)
                self.scales[e, r:r + len(q)].copy_(scale)
            else:
                self._store_int4(e, r, *int4_quantize(part, self.group))

    def _store_int4(self, e: int, r: int, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Rows r.. of expert e from q [rows, I] in 0..15, scale / zero [rows, I/g] (w = (q - 8) *
        scale + zero); the CPU packing is blocked by at most 64 rows, so row pieces pack alike."""
        n = len(q)
        self.qweight[e, r:r + n].copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        self.scales[e, :, r:r + n].copy_(torch.stack((scale.t(), zero.t()), dim=-1))

    def init_weights(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        """Random build: each expert a normal(0, std) float weight, quantized."""
        for e in range(self.n_experts):
            w = torch.empty(self.weight_shape[1:], device=self.qweight.device).normal_(0.0, std, generator=generator)
            self._fill(e, w)


def quantize_experts(model: nn.Module, mode: str, group: int, compute_dtype: torch.dtype, device: torch.device,
                     quantized: dict[str, str], kept_float: dict[str, str]) -> int:
    """Replace the stacked expert parameters of every module that names them in `quant_stacks`
    (contracts.QuantStacks: parameters [E, O, I]) by empty QuantExperts (in place, on the meta
    model). Records each in `quantized` (path -> what) or `kept_float` (parameter -> why); returns
    the weights quantized."""
    n = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, QuantStacks):
            continue
        params = dict(module.named_parameters(recurse=False))
        for name in module.quant_stacks:
            full = f"{path}.{name}" if path else name
            p = params.get(name)
            if p is None or p.dim() != 3:
                got = "no parameter" if p is None else f"a parameter of shape {list(p.shape)}"
                raise ContractError(f"{type(module).__name__}.quant_stacks names {name!r}, which is {got} of "
                                    f"{path or 'the model'} (expected a stacked [E, O, I] "
                                    f"parameter; contracts.QuantStacks)")
            E, O, I = p.shape
            why = _keep_reason(mode, group, O, I, device)
            if why:
                kept_float[full] = why
                continue
            q = QuantExperts(E, O, I, mode, group, kernel_dtype(compute_dtype), device=p.device,
                             zoo_kernel=compute_dtype == torch.float32)
            delattr(module, name)
            setattr(module, name, q)
            quantized[full] = q.what()
            n += q.numel()
    return n


def kernel_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The experts' compute dtype: torch's weight-only kernels are fast in bfloat16 / float16 only
    (their float32 path is a scalar fallback), so a float32 compute
    dtype (a choice for the linears' own kernels) becomes bfloat16 for the experts."""
    return compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _keep_reason(mode: str, group: int, O: int, I: int, device: torch.device) -> Optional[str]:
    if device.type != "cpu":
        return f"stacked experts: the quantized expert kernels run on CPU only (device {device.type})"
    if mode == "int4" and not int4_fits(O, I, group):
        return f"int4 kernel needs inputs divisible by {group} and outputs by {INT4_OUT}, got [{O}, {I}] per expert"
    return None
