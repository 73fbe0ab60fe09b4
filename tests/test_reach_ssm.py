"""State-space and convolution families (Mamba, Falcon-Mamba, Mamba2, LFM2, ...) from
configuration alone: tiny random transformers checkpoints with odd sizes (their prefill / decode
parity, eager, plus one compiled sample per new mixer kind: tests/test_family_parity.py's
reach_ssm/* entries), exact parameter counts of the flagship presets against transformers on the
meta device, and what the import or `zoo patterns` refuses."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.helpers import auto_reference, check_flagship_count, check_import_refused

transformers = pytest.importorskip("transformers")

VOCAB = 301
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name: (transformers config class prefix, the tiny config.json values); odd sizes throughout
FAMILIES = {
    "mamba": ("Mamba", dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, state_size=6,
                            intermediate_size=72, time_step_rank=5, tie_word_embeddings=True)),
    "falcon_mamba": ("FalconMamba", dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, state_size=6,
                                         intermediate_size=72, time_step_rank=5, tie_word_embeddings=False,
                                         conv_kernel=3)),
    # 6 heads of 12 over 3 B/C groups, chunks of 7 tokens (prompts span several)
    "mamba2": ("Mamba2", dict(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_heads=6, head_dim=12,
                              expand=2, n_groups=3, state_size=5, chunk_size=7)),
    # conv, attention, conv; the FFN width auto-adjusted (2/3 of 150, times 1.0, rounded up to 16)
    "lfm2": ("Lfm2", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=150, block_multiple_of=16,
                          max_position_embeddings=64, layer_types=["conv", "full_attention", "conv"],
                          full_attn_idxs=[1])),
    # Mamba2 (6 heads of 16, 2 groups, chunks of 5) around one GQA layer with rotary on half its head
    "bamba": ("Bamba", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64,
                            attn_layer_indices=[1], mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2,
                            mamba_d_state=8, mamba_chunk_size=5)),
    # Mamba-1 with weighted dt / B / C norms; attention (no positions) on layer 1, 5 experts on layers 1, 3
    "jamba": ("Jamba", dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=72, max_position_embeddings=64,
                            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            num_experts=5, num_experts_per_tok=2, mamba_dt_rank=5, mamba_d_state=6)),
    # conv + MLP, attention + MoE, conv + MoE: 5 experts, top-2 of sigmoid scores chosen with a bias
    "lfm2_moe": ("Lfm2Moe", dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=100, moe_intermediate_size=36,
                                 num_experts=5, num_experts_per_tok=2, num_dense_layers=1,
                                 max_position_embeddings=64, layer_types=["conv", "full_attention", "conv"])),
    # Mamba2 around NoPE attention, MoE (4 experts) + shared MLP on every layer, Granite's multipliers
    "granitemoehybrid": ("GraniteMoeHybrid", dict(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=40, shared_intermediate_size=60, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=6, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=5, embedding_multiplier=1.5, residual_multiplier=0.7,
        attention_multiplier=0.2, logits_scaling=3.0)),
    # one sub-layer per layer: Mamba2, NoPE attention, squared-ReLU MLP (a mixer-less layer), Mamba2
    "nemotron_h": ("NemotronH", dict(vocab_size=VOCAB, hidden_size=48, layers_block_type=["mamba", "attention",
                                                                                         "mlp", "mamba"],
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                     intermediate_size=100, max_position_embeddings=64, mamba_num_heads=6,
                                     mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=5)),
}
# one compiled sample per new mixer kind (the chunked scans are custom ops: one graph each)
COMPILED = {"mamba": 1, "mamba2": 1, "lfm2": 2, "nemotron_h": 3}  # nemotron_h: Mamba2, attention and FFN-only (NoMixer) layers


def make_config(family: str, **kw):
    prefix, values = FAMILIES[family]
    return getattr(transformers, f"{prefix}Config")(**{**values, **NO_TOKENS, **kw})


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Every constant-initialised vector (norm weights and D at 1, biases at 0) made random, so that
    a misplaced or missing one shows; A_log spread so decays range from slow to fast."""
    for name, p in model.named_buffers():
        if name.endswith("expert_bias"):  # LFM2-MoE's selection bias, a buffer saved with the weights
            p.normal_(0.0, 0.2)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)
        elif p.dim() == 1 and torch.all(p == p.flatten()[0]):
            p.uniform_(0.5, 1.5) if p.flatten()[0] == 1 else p.normal_(0.0, 0.2)


def reference(family: str, seed: int = 0):
    return auto_reference(make_config(family), seed, randomize)


# Flagship config.json values (the published configs of the checkpoints each preset names)
FLAGSHIPS = {
    "mamba_2_8b": ("Mamba", dict(vocab_size=50280, hidden_size=2560, num_hidden_layers=64, state_size=16,
                                 intermediate_size=5120, time_step_rank=160)),  # state-spaces/mamba-2.8b-hf
    "falcon_mamba_7b": ("FalconMamba", dict(vocab_size=65024, hidden_size=4096, num_hidden_layers=64, state_size=16,
                                            intermediate_size=8192, time_step_rank=256,
                                            tie_word_embeddings=False)),  # tiiuae/falcon-mamba-7b
    "mamba_codestral_7b": ("Mamba2", dict()),  # Mamba2Config's defaults are mistralai/Mamba-Codestral-7B-v0.1's
    "lfm2_1_2b": ("Lfm2", dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=12288,
                               full_attn_idxs=[2, 5, 8, 10, 12, 14], layer_types=None)),  # LiquidAI/LFM2-1.2B
    "bamba_9b": ("Bamba", dict(vocab_size=128256, attn_layer_indices=[9, 18, 27], mamba_d_state=128,
                               mamba_d_head=64)),  # ibm-ai-platform/Bamba-9B
    "jamba_v0_1": ("Jamba", dict()),  # JambaConfig's defaults are ai21labs/Jamba-v0.1's
}


@pytest.mark.parametrize("preset", list(FLAGSHIPS))
def test_flagship_parameter_count(preset):
    """The preset's exact parameter count equals transformers' for the published config (meta
    device), and importing that config gives the preset's layers (helpers.check_flagship_count)."""
    prefix, values = FLAGSHIPS[preset]
    check_flagship_count(preset, getattr(transformers, f"{prefix}Config")(**values))


@pytest.mark.parametrize("family, change, words", [
    ("mamba", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "conf/hf/mamba.yaml"]),
    ("mamba2", {"expand": 3}, ["hidden_size * expand == num_heads * head_dim", "conf/hf/mamba2.yaml"]),
    ("nemotron_h", {"layers_block_type": ["mamba", "moe", "attention", "mlp"]},
     ["moe", "not yet supported", "SwiGLU"]),
])
def test_what_cannot_be_expressed_is_refused(family, change, words):
    check_import_refused({**make_config(family).to_dict(), **change}, words)


def test_mamba_layers_have_no_ffn_norm():
    """A mixer-only layer (ffn kind none) carries exactly one norm: no ffn_norm to load."""
    m = zoo.build("mamba_2_8b_tiny", dry=True)
    names = [n for n, _ in m.module.named_parameters() if n.startswith("layers.0.")]
    assert "layers.0.mixer_norm.weight" in names and not any("ffn" in n for n in names), names


@pytest.mark.parametrize("name", ["reach_ssm/mamba", "reach_ssm/mamba2", "reach_ssm/lfm2", "reach_ssm/bamba"])
def test_extend_from_the_cached_state(families, name):
    """Mixer.extend of the three kinds (the chunked form from the cached conv inputs and state):
    a prompt prefilled in chunks, 1-token chunks included, == one prefill and the decode steps
    after; rolled back with save_state / restore_state == never extended (tests/test_extend.py's
    checks, on these twins)."""
    from tests import test_extend

    test_extend.test_chunked_prefill_equals_whole(families, name)
    test_extend.test_rollback_equals_never_extended(families, name)


@pytest.mark.parametrize("conf, stats", [
    ("lfm2_1_2b_tiny", {"input_gate", "output_gate", "output_norm"}),
    ("mamba_codestral_7b_tiny", {"decay", "write", "state_norm", "output_norm"}),
])
def test_patterns_reports_statistics_where_there_are_no_attention_weights(capsys, conf, stats):
    """`zoo patterns`: the SSM and short-conv layers have no attention weights, so their score rows
    are null and they report their statistics instead; the text report runs through (a prompt of
    2^k + 1 tokens included)."""
    import json

    from zoo.cli import main as zoo_main

    assert zoo_main(["patterns", f"conf={conf}", "repeat=8", "output=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for kind, row, got in zip(out["kinds"], out["induction"], out["recurrent"]):
        if kind == "gqa":
            assert row is not None and got is None
        else:
            assert row is None and set(got) == stats, kind
    assert zoo_main(["patterns", f"conf={conf}", "repeat=8"]) == 0
    assert "per layer" in capsys.readouterr().out


@pytest.mark.parametrize("conf, kind", [("mamba_2_8b_tiny", "mamba"), ("mamba_codestral_7b_tiny", "mamba2"),
                                        ("lfm2_1_2b_tiny", "short_conv")])
def test_tensor_parallelism_is_refused_naming_the_kind(conf, kind):
    """The three kinds declare no sharding plan (contracts.no_sharding_plan): tp=2 is a clear error."""
    from tests.test_parallel import _mesh, _meta
    from zoo.compiler.parallel.plan import shard_model

    with pytest.raises(zoo.ConfigError, match=f"kind '{kind}' declares no sharding plan"):
        shard_model(_meta(conf), _mesh(2, 0, 2, 1))
