"""Peak resident memory per rank when a DeepSeek-V3-shaped checkpoint is loaded sharded.

    python scripts/parallel_rss.py make /tmp/dsv3_shaped          # writes the checkpoint (transformers)
    torchrun --nproc-per-node 4 scripts/parallel_rss.py run /tmp/dsv3_shaped   # tp=4 ep=4, per rank
    python scripts/parallel_rss.py run /tmp/dsv3_shaped           # one process, for comparison

Each rank prints one JSON line: its parameter bytes (its share of the weights), the full model's,
the RSS before building (torch + zoo imported) and the peak RSS after loading (ru_maxrss), so
peak - baseline is what loading cost. Every rank reads only its slices (sharded experts, heads,
columns, vocab rows), so that difference is about its parameter bytes, not the full model's.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import torch

# DeepSeek-V3's layout (MLA, first layer dense, then MoE with groups, a shared expert) at a size
# this machine holds four times: about 250 M parameters
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1, n_routed_experts=32,
             kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=4,
             topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=4096,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()):,} parameters (bf16)")


def run(path: str) -> None:
    import zoo

    world = int(os.environ.get("WORLD_SIZE", 1))
    overrides = [f"runtime.parallel.tp={world}", f"runtime.parallel.ep={world}"] if world > 1 else []
    torch.set_num_threads(1)
    base = rss_now()
    m = zoo.from_pretrained(path, compile=False, max_batch=1, max_seq=64, overrides=overrides)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    full = m.info.param_bytes if world == 1 else None
    logits = m.prefill(torch.arange(8)[None])  # the model runs (all ranks together)
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "world": world, "param_bytes": m.info.param_bytes,
                      "full_param_bytes": full, "rss_before_build": base, "peak_rss": peak,
                      "load_cost": peak - base, "bytes_read": m.info.load.bytes_read,
                      "logits_finite": bool(torch.isfinite(logits).all())}), flush=True)


if __name__ == "__main__":
    {"make": make, "run": run}[sys.argv[1]](sys.argv[2])
