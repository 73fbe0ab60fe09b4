"""The cache of converted weights (compiler/checkpoint/weight_cache.py) and the GGUF header reader
(compiler/checkpoint/gguf_index.py), on tiny GGUF files written by tests/test_gguf_load.py's
llama.cpp-style writer (mixed Q8_0 / Q4_0 / Q4_1 / BF16 / F16 / F32 tensors).

A hit must give the very bytes a fresh conversion gives (float and quantized builds); changing the
file, the dtype, the quantization or the module state's layout must miss; a damaged entry must be
rebuilt with a warning.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.checkpoint.loader import plan_load  # noqa: E402
from zoo.compiler.checkpoint.rules import checkpoint_stages  # noqa: E402
from zoo.compiler.checkpoint.weight_cache import WeightCacheWarning, cache_key  # noqa: E402
from tests.test_gguf_load import random_llama, write_llama_gguf  # noqa: E402,F401 (a fixture)


@pytest.fixture(scope="module")
def ref(random_llama):
    return random_llama


@pytest.fixture
def gguf_file(tmp_path, ref):
    return write_llama_gguf(tmp_path / "tiny.gguf", ref)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "weights"
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", str(d))
    return d


def load(path, **kw):
    return zoo.from_pretrained(str(path), compile=False, max_seq=16, **kw)


def state(m) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.module.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.is_floating_point else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.is_floating_point else b[k]), k


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_hit_returns_identical_weights(gguf_file, cache, monkeypatch, quant):
    first = load(gguf_file, quant=quant)
    assert first.info.load.cache.startswith("wrote ")
    second = load(gguf_file, quant=quant)
    assert second.info.load.cache == f"hit {first.info.load.cache.removeprefix('wrote ')}"
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", "0")
    fresh = load(gguf_file, quant=quant)
    assert fresh.info.load.cache is None
    assert_same_state(state(second), state(fresh))
    assert_same_state(state(first), state(fresh))
    # the report of the load that wrote the entry travels with it
    assert second.info.load.tensors == fresh.info.load.tensors
    assert (second.info.load.tensors_read, second.info.load.params_filled) == \
        (fresh.info.load.tensors_read, fresh.info.load.params_filled)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    assert torch.equal(second.prefill(ids), fresh.prefill(ids))
    assert torch.equal(second.decode(torch.tensor([7])), fresh.decode(torch.tensor([7])))


def _mappings(path) -> list[dict]:
    """This process's mappings of `path` (/proc/self/smaps): lo, hi, perms and the kB fields."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = {"lo": lo, "hi": hi, "perms": head[1]} if len(head) > 5 and head[5] == str(path) else None
                if current is not None:
                    out.append(current)
            elif current is not None and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                current[head[0][:-1]] = int(head[1])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the process's mappings (Linux)")
@pytest.mark.parametrize("quant", [None, "int4"])
def test_a_hit_maps_the_entry(gguf_file, cache, monkeypatch, quant):
    """A hit holds no copy of the weights: every parameter and buffer is a view of one private
    mapping of the entry file (its pages the page cache's, shared by every process that maps
    it), and after a prefill and a decode step no page of it was copied into anonymous memory;
    the values are the cold load's."""
    load(gguf_file, quant=quant)
    second = load(gguf_file, quant=quant)
    entry = second.info.load.cache.removeprefix("hit ")
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    got = second.prefill(ids), second.decode(torch.tensor([7]))
    maps = _mappings(os.path.realpath(entry))
    assert maps and all(m["perms"].endswith("p") for m in maps), maps  # private: writes would not reach the file
    held = second.module.state_dict()
    for name, t in held.items():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(m["lo"] <= lo and hi <= m["hi"] for m in maps), name
    assert sum(m.get("Anonymous", 0) for m in maps) == 0, maps  # no page copied on write
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", "0")
    fresh = load(gguf_file, quant=quant)
    assert_same_state(state(second), state(fresh))
    assert torch.equal(got[0], fresh.prefill(ids)) and torch.equal(got[1], fresh.decode(torch.tensor([7])))


def test_changed_file_or_settings_miss(gguf_file, cache, ref, monkeypatch):
    written = {load(gguf_file).info.load.cache}
    assert next(iter(written)).startswith("wrote ")
    for kw in (dict(dtype=torch.bfloat16), dict(quant="int8"), dict(quant="int4", quant_group=32),
               dict(quant="int4", quant_group=64)):
        again = load(gguf_file, **kw).info.load.cache
        assert again.startswith("wrote "), kw
        written.add(again)
    assert len(written) == 5 and len(list(cache.glob("*.safetensors"))) == 5
    # a rewritten file (same path, new mtime) misses: other values
    st = os.stat(gguf_file)
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load(gguf_file).info.load.cache.startswith("wrote ")
    torch.manual_seed(1)
    other = type(ref)(ref.config).eval()
    write_llama_gguf(gguf_file, other)
    m = load(gguf_file)
    assert m.info.load.cache.startswith("wrote ")
    monkeypatch.setenv("ZOO_WEIGHT_CACHE", "0")
    assert_same_state(state(m), state(load(gguf_file)))


def test_state_layout_is_part_of_the_key(gguf_file):
    """A module whose buffers change (another packing of a quantized linear) gets another key."""
    m = zoo.from_pretrained(str(gguf_file), compile=False, max_seq=16, quant="none")  # replanned below: float tables
    source = GGUFSource(gguf_file)
    plan = plan_load(m.module, source, checkpoint_stages(source, m.spec))
    settings = {"dtype": "float32", "quant": None, "quant_group": None, "device": "cpu"}
    key = cache_key(plan, m.module, settings)
    assert cache_key(plan, m.module, settings) == key
    assert cache_key(plan, m.module, {**settings, "dtype": "bfloat16"}) != key
    m.module.layers[0].mixer.register_buffer("extra", torch.zeros(3, dtype=torch.int8))
    assert cache_key(plan, m.module, settings) != key


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other key"])
def test_damaged_entry_is_rebuilt_with_a_warning(gguf_file, cache, damage):
    path = cache / load(gguf_file, quant="int8").info.load.cache.removeprefix("wrote ").split("/")[-1]
    good = state(load(gguf_file, quant="int8"))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, len(raw), dtype=np.uint8).tobytes())
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a well-formed file of another load under this name: one character of its key differs
        at = raw.index(b'"zoo_weight_cache":"') + len(b'"zoo_weight_cache":"')
        path.write_bytes(raw[:at] + (b"0" if raw[at:at + 1] != b"0" else b"1") + raw[at + 1:])
    with pytest.warns(WeightCacheWarning, match="unusable"):
        m = load(gguf_file, quant="int8")
    assert m.info.load.cache == f"wrote {path}"
    assert_same_state(state(m), good)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightCacheWarning)
        assert load(gguf_file, quant="int8").info.load.cache == f"hit {path}"


def test_plain_float_checkpoints_are_not_copied(tmp_path, cache, ref):
    ref.save_pretrained(tmp_path / "hf")
    assert load(tmp_path / "hf").info.load.cache is None
    assert not cache.exists()


def test_gguf_index_reads_what_gguf_reader_reads(tmp_path, ref):
    """Every metadata value and tensor view equals gguf-py's GGUFReader's (types included)."""
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("x.text", "héllo")
    w.add_array("x.strings", ["a", "", "ünï", "<|im_end|>"])
    w.add_array("x.ints", [1, -2, 3])
    w.add_array("x.floats", [0.5, -1.25])
    w.add_array("x.bools", [True, False])
    w.add_bool("x.flag", True)
    w.add_float32("x.f32", 0.1)
    w.add_uint64("x.u64", 2**40)
    w.add_int32("x.i32", -7)
    w.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("blocks", gguf.quants.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32),
                                                gguf.GGMLQuantizationType.Q4_1), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, write_llama_gguf(tmp_path / "tiny.gguf", ref)):
        reader, ours = gguf.GGUFReader(str(p)), GGUFSource(p)
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            a, b = field.contents(), ours.metadata(key)
            assert a == b and type(a) is type(b), key
            if isinstance(a, list):
                assert [type(x) for x in a] == [type(x) for x in b], key
        for t in reader.tensors:
            mine = ours._tensors[t.name]
            assert mine.tensor_type == t.tensor_type and mine.n_bytes == t.n_bytes
            assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data), t.name


def test_cache_command_lists_and_clears_weights(gguf_file, cache, capsys, tmp_path, monkeypatch):
    from zoo.cli import main

    # `clear` removes the compile caches too: point them at the test's folder
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "zoo" / "inductor"))
    load(gguf_file)
    assert main(["cache"]) == 0
    assert f"converted weights    {cache}  (1 files" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert not cache.exists()


def test_states_over_the_size_limit_are_not_written(gguf_file, cache, monkeypatch):
    monkeypatch.setenv("ZOO_WEIGHT_CACHE_GB", "1e-6")  # ~1 KiB
    assert load(gguf_file).info.load.cache is None
    assert not list(cache.glob("*.safetensors"))
