"""Every shipped family against transformers through one harness (tests/family_harness.py): tiny
random checkpoints with odd sizes saved by transformers, loaded by zoo.from_pretrained as a user
loads them (from the directory; from a Hub id in an offline local cache), prefill and every greedy
decode step, decode through the caches == one prefill, eager and compiled (graph counts).

FAMILIES is the data: one entry per checkpoint ("family/variant" for variants of one family).
The tiny configs and the randomisation of constant-initialised weights live next to each
family's special tests (tests/test_<family>.py), which reach these checkpoints and eager models
through the `families` fixture. How to add a family: tests/family_harness.py's docstring.
"""
from __future__ import annotations

import os
import subprocess
import sys
import pytest
import torch

from tests import deepseek_v3_fixtures as v3
from tests import test_attn_families as attn
from tests import test_deepseek_v3 as dsv3
from tests import test_deepseek_v4 as v4
from tests import test_dense_families as dense
from tests import test_gemma4 as gemma4
from tests import test_glm5 as glm5
from tests import test_gpt2era as gpt2era
from tests import test_kimi_linear as kimi
from tests import test_llama as llama
from tests import test_moe_families as moe
from tests import test_qwen3_5 as qwen3_5
from tests import test_qwen3_next as qwen3_next
from tests import test_reach_dense as reach_dense
from tests import test_reach_moe as reach_moe
from tests import test_reach_hybrid as reach_hybrid
from tests import test_reach_ssm as reach_ssm
from tests.family_harness import (DecodeEqualsPrefill as DEP, Family, Parity as P, randomize_norms, run_checks,
                                  tiny_reference)
from tests.helpers import populate_hub_cache

transformers = pytest.importorskip("transformers")


def _cls(name: str):
    return lambda config: getattr(transformers, name)(config)


def _auto(config):
    return transformers.AutoModelForCausalLM.from_config(config)


# ------------------------------------------------------------------------------ Llama (tests/test_llama.py)

def _llama(**kw):
    return lambda: tiny_reference(_cls("LlamaForCausalLM"), llama.tiny_config(**kw), randomize_norms)


LLAMA_COMPILED = (P(11, 8), P(2, 2), P(5, 2), P(17, 2), P(40, 2))  # other prompt lengths: the same graphs
LLAMA_MORE = {  # variant: (eager checks after P(11, 8), compiled checks); the other variants differ in
    # data the graphs take as inputs (rope tables, shards, batch: tests/test_buckets.py), compiled once
    "gqa": ((), LLAMA_COMPILED), "batch3": ((DEP(30, 9),), ()),
}
FAMILIES = {}
for _name, (_kw, _batch, _save) in llama.VARIANTS.items():
    _eager, _compiled = LLAMA_MORE.get(_name, ((), ()))
    FAMILIES[f"llama/{_name}"] = Family(_llama(**_kw), batch=_batch, save_kwargs=_save, eager=(P(11, 8), *_eager),
                                        compiled=_compiled, graphs=1 if _compiled else None)

# ------------------------------------------------------------- qwen2, qwen3, smollm3, granite, phi3 (test_dense_families.py)

DENSE_COMPILED = {"qwen3": 1, "smollm3": 2}  # compiled samples: q/k norm; RoPE and NoPE layers (a graph each)

for _i, _name in enumerate(dense.FAMILIES):
    FAMILIES[f"dense/{_name}"] = Family(
        (lambda n=_name, i=_i: tiny_reference(_cls(dense.FAMILIES[n][0]), dense.make_config(n), randomize_norms, i)),
        model_type=_name, max_seq=40, hub=True, eager=(P(9, 6),),
        compiled=(P(9, 4), P(17, 2), DEP(20, 7)) if _name in DENSE_COMPILED else (), graphs=DENSE_COMPILED.get(_name))

# ------------------------------------------------- gemma2, gemma3_text, olmo2, gpt_oss, mistral (test_attn_families.py)

ATTN_GRAPHS = {"gemma2": 2, "gpt_oss": 2}  # compiled samples (sliding / global layers): windows, soft-capping and
# sandwich norms; sinks
for _i, _name in enumerate(attn.FAMILIES):
    FAMILIES[f"attn/{_name}"] = Family(
        (lambda n=_name, i=_i: tiny_reference(_auto, attn.hf_config(n), attn.randomize, i)),
        rtol=1e-4, hub=True, eager=(P(attn.PROMPT, attn.STEPS, seed=0), DEP(20, 3, seed=1)),
        # within, at and far past the window: the same graphs
        compiled=(P(attn.PROMPT, attn.STEPS, seed=0), P(2, 2, seed=2), P(5, 2, seed=5), P(23, 2, seed=23),
                  DEP(16, 4, seed=2)) if _name in ATTN_GRAPHS else (),
        graphs=ATTN_GRAPHS.get(_name))

# ------------------------------------------------- qwen3_moe, mixtral, deepseek_v2, glm4_moe (test_moe_families.py)

MOE_GRAPHS = {"qwen3_moe": 1}  # compiled sample: softmax top-k routing (MLA + dense / MoE layers: deepseek_v3/main)
HUB_MOE = ("qwen3_moe", "mixtral", "deepseek_v2", "glm4_moe")
for _name, (_config, _kw, _batch, _save) in moe.VARIANTS.items():
    FAMILIES[f"moe/{_name}"] = Family(
        (lambda c=_config, kw=_kw: tiny_reference(_auto, c(**kw), moe.randomize)),
        batch=_batch, save_kwargs=_save, max_seq=64, rtol=1e-4,
        eager=(P(11, 6), P(1, 2), DEP(25, 9)),  # a 1-token prompt: the decode graph
        compiled=(P(11, 5), DEP(25, 9)) if _name in MOE_GRAPHS else (), graphs=MOE_GRAPHS.get(_name),
        hub=_name in HUB_MOE)

# ---------------------------------------------------------------------------- DeepSeek-V3 (test_deepseek_v3.py)

for _name, (_kw, _batch, _save) in dsv3.VARIANTS.items():
    FAMILIES[f"deepseek_v3/{_name}"] = Family(
        (lambda kw=_kw: tiny_reference(_cls("DeepseekV3ForCausalLM"), v3.tiny_config(**kw), v3.randomize)),
        batch=_batch, save_kwargs=_save, eager=(P(11, 8),) + ((DEP(30, 7),) if _name == "yarn_cos_sin" else ()),
        # other prompt lengths reuse the same graphs: one per layer kind (dense, MoE) and entry point
        compiled=(P(11, 8), P(2, 2), P(5, 2), P(17, 2), P(40, 2), DEP(30, 9)) if _name == "main" else (),
        graphs=2 if _name == "main" else None)

# ------------------------------------------------------- Qwen3-Next, Qwen3.5, Kimi Linear: linear attention + chunks

LINEAR = dict(max_seq=128, overrides=tuple(qwen3_next.CHUNK))  # 16-token chunks: the prompts span several
FAMILIES["qwen3_next"] = Family(
    lambda: tiny_reference(_cls("Qwen3NextForCausalLM"), qwen3_next.tiny_config(), qwen3_next.randomize),
    save_kwargs={"max_shard_size": "400KB"}, **LINEAR,  # sharded: the MTP test adds a shard
    eager=(P(37, 6), P(70, 2, batch=1), P(1, 3), DEP(45, 30)),
    compiled=(P(37, 4), P(21, 2), DEP(40, 33)), graphs=2)
FAMILIES["qwen3_5"] = Family(
    lambda: tiny_reference(_cls("Qwen3_5ForCausalLM"), qwen3_5.tiny_config(), qwen3_next.randomize), **LINEAR,
    eager=(P(37, 4), P(1, 2), DEP(43, 32)))  # the kinds of qwen3_next: compiled there
FAMILIES["kimi_linear"] = Family(
    lambda: tiny_reference(_cls("KimiLinearForCausalLM"), kimi.tiny_config(), kimi.randomize), **LINEAR,
    eager=(P(37, 4), P(1, 2), DEP(43, 32)), compiled=(P(33, 4), P(1, 2), DEP(39, 28), P(19, 2)),
    # a prompt over several chunks and a 1-token prompt (the decode graph), then other lengths: the same graphs
    graphs=3)  # KDA + dense, KDA + MoE, MLA + MoE

# ------------------------------------------------------------------------------ DeepSeek-V4 (test_deepseek_v4.py)


KINDS_COMPILED_V4 = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
# 20 tokens: entries in both compressed kinds at prefill, decode completes CSA blocks at positions
# 23, 27, 31 and HCA ones at 23, 31; 3 and 8: no entry / exactly one complete block at the end
FAMILIES["deepseek_v4"] = Family(
    lambda: v4.make_reference(seed=1), save=lambda ref, path: v4.save_checkpoint(ref, path), max_seq=v4.MAX_SEQ,
    eager=(P(20, 12), P(3, 6), P(8, 6), DEP(32, 5)))
# compiled: one layer of each attention kind (CI time: each V4 layer kind is a long cold compile, and the
# full twin pairs them with the routings into 4)
FAMILIES["deepseek_v4/compiled"] = Family(
    lambda: v4.make_reference(seed=1, num_hidden_layers=3, layer_types=KINDS_COMPILED_V4,
                              mlp_layer_types=["hash_moe", "moe", "moe"]),
    save=lambda ref, path: v4.save_checkpoint(ref, path), max_seq=v4.MAX_SEQ,
    eager=(), compiled=(P(20, 12), P(9, 3), DEP(30, 6)), graphs=3)  # (swa, hash MoE), (csa, MoE), (hca, MoE)

# --------------------------------------------------------------------------- Gemma 4 (test_gemma4.py)

# KV shared across layers (a cache plan), per-layer inputs, proportional rope, v norm, layer scalars.
# Compiled: one graph per layer (each block picks its own per-layer input by its index, and the
# consumers read another layer's cache: no two of the 7 layers share a structure)
GEMMA4_GRAPHS = 7
for _name, _kw in gemma4.VARIANTS.items():
    FAMILIES[f"gemma4/{_name}"] = Family(
        (lambda kw=_kw: tiny_reference(_cls("Gemma4ForCausalLM"), gemma4.tiny_config(**kw), gemma4.randomize)),
        rtol=1e-4, hub=_name == "shared", eager=(P(11, 8, seed=0), P(1, 3), DEP(25, 9, seed=1)),
        compiled=(P(11, 4, seed=0), P(17, 2), DEP(20, 7, seed=1)) if _name == "shared" else (),
        graphs=GEMMA4_GRAPHS if _name == "shared" else None)

# ------------------------------------------------------------------- GLM-5 / DeepSeek-V3.2 (test_glm5.py)

for _name, (_cls_name, _cfg, _kw, _batch, _seed) in glm5.VARIANTS.items():
    FAMILIES[f"glm5/{_name}"] = Family(
        (lambda n=_name: tiny_reference(_cls(glm5.VARIANTS[n][0]),
                                        getattr(transformers, glm5.VARIANTS[n][1])(**glm5.DIMS, **glm5.VARIANTS[n][2]),
                                        v3.randomize)),
        batch=_batch, max_seq=glm5.MAX_SEQ, save_kwargs={"max_shard_size": "200KB"} if _name == "glm" else {},
        guard=glm5.tie_free_guard,  # the top-k boundary of every query clear of a tie
        # prompts of 19 > index_topk 8 tokens
        eager=(P(glm5.PROMPT, glm5.STEPS, seed=_seed),) + ((DEP(32, 5, seed=5),) if _name == "v32" else ()),
        # a prompt shorter than index_topk reuses the same graphs
        compiled=(P(glm5.PROMPT, 4, seed=_seed), P(5, 2, seed=2),
                  DEP(glm5.PROMPT + 10, 9, seed=_seed, greedy_from=glm5.PROMPT)) if _name == "glm" else (),
        graphs=2 if _name == "glm" else None)  # dense, MoE


# ----------------------------------------- GPT-2-era families: LayerNorm, MLPs, ALiBi, parallel (test_gpt2era.py)

GPT2ERA_COMPILED = {"gpt2": 2, "bloom": 1, "gptj": 1}  # compiled samples: learned positions + MLP + LayerNorm (the first block reads pos_embed: its own graph), ALiBi + embed norm, parallel + interleaved partial rotary
for _i, _name in enumerate(gpt2era.FAMILIES):
    FAMILIES[f"gpt2era/{_name}"] = Family(
        (lambda n=_name, i=_i: gpt2era.reference(n, i)), model_type=_name.split("/")[0], rtol=1e-4, max_seq=40,
        eager=(P(9, 6), DEP(20, 7)),
        compiled=(P(9, 4), P(17, 2), DEP(20, 7)) if _name in GPT2ERA_COMPILED else (),
        graphs=GPT2ERA_COMPILED.get(_name))


# ------------------------------------------- dense families through data (issue 26; test_reach_dense.py)

REACH_DENSE_COMPILED = {"apertus": 1, "ministral3": 1,  # compiled samples: xIELU; attention temperature;
                        "diffllama": 3}  # differential attention (mixer diff_attn): lambda_init is each
# layer's constant, so each of the 3 layers is a structure (a graph) of its own
for _i, _name in enumerate(reach_dense.FAMILIES):
    FAMILIES[f"reach_dense/{_name}"] = Family(
        (lambda n=_name, i=_i: reach_dense.reference(n, i)), model_type=_name.split("/")[0], rtol=1e-4, max_seq=40,
        eager=(P(11, 6), DEP(25, 9)),
        compiled=(P(11, 4), P(17, 2), DEP(25, 7)) if _name in REACH_DENSE_COMPILED else (),
        graphs=REACH_DENSE_COMPILED.get(_name))

# ------------------------------------------- MoE families through data, eager only (test_reach_moe.py)

REACH_MOE_COMPILED = {"cohere2_moe": 3,  # compiled samples: shared_combine mean (dense + RoPE full, local + MoE,
                      # NoPE + MoE); chunked + L2 q/k norm, NoPE + temperature, MoE scale_input
                      "llama4_text/compiled": 2,
                      "phimoe": 1}  # SparseMixer routing in the graphs (one layer structure)
for _i, _name in enumerate(reach_moe.FAMILIES):
    FAMILIES[f"reach_moe/{_name}"] = Family(
        (lambda n=_name, i=_i: reach_moe.reference(n, i)), model_type=_name.split("/")[0], rtol=1e-4, max_seq=48,
        eager=(P(11, 6), DEP(25, 9)),
        compiled=(P(11, 4), P(17, 2), DEP(20, 7)) if _name in REACH_MOE_COMPILED else (),
        graphs=REACH_MOE_COMPILED.get(_name))

# ----------------------------------------- state-space and convolution families (test_reach_ssm.py)

for _i, _name in enumerate(reach_ssm.FAMILIES):
    FAMILIES[f"reach_ssm/{_name}"] = Family(
        (lambda n=_name, i=_i: reach_ssm.reference(n, i)), model_type=_name.split("/")[0], rtol=1e-4, max_seq=40,
        eager=(P(11, 6), DEP(25, 9)),
        compiled=(P(11, 4), P(17, 2), DEP(25, 7)) if _name in reach_ssm.COMPILED else (),
        graphs=reach_ssm.COMPILED.get(_name))

# ------------------------------------- hybrid families, more than one mixer a layer (test_reach_hybrid.py)

for _i, _name in enumerate(reach_hybrid.FAMILIES):
    FAMILIES[f"reach_hybrid/{_name}"] = Family(
        (lambda n=_name, i=_i: reach_hybrid.reference(n, i)), model_type=_name.split("/")[0], rtol=1e-4,
        max_seq=40, eager=(P(11, 6), DEP(25, 9)),
        compiled=(P(11, 4), P(17, 2), DEP(25, 7)) if _name in reach_hybrid.COMPILED else (),
        graphs=reach_hybrid.COMPILED.get(_name))


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.eager])
def test_parity_eager(families, name):
    ref, _ = families.reference(name)
    run_checks(families.family(name), families.family(name).eager, ref, families.eager(name))


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.compiled])
def test_parity_compiled(families, name):
    family = families.family(name)
    ref, _ = families.reference(name)
    m = families.load(name, compile=True)
    run_checks(family, family.compiled, ref, m)
    counts = {"prefill": family.graphs, "decode": family.graphs}
    assert m.engine.graph_counts() == counts
    # then every prompt length from 1 to max_seq and every decode step up to a full cache: the same graphs
    gen = torch.Generator().manual_seed(0)
    for length in (1, 2, 3, family.max_seq - 1, family.max_seq):
        m.prefill(torch.randint(0, m.spec.vocab_size, (family.batch, length), generator=gen))
    tok = torch.zeros(family.batch, dtype=torch.long)
    m.prefill(torch.randint(0, m.spec.vocab_size, (family.batch, 2), generator=gen))
    for _ in range(family.max_seq - 2):
        tok = m.decode(tok).argmax(-1)
    assert m.engine.graph_counts() == counts
    assert m.engine._trusted is True  # one decode function per layer structure: the steps skipped the guards
    if family.after_compiled is not None:
        family.after_compiled(m)


def test_every_family_is_checked_at_batch_two():
    """Each family (the part before '/') has a batch >= 2 parity check."""
    groups: dict[str, list] = {}
    for name, family in FAMILIES.items():
        groups.setdefault(name.split("/")[0], []).append(family)
    for group, members in groups.items():
        assert any((c.batch or f.batch) >= 2 for f in members for c in f.eager if isinstance(c, P)), group


def _zoo_classes(model) -> set[type]:
    """zoo's module classes in a model's layers (kinds, norms, positions, residuals, quant), by class."""
    return {type(mod) for mod in model.module.modules() if type(mod).__module__.startswith("zoo.")}


def test_every_module_class_runs_compiled_somewhere(families):
    """The compiled samples are chosen per concept, not per family: each zoo module class that
    any family's model holds is in at least one compiled sample's model (eager models compared:
    the same classes a compiled build holds), so no kind, norm, position or residual is only
    ever run eagerly."""
    compiled = set().union(*(_zoo_classes(families.eager(n)) for n, f in FAMILIES.items() if f.compiled))
    missing = {}
    for name in FAMILIES:
        for cls in _zoo_classes(families.eager(name)) - compiled:
            missing.setdefault(f"{cls.__module__}.{cls.__qualname__}", name)
    assert not missing, f"module classes no compiled sample runs (class: a family holding it): {missing}"


HUB_SCRIPT = """
import sys, torch, zoo
ids = torch.tensor([[5, 17, 99, 3, 150, 41, 7, 8, 9]])
for repo, overrides, out in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    m = zoo.from_pretrained(repo, compile=False, max_seq=32, overrides=[o for o in overrides.split(",") if o])
    torch.save(m.prefill(ids), out)
"""


def test_hub_repo_ids_offline(families, tmp_path):
    """The hub=True families by Hub id from a local cache, offline, in one fresh process (HF_HOME
    and HF_HUB_OFFLINE are read at start-up), as a user loads them: the prefill of 9 tokens (past
    the sliding windows) against transformers within rtol, the floor rtol * min(1, max|logits|)."""
    names = [n for n, f in FAMILIES.items() if f.hub]
    argv = []
    for name in names:
        repo = "zoo-test/tiny-" + name.replace("/", "-")
        populate_hub_cache(families.reference(name)[1], tmp_path / "hf" / "hub", repo)
        argv += [repo, ",".join(FAMILIES[name].overrides), str(tmp_path / f"{name.replace('/', '-')}.pt")]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.tensor([[5, 17, 99, 3, 150, 41, 7, 8, 9]])
    for name in names:
        with torch.no_grad():
            want = families.reference(name)[0](ids).logits
        rtol = FAMILIES[name].rtol
        torch.testing.assert_close(torch.load(tmp_path / f"{name.replace('/', '-')}.pt"), want, rtol=rtol,
                                   atol=rtol * min(1.0, want.abs().max().item()), msg=lambda m, n=name: f"{n}: {m}")
