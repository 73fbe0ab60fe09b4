"""zoo: a declarative model-zoo config compiler for LLMs.

    m = zoo.from_pretrained("meta-llama/Meta-Llama-3-8B", dtype=torch.bfloat16, device="cuda")
    m = zoo.build("llama3_8b_tiny", overrides=["mixers.attn.n_kv_heads=1"])
    logits = m.prefill(ids)          # [B, L] -> [B, L, V]
    logits = m.decode(next_tokens)   # [B]    -> [B, V]
    out = m.generate(ids, max_new_tokens=32)
"""
from .compiler.errors import CheckpointError, ConfigError, InputError, ZooError

from .runtime import Model, build, from_pretrained

__all__ = ["Model", "build", "from_pretrained", "ZooError", "ConfigError", "CheckpointError", "InputError"]
