"""GGUF checkpoint source: llama.cpp's single-file format, memory-mapped and dequantized on read.

GGUF writes tensor dims fastest-varying first, the reverse of torch: a linear weight that torch
sees as [out, in] is stored with GGUF shape [in, out]. Everything this module hands out is in torch
order. Quantized tensors are dequantized to float32 with `gguf.quants`, llama.cpp's own Python
reference implementation.

llama.cpp's HF->GGUF converter also reorders the rows of llama q_proj / k_proj weights for its
RoPE kernel; `read` returns them as stored and `unpermute_llama_cpp_rope` undoes that.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from compiler.checkpoint.source import TensorInfo
from compiler.errors import CheckpointError

# Types `read` dequantizes. gguf.quants has reference code for more; these are the ones in common
# use for llama-family files.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16",
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)

_ROPE_SCALING_TYPES = ("none", "linear", "yarn")


class GGUFSource:
    """A `Source` over one .gguf file.

    Opening reads the header, metadata and tensor index; tensor data stays memory-mapped until
    `read`. Raises CheckpointError if the file is missing or is not a well-formed GGUF file.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.description = f"{self.path} (GGUF)"
        try:
            self._reader: GGUFReader | None = GGUFReader(self.path, "r")
        # The reader signals bad magic, short files and unknown types with these, not its own class.
        except (OSError, ValueError, IndexError, KeyError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._tensors = {t.name: t for t in self._reader.tensors}

    # -- Source protocol ------------------------------------------------------------------------

    def entries(self) -> dict[str, TensorInfo]:
        """name -> TensorInfo(torch-order shape, GGML type name, file, stored bytes).

        Raises CheckpointError naming the tensors whose GGML type `read` cannot dequantize, so a
        load fails while planning, before any memory is allocated.
        """
        unreadable = [f"{name} ({t.tensor_type.name})" for name, t in self._open_tensors().items()
                      if t.tensor_type not in SUPPORTED_TYPES]
        if unreadable:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            more = f" and {len(unreadable) - 8} more" if len(unreadable) > 8 else ""
            raise CheckpointError(f"{self.description}: unsupported GGML quantization type(s) in "
                                  f"{', '.join(unreadable[:8])}{more} (supported: {supported})")
        return {
            name: TensorInfo(
                shape=_torch_shape(t.shape),
                dtype=t.tensor_type.name,
                file=self.path,
                nbytes=int(t.n_bytes),
            )
            for name, t in self._open_tensors().items()
        }

    def read_order(self) -> list[list[str]]:
        """One group: every tensor, in file order."""
        return [list(self._open_tensors())]

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in torch order (shape as in `entries()`)."""
        tensors = self._open_tensors()
        if name not in tensors:
            raise CheckpointError(f"{self.description}: no tensor named {name!r}")
        t = tensors[name]
        values = _dequantize(t.data, t.tensor_type, name)
        values = values.reshape(_torch_shape(t.shape))
        # F32 dequantizes to a read-only view of the memory map; torch needs its own writable copy.
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))

    def config(self) -> dict:
        """A Hugging Face config.json-style dict for a `llama` GGUF file.

        Raises CheckpointError for other architectures, MoE llama files, per-dimension RoPE
        factors (`rope_freqs.weight`), partial rotary and RoPE scaling types not mapped here.
        """
        arch = self.metadata("general.architecture")
        if arch != "llama":
            raise CheckpointError(f"{self.description}: unsupported GGUF architecture {arch!r} (supported: llama)")
        if self.metadata("llama.expert_count", 0):
            raise CheckpointError(f"{self.description}: mixture-of-experts llama GGUF files are not supported")
        if "rope_freqs.weight" in self._open_tensors():
            # Llama 3.1-style RoPE scaling is stored as this tensor, not as metadata; ignoring it
            # would silently change every attention score.
            raise CheckpointError(
                f"{self.description}: per-dimension RoPE frequency factors (rope_freqs.weight) are not supported"
            )

        hidden = self._required("llama.embedding_length")
        n_heads = self._required("llama.attention.head_count")
        head_dim = self.metadata("llama.attention.key_length", hidden // n_heads)
        rotary_dim = self.metadata("llama.rope.dimension_count", head_dim)
        if rotary_dim != head_dim:
            raise CheckpointError(
                f"{self.description}: partial rotary embedding (rope.dimension_count={rotary_dim}, "
                f"head_dim={head_dim}) is not supported for llama"
            )
        names = self._open_tensors()
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": self._required("llama.feed_forward_length"),
            "num_hidden_layers": self._required("llama.block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": self.metadata("llama.attention.head_count_kv", n_heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._required("llama.attention.layer_norm_rms_epsilon"),
            "rope_theta": float(self.metadata("llama.rope.freq_base", 10000.0)),
            "max_position_embeddings": self._required("llama.context_length"),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "mlp_bias": "blk.0.ffn_up.bias" in names,
        }
        for key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                              ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if (token_id := self.metadata(gguf_key)) is not None:
                cfg[key] = token_id
        if (rope_scaling := self._rope_scaling()) is not None:
            cfg["rope_scaling"] = rope_scaling
        return cfg

    def format_stages(self) -> list[str]:
        """Rule stages that rename llama.cpp tensor names to the architecture's Hugging Face names
        (conf/rules/gguf_{general.architecture}.yaml); the loader runs them before the model's rules.

        Raises CheckpointError when no such rule file exists for the file's architecture.
        """
        from .rules import rules_dir

        arch = self.metadata("general.architecture")
        name = f"gguf_{arch}"
        if not isinstance(arch, str) or not (rules_dir() / f"{name}.yaml").is_file():
            known = sorted(p.stem.removeprefix("gguf_") for p in rules_dir().glob("gguf_*.yaml"))
            raise CheckpointError(f"{self.description}: unsupported GGUF architecture {arch!r}: no tensor-name "
                                  f"rules conf/rules/{name}.yaml (supported: {', '.join(known)})")
        return [name]

    def close(self) -> None:
        """Drop the memory map (tensors already returned by `read` are independent copies)."""
        self._reader = None
        self._tensors = {}

    # -- metadata -------------------------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value `key` as a Python value (str, int, float, bool, or a list of them)."""
        field = self._open_reader().fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _required(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise CheckpointError(f"{self.description}: missing required GGUF metadata key {key!r}")
        return value

    def _vocab_size(self) -> int:
        if (size := self.metadata("llama.vocab_size")) is not None:
            return size
        field = self._open_reader().fields.get("tokenizer.ggml.tokens")
        if field is not None:
            return len(field.data)
        if "token_embd.weight" in self._open_tensors():
            return int(self._open_tensors()["token_embd.weight"].shape[-1])  # GGUF order: [d, vocab]
        raise CheckpointError(f"{self.description}: cannot tell the vocabulary size")

    def _rope_scaling(self) -> dict | None:
        """HF `rope_scaling` from llama.rope.scaling.*, or None when the file has no scaling."""
        kind = self.metadata("llama.rope.scaling.type")
        factor = self.metadata("llama.rope.scaling.factor")
        if kind is None and (old_linear := self.metadata("llama.rope.scale_linear")) is not None:
            kind, factor = "linear", old_linear  # key used by older converters
        if kind is None or kind == "none":
            return None
        if kind not in _ROPE_SCALING_TYPES:
            raise CheckpointError(
                f"{self.description}: unsupported RoPE scaling type {kind!r} (supported: {', '.join(_ROPE_SCALING_TYPES)})"
            )
        if factor is None:
            raise CheckpointError(f"{self.description}: RoPE scaling {kind!r} without llama.rope.scaling.factor")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            original = self.metadata("llama.rope.scaling.original_context_length")
            if original is None:
                raise CheckpointError(
                    f"{self.description}: yarn RoPE scaling without llama.rope.scaling.original_context_length"
                )
            scaling["original_max_position_embeddings"] = original
            if (attn_factor := self.metadata("llama.rope.scaling.attn_factor")) is not None:
                scaling["attention_factor"] = float(attn_factor)
        return scaling

    def _open_reader(self) -> GGUFReader:
        if self._reader is None:
            raise CheckpointError(f"{self.description}: source is closed")
        return self._reader

    def _open_tensors(self) -> dict:
        self._open_reader()
        return self._tensors


def _torch_shape(gguf_shape) -> tuple[int, ...]:
    """GGUF dims (fastest-varying first) -> torch shape (slowest first)."""
    return tuple(int(d) for d in reversed(gguf_shape))


def _dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType, name: str) -> np.ndarray:
    """Raw stored data of tensor `name` -> float32 array (rows x elements; caller reshapes).

    `data` is the reader's array: typed for F32/F16, bytes [rows, row_bytes] for block types.
    """
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise CheckpointError(
            f"tensor {name!r} has GGML type {ggml_type.name}, which cannot be dequantized (supported: {supported})"
        )
    return dequantize(data, ggml_type)


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
