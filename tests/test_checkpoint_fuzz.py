"""Hostile checkpoint files (issue #44, docs/security.md): structure-aware mutations of real files
(tests/checkpoint_fuzz.py), a seeded sample, each case in a forked child under an address-space
limit: a named zoo error within 1 s, or a read equal to the good file's (or, for a value the file
states consistently, the model it describes); never a raw exception, a hang, a crash or a
structural change that loads as another model. scripts/fuzz_checkpoints.py is the long run."""
from __future__ import annotations

import json
import random
import shutil
import struct

import pytest

gguf = pytest.importorskip("gguf")

from tests.checkpoint_fuzz import (FAILURES, PatchedFile, Target, gguf_mutations, isolated,  # noqa: E402
                                   run_case, safetensors_mutations)

CASE_TIMEOUT_S = 20.0  # a hang is killed here; a refusal counts only within checkpoint_fuzz.DEADLINE_S


def _failures(results) -> list[str]:
    return [f"{o.outcome}: {label} -> {o.error} {o.message[:300]} ({o.seconds:.2f} s)"
            for label, o in results if o.outcome in FAILURES]


@pytest.fixture(scope="module")
def safetensors_ckpt(tmp_path_factory):
    from tests.test_llama import make_reference

    path = tmp_path_factory.mktemp("fuzz_st")
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2), {})
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.gguf_writer import LAYOUTS, write_gguf
    from tests.test_gguf_families import FAMILIES, twin

    path = tmp_path_factory.mktemp("fuzz_gguf") / "qwen2.gguf"
    return write_gguf(path, twin("Qwen2Config", FAMILIES["qwen2"][2]), LAYOUTS["qwen2"],
                      quantize={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_0})


def test_safetensors_mutations(safetensors_ckpt, tmp_path):
    work = shutil.copytree(safetensors_ckpt, tmp_path / "ckpt")
    f = work / "model.safetensors"
    data = f.read_bytes()
    target = Target(work)
    results = []
    for label, kind, mutated in safetensors_mutations(data, random.Random(44), 32):
        f.write_bytes(mutated)
        results.append((label, run_case(target, work, kind, CASE_TIMEOUT_S)))
    f.write_bytes(data)
    assert not _failures(results), "\n".join(_failures(results))
    assert sum(o.outcome == "refused" for _, o in results) > len(results) // 2  # the sample reaches the checks


def _gguf_cases(path, tmp_path, n, seed):
    data = path.read_bytes()
    results = []
    with PatchedFile(tmp_path / path.name, data) as work:
        target = Target(work.path)
        for patch in gguf_mutations(data, gguf.GGML_QUANT_SIZES, random.Random(seed), n):
            work.write(patch)
            results.append((patch.label, run_case(target, work.path, patch.kind, CASE_TIMEOUT_S)))
            work.undo(patch)
    return results


def test_tiny_gguf_mutations(tiny_gguf, tmp_path):
    results = _gguf_cases(tiny_gguf, tmp_path, 32, seed=44)
    assert not _failures(results), "\n".join(_failures(results))
    assert sum(o.outcome == "refused" for _, o in results) > len(results) // 2


def test_smollm2_header_mutations(smollm2_gguf, tmp_path):
    """The 100 MB SmolLM2 Q4_1 file, its header patched in place: one case per field role first
    (magic, version, counts, lengths, value / array types, values, n_dims, dims, GGML types,
    offsets, a cut, a tensor moved onto another's bytes, a flipped byte)."""
    results = _gguf_cases(smollm2_gguf, tmp_path, 14, seed=44)
    assert not _failures(results), "\n".join(_failures(results))


# ----------------------------------------------------------------------------- the issue's cases

def _kv_value_at(data: bytes, key: str) -> int:
    """Byte offset of the (uint32) value of metadata key `key` in a GGUF file."""
    at = data.index(key.encode()) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # UINT32
    return at + 4


def test_block_count_far_beyond_the_tensors_is_refused_at_once(smollm2_gguf, tmp_path):
    """llama.block_count = 3,000,000 for 30 blocks hung the loader over a minute."""
    from zoo.runtime import from_pretrained_config

    data = smollm2_gguf.read_bytes()
    at = _kv_value_at(data, "llama.block_count")
    with PatchedFile(tmp_path / "layers.gguf", data) as work:
        from tests.checkpoint_fuzz import Patch

        work.write(Patch("block_count", "value", at, struct.pack("<I", 3_000_000)))
        status, value, seconds, _ = isolated(lambda: from_pretrained_config(str(work.path), compile=False), 30)
    assert status == "error" and value[0] == "CheckpointFormatError", (status, value)
    assert "llama.block_count = 3000000, but the file's tensors hold 30 layers" in value[1] and str(work.path) in value[1]
    assert seconds < 1.0


def _rewrite_header(path, fn=None, raw: bytes | None = None):
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    if fn is not None:
        fn(header)
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def test_safetensors_header_not_an_object(safetensors_ckpt, tmp_path):
    import zoo

    bad = shutil.copytree(safetensors_ckpt, tmp_path / "bad")
    _rewrite_header(bad / "model.safetensors", raw=b'["model.embed_tokens.weight"]')
    with pytest.raises(zoo.CheckpointError, match=r"model.safetensors: corrupt safetensors header: a JSON list, "
                                                  r"expected an object"):
        zoo.from_pretrained(str(bad), compile=False)


def test_safetensors_tensors_sharing_bytes_are_refused(safetensors_ckpt, tmp_path):
    """Two same-sized tensors pointed at the same bytes loaded silently: another model."""
    import zoo

    bad = shutil.copytree(safetensors_ckpt, tmp_path / "bad")
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    _rewrite_header(bad / "model.safetensors", lambda h: h[v].__setitem__("data_offsets", h[k]["data_offsets"]))
    with pytest.raises(zoo.CheckpointError, match=r"model.safetensors: tensor .*data_offsets \[\d+, \d+\] overlaps"):
        zoo.from_pretrained(str(bad), compile=False)


def test_gguf_tensors_sharing_bytes_are_refused(tiny_gguf, tmp_path):
    from zoo.compiler.checkpoint.gguf import GGUFSource
    from zoo.compiler.errors import CheckpointFormatError
    from tests.checkpoint_fuzz import gguf_fields

    data = bytearray(tiny_gguf.read_bytes())
    offsets = [f for f in gguf_fields(bytes(data))[0] if f.role == "offset"]
    first = struct.unpack_from("<Q", data, offsets[1].at)[0]
    struct.pack_into("<Q", data, offsets[2].at, first)
    bad = tmp_path / "shared.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=rf"{bad}: not a readable GGUF file \(tensor '.*': data offset "
                                                    rf"{first} overlaps the tensor before it; expected \d+"):
        GGUFSource(bad)


def test_gguf_metadata_the_fuzz_run_found(tmp_path):
    """What scripts/fuzz_checkpoints.py got past the readers before they checked it: a special
    token id outside the vocabulary (a raw IndexError), a float key stored as an integer of the
    same width (read as another number), a trailing tensor retyped to one that still fits."""
    from gguf import GGMLQuantizationType as Q, GGUFValueType as V
    import numpy as np

    from zoo.compiler.checkpoint.gguf import GGUFSource
    from zoo.compiler.errors import CheckpointFormatError
    from tests.test_gguf_source import LLAMA_KV, write_gguf

    bos = dict(LLAMA_KV, **{"tokenizer.ggml.bos_token_id": (3, V.UINT32)})  # 3 tokens: ids 0-2
    with pytest.raises(CheckpointFormatError, match=r"b.gguf.*tokenizer.ggml.bos_token_id = 3: expected a token id "
                                                    r"in \[0, 3\)"):
        GGUFSource(write_gguf(tmp_path / "b.gguf", kv=bos))
    retyped = dict(LLAMA_KV, **{"llama.rope.freq_base": (10000, V.UINT32)})
    with pytest.raises(CheckpointFormatError, match=r"llama.rope.freq_base is stored as GGUF type 4: expected a float"):
        GGUFSource(write_gguf(tmp_path / "f.gguf", kv=retyped))
    path = write_gguf(tmp_path / "t.gguf", kv=LLAMA_KV, tensors={"blk.0.w": np.ones((2, 64), np.float32)})
    data = bytearray(path.read_bytes())
    from tests.checkpoint_fuzz import gguf_fields

    (kind,) = [f for f in gguf_fields(bytes(data))[0] if f.role == "ggml_type"]
    struct.pack_into("<I", data, kind.at, Q.Q8_0)  # 512 bytes of F32 read as 136 of Q8_0 blocks
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=r"t.gguf.*its tensors end at byte \d+ \(padded: \d+\): \d+ "
                                                    r"trailing bytes no tensor holds"):
        GGUFSource(path)
