"""GGUF checkpoint source: llama.cpp's single-file format, memory-mapped and dequantized on read.

GGUF writes tensor dims fastest-varying first, the reverse of torch: a linear weight that torch
sees as [out, in] is stored with GGUF shape [in, out]. Everything this module hands out is in torch
order. Quantized tensors are dequantized to float32 by compiler/quant/gguf_blocks.py (torch, equal
bit for bit to `gguf.quants`, llama.cpp's own Python reference implementation).

llama.cpp's HF->GGUF converter also reorders the rows of llama q_proj / k_proj weights for its
RoPE kernel; `read` returns them as stored and the `unpermute_rope` op (ops.py) undoes that.
Metadata becomes a config.json dict through conf/gguf/<architecture>.yaml.
"""
from __future__ import annotations

import copy
import mmap
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..config import conf_files
from ..contracts import Source, TensorInfo
from ..errors import CheckpointError, CheckpointFormatError
from ..quant.gguf_blocks import LAYOUTS, dequantize, mixed_format, to_mixed
from .gguf_index import GGUFFormatError, read_index, tensor_data

# Types `read` dequantizes: the plain floats and every block type of gguf_blocks.LAYOUTS (the ones
# in common use; gguf.quants knows more, e.g. the IQ2 / IQ3 / IQ1 grids).
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", *LAYOUTS))

_ROPE_SCALING_TYPES = ("none", "linear", "yarn")


class GGUFSource(Source):
    """A `Source` over one .gguf file.

    Opening reads the header, metadata and tensor index; tensor data stays memory-mapped until
    `read`. Raises CheckpointError if the file is missing or is not a well-formed GGUF file.
    """

    reads_blocks = True  # read_blocks: Q4_0 / Q4_1 / Q8_0 bytes for quantized weight sinks

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.description = f"{self.path} (GGUF)"
        try:
            # the header in one struct pass (gguf_index.py: gguf-py's GGUFReader takes ~1.5 s
            # over a 49k-token vocabulary)
            self._index = read_index(self.path, GGML_QUANT_SIZES)
        except GGUFFormatError as e:
            raise CheckpointFormatError(f"{self.path}: not a readable GGUF file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._tensors = {name: _Tensor(self._index, t) for name, t in self._index.tensors.items()}
        self._made: dict[str, torch.Tensor] | None = None  # metadata_tensors, made on first use
        # every error from here on names the file and its architecture
        self.description = f"{self.path} (GGUF, general.architecture={self.metadata('general.architecture')!r})"
        check_sizes(self._index.fields, self._index.tensors, self.description, self._index.types)

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
        entries = {
            name: TensorInfo(
                shape=_torch_shape(t.shape),
                dtype=t.tensor_type.name,
                file=self.path,
                nbytes=int(t.n_bytes),
            )
            for name, t in self._open_tensors().items()
        }
        for name, t in self._metadata_tensors().items():
            entries[name] = TensorInfo(shape=tuple(t.shape), dtype="F32", file=self.path, nbytes=4 * t.numel())
        return entries

    def read_order(self) -> list[list[str]]:
        """One group: every tensor, in file order, then those the map makes of metadata."""
        return [[*self._open_tensors(), *self._metadata_tensors()]]

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in torch order (shape as in `entries()`)."""
        if name in (made := self._metadata_tensors()):
            return made[name].clone()
        tensors = self._open_tensors()
        if name not in tensors:
            raise CheckpointError(f"{self.description}: no tensor named {name!r}")
        t = tensors[name]
        return _dequantize(t.data, t.tensor_type, f"{self.description}: tensor {name!r}").reshape(_torch_shape(t.shape))

    def read_blocks(self, name: str, as_format: str | None = None) -> torch.Tensor:
        """A block-quantized tensor's stored bytes, uint8 [..., rows, bytes per row] (the torch
        shape but its last dim: [E, O, bytes] for a stack of experts), for a loader that keeps the blocks (compiler/quant/gguf_blocks.py);
        as_format: a mixed_blocks format the bytes are re-blocked into (exactly)."""
        t = self._open_tensors()[name]
        if t.tensor_type.name not in LAYOUTS:
            raise CheckpointError(f"{self.description}: tensor {name!r} is {t.tensor_type.name}, not block-quantized")
        lead = _torch_shape(t.shape)[:-1]
        # a view of the (read-only) memory map: a sink whose layout is the bytes as stored keeps it
        # (no copy, QuantLinear's q6k), the others copy what they need; the view keeps the map open.
        # Nothing writes into it (a write would fault): the sinks read it into their own buffers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that the array is not writable
            raw = torch.from_numpy(t.data.view(np.uint8).reshape(*lead, -1))
        if as_format is None or as_format == t.tensor_type.name:
            return raw
        return to_mixed(raw.reshape(-1, raw.shape[-1]), t.tensor_type.name, as_format).reshape(*lead, -1)

    def mixed_blocks(self, ggml_types) -> str | None:
        """The block format `read_blocks(as_format=...)` re-blocks tensors of all these (different)
        types into, so that row-wise ops can join them (gguf_blocks.mixed_format), or None."""
        return mixed_format(ggml_types)

    def config(self) -> dict:
        """A Hugging Face config.json-style dict, mapped from the file's metadata by
        conf/gguf/{general.architecture}.yaml (see that file for the vocabulary).

        Raises CheckpointError for an architecture without such a file, and for anything its
        `reject` section names (MoE files, per-dimension RoPE factors, partial rotary, ...).
        """
        arch, _, mapping = self._mapping()
        names = self._open_tensors()
        reject = mapping.get("reject", {})
        for key, why in reject.get("absent", {}).items():  # a key llama.cpp defaults to what the map cannot express
            if self.metadata(key.format(arch=arch)) is None:
                raise CheckpointError(f"{self.description}: {why} ({key.format(arch=arch)} is not set)")
        for key, why in reject.get("metadata", {}).items():
            if self.metadata(key.format(arch=arch), 0):
                raise CheckpointError(f"{self.description}: {why} ({key.format(arch=arch)} is set)")
        for key, values in reject.get("values", {}).items():
            value = self.metadata(key.format(arch=arch))
            if value in values:
                raise CheckpointError(f"{self.description}: {values[value]} ({key.format(arch=arch)} = {value})")
        for key, (limit, why) in reject.get("above", {}).items():
            if (value := self.metadata(key.format(arch=arch), 0)) > limit:
                raise CheckpointError(f"{self.description}: {why} ({key.format(arch=arch)} = {value})")
        for key, (other, why) in reject.get("differs", {}).items():
            value, expected = self.metadata(key.format(arch=arch)), self.metadata(other.format(arch=arch))
            if value is not None and value != expected:
                raise CheckpointError(f"{self.description}: {why} ({key.format(arch=arch)} = {value}, "
                                      f"{other.format(arch=arch)} = {expected})")
        for key, (expected, why) in reject.get("other_than", {}).items():
            # a value llama.cpp reads but the modules fix (each element of a per-layer array)
            value = self.metadata(key.format(arch=arch))
            values = value if isinstance(value, list) else [value]
            if value is not None and any(abs(v - expected) > 1e-6 * max(1.0, abs(expected)) for v in values):
                raise CheckpointError(f"{self.description}: {why} ({key.format(arch=arch)} = {value}, "
                                      f"expected {expected})")
        for tensor, why in reject.get("tensors", {}).items():
            if tensor in names:
                raise CheckpointError(f"{self.description}: {why}")
        cfg: dict[str, Any] = copy.deepcopy(mapping.get("config", {}))
        for hf_key, field in mapping.get("fields", {}).items():
            if isinstance(field, dict) and "kinds" in field:
                _put(cfg, hf_key, self._kinds(arch, field["kinds"], field["other"]))
                continue
            if isinstance(field, dict) and "tensor" in field:
                # which blocks have a tensor, per layer (llama.cpp tells Jamba's MoE layers by their
                # router alone)
                key = field["tensor"]
                value = [key.format(layer=i) in names for i in range(self._required(f"{arch}.block_count"))]
            else:
                key = field["key"] if isinstance(field, dict) else field
                if isinstance(key, list):  # the first key the file has (newer converters renamed some)
                    key = next((k for k in key if self.metadata(k.format(arch=arch)) is not None), key[0])
                key = key.format(arch=arch)
                value = self.metadata(key) if isinstance(field, dict) else self._required(key)
            if isinstance(field, dict) and "none_if" in field and value == field["none_if"]:
                value = None  # the converter's stand-in for "not set" (e.g. sliding_window 0)
            if value is None:
                value = field["default"]
            elif isinstance(field, dict) and "each" in field:
                value = self._each(key, value, field["each"], field.get("each_other"))
            elif isinstance(field, dict) and field.get("largest") and isinstance(value, list):
                value = max(value)  # a per-layer array's one value (LFM2's kv heads: 0 on conv layers)
            elif isinstance(field, dict) and field.get("nonzero"):
                # the layers whose element is set, as a list of indices (Bamba's attn_layer_indices:
                # head_count_kv is 0 on its Mamba2 layers)
                value = [i for i, v in enumerate(value if isinstance(value, list) else [value]) if v]
            elif isinstance(field, dict) and "period" in field:
                value = self._period(key, value, self._required(f"{arch}.block_count"))[field["period"] == "offset"]
            elif isinstance(field, dict) and ("minus" in field or "over" in field or "times" in field):
                # a value the converter writes as a sum or a product (DeepSeek's key_length_mla =
                # nope + rope; GLM's block_count counts the MTP layers; rope.dimension_count =
                # partial_rotary_factor * head_dim); an absent `minus` key is 0
                if "minus" in field:
                    value = value - self.metadata(field["minus"].format(arch=arch), 0)
                if "times" in field:  # GPT-NeoX's rotary fraction: dimension_count * head_count / embedding_length
                    value = value * self._required(field["times"].format(arch=arch))
                if "over" in field:  # a whole quotient stays an integer (a width), else a fraction
                    d = self._required(field["over"].format(arch=arch))
                    value = value // d if value % d == 0 else value / d
            if value is not None or (isinstance(field, dict) and field.get("nullable")):
                _put(cfg, hf_key, value)  # nullable: config.json's explicit null (DeepSeek's full-rank q)
        for hf_key, tensor in mapping.get("tensor_present", {}).items():
            if isinstance(tensor, dict):  # {tensor, present, absent}: a value other than a boolean
                present = _present(tensor["tensor"], names)
                if present or "absent" in tensor:  # no `absent`: the key stays unset
                    _put(cfg, hf_key, tensor["present"] if present else tensor["absent"])
            else:
                _put(cfg, hf_key, _present(tensor, names))
        for hf_key, tensor in mapping.get("tensor_values", {}).items():
            # numbers the converter stores as a tensor, not as metadata (MiniCPM3's LongRoPE
            # factors): config.json's list of them, when the file has the tensor
            if tensor in names:
                _put(cfg, hf_key, [float(v) for v in self.read(tensor).flatten().tolist()])
        for hf_key, tensor in mapping.get("tensor_absent", {}).items():
            cfg[hf_key] = tensor not in names
        # llama.cpp's own default for every architecture: key_length = embedding_length / head_count;
        # config.json gets it only where the map has the field (some import maps have no head_dim;
        # GPT-2's config.json has other names for the sizes and no rotary)
        if "head_dim" in mapping.get("fields", {}) or "rotary_dim" in reject:
            if "head_dim" not in cfg and not cfg.get("num_attention_heads"):  # (Mamba's files write 0: no head_dim)
                raise CheckpointFormatError(f"{self.description}: {arch}.attention.head_count = "
                                            f"{cfg.get('num_attention_heads')!r}: expected at least one head (the head "
                                            f"width is embedding_length / head_count)")
            head_dim = cfg["head_dim"] if "head_dim" in cfg else cfg["hidden_size"] // cfg["num_attention_heads"]
        if "head_dim" in mapping.get("fields", {}):
            cfg["head_dim"] = head_dim
        if "rotary_dim" in reject:
            rotary = self.metadata(reject["rotary_dim"].format(arch=arch), head_dim)
            if rotary != head_dim:
                raise CheckpointError(
                    f"{self.description}: partial rotary embedding (rope.dimension_count={rotary}, "
                    f"head_dim={head_dim}) is not supported for {arch}")
        cfg["vocab_size"] = self._vocab_size(arch)
        if (rope_scaling := self._rope_scaling(arch, mapping.get("yarn", {}))) is not None:
            cfg["rope_scaling"] = rope_scaling
        return cfg

    def format_stages(self) -> list[str]:
        """Rule stages that rename llama.cpp tensor names to the architecture's Hugging Face names
        (conf/rules/gguf_{general.architecture}.yaml); the loader runs them before the model's rules.

        Raises CheckpointError when no such rule file exists for the file's architecture.
        """
        arch = self.metadata("general.architecture")
        variant = self._mapping()[1] if isinstance(arch, str) and arch in conf_files("gguf") else arch
        name = f"gguf_{variant}"
        rules = conf_files("rules")
        if not isinstance(arch, str) or name not in rules:
            known = sorted(n.removeprefix("gguf_") for n in rules
                           if n.startswith("gguf_") and n.removeprefix("gguf_") in _architectures())
            raise CheckpointError(f"{self.description}: unsupported GGUF architecture {arch!r}: no tensor-name "
                                  f"rules conf/rules/{name}.yaml (supported: {', '.join(known)})")
        return [name]

    def tokenizer_options(self) -> dict:
        """The architecture map's `tokenizer` section (e.g. {sentencepiece: gemma}: how its
        SentencePiece vocabulary spells spaces), {} without one or for an unmapped architecture."""
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str) or arch not in conf_files("gguf"):
            return {}
        return dict(self._mapping()[2].get("tokenizer", {}))

    def release(self, name: str) -> None:
        """Drop tensor `name`'s pages from this process (madvise DONTNEED on the whole pages inside
        its bytes; the file's page cache keeps them, and a view kept by a module re-reads them
        when touched): a load's peak holds the model and the tensor in hand, not the whole file."""
        t = self._index.tensors.get(name) if self._index is not None else None
        mm = getattr(self._index.memmap, "_mmap", None) if t is not None else None
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.n_bytes) // page * page
        if end > start:
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass  # a hint only

    def close(self) -> None:
        """Drop the memory map (tensors already returned by `read` are independent copies)."""
        self._index = None
        self._tensors = {}
        self._made = {}

    # -- metadata -------------------------------------------------------------------------------

    def _mapping(self) -> tuple[str, str, dict]:
        """(general.architecture, the map's name, the map): conf/gguf/ARCH.yaml, or the first of
        its `variants` whose `when` key is set and nonzero (e.g. llama files with experts), or
        equal to its `equals` value, whose rules are then conf/rules/gguf_<variant>.yaml."""
        arch = self.metadata("general.architecture")
        mapping = _gguf_mapping(arch, self.description)
        for variant in mapping.get("variants", []):
            value = self.metadata(variant["when"].format(arch=arch), 0)
            if value == variant["equals"] if "equals" in variant else value:
                path = conf_files("gguf").get(variant["map"])
                if path is None:
                    raise CheckpointError(f"{self.description}: conf/gguf/{arch}.yaml names variant map "
                                          f"{variant['map']!r}, which has no file conf/gguf/{variant['map']}.yaml")
                return arch, variant["map"], _load_map(path, self.description)
        return arch, arch, mapping


    def _metadata_tensors(self) -> dict[str, torch.Tensor]:
        """The map's `metadata_tensors`: {tensor pattern with {layer}: metadata key} -> one [1]
        float32 tensor per element of that per-layer array (parameters a converter writes as
        metadata: Apertus's xIELU scalars), named by the pattern at the element's index. Empty for
        an architecture without a map (config() reports that)."""
        if self._made is None:
            arch = self.metadata("general.architecture")
            made: dict[str, torch.Tensor] = {}
            if isinstance(arch, str) and arch in conf_files("gguf"):
                for pattern, key in self._mapping()[2].get("metadata_tensors", {}).items():
                    key = key.format(arch=arch)
                    values = self._required(key)
                    if not isinstance(values, list) or len(values) != self.metadata(f"{arch}.block_count", len(values)):
                        raise CheckpointError(f"{self.description}: {key} = {values!r}: expected one number per "
                                              f"layer ({arch}.block_count = {self.metadata(f'{arch}.block_count')})")
                    for i, v in enumerate(values):
                        made[pattern.format(layer=i)] = torch.tensor([float(v)], dtype=torch.float32)
            self._made = made
        return self._made

    def _each(self, key: str, value: Any, table: dict, other: Any = None) -> list:
        """A per-layer metadata array (e.g. llama.cpp's sliding_window_pattern [bool] * n_layers)
        as config.json's list, element by element through `table` (e.g. {true: sliding_attention,
        false: full_attention}), an element outside it as `other` when given (LFM2's head_count_kv
        {0: conv}, other: full_attention), else an error naming the key and the value."""
        values = value if isinstance(value, list) else [value]
        if other is not None:
            return [table.get(v, other) for v in values]
        if bad := [v for v in values if v not in table]:
            raise CheckpointError(f"{self.description}: {key} has {bad[0]!r}, expected one of "
                                  f"{', '.join(repr(k) for k in table)}")
        return [table[v] for v in values]

    def _period(self, key: str, value: Any, n_layers: int) -> tuple[int, int]:
        """(period, offset) of a per-layer array whose set layers are exactly those with
        layer % period == offset (Jamba's attention and MoE schedules), the smallest period that
        states them (any other that does gives the same layers); an error naming the key and the
        layers when none does."""
        values = value if isinstance(value, list) else [value] * n_layers  # a scalar: every layer's
        n, layers = len(values), [i for i, v in enumerate(values) if v]
        if n != n_layers:
            raise CheckpointError(f"{self.description}: {key} has {n} elements, expected one per layer "
                                  f"(block_count = {n_layers})")
        for period in range(1, n + 1):
            if layers and layers[0] < period and layers == list(range(layers[0], n, period)):
                return period, layers[0]
        raise CheckpointError(f"{self.description}: {key} is set on layers {layers} of {n}; expected the layers "
                              f"i % period == offset for some period and offset")

    def _kinds(self, arch: str, kinds: dict, other: str) -> list:
        """Per-layer kinds from several per-layer arrays (llama.cpp's hybrid patterns: NemotronH's
        head_count_kv set on attention layers, feed_forward_length on MLP layers): each layer is the
        kind whose array is set (nonzero) there, `other` where none is; a layer two arrays claim is
        an error naming both keys (it holds what one kind cannot state). A scalar covers every layer."""
        n = self._required(f"{arch}.block_count")
        claims: list[list[str]] = [[] for _ in range(n)]
        for kind, key in kinds.items():
            key = key.format(arch=arch)
            value = self.metadata(key, 0)
            values = value if isinstance(value, list) else [value] * n
            if len(values) != n:
                raise CheckpointError(f"{self.description}: {key} has {len(values)} elements, expected one per "
                                      f"layer ({arch}.block_count = {n})")
            for layer, v in enumerate(values):
                if v:
                    claims[layer].append(key)
        for layer, keys in enumerate(claims):
            if len(keys) > 1:
                raise CheckpointError(f"{self.description}: layer {layer} is set in both {keys[0]} and {keys[1]}; "
                                      f"expected one of {', '.join(kinds)} per layer")
        by_key = {key.format(arch=arch): kind for kind, key in kinds.items()}
        return [by_key[keys[0]] if keys else other for keys in claims]

    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value `key` as a Python value (str, int, float, bool, or a list of them)."""
        value = self._open_reader().fields.get(key)
        if value is None:
            return default
        return list(value) if isinstance(value, list) else value

    def _required(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise CheckpointError(f"{self.description}: missing required GGUF metadata key {key!r}")
        return value

    def _vocab_size(self, arch: str) -> int:
        if (size := self.metadata(f"{arch}.vocab_size")) is not None:
            return size
        tokens = self._open_reader().fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            return len(tokens)
        if "token_embd.weight" in self._open_tensors():
            return int(self._open_tensors()["token_embd.weight"].shape[-1])  # GGUF order: [d, vocab]
        raise CheckpointError(f"{self.description}: cannot tell the vocabulary size")

    def _rope_scaling(self, arch: str, yarn: dict) -> dict | None:
        """HF `rope_scaling` from {arch}.rope.scaling.* (llama.cpp's keys for every architecture),
        or None when the file has no scaling. yarn: the map's `yarn` section, {llama.cpp knob:
        {to: [HF keys], scale: s, required: bool}} for the knobs an architecture gives a meaning
        (DeepSeek's yarn_log_multiplier is 0.1 * mscale_all_dim)."""
        kind = self.metadata(f"{arch}.rope.scaling.type")
        factor = self.metadata(f"{arch}.rope.scaling.factor")
        if kind is None and (old_linear := self.metadata(f"{arch}.rope.scale_linear")) is not None:
            kind, factor = "linear", old_linear  # key used by older converters
        if kind is None or kind == "none":
            return None
        if kind not in _ROPE_SCALING_TYPES:
            raise CheckpointError(
                f"{self.description}: unsupported RoPE scaling type {kind!r} (supported: {', '.join(_ROPE_SCALING_TYPES)})"
            )
        if factor is None:
            raise CheckpointError(f"{self.description}: RoPE scaling {kind!r} without {arch}.rope.scaling.factor")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            original = self.metadata(f"{arch}.rope.scaling.original_context_length")
            if original is None:
                raise CheckpointError(
                    f"{self.description}: yarn RoPE scaling without {arch}.rope.scaling.original_context_length"
                )
            scaling["original_max_position_embeddings"] = original
            if (attn_factor := self.metadata(f"{arch}.rope.scaling.attn_factor")) is not None:
                scaling["attention_factor"] = float(attn_factor)
            for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if (value := self.metadata(f"{arch}.rope.scaling.{key}")) is not None:
                    scaling[hf_key] = float(value)
            for key, knob in yarn.items():
                value = self.metadata(f"{arch}.rope.scaling.{key}")
                if value is None and knob.get("required"):
                    raise CheckpointError(f"{self.description}: yarn RoPE without {arch}.rope.scaling.{key} is not "
                                          f"supported for {arch} (the map reads it as {', '.join(knob['to'])})")
                if value is not None:
                    scaling.update({hf_key: float(value) * knob.get("scale", 1.0) for hf_key in knob["to"]})
            # llama.cpp's own yarn knobs without a config.json counterpart: ignoring them would
            # silently change every rotation
            for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
                if key not in yarn and (value := self.metadata(f"{arch}.rope.scaling.{key}")) is not None:
                    raise CheckpointError(f"{self.description}: yarn RoPE with {arch}.rope.scaling.{key} = {value} "
                                          f"is not supported (expressible: factor, original_context_length, "
                                          f"attn_factor, yarn_beta_fast, yarn_beta_slow)")
        return scaling

    def _open_reader(self):
        if self._index is None:
            raise CheckpointError(f"{self.description}: source is closed")
        return self._index

    def _open_tensors(self) -> dict:
        self._open_reader()
        return self._tensors


class _Tensor:
    """A tensor of the index as the rest of this module reads it (GGUFReader's attribute names);
    its data is mapped on first use."""

    def __init__(self, index, t):
        self._index, self._t = index, t
        self.tensor_type = GGMLQuantizationType(t.ggml_type)
        self.shape, self.n_bytes = t.shape, t.n_bytes

    @property
    def data(self) -> np.ndarray:
        return tensor_data(self._index, self._t, GGML_QUANT_SIZES)


# llama.cpp's generic keys that size a model ({arch}.*): a count each, or one per layer where a map
# may read a per-layer array
_COUNTS = ("block_count", "context_length", "embedding_length", "attention.key_length", "attention.value_length",
           "expert_count", "expert_used_count", "vocab_size")
_PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")
# llama.cpp's generic keys of other numbers: each read with the type llama.cpp's loader demands
# (llama-model-loader: "key has wrong type"): a float stored as an integer of the same width
# would otherwise be read as another number
_INTEGERS = ("rope.dimension_count", "rope.scaling.original_context_length", "attention.sliding_window",
             "expert_shared_count", "leading_dense_block_count", "expert_feed_forward_length", "expert_group_count",
             "expert_group_used_count", "nextn_predict_layers", "attention.kv_lora_rank", "attention.q_lora_rank",
             "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count")
_FLOATS = ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon", "attention.group_norm_epsilon",
           "attention.clamp_kqv", "attention.max_alibi_bias", "attention.scale", "rope.freq_base", "rope.freq_base_swa",
           "rope.scale_linear", "rope.scaling.factor", "rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier",
           "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
           "rope.scaling.yarn_beta_slow", "logit_scale", "embedding_scale", "residual_scale", "expert_weights_scale",
           "final_logit_softcapping", "attn_logit_softcapping", "router_logit_softcapping")
_INT_TYPES, _FLOAT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}
_LAYER = re.compile(r"blk\.(\d+)\.")
_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_ids?")
_KV_PROJ = re.compile(r"blk\.(\d+)\.attn_(k|v)\.weight")
_EXPERTS = re.compile(r"blk\.\d+\.ffn_\w+_exps\.weight")


def check_sizes(fields: dict, tensors: dict, desc: str, types: dict | None = None) -> None:
    """Refuse metadata that contradicts the file's own tensors, from the header alone, before a map
    reads it into a config (docs/security.md): the counts above of the right type;
    {arch}.block_count, less its nextn_predict_layers (which a file may leave out), against the
    blk.N tensors present (a file declaring a million layers for its 30 would otherwise be built
    before the plan finds them unfilled); embedding_length against token_embd's width; the
    vocabulary ({arch}.vocab_size, tokenizer.ggml.tokens and its per-token arrays) against its
    rows, the special token ids (tokenizer.ggml.*_token_id) against the tokens; expert_count against the expert stacks and routers; the kv head count and head width
    against the k / v projections. Shapes are GGUF order: token_embd [n_embd, n_vocab],
    ffn_*_exps [in, out, n_expert], ffn_gate_inp [n_embd, n_expert], attn_k / attn_v
    [n_embd, n_kv x head width]. types: each key's GGUF value type (GGUFIndex.types): llama.cpp's
    integer and float keys must have one of those types (or be arrays of them, per layer)."""
    arch = fields.get("general.architecture")
    if arch is not None and not isinstance(arch, str):
        raise CheckpointFormatError(f"{desc}: general.architecture = {arch!r}: expected a string")
    layers = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    for names, allowed, what in (([f"{arch}.{k}" for k in _COUNTS + _PER_LAYER + _INTEGERS]
                                  + ["tokenizer.ggml.token_type"], _INT_TYPES, "an integer"),
                                 ([f"{arch}.{k}" for k in _FLOATS] + ["tokenizer.ggml.scores"], _FLOAT_TYPES, "a float"),
                                 (["tokenizer.ggml.tokens", "tokenizer.ggml.merges"], {8}, "a string")):
        for k in names:
            vtype = (types or {}).get(k)
            element = vtype[1] if isinstance(vtype, tuple) else vtype
            if vtype is not None and element not in allowed:
                raise CheckpointFormatError(f"{desc}: {k} is stored as GGUF type {vtype}: expected {what} "
                                            f"(type ids {sorted(allowed)}, or an array of them)")

    def count(key: str, per_layer: bool = False):
        value = fields.get(key)
        if value is None:
            return None
        if type(value) is int and value >= 0:
            return value
        if per_layer and isinstance(value, list) and all(type(v) is int and v >= 0 for v in value):
            return value
        raise CheckpointFormatError(f"{desc}: {key} = {_short(value)}: expected a non-negative integer"
                                    + (" or a list of them, one per layer" if per_layer else ""))

    sizes = {k: count(f"{arch}.{k}") for k in _COUNTS} | {k: count(f"{arch}.{k}", True) for k in _PER_LAYER}
    if (n := sizes["block_count"]) is not None:
        key = f"{arch}.block_count"
        # the MTP layers a converter counts in block_count may be left out of the file (llama.cpp
        # skips them): the main ones each hold some tensor
        nextn = count(f"{arch}.nextn_predict_layers") or 0
        main = n - nextn
        if main < 0 or nextn > main:
            raise CheckpointFormatError(f"{desc}: {arch}.nextn_predict_layers = {nextn} with {key} = {n}: expected "
                                        f"at most half the layers to be MTP layers")
        if main > len(layers):  # more layers than hold tensors is a lie, refused before looping over them
            raise CheckpointFormatError(f"{desc}: {key} = {n}, but the file's tensors hold {len(layers)} layers "
                                        f"(blk.N.*): expected at most {len(layers) + nextn}")
        if missing := [i for i in range(main) if i not in layers]:
            raise CheckpointFormatError(f"{desc}: {key} = {n}, but layers {missing[:8]} have no tensors (blk.N.*)")
        for k in _PER_LAYER:
            if isinstance(sizes[k], list) and len(sizes[k]) != n:
                raise CheckpointFormatError(f"{desc}: {arch}.{k} has {len(sizes[k])} elements, expected one per "
                                            f"layer ({key} = {n})")
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2:
        width, rows = embd.shape
        if sizes["embedding_length"] is not None and sizes["embedding_length"] != width:
            raise CheckpointFormatError(f"{desc}: {arch}.embedding_length = {sizes['embedding_length']}, but "
                                        f"token_embd.weight is {width} wide (GGUF shape {list(embd.shape)})")
        if sizes["vocab_size"] is not None and sizes["vocab_size"] != rows:
            raise CheckpointFormatError(f"{desc}: {arch}.vocab_size = {sizes['vocab_size']}, but token_embd.weight "
                                        f"has {rows} rows (GGUF shape {list(embd.shape)})")
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is not None and (not isinstance(tokens, list) or len(tokens) != rows):
            got = f"{len(tokens)} tokens" if isinstance(tokens, list) else _short(tokens)
            raise CheckpointFormatError(f"{desc}: tokenizer.ggml.tokens has {got}, but token_embd.weight has "
                                        f"{rows} rows: expected one token per row (llama.cpp's rule)")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise CheckpointFormatError(f"{desc}: tokenizer.ggml.tokens = {_short(tokens)}: expected a list of strings")
        for key in [k for k in fields if _SPECIAL_ID.fullmatch(k)]:  # bos, eos, padding, ... ids: rows of the table
            ids = fields[key] if isinstance(fields[key], list) else [fields[key]]
            if not all(type(i) is int and 0 <= i < len(tokens) for i in ids):
                raise CheckpointFormatError(f"{desc}: {key} = {_short(fields[key])}: expected a token id in "
                                            f"[0, {len(tokens)}) (tokenizer.ggml.tokens)")
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            value = fields.get(key)
            if value is not None and (not isinstance(value, list) or len(value) != len(tokens)):
                got = len(value) if isinstance(value, list) else _short(value)
                raise CheckpointFormatError(f"{desc}: expected {key}, one per token ({got} for {len(tokens)} tokens)")
    heads, kv_heads = sizes["attention.head_count"], sizes["attention.head_count_kv"]
    for name, t in tensors.items():  # k / v projections [n_embd, kv heads x head width] (q may be gated or low-rank)
        if (m := _KV_PROJ.fullmatch(name)) is None or len(t.shape) != 2 or heads is None:
            continue
        layer = int(m.group(1))
        h, kv = _at(heads, layer), _at(kv_heads if kv_heads is not None else heads, layer)
        width = sizes["attention.key_length" if m.group(2) == "k" else "attention.value_length"]
        if width is None and m.group(2) == "v":
            width = sizes["attention.key_length"]
        if width is None and h and sizes["embedding_length"] is not None:
            width = sizes["embedding_length"] // h  # llama.cpp's default head width
        if kv and width and t.shape[1] != kv * width:  # kv 0: a layer of another kind (LFM2's conv, KDA)
            raise CheckpointFormatError(f"{desc}: {name} is GGUF shape {list(t.shape)}, but the metadata gives "
                                        f"{kv} kv heads x {width} = {kv * width} outputs ({arch}.attention.head_count"
                                        f"{'_kv' if kv_heads is not None else ''}, key/value_length or "
                                        f"embedding_length / head_count)")
    # expert_count 0 says "dense" (Granite-4.0-H): what the import maps decide about, and stacks
    # then are tensors the plan finds no parameter for
    if experts := sizes["expert_count"]:
        for name, t in tensors.items():
            lead = t.shape[2] if _EXPERTS.fullmatch(name) and len(t.shape) == 3 else (
                t.shape[1] if name.endswith(".ffn_gate_inp.weight") and len(t.shape) == 2 else None)
            if lead is not None and lead != experts:
                raise CheckpointFormatError(f"{desc}: {arch}.expert_count = {experts}, but {name} holds {lead} "
                                            f"experts (GGUF shape {list(t.shape)})")


def _at(value: Any, layer: int) -> Any:
    """A per-layer count at `layer`: a list's element (None past its end), a scalar as it is."""
    if isinstance(value, list):
        return value[layer] if layer < len(value) else None
    return value


def _short(value: Any) -> str:
    """A metadata value for a message: a long list or string by its start and length."""
    if isinstance(value, (list, str)) and len(value) > 8:
        return f"{value[:8]!r}... ({len(value)} {'elements' if isinstance(value, list) else 'characters'})"
    return repr(value)


def _torch_shape(gguf_shape) -> tuple[int, ...]:
    """GGUF dims (fastest-varying first) -> torch shape (slowest first)."""
    return tuple(int(d) for d in reversed(gguf_shape))


def _dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType, name: str) -> torch.Tensor:
    """Raw stored data of tensor `name` (a description naming it and its file) -> a float32 tensor
    of its own (rows x elements; the caller reshapes).

    `data` is the reader's array: typed for F32/F16, bytes [rows, row_bytes] for block types.
    """
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise CheckpointError(
            f"{name} has GGML type {ggml_type.name}, which zoo cannot read (supported: {supported})"
        )
    if ggml_type == GGMLQuantizationType.F32:  # a view of the memory map: `read` hands out its own copy
        return torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))
    raw = torch.from_numpy(np.array(data, copy=True).view(np.uint8))  # the stored bytes, writable
    return dequantize(raw, ggml_type.name)


def _present(tensor: str, names) -> bool:
    """Whether the file has `tensor`; a name with `{layer}` asks whether any block has it (a hybrid's
    Mamba2 conv bias, on whichever layers are Mamba2 layers)."""
    if "{layer}" not in tensor:
        return tensor in names
    pattern = re.compile(re.escape(tensor).replace(re.escape("{layer}"), r"\d+"))
    return any(pattern.fullmatch(name) for name in names)


def _put(cfg: dict, key: str, value: Any) -> None:
    """cfg[key] = value; a dotted key reaches into config.json's sub-dicts (MPT's
    attn_config.clip_qkv), made as needed."""
    *parents, last = key.split(".")
    for part in parents:
        cfg = cfg.setdefault(part, {})
    cfg[last] = value


def _load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _architectures() -> list[str]:
    """The architectures with a map of their own (a variant map, e.g. llama_moe, is not one)."""
    return sorted(name for name, path in conf_files("gguf").items() if _load_yaml(path).get("architecture") == name)


def _load_map(path: Path, description: str, seen: tuple = ()) -> dict:
    """A conf/gguf map as a dict; `include: <map>` starts from that map's keys, the file's own
    top-level keys replacing them (nemotron_h_moe: nemotron_h's fields under its own architecture)."""
    mapping = dict(_load_yaml(path))
    base = mapping.pop("include", None)
    if base is None:
        return mapping
    base_path = conf_files("gguf").get(base) if isinstance(base, str) else None
    if base_path is None or base in seen:
        raise CheckpointError(f"{description}: {path} includes map {base!r}, which "
                              + ("includes it back" if base in seen else f"has no file conf/gguf/{base}.yaml"))
    return {**_load_map(base_path, description, (*seen, base)), **mapping}


def _gguf_mapping(arch: Any, description: str) -> dict:
    """conf/gguf/ARCH.yaml as a dict; CheckpointError naming the supported architectures."""
    maps = conf_files("gguf")
    path = maps.get(arch) if isinstance(arch, str) else None
    if path is None or _load_yaml(path).get("architecture") != arch:
        raise CheckpointError(f"{description}: unsupported GGUF architecture {arch!r} (supported: "
                              f"{', '.join(_architectures())}); a new one is a file conf/gguf/<architecture>.yaml "
                              f"(or gguf/<architecture>.yaml in the user conf dir)")
    return _load_map(path, description)
