"""Shipped families take their published configs whole: Phi-3-mini-4k's own sliding_window
(2047 there), Phi-3/3.5's longrope scaling (short and long factors, the pre-training length, the
attention factor), Mixtral with a sliding window, and a config.json that transformers saved
after loading a GGUF (`_model_name_or_path`: its private keys are metadata).

Each: a tiny random transformers checkpoint (float32, eager, batch 2) saved by save_pretrained
and loaded by from_pretrained; prefill and every greedy decode step against transformers' full
forward, and decode through the caches == one prefill. Windows are shorter than the prompt and
decode goes past them; longrope runs once below its pre-training length (short factors) and
once with a prompt longer than it (long factors)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import zoo
from zoo.compiler.hf_import import import_config
from zoo.compiler.spec import validate
from tests.helpers import check_decode_equals_prefill, check_parity, save_reference

transformers = pytest.importorskip("transformers")

VOCAB, BATCH = 301, 2
PHI3 = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
ORIGINAL = 16  # longrope's pre-training length in the tiny configs
# one divisor per rotated channel pair (head_dim 12 -> 6), far apart so that a swapped list shows
SHORT = [1.0, 1.3, 1.7, 2.2, 2.9, 3.5]
LONG = [1.5, 2.5, 4.0, 6.5, 9.0, 13.0]


def _longrope(**extra):
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG,
            "original_max_position_embeddings": ORIGINAL, **extra}


VARIANTS = {
    # Phi-3-mini-4k's shape of config: a window (2047 there) on every layer
    "phi3_window": ("Phi3", dict(PHI3, sliding_window=5)),
    # Phi-3.5-mini / Phi-3-*-128k: longrope, factor from max_position_embeddings / original
    "phi3_longrope": ("Phi3", dict(PHI3, original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope())),
    # an explicit attention_factor and partial rotary (Phi-4-mini)
    "phi3_longrope_partial": ("Phi3", dict(PHI3, original_max_position_embeddings=ORIGINAL,
                                           rope_parameters=_longrope(attention_factor=1.19, partial_rotary_factor=0.5,
                                                                     short_factor=SHORT[:3], long_factor=LONG[:3]))),
    "mixtral_window": ("Mixtral", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                       max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None)),
}


def _config(name: str):
    prefix, kwargs = VARIANTS[name]
    return getattr(transformers, f"{prefix}Config")(**kwargs)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for i, name in enumerate(VARIANTS):
        torch.manual_seed(100 + i)
        prefix = VARIANTS[name][0]
        ref = getattr(transformers, f"{prefix}ForCausalLM")(_config(name)).eval()
        with torch.no_grad():  # norms away from 1 so that a misplaced norm weight shows
            for pname, p in ref.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
        out[name] = (ref, save_reference(ref, tmp_path_factory.mktemp(name)))
    return out


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["phi3_window", "mixtral_window"])
def test_sliding_window_parity(references, name):
    """The prompt (11) is longer than the window and decode goes past it: the window has
    transformers' meaning (a token and the window - 1 before it), off by none."""
    ref, path = references[name]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=BATCH, max_seq=40)
    window = VARIANTS[name][1]["sliding_window"]
    assert m.spec.mixers["attn"].window == window
    seq = check_parity(ref, m, ids(11), steps=8)
    check_decode_equals_prefill(m, seq, prompt_len=7)


@pytest.mark.parametrize("name", ["phi3_longrope", "phi3_longrope_partial"])
def test_longrope_short_factors(references, name):
    """An engine whose context fits the pre-training length uses the short factors: parity with
    transformers for every sequence up to it."""
    ref, path = references[name]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=BATCH, max_seq=ORIGINAL)
    seq = check_parity(ref, m, ids(9, 1), steps=ORIGINAL - 9)
    assert seq.shape[1] == ORIGINAL
    check_decode_equals_prefill(m, seq, prompt_len=5)


@pytest.mark.parametrize("name", ["phi3_longrope", "phi3_longrope_partial"])
def test_longrope_long_factors(references, name):
    """A prompt longer than original_max_position_embeddings: transformers switches to the long
    factors, as a zoo engine with a longer context does; every decode step after it agrees."""
    ref, path = references[name]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=BATCH, max_seq=40)
    seq = check_parity(ref, m, ids(ORIGINAL + 4, 2), steps=8)
    check_decode_equals_prefill(m, seq, prompt_len=ORIGINAL + 1)


def test_longrope_list_can_be_forced(references):
    """`rope.long=true` gives the long factors to an engine whose context fits the pre-training
    length: transformers' logits for a sequence longer than it, over the first positions."""
    ref, path = references["phi3_longrope"]
    forced = zoo.from_pretrained(str(path), overrides=["rope.long=true"], compile=False, max_batch=BATCH, max_seq=ORIGINAL)
    long = ids(ORIGINAL + 2, 5)
    with torch.no_grad():
        want = ref(long).logits[:, :ORIGINAL]
    from tests.helpers import assert_logits_close

    assert_logits_close(forced.prefill(long[:, :ORIGINAL]), want, what="forced long factors")


def test_longrope_spec_and_attention_factor(references):
    """What the import reads: the factors, the pre-training length, factor = max / original and
    transformers' default attention factor sqrt(1 + ln(factor) / ln(original)); an explicit one wins."""
    spec = validate(import_config(json.loads((references["phi3_longrope"][1] / "config.json").read_text()),
                                  "c"), "c")
    rope = spec.rope
    assert (rope.kind, rope.short_factor, rope.long_factor) == ("longrope", SHORT, LONG)
    assert rope.original_max_position == ORIGINAL and rope.factor == 64 / ORIGINAL
    from zoo.compiler.position.rope import make_rope

    assert make_rope(rope).cos_sin_scale() == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(ORIGINAL)))
    partial = validate(import_config(json.loads(
        (references["phi3_longrope_partial"][1] / "config.json").read_text()), "c"), "c")
    assert make_rope(partial.rope).cos_sin_scale() == 1.19


def test_phi3_legacy_rope_names_and_top_level_length():
    """Phi3Config reads rope_scaling type "su" (and "yarn") as longrope, and its top-level
    original_max_position_embeddings over rope_scaling's; so does the import."""
    config = _config("phi3_longrope").to_dict()
    config.pop("rope_parameters")
    config["rope_scaling"] = {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                              "original_max_position_embeddings": 999}
    config["rope_theta"] = 10000.0
    rope = validate(import_config(config, "c"), "c").rope
    assert rope.kind == "longrope" and rope.original_max_position == ORIGINAL


def test_longrope_wrong_factor_count_names_the_list(references):
    config = json.loads((references["phi3_longrope"][1] / "config.json").read_text())
    config["rope_parameters"]["long_factor"] = LONG[:4]
    with pytest.raises(zoo.ConfigError, match=r"short_factor and long_factor .* got 6 and 4"):
        validate(import_config(config, "c"), "c")
    config["rope_parameters"]["long_factor"] = "wide"
    with pytest.raises(zoo.ConfigError, match=r"rope_parameters.long_factor = 'wide'.*conf/hf/phi3.yaml"):
        import_config(config, "c")


def test_phi3_mini_4k_published_config_imports():
    """microsoft/Phi-3-mini-4k-instruct's config.json as published (sliding_window 2047)."""
    published = {
        "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                     "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
        "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
        "use_cache": True, "vocab_size": 32064}
    spec = validate(import_config(published, "config.json"), "config.json")
    assert spec.mixers["attn"].window == 2047 and spec.rope.kind == "default"
    preset = zoo.build("phi3_mini_4k", dry=True).spec  # the preset is that config
    assert spec.layers == preset.layers and spec.dim == preset.dim and spec.mixers == preset.mixers


def test_gguf_loaded_then_saved_checkpoint(references, tmp_path):
    """transformers writes `_model_name_or_path` (and other private keys) into a config.json it
    saves after loading a GGUF: metadata, so the checkpoint loads and matches."""
    import shutil

    ref, path = references["phi3_window"]
    copy = tmp_path / "from_gguf"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update({"_model_name_or_path": "/models/phi3.Q8_0.gguf", "_some_future_private_key": {"x": 1}})
    (copy / "config.json").write_text(json.dumps(config))
    m = zoo.from_pretrained(str(copy), compile=False, max_batch=BATCH, max_seq=24)
    check_parity(ref, m, ids(7, 3), steps=3)


def test_phi3_5_mini_published_config_imports():
    """microsoft/Phi-3.5-mini-instruct's config.json keys as published: longrope in rope_scaling
    (type "longrope", 48 factors each for head_dim 96), the top-level pre-training length, a
    sliding_window longer than the context. Factor values here are placeholders."""
    from zoo.compiler.position.rope import make_rope

    published = {
        "_name_or_path": "Phi-3.5-mini-instruct", "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                                               "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": [1.0 + i / 10 for i in range(48)], "short_factor": [1.0] * 48,
                         "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.3", "use_cache": True, "vocab_size": 32064}
    spec = validate(import_config(published, "config.json"), "config.json")
    rope = make_rope(spec.rope)
    assert spec.rope.kind == "longrope" and spec.rope.original_max_position == 4096 and spec.rope.factor == 32.0
    assert rope.cos_sin_scale() == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert spec.mixers["attn"].window == 262144 and spec.max_position == 131072
    short, _ = rope.table(96, 8, "cpu")  # 48 pairs of head_dim 96
    long, _ = rope.table(96, 4097, "cpu")
    assert short.shape == (8, 48) and not torch.equal(short, long[:8])


def test_zoo_import_round_trip_longrope(references, tmp_path, monkeypatch):
    """`zoo import` writes a conf carrying the longrope spec whole; it builds the same model."""
    from zoo.cli import main

    _, path = references["phi3_longrope"]
    monkeypatch.setenv("ZOO_CONF_DIR", str(tmp_path / "confs"))
    assert main(["import", str(path), "name=phi3_longrope_imported"]) == 0
    built = zoo.build("phi3_longrope_imported", weights=str(path), compile=False, max_seq=24)
    direct = zoo.from_pretrained(str(path), compile=False, max_seq=24)
    assert built.spec.rope == direct.spec.rope
    x = ids(19, 4)[:1]
    torch.testing.assert_close(built.prefill(x), direct.prefill(x), rtol=0, atol=0)


def test_llama4_scout_empty_no_rope_layers_is_the_default_schedule():
    """Llama-4-Scout's config.json gives `no_rope_layers: []`; Llama4TextConfig then takes NoPE
    every no_rope_layer_interval-th layer, and so must the import (not "0 entries")."""
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None).to_dict()
    expected = ["nope" if x == 0 else "rope" for x in config["no_rope_layers"]]
    assert expected.count("nope") == 2
    config["no_rope_layers"] = []
    spec = validate(import_config(config, "config.json"), "config.json")
    assert [layer.mixer_name for layer in spec.layers] == expected


# ------------------------------------------------------------------ the corpus of published configs
#
# tests/data/published_configs/*.json: config.json files of shipped families as their publishers
# wrote them (README.md there says where each came from). Each is shrunk in its dimension keys
# only (layers, hidden, heads, head dims, vocab, experts, latent ranks; per-layer lists cut to the
# layers kept), a random transformers model is built from it, and zoo loads a directory holding
# that model's weights and the shrunk published config.json itself, every other key as published
# (token ids, dtypes, generation defaults, remote-code names, ...): prefill and every decode step
# equal to transformers', decode through the caches == one prefill.

import fnmatch
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "published_configs"
PUBLISHED = sorted(p.stem for p in CORPUS.glob("*.json"))
# the keys the test may change, and to what when a file has them (DIMENSIONS) or by its own entry
# (SHRINK, where a file's other keys pin a size: Phi-4-mini's 48 longrope factors need head_dim 128)
DIMENSIONS = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
              "num_attention_heads": 4, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
              "n_routed_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
              "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 16, "max_window_layers": 4}
SHRINK = {"phi_4_mini_instruct": {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2}}
PER_LAYER = ("layer_types",)  # lists with one entry per layer: cut to the layers kept
# what the twin cannot keep: its weights are stored in float32, not as the file's FP8 blocks
TWIN_DROPS = ("quantization_config",)


def _shrunk(name: str) -> dict:
    """The published config.json of `name`, its dimension keys (only) at tiny sizes."""
    config = json.loads((CORPUS / f"{name}.json").read_text())
    out = dict(config)
    for key, value in DIMENSIONS.items():
        if key in config:
            out[key] = value
    if "num_key_value_heads" in config:  # MHA stays MHA, GQA stays GQA
        mha = config["num_key_value_heads"] == config["num_attention_heads"]
        out["num_key_value_heads"] = out["num_attention_heads"] if mha else 2
    out.update(SHRINK.get(name, {}))
    for key in PER_LAYER:
        if isinstance(config.get(key), list):
            out[key] = config[key][:out["num_hidden_layers"]]
    for key in TWIN_DROPS:
        out.pop(key, None)
    return out


def _reference_config(config: dict):
    """transformers' config of the shrunk file. Token ids past the tiny vocabulary become null
    for transformers only (an embedding's padding_idx must lie inside it; ids never reach the
    logits): zoo reads them as published."""
    ids = {k: None for k, v in config.items()
           if fnmatch.fnmatchcase(k, "*_token_id") and isinstance(v, int) and v >= config["vocab_size"]}
    kwargs = {k: v for k, v in {**config, **ids}.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(config["model_type"], **kwargs)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """name -> (transformers model, directory of its weights + the shrunk published config.json)."""
    out = {}
    for i, name in enumerate(PUBLISHED):
        config = _shrunk(name)
        torch.manual_seed(200 + i)
        ref = transformers.AutoModelForCausalLM.from_config(_reference_config(config), dtype=torch.float32).eval()
        from tests.helpers import randomize_constant_vectors

        randomize_constant_vectors(ref)
        path = save_reference(ref, tmp_path_factory.mktemp(name))
        (path / "config.json").write_text(json.dumps(config, indent=2))
        out[name] = (ref, path)
    return out


def test_corpus_changes_only_dimension_keys():
    """The twin differs from the published file in the keys this test may change, nowhere else;
    every file has its source in the README."""
    allowed = set(DIMENSIONS) | {"num_key_value_heads", *PER_LAYER, *TWIN_DROPS}
    readme = (CORPUS / "README.md").read_text()
    assert len(PUBLISHED) >= 15
    for name in PUBLISHED:
        config, shrunk = json.loads((CORPUS / f"{name}.json").read_text()), _shrunk(name)
        changed = {k for k in set(config) | set(shrunk) if config.get(k, "absent") != shrunk.get(k, "absent")}
        assert changed <= allowed, (name, changed - allowed)
        assert f"`{name}.json`" in readme, f"{name}.json has no source in {CORPUS / 'README.md'}"


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_parity(published, name):
    ref, path = published[name]
    m = zoo.from_pretrained(str(path), compile=False, max_batch=BATCH, max_seq=24)
    seq = check_parity(ref, m, ids(9, 7), steps=4)
    check_decode_equals_prefill(m, seq, prompt_len=6)


def test_no_import_map_relists_a_common_key():
    """conf/hf/common.yaml is the one list of keys that never change the computation: an import
    map that relisted one would be a second list to keep in step."""
    from zoo.compiler.hf_import import common_keys, common_patterns, import_specs

    common, patterns = common_keys(), common_patterns()
    relisted = {t: sorted(k for k in spec.get("irrelevant") or {}
                          if k in common or any(fnmatch.fnmatchcase(k, p) for p in patterns))
                for t, spec in import_specs().items()}
    assert not {t: keys for t, keys in relisted.items() if keys}


def test_token_ids_never_refuse_architecture_keys_still_do():
    """Any `*_token_id` (unk_token_id: the key a transformers-written Llama config.json was refused
    for) passes for every family; a key that would change the model is still refused, named."""
    from tests.helpers import check_import_refused

    config = _shrunk("llama_3_1_8b_instruct")
    validate(import_config({**config, "unk_token_id": 0, "eot_token_id": 7, "image_token_id": 9}, "c"), "c")
    check_import_refused({**config, "attn_logit_softcapping": 50.0}, ["'attn_logit_softcapping'", "conf/hf/llama.yaml"])
    check_import_refused({**config, "per_layer_config": {"0": {}}}, ["'per_layer_config'"])
    check_import_refused({**config, "token_ids": [1, 2]}, ["'token_ids'"])  # the pattern is exact
