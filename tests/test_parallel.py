"""Tensor and expert parallelism (runtime.parallel.tp / ep) equal to one process.

Tiny random checkpoints saved by transformers (Llama with biases, DeepSeek-V3: MLA + experts,
Qwen3-Next with fewer kv / key heads than ranks, GLM-5: DSA) are loaded by 2 and 4 ranks of a
torchrun launch (gloo, CPU, spawned processes: tests/parallel_worker.py), each reading only its
slices; prefill and every decode step must equal the single-process logits (<= 1e-5 relative,
float32) on every rank, eager and compiled (the all-reduces inside the block graphs, one graph
per entry point). 2 ranks only, eagerly (CI time): Kimi Linear (KDA + MLA), DeepSeek-V4 (sink,
compressed and sparse-compressed attention), Llama 4 (chunked attention, experts fed weight * x) and Llama with runtime.quant=int8 / int4, whose
quantized kernel weights equal the slices of one process's bit for bit and whose logits agree to
bfloat16 rounding (the kernels' compute dtype). The sharding plan and its errors are also checked
without processes, on meta.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.compiler.errors import ConfigError
from zoo.compiler.model import build_model
from zoo.compiler.parallel.mesh import Mesh
from zoo.compiler.parallel.plan import shard_model
from zoo.compiler.spec import validate
from zoo.compiler.config import compose
from tests.helpers import assert_logits_close, save_reference
from tests.parallel_worker import kernel_weights
from zoo.compiler.contracts import Slice
from zoo.compiler.quant.apply import quantize_linears

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PROMPT, STEPS, BATCH, MAX_SEQ = 9, 3, 2, 32
QUANT_RTOL = 2e-2  # int4 under tp (see RTOL below); the kernel weights agree bit for bit
RANK_TIMEOUT = 1800  # seconds for one torchrun launch (all its cases); 2 shared cores are slow


def _llama(path):
    from tests.test_llama import make_reference

    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True), {})


def _deepseek_v3(path):
    from tests.test_deepseek_v3 import make_reference

    make_reference(path, {}, {"max_shard_size": "150KB"})


def _qwen3_next(path):
    from tests.test_qwen3_next import randomize, tiny_config

    torch.manual_seed(0)
    # one kv head (gated attention) and one key head (DeltaNet): more ranks than either
    ref = transformers.Qwen3NextForCausalLM(tiny_config(num_key_value_heads=1, linear_num_key_heads=1)).eval()
    randomize(ref)
    save_reference(ref, path)


def _llama_quant(path):
    from tests.test_llama import make_reference

    # F = 192: w2's input cut (96 per rank) keeps int4's groups of 32 whole; tied, so the int8 head
    # is a quantized copy of the embedding's rows
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                              intermediate_size=192, tie_word_embeddings=True), {})


def _kimi_linear(path):
    from tests.test_kimi_linear import randomize, tiny_config

    torch.manual_seed(0)
    # KDA + MLA, 2 heads each (the preset twin's 3 do not split over 2 ranks)
    ref = transformers.KimiLinearForCausalLM(tiny_config(linear_num_heads=2, num_attention_heads=2)).eval()
    randomize(ref)
    save_reference(ref, path)


def _deepseek_v4(path):
    from tests.test_deepseek_v4 import make_reference, save_checkpoint

    # sliding, compressed-sparse (CSA: indexer, top-k) and heavily compressed (HCA) attention with
    # sinks; 12 tokens complete CSA blocks (ratio 4) at 4, 8, 12 and an HCA block (ratio 8) at 8
    save_checkpoint(make_reference(seed=1), Path(path))


def _llama4(path):
    from tests.test_reach_moe import make_config, randomize

    # chunked RoPE layers (chunks of 8: the 9-token prompt crosses one), NoPE layers, and the MoE
    # whose experts take weight * x (scale_input), 8 experts: 4 a rank under ep=2
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(make_config("llama4_text", num_local_experts=8)).eval()
    randomize(ref)
    save_reference(ref, path)


def _glm5(path):
    from tests.test_glm5 import make_reference

    make_reference("glm", path)


MODELS = {"llama": (_llama, []), "deepseek_v3": (_deepseek_v3, []),
          "qwen3_next": (_qwen3_next, ["mixers.linear.chunk_size=4"]), "glm5": (_glm5, []),
          "llama_int8": (_llama_quant, []), "llama_int4": (_llama_quant, []),
          "kimi_linear": (_kimi_linear, ["mixers.linear.chunk_size=4"]),
          "deepseek_v4": (_deepseek_v4, ["checkpoint.mtp=false"]), "llama4": (_llama4, [])}
QUANT = {"llama_int8": "int8", "llama_int4": "int4"}  # runtime.quant
# measured on the CPU kernels (float32): int8 equals one process to 1e-6 at every step; int4
# prefill and decode steps differ by up to ~1e-2 of the largest logit (the kernels round
# activations to int8 per 32 inputs at every row count, where a last-bit difference in a rank's
# input can flip a code: 0.009 against a largest |logit| of ~0.85 seen on the 2026-12-07 suite)
RTOL = {"llama_int8": 1e-5, "llama_int4": QUANT_RTOL}
# per world size: the parallel overrides of each model (experts split over ep, tp splitting heads)
LAYOUTS = {
    2: {"llama": ["runtime.parallel.tp=2"], "deepseek_v3": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"],
        "qwen3_next": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"],
        "glm5": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"],
        "llama_int8": ["runtime.parallel.tp=2"], "llama_int4": ["runtime.parallel.tp=2"],
        "kimi_linear": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"],
        "deepseek_v4": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"],
        "llama4": ["runtime.parallel.tp=2", "runtime.parallel.ep=2"]},
    # ep=2 of 4 ranks: each expert's hidden width split over 2 ranks too
    4: {"llama": ["runtime.parallel.tp=4"], "deepseek_v3": ["runtime.parallel.tp=4", "runtime.parallel.ep=2"],
        "qwen3_next": ["runtime.parallel.tp=4", "runtime.parallel.ep=4"],
        "glm5": ["runtime.parallel.tp=4", "runtime.parallel.ep=4"]},
}
# compiled with the collectives inside the graphs: at 2 ranks a dense family and GLM-5 (MLA, MoE and
# DSA's custom ops all-reduced inside the graphs); at 4 ranks GLM-5, one head per rank (it found a
# custom op whose output strides differed from its fake's). The other families' sharded layers are
# the same modules run eagerly here and compiled in one process (CI time: 188 s cold for four at 2
# ranks; ranks compile side by side on 2 cores)
COMPILED = {2: ["llama", "glm5"], 4: ["glm5"]}


KERNEL_WEIGHTS: dict[str, dict] = {}  # quantized models: the one-process kernel weights (references)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """{model: (checkpoint dir, token sequence [B, PROMPT + STEPS], single-process logits per step)}."""
    out = {}
    for name, (make, overrides) in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        make(path)
        m = zoo.from_pretrained(str(path), compile=False, max_batch=BATCH, max_seq=MAX_SEQ, overrides=overrides,
                                 quant=QUANT.get(name))
        seq = torch.randint(0, m.spec.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
        logits = [m.prefill(seq)]
        for _ in range(STEPS):
            tok = logits[-1][:, -1].argmax(-1) if logits[-1].dim() == 3 else logits[-1].argmax(-1)
            seq = torch.cat((seq, tok[:, None]), dim=1)
            logits.append(m.decode(tok))
        out[name] = (path, seq, logits, m.info.param_bytes)
        if name in QUANT:
            KERNEL_WEIGHTS[name] = kernel_weights(m.module)
    return out


def run_ranks(n: int, cases: list[dict], tmp: Path) -> list[dict]:
    """Run the cases on n ranks (torchrun, gloo); returns each rank's results."""
    job = tmp / f"job{n}.json"
    job.write_text(json.dumps({"out": str(tmp / f"out{n}"), "cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           str(ROOT / "tests" / "parallel_worker.py"), str(job)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        log, _ = proc.communicate(timeout=RANK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{n} ranks did not finish in {RANK_TIMEOUT} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    return [torch.load(tmp / f"out{n}.{r}") for r in range(n)]


def _cases(references, n: int, compile: bool) -> list[dict]:
    cases = []
    for name, (path, seq, _, _) in references.items():
        if compile and name not in COMPILED[n] or name not in LAYOUTS[n]:
            continue
        cases.append({"kernel_weights": name in QUANT, "quant": QUANT.get(name), "path": str(path), "seq": seq.tolist(), "prompt": PROMPT, "max_seq": MAX_SEQ,
                      "name": f"{name}/{'compiled' if compile else 'eager'}", "compile": compile,
                      "overrides": MODELS[name][1] + LAYOUTS[n][name]})
    return cases


@pytest.fixture(scope="module")
def two_ranks(references, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks2")
    cases = _cases(references, 2, compile=False)
    llama = references["llama"][0]
    # ranks that disagree: on the config (rank 1 another norm eps), on the checkpoint (rank 1 a copy
    # with one tensor stored in another dtype)
    other = tmp / "llama_bf16"
    other.mkdir()
    (other / "config.json").write_text((llama / "config.json").read_text())
    tensors = load_file(llama / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    save_file(tensors, other / "model.safetensors")
    base = {"seq": references["llama"][1].tolist(), "prompt": PROMPT, "compile": False,
            "overrides": LAYOUTS[2]["llama"]}
    cases.append({**base, "name": "disagree/config", "path": str(llama), "rank_overrides": {"1": ["norm.eps=1e-3"]}})
    cases.append({**base, "name": "disagree/checkpoint", "path": str(llama), "rank_path": {"1": str(other)}})
    return run_ranks(2, cases, tmp)


@pytest.fixture(scope="module")
def two_ranks_compiled(references, tmp_path_factory):
    return run_ranks(2, _cases(references, 2, compile=True), tmp_path_factory.mktemp("ranks2c"))


@pytest.fixture(scope="module")
def four_ranks(references, tmp_path_factory):
    return run_ranks(4, _cases(references, 4, compile=False) + _cases(references, 4, compile=True),
                     tmp_path_factory.mktemp("ranks4"))


def _check(references, ranks: list[dict], n: int, mode: str) -> None:
    for name, (_, _, expected, full_bytes) in references.items():
        if mode == "compiled" and name not in COMPILED[n] or name not in LAYOUTS[n]:
            continue
        for rank, results in enumerate(ranks):
            got = results[f"{name}/{mode}"]
            assert "error" not in got, f"{name}/{mode} rank {rank}: {got.get('trace')}"
            assert len(got["logits"]) == len(expected)
            for step, (a, e) in enumerate(zip(got["logits"], expected)):
                what = "prefill" if step == 0 else f"decode step {step}"
                assert_logits_close(a, e, RTOL.get(name, 1e-5), f"{name} {mode} {n} ranks, rank {rank}, {what}")
            # each rank holds its share: less than the whole model
            assert got["param_bytes"] < full_bytes
            if mode == "compiled":
                # one graph per layer kind per entry point, the all-reduces inside them
                kinds = {"llama": 1, "deepseek_v3": 2, "qwen3_next": 2, "glm5": 2}[name]
                assert got["graphs"] == {"prefill": kinds, "decode": kinds}, got["graphs"]


def test_two_ranks_equal_one_process(references, two_ranks):
    _check(references, two_ranks, 2, "eager")


def test_two_ranks_compiled_equal_one_process(references, two_ranks_compiled):
    """The all-reduces inside inductor's CPU graphs (gloo): one graph per layer kind per entry point."""
    _check(references, two_ranks_compiled, 2, "compiled")


def test_four_ranks_equal_one_process(references, four_ranks):
    _check(references, four_ranks, 4, "eager")
    if COMPILED[4]:
        _check(references, four_ranks, 4, "compiled")


def test_quantized_ranks_hold_slices_of_one_process(references, two_ranks):
    """runtime.quant=int8 / int4 under tp=2: every quantized linear (wqkv and w13 column-parallel,
    wo and w2 row-parallel, the vocab-parallel int8 head copied from the tied embedding) applies,
    on each rank, exactly its slice of the weight the one-process kernel applies (bit for bit,
    read back through the kernels): each rank quantized its own slice of the float weight (int8
    with the whole rows' max |w| from the other ranks), and got what one process would have."""
    for name in QUANT:
        full = KERNEL_WEIGHTS[name]
        for rank, results in enumerate(two_ranks):
            got = results[f"{name}/eager"]
            assert "error" not in got, f"{name} rank {rank}: {got.get('trace')}"
            assert set(got["kernel_weights"]) == set(full)
            for w, value in got["kernel_weights"].items():
                assert w in got["slices"], f"{name}: {w} is not sharded"
                full_shape, cuts, _ = got["slices"][w]
                assert torch.equal(value, Slice(full_shape, cuts).apply(full[w])), f"{name} rank {rank}: {w}"
            assert got["logits"][0].shape == references[name][2][0].shape


def test_int4_input_cut_through_a_group_is_refused():
    """ffn_dim 160 over 2 ranks cuts w2's inputs at 80, inside a group of 32."""
    model = _meta("llama3_8b_tiny", ["ffns.mlp.ffn_dim=160"])
    quantize_linears(model, "int4", 32, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"ffns.mlp: runtime.quant=int4 under runtime.parallel tp=2.*\[\[80, 160\]\]"
                                          r".*runtime.quant_group=32"):
        shard_model(model, _mesh(2, 1, 2, 1))


def test_ranks_that_disagree_are_refused(two_ranks):
    for results in two_ranks:
        assert "the ranks disagree on the config" in results["disagree/config"]["error"]
        assert "the ranks disagree on the checkpoint" in results["disagree/checkpoint"]["error"]


def test_vocab_parallel_head_and_local_caches(two_ranks):
    got = two_ranks[0]["deepseek_v3/eager"]
    assert got["parallel"]["head"] == "vocab-parallel"
    assert got["parallel"]["tp"] == 2 and got["parallel"]["ep"] == 2


# ----------------------------------------------------------------------------- the plan on meta


def _mesh(size: int, rank: int, tp: int, ep: int) -> Mesh:
    return Mesh(size=size, rank=rank, tp=tp, ep=ep, group_name="unused", device=torch.device("cpu"))


def _meta(conf: str, overrides=()):
    spec = validate(compose(conf, list(overrides)), source=f"conf/{conf}.yaml")
    return build_model(spec, mtp=spec.checkpoint.mtp)


def test_plan_shapes_deepseek_v3_tp8_ep8():
    """The full-size DeepSeek-V3 on meta, rank 3 of 8: heads, experts and cache cut as declared."""
    model = _meta("deepseek_v3")
    report = shard_model(model, _mesh(8, 3, 8, 8))
    mla, moe = model.layers[5].mixer, model.layers[5].ffn
    assert mla.n_heads == 16 and tuple(mla.wq_b.weight.shape) == (16 * 192, 1536)
    assert tuple(mla.wkv_a.weight.shape) == (576, 7168)  # latent projection replicated
    assert mla.cache_fields(1, 10, torch.bfloat16)["kv"].shape == (1, 1, 10, 576)  # latent cache replicated
    assert tuple(moe.w13.shape) == (32, 2 * 2048, 7168) and moe.local == (96, 128)
    assert tuple(moe.router.weight.shape) == (256, 7168)
    assert report.slices["layers.5.ffn.w13"].ranges(0) == ((96, 128),)
    assert report.head == "vocab-parallel" and tuple(model.head.weight.shape) == (129280 // 8, 7168)


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    model = _meta("llama3_8b_tiny", ["mixers.attn.n_heads=8", "mixers.attn.n_kv_heads=2"])
    shard_model(model, _mesh(4, 3, 4, 1))
    attn = model.layers[0].mixer
    assert (attn.n_heads, attn.n_kv_heads) == (2, 1)


@pytest.mark.parametrize("conf, overrides, match", [
    ("llama3_8b_tiny", ["mixers.attn.n_heads=6", "mixers.attn.n_kv_heads=2", "mixers.attn.head_dim=16"], r"mixers.attn.n_heads=6 does not divide by 4"),
    ("llama3_8b_tiny", ["mixers.attn.n_heads=12", "mixers.attn.n_kv_heads=3", "mixers.attn.head_dim=16"], r"mixers.attn.n_kv_heads=3 does not divide"),
    ("deepseek_v3_tiny", ["ffns.moe.n_experts=6", "ffns.moe.n_group=1", "ffns.moe.topk_group=1"],
     r"ffns.moe.n_experts=6 does not divide by 4"),
])
def test_plan_errors_name_the_key(conf, overrides, match):
    with pytest.raises(ConfigError, match=match):
        shard_model(_meta(conf, overrides), _mesh(4, 0, 4, 4))


def test_plan_without_a_split_is_refused():
    with pytest.raises(ConfigError, match="experts with biases"):
        shard_model(_meta("gpt_oss_20b_tiny"), _mesh(2, 0, 2, 2))


def test_plan_shapes_deepseek_v4_flash_tp8():
    """Sink / compressed attention on meta, rank 3 of 8: one output group and its heads per rank,
    the shared K=V head, compressor and indexer replicated."""
    model = _meta("deepseek_v4_flash")
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    report = shard_model(model, _mesh(8, 3, 8, 8))
    for block in model.layers:
        m, s = block.mixer, block.mixer.spec
        assert (m.n_heads, m.groups) == (s.n_heads // 8, s.o_groups // 8) and block.mixer_reduce is not None
    i = next(i for i, b in enumerate(model.layers) if hasattr(b.mixer, "indexer"))
    name = f"layers.{i}.mixer"
    m = model.layers[i].mixer
    assert report.slices[f"{name}.wq_b.weight"].ranges(0) == ((3 * m.n_heads * m.head_dim, 4 * m.n_heads * m.head_dim),)
    assert tuple(m.wo_b.weight.shape) == (full[f"{name}.wo_b.weight"][0], m.o_rank)
    for kept in ("wkv.weight", "wq_a.weight", "compressor.wkv.weight", "indexer.wq_b.weight"):
        assert tuple(model.get_parameter(f"{name}.{kept}").shape) == full[f"{name}.{kept}"], kept


def test_tp_without_a_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="needs a process group: launch under `torchrun --nproc-per-node 2"):
        zoo.build("llama3_8b_tiny", overrides=["runtime.parallel.tp=2"], compile=False)


# ----------------------------------------------------------------------------- zoo report tp / ep


def test_report_per_rank_llama3_8b(capsys):
    from zoo.cli import main
    from zoo.compiler.analysis import analyze, parallel_plan

    spec = validate(compose("llama3_8b", []), source="conf/llama3_8b.yaml")
    full = analyze(spec, context=8192, device="h200")
    p = parallel_plan(spec, 8, 1, context=8192, device="h200")
    # 8 kv heads split 8 ways: an eighth of the KV cache per rank; the head is vocab-parallel, the
    # embedding (128256 x 4096) and the norms replicated
    assert p["cache_bytes_per_token_per_rank"] * 8 == full["cache_bytes_per_token"]
    assert p["head"] == "vocab-parallel"
    dim, vocab, layers = 4096, 128256, 32
    replicated = vocab * dim + (2 * layers + 1) * dim
    assert p["params_per_rank"] == (full["params_total"] - replicated) // 8 + replicated
    free = 141.0e9 - p["weight_bytes_per_rank"]
    assert p["max_batch_at_context"] == int(free // (p["cache_bytes_per_token_per_rank"] * 8192))
    # 16 GB of bf16 weights fit one H200 at every width
    assert p["devices_needed"] == {"bf16": 1, "fp8": 1, "int4": 1}
    assert main(["report", "conf=llama3_8b", "device=h200", "tp=8", "context=8192"]) == 0
    out = capsys.readouterr().out
    assert "per rank (tp=8 ep=1)" in out and "devices needed" in out


def test_devices_needed_deepseek_v3():
    """671 B parameters on 141 GB H200s: 1342 GB at bf16 -> 16 devices, 671 GB at fp8 -> 8, 336 GB
    at int4 -> 4 (the replicated embedding, latent projections and routers fit in the rest)."""
    from zoo.compiler.analysis import devices_needed

    spec = validate(compose("deepseek_v3", []), source="conf/deepseek_v3.yaml")
    assert devices_needed(spec, 141.0e9, context=4096, batch=1) == {"bf16": 16, "fp8": 8, "int4": 4}


# ----------------------------------------------------------------------------- sliced loading


def test_rank_reads_only_its_slices(tmp_path):
    """Rank 1 of 2 loads a Llama checkpoint (biases, fused q|k|v and gate|up rules): every
    parameter equals its slice of the whole load, sliced tensors come through read_part (never a
    whole read), the row-parallel biases are zero on this rank, and it reads about half the bytes."""
    from tests.test_llama import make_reference
    from zoo.compiler.checkpoint.loader import execute, plan_load
    from zoo.compiler.checkpoint.rules import checkpoint_stages
    from zoo.compiler.checkpoint.safetensors_source import SafetensorsSource
    from zoo.compiler.hf_import import import_config
    from zoo.compiler.model import materialize

    make_reference(tmp_path, dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True), {})
    source = SafetensorsSource(tmp_path)
    spec = validate(import_config(source.config(), source.description), source=source.description)
    whole = materialize(build_model(spec, mtp=False), "cpu", torch.float32)
    whole_plan = plan_load(whole, source, checkpoint_stages(source, spec))
    execute(whole_plan, whole, source)

    model = build_model(spec, mtp=False)
    report = shard_model(model, _mesh(2, 1, 2, 1))
    source = SafetensorsSource(tmp_path)
    full_reads, part_reads = [], []
    read, read_part = source.read, source.read_part
    source.read = lambda name: full_reads.append(name) or read(name)
    source.read_part = lambda name, part: part_reads.append(name) or read_part(name, part)
    plan = plan_load(model, source, checkpoint_stages(source, spec), slices=report.slices)
    model = materialize(model, "cpu", torch.float32)
    execute(plan, model, source)
    expected = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        s = report.slices.get(name)
        want = expected[name] if s is None else torch.zeros(s.local_shape()) if s.zero else s.apply(expected[name])
        assert torch.equal(p, want), name
    assert full_reads == [] and "model.layers.0.self_attn.k_proj.weight" in part_reads
    assert not model.layers[0].mixer.wo.bias.any() and not model.layers[0].ffn.w2.bias.any()
    assert 0.45 < plan.bytes_to_read / whole_plan.bytes_to_read < 0.7  # the embedding is replicated
