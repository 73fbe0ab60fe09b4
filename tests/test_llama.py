"""Llama against transformers' LlamaForCausalLM on tiny random checkpoints (CPU, float32): generate,
Hub ids and revisions, legacy rope keys, a conf built with matching weights. Prefill / decode parity,
eager and compiled, of every variant below: tests/test_family_parity.py (the llama/* entries)."""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from tests.family_harness import randomize_norms, tiny_reference
from tests.helpers import assert_logits_close, check_parity, populate_hub_cache, save_reference

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}

VARIANTS = {
    # name: (config overrides, batch, save kwargs); tests/test_family_parity.py's llama/* entries
    "gqa": (dict(num_attention_heads=4, num_key_value_heads=2), 2, {}),
    "mha": (dict(num_attention_heads=4, num_key_value_heads=4), 2, {}),
    "mqa": (dict(num_attention_heads=4, num_key_value_heads=1), 2, {}),
    "llama3_1_rope": (dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE,
                           max_position_embeddings=1024), 2, {}),
    "tied": (dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), 2, {}),
    "batch3": (dict(num_attention_heads=4, num_key_value_heads=2), 3, {}),
    "sharded": (dict(num_attention_heads=4, num_key_value_heads=2), 2, {"max_shard_size": "100KB"}),
    "bias_headdim": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
                          mlp_bias=True), 2, {}),
}


def tiny_config(**kw):
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None,
                bos_token_id=None, pad_token_id=None)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def make_reference(path, overrides, save_kwargs, seed=0):
    ref = tiny_reference(transformers.LlamaForCausalLM, tiny_config(**overrides), randomize_norms, seed)
    save_reference(ref, path, **save_kwargs)
    return ref


@pytest.fixture(scope="module")
def references(families):
    """{variant: (reference, checkpoint dir, batch)}: tests/test_family_parity.py's llama/* entries
    (prefill, decode, eager and compiled parity run there), shared for the session."""
    return families.group("llama")


def test_sharded_checkpoint_is_really_sharded(references):
    _, path, _ = references["sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_generate_matches_reference(references):
    ref, path, _ = references["gqa"]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=64)
    ids = torch.randint(0, 320, (1, 7))
    out = m.generate(ids, max_new_tokens=12)
    want = ref.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    assert out.tolist() == want.tolist()


def test_generate_stops_at_eos(references):
    ref, path, _ = references["gqa"]
    m = zoo.from_pretrained(str(path), compile=False, max_seq=64)
    ids = torch.randint(0, 320, (1, 7))
    free = m.generate(ids, max_new_tokens=10)
    eos = int(free[0, 7 + 3])  # make the 4th generated token the end token
    out = m.generate(ids, max_new_tokens=10, eos_ids=[eos])
    assert out.shape[1] <= 7 + 4 and int(out[0, -1]) == eos


HUB_SCRIPT = """
import sys, torch, zoo
ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
m = zoo.from_pretrained(sys.argv[1], revision=sys.argv[2], compile=False, max_seq=32)
torch.save(m.prefill(ids), sys.argv[3])
try:
    zoo.from_pretrained("zoo-test/absent-model", compile=False)
except zoo.CheckpointError as e:
    print("ABSENT:", e)
"""


def _run_hub(tmp_path, repo, revision):
    """A fresh process, as a user runs it: HF_HOME and HF_HUB_OFFLINE are read at start-up."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / f"logits-{revision}.pt"
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, repo, revision, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, out


def test_hub_repo_id_offline(references, tmp_path):
    ref, path, _ = references["gqa"]
    populate_hub_cache(path, tmp_path / "hf" / "hub", "zoo-test/tiny-llama")
    proc, out = _run_hub(tmp_path, "zoo-test/tiny-llama", "main")
    assert proc.returncode == 0, proc.stderr
    assert "ABSENT:" in proc.stdout and "not in the local cache" in proc.stdout
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        torch.testing.assert_close(torch.load(out), ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_hub_revision(references, tmp_path):
    _, path, _ = references["gqa"]
    populate_hub_cache(path, tmp_path / "hf" / "hub", "zoo-test/tiny-llama", revision="v1")
    proc, _ = _run_hub(tmp_path, "zoo-test/tiny-llama", "v1")
    assert proc.returncode == 0, proc.stderr
    proc, _ = _run_hub(tmp_path, "zoo-test/tiny-llama", "v2")
    assert proc.returncode != 0 and "not in the local cache" in proc.stderr


def test_legacy_rope_keys(references, tmp_path):
    """config.json written with rope_theta + rope_scaling (pre-transformers-5 Hub configs)."""
    ref, path, _ = references["llama3_1_rope"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in path.iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(cfg))
    m = zoo.from_pretrained(str(legacy), compile=False, max_seq=48)
    assert m.spec.rope.kind == "llama3" and m.spec.rope.theta == 500000.0
    check_parity(ref, m, torch.randint(0, 320, (1, 9)), steps=3)


def test_conf_build_with_matching_weights(references):
    """zoo.build(conf) + weights: the conf's architecture filled from a checkpoint of that shape."""
    _, path, _ = references["gqa"]
    overrides = ["n_layers=3", "vocab_size=320", "dim=64", "ffns.mlp.ffn_dim=160", "rope.theta=10000.0",
                 "max_position=256"]
    m = zoo.build("llama3_8b_tiny", overrides, weights=str(path), compile=False, max_seq=32)
    ref_model = zoo.from_pretrained(str(path), compile=False, max_seq=32)
    ids = torch.randint(0, 320, (1, 8))
    torch.testing.assert_close(m.prefill(ids), ref_model.prefill(ids), rtol=0, atol=0)


def test_prefill_last_only(references):
    _, path, batch = references["batch3"]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=batch, max_seq=32)
    ids = torch.randint(0, 320, (batch, 9))
    full = m.prefill(ids)
    last = m.prefill(ids, last_only=True)
    assert last.shape == (batch, 1, 320)
    # the head as a matrix-vector vs a matrix-matrix product: two kernels, equal within rounding
    assert_logits_close(last, full[:, -1:], 1e-6, "last_only vs the full prefill's last row")
