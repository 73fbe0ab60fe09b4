"""QuantLinear: a linear layer whose weight is stored weight-only quantized.

    forward(x [..., I]) -> [..., O] = x W^T (+ bias), W [O, I] held as
      int8  qweight [O, I] int8, scales [O]:               W[o, i] = qweight[o, i] * scales[o]
      int4  qweight packed for the device's int4 kernel, scales_zeros [I/g, O, 2] (group g along I):
            W[o, i] = (q[o, i] - 8) * scales_zeros[i // g, o, 0] + scales_zeros[i // g, o, 1]
            with q in 0..15 (the zero-point convention of torch's int4 kernels); CPU packing
            [O, I/2] uint8 (torch.ops.aten._convert_weight_to_int4pack_for_cpu), CUDA the tinygemm
            tiles of torch._convert_weight_to_int4pack

Two kernel families, chosen by `compute_dtype`:
  float32 (the CPU default): zoo's CPU kernels (cpu_kernels.py / .cpp). int8 as above with
      float32 scales; int4 as llama.cpp's Q4 blocks, qweight [O, I/2] uint8 (byte t of each
      32-input block: input t low nibble, t + 16 high nibble) and scales [O, 2, I/g] float16
      (d, m): W[o, i] = q * d + m. GGUF blocks are kept exactly, in the layout `block_layout`
      names (the buffers are re-made at load for it):
        Q4_0 / Q4_1 / Q4_K -> int4 g32 (Q4_0 / Q4_1 copied in as they are; Q4_K's d * sc needs
          float32 scales [O, 2, I/32])
        Q5_0 / Q5_1 -> int5 g32: int4's qweight and float16 scales plus qhigh [O, I/8] uint8, the
          codes' fifth bits (the blocks' bytes as they are, 24 bytes per 32 weights); Q5_K -> int5
          g32 with its codes re-packed and float32 scales (28 bytes per 32, as stored 22)
        Q6_K -> q6k: qweight [O, I/256 * 210] uint8, the blocks' bytes as they are (6.5625 bits a
          weight; zoo_quant.q6k_linear reads them), no scales buffer
        every other block type -> int8g: qweight [O, I] int8 codes and scales [O, 2, I/g] float32
          (d, m) per group of g = 16 or 32 as the type has them, W = q * d + m (gguf_blocks.py);
          scales [O, 1, I/g] (d only, W = q * d) for the types without an offset (Q8_0, Q3_K, ...);
          float16 scales where the type stores d (and m) as float16 (Q8_0, IQ4_NL: Layout.half)
        parts of different types cat into one weight (Q4_K_M's wqkv) -> int8g through gguf_blocks'
          ZQ8 format (the smallest group of the parts)
  bfloat16 / float16 (CUDA): torch's weight-only kernels (`torch._weight_int8pack_mm`,
      `torch._weight_int4pack_mm`), activations cast to the compute dtype and back; int4 held as
      tinygemm tiles with scales_zeros [I/g, O, 2].
They run inside the compiled graphs (registered torch ops).

Quantized values are plain buffers (no tensor subclass, no global state): a tensor-parallel pass
can shard qweight / scales by rows like any weight. The weight arrives through `load_weight`, one
tensor at a time (a float tensor, quantized here, or GGUF blocks kept as they are).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..contracts import Slice, StoredBlocks, WeightSink
from ..errors import CheckpointError, ConfigError
from . import cpu_kernels, repack
from .gguf_blocks import (INT4_TYPES, INT5_TYPES, LAYOUTS, MIXED_LAYOUTS, Q6K_TYPES, block_bytes, block_codes,
                          has_offset, layout, q4_codes, q8_0_values)

from ..spec import QUANT_GROUPS as GROUPS, QUANT_MODES as MODES  # the config's choices
INT4_ROWS = 16  # torch's int4 kernels need O to be a multiple of this
INT8_INPUTS = cpu_kernels.BLOCK  # zoo's int8 kernel rounds activations per 32 inputs
CHUNK_WEIGHTS = 1 << 17  # weights quantized at a time (0.5 MB of float32 per temporary)
CHUNK_ROWS = 64  # chunks are whole multiples of torch's CPU int4 packing block


def chunk_rows(in_features: int) -> int:
    """Rows quantized at a time: about CHUNK_WEIGHTS weights, a multiple of CHUNK_ROWS."""
    return max(CHUNK_ROWS, CHUNK_WEIGHTS // in_features // CHUNK_ROWS * CHUNK_ROWS)


def int8_quantize(w: torch.Tensor, absmax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] float -> (q [O, I] int8, scale [O] float32): symmetric per output channel,
    w ~= q * scale, |q| <= 127. absmax [O]: max |w| of each whole row when w holds only some of
    its inputs (a tensor-parallel rank's columns), so the scale is the whole row's."""
    w = w.float()
    scale = (w.abs().amax(dim=1) if absmax is None else absmax.float()).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [O, I] float -> (q [O, I] int32 in 0..15, scale [O, I/g], zero [O, I/g] float32):
    asymmetric per group of g inputs, w ~= (q - 8) * scale + zero (min..max of each group
    spread over the 16 codes)."""
    O, I = w.shape
    g = w.float().reshape(O, I // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    g = g - lo[..., None]  # in place from here: one float temporary the size of w
    q = g.div_(scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return q.reshape(O, I), scale, lo + 8.0 * scale


class QuantLinear(nn.Module, WeightSink):
    """See the module docstring. Built on any device (meta first, like every module); the
    buffers are allocated by `to_empty` and filled by `load_weight` or `init_weights`.

    tied_to: the parameter this weight is a quantized copy of (a tied output head: the head
    multiplies a quantized copy; the embedding stays float for its lookups, unless the head
    keeps the file's blocks, whose rows it then reads: contracts.RowTable).

    blocks_only: it takes a GGUF file's blocks as stored and no float weight (set by
    apply.keep_stored_blocks, runtime.quant=null): never a silently requantized model."""

    blocks_only = False
    _adopted = False  # qweight is the source's own bytes (a view of a GGUF file's map: _adopt)

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str, group: Optional[int],
                 compute_dtype: torch.dtype, tied_to: Optional[str] = None, device=None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"quant mode {mode!r}: expected one of {list(MODES)}")
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.group = mode, (group if mode == "int4" else None)
        self.layout = mode  # what the buffers hold: int8 | int4 | int5 | int8g | q6k (GGUF blocks, see block_layout)
        self.mode_group = self.group  # the configured group (self.group follows the layout)
        self.tied_to = tied_to
        self.compute_dtype = compute_dtype
        # zoo's kernels (float32 compute); without a C++ compiler their torch reference, same numbers
        self.zoo_kernel = compute_dtype == torch.float32
        self.compiled_kernel = self.zoo_kernel and cpu_kernels.available()
        # zoo's kernels: 0 rounds x to int8 at every row count (batch invariant); n > 0 runs calls of
        # more rows on the float GEMM (runtime.quant_prefill=float; cpu_kernels.PREFILL_MODES)
        self.float_rows = 0
        O, I = out_features, in_features
        if mode == "int8":
            if self.zoo_kernel and I % INT8_INPUTS:
                raise ValueError(f"int8 needs in_features ({I}) divisible by {INT8_INPUTS}")
            self.register_buffer("qweight", torch.empty(O, I, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(O, dtype=compute_dtype, device=device))
        else:
            if I % group or O % INT4_ROWS:
                raise ValueError(f"int4 needs in_features ({I}) divisible by the group ({group}) and "
                                 f"out_features ({O}) by {INT4_ROWS}")
            self.register_buffer("qweight", torch.empty(O, I // 2, dtype=torch.uint8, device=device))
            if self.zoo_kernel:
                self.register_buffer("scales", torch.empty(O, 2, I // group, dtype=torch.float16, device=device))
            else:
                self.register_buffer("scales_zeros", torch.empty(I // group, O, 2, dtype=compute_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(O, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group: Optional[int], compute_dtype: torch.dtype,
                    tied_to: Optional[str] = None) -> "QuantLinear":
        """An empty QuantLinear of `linear`'s shape on its device (its weight is not copied)."""
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, group, compute_dtype,
                tied_to=tied_to, device=linear.weight.device)
        if q.bias is not None:
            q.bias = nn.Parameter(torch.empty_like(linear.bias), requires_grad=False)
        return q

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def weight(self):
        raise AttributeError(
            f"QuantLinear [{self.out_features}, {self.in_features}] ({self.mode}) has no float weight; a kind "
            f"that reads a linear's .weight directly must name it in `float_linears` (contracts.FloatLinears)")

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.group else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.layout}{group}, "
                f"compute={str(self.compute_dtype).removeprefix('torch.')}, bias={self.bias is not None}")

    def quantized_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` casts floating buffers; the scales keep the kernel's compute dtype
        dtypes = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            if self._buffers[name].dtype != dtype:
                self._buffers[name] = self._buffers[name].to(dtype)
        return self

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if self.zoo_kernel:
            y = self._zoo_matmul(x2)
        elif self.mode == "int8":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.qweight.device.type == "cuda":
            y = torch._weight_int4pack_mm(x2, self.qweight, self.group, self.scales_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def _zoo_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        f = self.float_rows
        if self.layout == "q6k":
            if self.compiled_kernel:
                return torch.ops.zoo_quant.q6k_linear(x2, self.qweight, f)
            return cpu_kernels.q6k_reference(x2, self.qweight, f)
        if self.layout == "int8g":
            if self.compiled_kernel:
                return torch.ops.zoo_quant.int8g_linear(x2, self.qweight, self.scales, self.group, f)
            return cpu_kernels.int8g_reference(x2, self.qweight, self.scales, self.group, f)
        if self.layout == "int8":
            if self.compiled_kernel:
                return torch.ops.zoo_quant.int8_linear(x2, self.qweight, self.scales, f)
            return cpu_kernels.int8_reference(x2, self.qweight, self.scales, f)
        if self.layout == "int5":
            if self.compiled_kernel:
                return torch.ops.zoo_quant.int5_linear(x2, self.qweight, self.qhigh, self.scales, self.group, f)
            return cpu_kernels.int5_reference(x2, self.qweight, self.qhigh, self.scales, self.group, f)
        if self.compiled_kernel:
            return torch.ops.zoo_quant.int4_linear(x2, self.qweight, self.scales, self.group, f)
        return cpu_kernels.int4_reference(x2, self.qweight, self.scales, self.group, float_rows=f)

    def serves_rows(self) -> bool:
        """Rows are read back in the GGUF block layouts of zoo's kernels (contracts.WeightSink)."""
        return self.zoo_kernel and self.layout in ("int4", "int5", "int8g", "q6k")

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N] int64 -> W[rows] [N, I] float32 as held (a tied embedding's lookups: the
        blocks' values, gguf's dequantization bit for bit)."""
        q = self.qweight[rows]
        if self.layout == "int8g":
            return cpu_kernels.int8g_dequantize(q, self.scales[rows])
        if self.layout == "q6k":
            return cpu_kernels.int8g_dequantize(*cpu_kernels.q6k_codes(q))
        if self.layout in ("int4", "int5") and self.zoo_kernel:
            return cpu_kernels.int4_dequantize(q, self.scales[rows], self.qhigh[rows] if self.layout == "int5" else None)
        return super().dequantize_rows(rows)

    # ------------------------------------------------------------------ filling

    def block_layout(self, ggml_type: str) -> Optional[str]:
        """How `load_weight` takes stored GGUF blocks of this type: "int4" / "int5" / "q6k" / "int8g" (kept exactly,
        see the module docstring), "convert" (Q8_0 through its values to int8 per channel, torch's
        kernels), or None (the loader dequantizes them and they are quantized here; why_not_kept says why)."""
        if self.mode == "int4" and self.mode_group != 32:
            return None
        if self.zoo_kernel and (ggml_type in LAYOUTS or ggml_type in MIXED_LAYOUTS):
            return ("int4" if ggml_type in INT4_TYPES else "int5" if ggml_type in INT5_TYPES
                    else "q6k" if ggml_type in Q6K_TYPES else "int8g")
        if self.mode == "int4" and ggml_type in ("Q4_0", "Q4_1"):
            return "int4"
        return "convert" if ggml_type == "Q8_0" else None

    def accepts_blocks(self, ggml_type: str) -> bool:
        """Whether `load_weight` takes stored blocks of this type (the loader then reads the bytes,
        not dequantized values)."""
        return self.block_layout(ggml_type) is not None

    def why_not_kept(self, ggml_type: str) -> str:
        """For the load report: why stored blocks of this type were dequantized and quantized again."""
        if self.mode == "int4" and self.mode_group != 32:
            return f"{ggml_type} blocks not kept: int4 g{self.mode_group} does not hold groups of 32 (runtime.quant_group=32 keeps them)"
        if ggml_type not in LAYOUTS:
            return f"{ggml_type} has no block layout zoo keeps"
        return (f"{ggml_type} blocks not kept: torch's {str(self.compute_dtype).removeprefix('torch.')} kernels "
                f"hold Q4_0 / Q4_1 (int4 g32) only; zoo's float32 CPU kernels keep every block type")

    @torch.no_grad()
    def load_weight(self, value, absmax: Optional[torch.Tensor] = None) -> str:
        """Fill from a float tensor [O, I] (quantized here) or StoredBlocks; returns what happened,
        for the load report ("quantized -> int8 per channel", "kept Q4_1 blocks as int4 g32", ...).

        Works through chunk_rows(I) rows at a time, so the temporaries (float32 copies, int32 codes)
        stay small next to the weight: a load's peak memory is the quantized model plus one stored tensor.
        absmax [O]: see int8_quantize (int8 only; int4's groups never span ranks)."""
        shape = tuple(value.shape)
        step = chunk_rows(self.in_features)
        if shape != self.weight_shape:
            raise CheckpointError(f"weight of shape {list(shape)} for a QuantLinear of {list(self.weight_shape)}")
        if isinstance(value, StoredBlocks):
            kind = self.block_layout(value.ggml_type)
            if kind is None:
                raise CheckpointError(f"QuantLinear ({self._what()}) cannot take {value.ggml_type} blocks as they "
                                      f"are: {self.why_not_kept(value.ggml_type)}")
            rows = lambda r: StoredBlocks(value.ggml_type, value.data[r:r + step], (min(step, shape[0] - r), shape[1]))
            if kind == "convert":
                fill = lambda r: self._store_values(r, q8_0_values(rows(r)), absmax)
                what = f"converted Q8_0 -> {self._what()} (requantized from its values)"
            elif not self.zoo_kernel:
                fill = lambda r: self._store_int4(r, *q4_codes(rows(r)))
                what = (f"kept {value.ggml_type} codes as int4 g32 (scales rounded to "
                        f"{str(self.compute_dtype).removeprefix('torch.')})")
            else:
                what = self._relayout(kind, value.ggml_type)
                if kind in ("int4", "int5"):  # the codes in the kernel's layout, in one pass into the buffers
                    # (repack.py: Q4_K / Q5_K natively; Q4_0 / Q4_1 / Q5_0 / Q5_1 their bytes copied)
                    block_bytes(value)
                    d, m = self.scales[:, 0], self.scales[:, 1]
                    if kind == "int4":
                        repack.into_int4(value, self.qweight, d, m)
                    else:
                        repack.into_int5(value, self.qweight, self.qhigh, d, m)
                    return what
                elif kind == "q6k":  # Q6_K: its bytes; the source's own (a file's map) kept as they are
                    if self._adopt(value):
                        return what
                    if self._adopted:  # (a read-only map is never written: bytes of its own)
                        self._buffers["qweight"], self._adopted = torch.empty_like(self.qweight), False
                    fill = lambda r: self.qweight[r:r + step].copy_(block_bytes(rows(r)))
                elif value.ggml_type in MIXED_LAYOUTS and self.scales.dtype == torch.float32 and self.scales.shape[1] == 2:
                    # ZQ8 (parts of several types): its bytes are the codes and scales already, split in one pass
                    repack.into_int8g_zq8(block_bytes(value), value.ggml_type, self.qweight, self.scales[:, 0],
                                          self.scales[:, 1])
                    return what
                else:
                    fill = lambda r: self._store_int8g(r, rows(r))
        else:
            if self.blocks_only:
                raise CheckpointError(f"QuantLinear [{shape[0]}, {shape[1]}] keeps a GGUF file's blocks as stored "
                                      f"(runtime.quant=null) and takes no float weight; runtime.quant=none loads "
                                      f"float weights, int8 / int4 quantizes them")
            if self.layout != self.mode:
                raise CheckpointError(f"QuantLinear [{shape[0]}, {shape[1]}] holds GGUF blocks ({self._what()}): a float "
                                      f"weight cannot be loaded into it again")
            fill, what = (lambda r: self._store_values(r, value[r:r + step], absmax)), f"quantized -> {self._what()}"
        if self.qweight.device.type == "cuda" and not self.zoo_kernel:  # tinygemm's tiles span rows: pack the whole weight once
            return self._load_cuda(value, absmax)
        for r in range(0, shape[0], step):
            fill(r)
        return what

    def _adopt(self, value: StoredBlocks) -> bool:
        """Hold the stored bytes themselves as qweight (the q6k layout is the blocks as stored): a
        whole weight's contiguous CPU bytes, e.g. a view of a GGUF file's memory map, which the
        view keeps open. The empty buffer it replaces was never written (never resident). The view
        may be read-only memory: nothing writes a loaded weight, and a later load_weight gives the
        module bytes of its own first."""
        data = block_bytes(value)
        held = self.qweight
        if (data.device.type != "cpu" or held.device.type != "cpu" or data.dtype != held.dtype
                or tuple(data.shape) != tuple(held.shape) or not data.is_contiguous()):
            return False
        self._buffers["qweight"], self._adopted = data, True
        return True

    def _what(self) -> str:
        if self.layout == "q6k":
            return "Q6_K blocks as stored"
        return "int8 per channel" if self.layout == "int8" else f"{self.layout.replace('int8g', 'int8')} g{self.group}"

    def prepare_blocks(self, ggml_type: str) -> None:
        """The loader's plan: blocks of `ggml_type` will come (accepts_blocks said yes). On zoo's
        kernels the buffers take their layout now, on the meta model, so that the model is
        allocated (and the weight cache keyed) as it will be filled."""
        kind = self.block_layout(ggml_type)
        if self.zoo_kernel and kind in ("int4", "int5", "int8g", "q6k"):
            self._relayout(kind, ggml_type)

    def _relayout(self, kind: str, ggml_type: str) -> str:
        """Make the buffers hold GGUF blocks of `ggml_type` kept as `kind` (int4 | int5 | int8g | q6k),
        new empty ones unless they already do; returns the load report's line."""
        O, I = self.weight_shape
        dev = self.qweight.device
        if kind == "q6k":  # the blocks' bytes, scales inside
            lay = layout(ggml_type)
            codes = (O, I // lay.block * lay.nbytes)
            if self.layout != kind or tuple(self.qweight.shape) != codes or self.qweight.dtype != torch.uint8:
                self.layout, self.group = kind, lay.group
                self._buffers["qweight"] = torch.empty(codes, dtype=torch.uint8, device=dev)
                self._buffers.pop("scales", None)
                self._buffers.pop("qhigh", None)
            return f"kept {ggml_type} blocks as stored ({lay.nbytes * 8 / lay.block} bits a weight)"
        ns = 2  # scales' rows: d, m (int8g of a type without offsets: d only)
        if kind in ("int4", "int5"):
            g, codes, scales = 32, (O, I // 2, torch.uint8), torch.float32 if ggml_type in ("Q4_K", "Q5_K") else torch.float16
        else:
            lay = layout(ggml_type)  # Q8_0's d float16 as stored: 34 bytes per 32 weights, as the file
            g, codes, scales = lay.group, (O, I, torch.int8), torch.float16 if lay.half else torch.float32
            ns = 2 if has_offset(ggml_type) else 1
        held = self._buffers.get("scales")
        if (held is None or (self.layout, self.group, tuple(self.qweight.shape), self.qweight.dtype, tuple(held.shape),
                             held.dtype) != (kind, g, codes[:2], codes[2], (O, ns, I // g), scales)):
            self.layout, self.group = kind, g
            self._buffers["qweight"] = torch.empty(codes[:2], dtype=codes[2], device=dev)
            self._buffers["scales"] = torch.empty(O, ns, I // g, dtype=scales, device=dev)
        if kind == "int5" and "qhigh" not in self._buffers:
            self.register_buffer("qhigh", torch.empty(O, I // 8, dtype=torch.uint8, device=dev))
        elif kind != "int5":
            self._buffers.pop("qhigh", None)
        if kind in ("int4", "int5"):
            return f"kept {ggml_type} blocks as {kind} g32" + (" (float32 scales)" if scales == torch.float32 else "")
        held = str(scales).removeprefix("torch.")
        if ggml_type in MIXED_LAYOUTS:  # the loader names each part's own type
            return f"kept (with parts of other types) as int8 g{g} ({held} scales)"
        return f"kept {ggml_type} blocks as int8 g{g} ({held} scales)"

    def _store_int8g(self, r: int, b: StoredBlocks) -> None:
        """Rows r.. of the int8g layout from blocks b: their codes and group scales, exactly."""
        q, d, m = block_codes(b)
        n = len(q)
        self.qweight[r:r + n].copy_(q)
        self.scales[r:r + n, 0].copy_(d)
        if m is not None:  # (a type without offsets has no row for them)
            self.scales[r:r + n, 1].copy_(m)

    def _store_values(self, r: int, w: torch.Tensor, absmax: Optional[torch.Tensor] = None) -> None:
        """Rows r.. of the weight from float values w [rows, I]."""
        if self.mode == "int8":
            q, scale = int8_quantize(w, None if absmax is None else absmax[r:r + len(w)])
            self.qweight[r:r + len(w)].copy_(q)
            self.scales[r:r + len(w)].copy_(scale)
        else:
            self._store_int4(r, *int4_quantize(w, self.group))

    def _store_int4(self, r: int, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Rows r.. from q [rows, I] int in 0..15, scale / zero [rows, I/g] float32 (w = (q - 8) *
        scale + zero). torch's CPU packing is blocked by at most 64 rows, so chunk_rows pieces pack
        as the whole weight would (tests/test_quant.py checks it through the kernel)."""
        n = len(q)
        if self.zoo_kernel:
            qs, sm = cpu_kernels.pack_int4(q, scale, zero - 8.0 * scale)
            self._store_q4_parts(r, qs, *sm.unbind(1))
            return
        self.qweight[r:r + n].copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        self.scales_zeros[:, r:r + n].copy_(torch.stack((scale.t(), zero.t()), dim=-1))

    def _store_q4_parts(self, r: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """Rows r.. of the zoo layout: qs [rows, I/2] uint8 (Q4 block bytes), d, m [rows, I/g]."""
        n = len(qs)
        self.qweight[r:r + n].copy_(qs)
        self.scales[r:r + n].copy_(torch.stack((d, m), dim=1))

    def _load_cuda(self, value, absmax: Optional[torch.Tensor] = None) -> str:
        if isinstance(value, StoredBlocks):
            if value.ggml_type == "Q8_0":
                return self._load_cuda(q8_0_values(value), absmax) and \
                    f"converted Q8_0 -> {self._what()} (requantized from its values)"
            q, scale, zero = q4_codes(value)
            what = f"kept {value.ggml_type} codes as int4 g32 (scales rounded to {str(self.compute_dtype).removeprefix('torch.')})"
        elif self.mode == "int8":
            q, scale = int8_quantize(value.to(self.qweight.device), absmax)
            self.qweight.copy_(q)
            self.scales.copy_(scale)
            return f"quantized -> {self._what()}"
        else:
            q, scale, zero = int4_quantize(value.to(self.qweight.device), self.group)
            what = f"quantized -> {self._what()}"
        dev = self.qweight.device
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).to(dev)
        self._buffers["qweight"] = torch._convert_weight_to_int4pack(pairs, 8)  # tinygemm's tiled shape
        self.scales_zeros.copy_(torch.stack((scale.t(), zero.t()), dim=-1))
        return what

    def init_weights(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        """Random build: a normal(0, std) float weight, quantized (the same draw as nn.Linear's)."""
        w = torch.empty(self.weight_shape, device=self.qweight.device).normal_(0.0, std, generator=generator)
        self.load_weight(w)
        if self.bias is not None:
            self.bias.data.zero_()

    # ------------------------------------------------------------------ tensor parallelism

    def localize(self, part: Slice, where: str, run: str) -> None:
        """Re-make this (meta) QuantLinear in place at the local shape of `part` (kinds keep their
        references); the loader fills it from its slice of the weight, which this rank quantizes
        (compiler/parallel/plan.py says why that equals the slice of the one-process quantization)."""
        O, I = part.local_shape()
        if self.mode == "int4":
            what = f"{where}: runtime.quant=int4 under {run}"
            cols = part.ranges(1) or ()
            if any(a % self.group or b % self.group for a, b in cols):
                raise ConfigError(f"{what}: a [{self.out_features}, {self.in_features}] linear splits its inputs at "
                                  f"{[list(r) for r in cols]}, which cut int4's groups of runtime.quant_group="
                                  f"{self.group}; choose a tp or a quant_group that keeps every cut a multiple of it "
                                  f"(or runtime.quant=int8)")
            if O % INT4_ROWS:
                raise ConfigError(f"{what}: a [{self.out_features}, {self.in_features}] linear keeps {O} output rows "
                                  f"per rank; torch's int4 kernel needs a multiple of {INT4_ROWS} (choose another "
                                  f"tp, or runtime.quant=int8)")
        bias, float_rows = self.bias, self.float_rows
        local = QuantLinear(I, O, False, self.mode, self.group, self.compute_dtype, tied_to=self.tied_to,
                            device=self.qweight.device)
        self.__dict__.update(local.__dict__)
        self.bias, self.float_rows = bias, float_rows

    def vocab_parallel(self, rows: tuple[int, int], gather) -> "VocabParallelQuantHead":
        return VocabParallelQuantHead(self, rows, gather)


class VocabParallelQuantHead(QuantLinear):
    """A quantized output head (runtime.quant: the head is int8) under tensor parallelism: this
    rank's vocabulary rows [a, b), quantized from its slice of the head (or of the tied
    embedding); gather(local logits [.., V/P]) -> [.., V] joins the ranks' (parallel/plan.py)."""

    def __init__(self, q: QuantLinear, rows: tuple[int, int], gather):
        super().__init__(q.in_features, rows[1] - rows[0], False, q.mode, q.group, q.compute_dtype,
                         tied_to=q.tied_to, device=q.qweight.device)
        self.rows, self.gather, self.float_rows = rows, gather, q.float_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(super().forward(x))

    def load_weight(self, value, absmax=None) -> str:
        if isinstance(value, torch.Tensor) and value.shape[0] != self.out_features:
            value = value[self.rows[0]:self.rows[1]]  # a random build's tied embedding (fill_tied), whole
        return super().load_weight(value, absmax)
