"""Tiny DeepSeek-V3 checkpoints for the tests: transformers configs, Hub-layout tensors (one tensor
per expert), a random MTP layer and a hand-written MTP reference (transformers has none)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 256
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_config(**kw):
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5, max_position_embeddings=256, rope_parameters=YARN,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def randomize(module: torch.nn.Module) -> None:
    """Norm weights away from 1 and a non-zero selection bias, so that a misplaced one shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.3, 0.3)


def hub_tensors(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors (fused experts) under Hub names (one tensor per expert)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = prefix + name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = w.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            base = prefix + name.removesuffix("down_proj")
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[prefix + name] = t
    return {k: v.contiguous() for k, v in out.items()}


def make_mtp_layer(config, seed=3, layer_cls=None):
    """A random MTP layer: a full MoE decoder block (layer index n_layers) and the extra parts
    (enorm, hnorm, eh_proj, shared_head, its own embedding copy), as Hub-named tensors.
    layer_cls(config, layer_idx): the family's decoder layer (default DeepseekV3DecoderLayer)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    D, V = config.hidden_size, config.vocab_size
    block = (layer_cls or DeepseekV3DecoderLayer)(config, layer_idx=config.num_hidden_layers).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.05)
    randomize(block)
    extra = {"enorm.weight": torch.rand(D) + 0.5, "hnorm.weight": torch.rand(D) + 0.5,
             "eh_proj.weight": torch.randn(D, 2 * D) * 0.05, "shared_head.norm.weight": torch.rand(D) + 0.5,
             "shared_head.head.weight": torch.randn(V, D) * 0.05, "embed_tokens.weight": torch.randn(V, D)}
    return block, extra


def mtp_hub_tensors(block, extra, n_layers: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{n_layers}."
    return {**hub_tensors(block.state_dict(), prefix), **{prefix + k: v for k, v in extra.items()}}


def add_shard(path: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Append a shard to a sharded safetensors checkpoint and list it in the index."""
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def mtp_reference(ref, block, extra, ids):
    """Hand-written MTP over ids [B, L] with the main model `ref` (transformers): logits
    [B, L-1, V] for token t + 2 at position t."""
    L = ids.shape[1]
    hidden = ref.model(ids).last_hidden_state  # final-normed main hidden state
    e = torch.nn.functional.embedding(ids[:, 1:], extra["embed_tokens.weight"].float())
    eps = ref.config.rms_norm_eps  # the MTP norms use the model's eps
    x = torch.cat((_rms(e, extra["enorm.weight"].float(), eps), _rms(hidden[:, :-1], extra["hnorm.weight"].float(), eps)),
                  -1)
    x = x @ extra["eh_proj.weight"].float().T
    pos = torch.arange(L - 1)[None]
    cos_sin = ref.model.rotary_emb(x, pos)
    mask = torch.full((L - 1, L - 1), float("-inf")).triu(1)[None, None]
    y = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    y = y[0] if isinstance(y, tuple) else y  # some layers also return their attention's extras
    return _rms(y, extra["shared_head.norm.weight"].float(), eps) @ extra["shared_head.head.weight"].float().T
