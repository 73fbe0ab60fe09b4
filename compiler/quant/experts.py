"""QuantExperts: a stack of expert weights [E, O, I] (MoE's w13 / w2) stored weight-only quantized.

    grouped_mm(x [N, I] rows sorted by expert, offs [E]) -> [N, O], row n = x[n] W[e]^T for the
      expert e owning row n (the contract of ffn/moe.py's expert_mm, which it replaces)
    held as
      int8  qweight [E, O, I] int8, scales [E, O]:          W[e, o, i] = qweight[e, o, i] * scales[e, o]
      int4  qweight [E, O, I/2] uint8, each expert packed for torch's CPU int4 kernel
            (aten._convert_weight_to_int4pack_for_cpu), scales_zeros [E, I/g, O, 2] (group g along I):
            W[e, o, i] = (q - 8) * scales_zeros[e, i // g, o, 0] + scales_zeros[e, i // g, o, 1]

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
from .gguf_blocks import q4_codes, q8_0_values
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


def int4_fits(out_features: int, in_features: int, group: int) -> bool:
    return in_features % group == 0 and out_features % INT4_OUT == 0


class QuantExperts(nn.Module, WeightSink):
    """See the module docstring. Stands in for a stacked parameter [E, O, I]: the loader addresses
    it by that parameter's name (`sink_name`), and fills it row by row (`stacked`)."""

    stacked = True  # takes one expert (a row of the stack) per load_weight call
    sink_suffix = ""  # addressed as the parameter it replaces (`{path}.ffn.w13`), not `.weight`

    def __init__(self, n_experts: int, out_features: int, in_features: int, mode: str, group: Optional[int],
                 compute_dtype: torch.dtype, device=None):
        super().__init__()
        E, O, I = n_experts, out_features, in_features
        self.n_experts, self.out_features, self.in_features = E, O, I
        self.mode, self.group = mode, (group if mode == "int4" else None)
        if mode == "int8":
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
        return self.scales.dtype

    def what(self) -> str:
        return ("int8 per channel" if self.mode == "int8" else f"int4 g{self.group}") + f", {self.n_experts} experts"

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, out={self.out_features}, in={self.in_features}, {self.what()}"

    def quantized_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` casts floating buffers; the scales keep the kernel's compute dtype
        dtype = self.scales.dtype
        super()._apply(fn, recurse)
        if self.scales.dtype != dtype:
            self.scales = self.scales.to(dtype)
        return self

    # ------------------------------------------------------------------ compute

    def grouped_mm(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, I] rows sorted by expert, offs [E] -> [N, O] in x's dtype (see expert_mm)."""
        y = quant_expert_mm(x.to(self.compute_dtype), self.qweight, self.scales, offs, self.group or 0)
        return y.to(x.dtype)

    # ------------------------------------------------------------------ filling

    def accepts_blocks(self, ggml_type: str) -> bool:
        """Stored GGUF blocks taken without float weights: Q4_0 / Q4_1 for int4 g32 (the same
        codes), Q8_0 for both (converted through its values to int8 per channel)."""
        return ggml_type == "Q8_0" or (self.mode == "int4" and self.group == 32 and ggml_type in ("Q4_0", "Q4_1"))

    @torch.no_grad()
    def load_weight(self, value, index: Optional[int] = None) -> str:
        """Fill expert `index` from a float tensor [O, I] or StoredBlocks, or every expert from a
        float [E, O, I] (index None); returns what happened, for the load report."""
        if index is None:
            if tuple(value.shape) != self.weight_shape or isinstance(value, StoredBlocks):
                raise CheckpointError(f"stacked experts {list(self.weight_shape)}: got a whole tensor of shape "
                                      f"{list(value.shape)}")
            for e in range(self.n_experts):
                what = self.load_weight(value[e], e)
            return what
        if tuple(value.shape) != self.weight_shape[1:] or not 0 <= index < self.n_experts:
            raise CheckpointError(f"expert {index} of shape {list(value.shape)} for stacked experts "
                                  f"{list(self.weight_shape)}")
        if isinstance(value, StoredBlocks):
            if not self.accepts_blocks(value.ggml_type):
                raise CheckpointError(f"experts ({self.what()}) cannot take {value.ggml_type} blocks as they are")
            if value.ggml_type == "Q8_0":
                self._fill(index, q8_0_values(value))
                return f"converted Q8_0 -> {self.what()}"
            self._store_int4(index, 0, *q4_codes(value))
            return f"kept {value.ggml_type} blocks as {self.what()}"
        self._fill(index, value)
        return f"quantized -> {self.what()}"

    def _fill(self, e: int, w: torch.Tensor) -> None:
        """Expert e from float values w [O, I], chunk_rows(I) rows at a time (small temporaries)."""
        step = chunk_rows(self.in_features)
        for r in range(0, self.out_features, step):
            part = w[r:r + step]
            if self.mode == "int8":
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
            q = QuantExperts(E, O, I, mode, group, kernel_dtype(compute_dtype), device=p.device)
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
