"""Attention probes (contracts.AttentionProbe) and `zoo patterns` (compiler/patterns.py).

The probes must give what the graphs compute: they are checked against transformers' eager
attention weights (`output_attentions=True`, attn_implementation="eager") on the tiny random
checkpoints the family tests build (their builders, reused), <= 1e-5; DeepSeek-V4's window, sink
and compressed kinds (no eager oracle) by rebuilding each layer's prefill output from the probe's
probabilities. Then the scores on constructed maps, mHC's stream mixing, the memory bound, and
the command (JSON, pictures). Real SmolLM2 weights are in test_patterns_smollm2.py.
"""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from zoo.cli import main as zoo_main
from zoo.compiler.contracts import AttentionMaps, AttentionProbe, MixerStatistics
from zoo.compiler.mixers.dsa import choice_mask
from zoo.compiler.patterns import analyze, attention_maps, distance_sums, head_scores, induction_prompt, mixing_summary
from zoo.compiler.registry import registered
from zoo.compiler.residual.mhc import sinkhorn
from tests.helpers import save_reference
from tests.test_gated_deltanet import peak_cpu_bytes

transformers = pytest.importorskip("transformers")

RTOL = 1e-5


def eager_attentions(ref, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' eager attention weights, one [B, H, L, L] per attention layer."""
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        return list(ref(ids, output_attentions=True).attentions)


def assert_maps_close(ours: dict[int, AttentionMaps], want: list[torch.Tensor]) -> None:
    assert len(ours) == len(want), (sorted(ours), len(want))
    for (i, maps), w in zip(sorted(ours.items()), want):
        torch.testing.assert_close(maps.probs, w.float(), rtol=RTOL, atol=RTOL, msg=lambda m: f"layer {i}: {m}")
        torch.testing.assert_close(maps.probs.sum(-1), torch.ones(maps.probs.shape[:-1]), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- vs transformers


def test_gqa_probe_matches_transformers(tmp_path):
    from tests.test_llama import VARIANTS, make_reference

    overrides, _, _ = VARIANTS["gqa"]
    ref = make_reference(tmp_path, overrides, {})
    m = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=2, max_seq=32)
    ids = torch.randint(0, 320, (2, 23))
    assert_maps_close(attention_maps(m.engine, ids), eager_attentions(ref, ids))


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_probe_matches_transformers(tmp_path_factory, absorbed):
    from tests.test_deepseek_v3 import VARIANTS, make_reference

    path = tmp_path_factory.mktemp("v3")
    ref = make_reference(path, VARIANTS["main"][0], {})  # YaRN with the mscale softmax correction
    m = zoo.from_pretrained(str(path), compile=False, max_batch=2, max_seq=32)
    ids = torch.randint(0, 256, (2, 21))
    assert_maps_close(attention_maps(m.engine, ids, absorbed=absorbed), eager_attentions(ref, ids))


def test_gated_attention_probe_matches_transformers_and_deltanet_statistics(tmp_path):
    """Qwen3-Next: the gated attention layers' probes against transformers' (only those layers
    report attentions); the DeltaNet layers report gates and the state, whose final norm equals
    the recurrent state transformers leaves in its cache."""
    from tests.test_qwen3_next import randomize, tiny_config

    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    randomize(ref)
    save_reference(ref, tmp_path)
    m = zoo.from_pretrained(str(tmp_path), compile=False, max_batch=2, max_seq=64, overrides=["mixers.linear.chunk_size=16"])
    ids = torch.randint(0, 256, (2, 37))
    maps = attention_maps(m.engine, ids)
    assert sorted(maps) == [i for i, b in enumerate(m.module.layers) if b.mixer.kind == "gqa"]
    assert_maps_close(maps, eager_attentions(ref, ids))

    p = analyze(m.engine, ids[:1], n_repeat=0)
    with torch.no_grad():
        cache = ref(ids[:1], use_cache=True).past_key_values
    for i, block in enumerate(m.module.layers):
        if isinstance(block.mixer, AttentionProbe):
            assert p.recurrent[i] is None and p.grids["sink"][i] is not None
            continue
        assert isinstance(block.mixer, MixerStatistics) and p.grids["sink"][i] is None
        stats = p.recurrent[i]
        state = cache.layers[i].recurrent_states[0].float()  # [1, Hv, Dk, Dv]
        torch.testing.assert_close(torch.tensor(stats["state_norm"]), state.flatten(-2).norm(dim=-1)[0], rtol=1e-4, atol=1e-6)
        assert all(0 < d < 1 for d in stats["decay"]) and all(0 < b < 1 for b in stats["write"])


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-5 (DSA) as test_glm5 builds it, a prompt longer than Ks whose top-k has no near ties
    (test_glm5.tie_free), and a dense twin of the same weights (index_topk >= the prompt: every
    key chosen, MLA's dense attention)."""
    from tests.test_glm5 import VARIANTS, make_reference, tie_free

    path = tmp_path_factory.mktemp("glm")
    ref = make_reference("glm", path)
    *_, batch, seed = VARIANTS["glm"]
    ids = torch.randint(0, 256, (batch, 19), generator=torch.Generator().manual_seed(seed))
    m = zoo.from_pretrained(str(path), compile=False, max_batch=batch, max_seq=32)
    tie_free(m, ref, ids)
    dense = zoo.from_pretrained(str(path), compile=False, max_batch=batch, max_seq=32,
                                overrides=["mixers.attn.index_topk=32"])
    return ref, m, dense, ids


@pytest.mark.parametrize("absorbed", [False, True])
def test_dsa_probe_matches_transformers(glm, absorbed):
    ref, m, _, ids = glm
    assert_maps_close(attention_maps(m.engine, ids, absorbed=absorbed), eager_attentions(ref, ids))


def test_dsa_picks_and_captured_mass(glm):
    """The probe's picks are transformers' indexer's top-k; `captured` is the dense twin's
    probability mass on those picks (1 while a query sees at most Ks keys, less after)."""
    from tests.test_glm5 import TOPK, capture, reference_choice

    ref, m, dense, ids = glm
    _, picked = capture(ref, ids)
    sparse, full = attention_maps(m.engine, ids), attention_maps(dense.engine, ids)
    L = ids.shape[1]
    for i, maps in sparse.items():
        picks = maps.extras["picks"]
        assert picks.shape == (ids.shape[0], L, TOPK)
        chosen = choice_mask(torch.where(picks >= 0, picks, L))  # column L: dropped
        assert torch.equal(chosen, reference_choice(picked[i])), i
        if i == 0:  # the twins' first layers see the same input (later ones differ: sparse vs dense)
            want = (full[i].probs * chosen[:, None]).sum(-1)
            torch.testing.assert_close(maps.extras["captured"], want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(full[i].probs, torch.softmax(maps.logits, -1), rtol=1e-5, atol=1e-6)
        assert torch.allclose(maps.extras["captured"][..., :TOPK], torch.ones(1)), "every key kept: all the mass"
        assert (maps.extras["captured"][..., TOPK:] < 1 - 1e-4).all(), "past Ks keys some mass is dropped"
    p = analyze(m.engine, ids, n_repeat=0)
    for i, row in enumerate(p.grids["dsa_captured"]):
        want = sparse[i].extras["captured"][..., TOPK:].mean((0, -1))
        torch.testing.assert_close(torch.tensor(row), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- DeepSeek-V4 kinds


@pytest.fixture(scope="module")
def v4():
    return zoo.build("deepseek_v4_flash_tiny", compile=False, max_seq=64, seed=1)


def test_window_sink_and_compressed_probes_rebuild_the_prefill(v4):
    """swa_mqa, csa_mqa, hca_mqa (DeepSeek-V4 tiny: window 8 < the prompt, compressed entries):
    the probe's token, entry and sink shares sum to 1, and weighting the layer's shared K=V rows
    and compressed entries by them gives the layer's own prefill output."""
    from zoo.compiler.patterns import _observe

    ids = torch.randint(0, v4.spec.vocab_size, (1, 41))
    seen = {}

    def check(i, mixer, x, cache, ctx):
        maps = mixer.attention_probe(x, ctx)
        cos, sin = ctx["rope"][mixer.rope]
        scratch = {n: torch.zeros(f.shape, dtype=f.dtype) for n, f in mixer.cache_fields(1, x.shape[1], x.dtype).items()}
        _, kv = mixer.project(x, cos, sin)
        o = torch.matmul(maps.probs, kv)  # [B, H, L, Dh]: keys are the values (shared K=V)
        total = maps.probs.sum(-1) + maps.extras["sink"]
        if "entries" in maps.extras:
            entries = mixer.prefill_attention(x, scratch, cos, sin)[1]
            o = o + torch.einsum("bhln,bnd->bhld", maps.extras["entries"], entries)
            total = total + maps.extras["entries"].sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-5)
        # the class's prefill: the instance's is the hook's wrapper
        want = type(mixer).prefill(mixer, x, {n: torch.zeros_like(t) for n, t in cache.items()}, ctx)
        torch.testing.assert_close(mixer.out(o, cos, sin), want, rtol=1e-5, atol=1e-6)
        window = mixer.window
        t = torch.arange(x.shape[1])
        outside = (t[:, None] - t[None, :] >= window) | (t[None, :] > t[:, None])
        assert (maps.probs[..., outside] == 0).all() and maps.logits[..., outside].isinf().all()
        seen[mixer.kind] = True

    _observe(v4.engine, ids, check)
    assert set(seen) == {"swa_mqa", "csa_mqa", "hca_mqa"}


def test_every_softmax_kind_has_a_probe():
    """Every registered mixer kind either shows attention or reports statistics."""
    for kind, cls in registered("mixer").items():
        assert hasattr(cls, "attention_probe") or hasattr(cls, "mixer_statistics"), kind


# ----------------------------------------------------------------------------- scores


def test_scores_on_constructed_maps():
    """Hand-made heads: one attends to position 0, one to t - 1, one to the token after the
    previous occurrence on a BOS + n + n prompt, one uniformly."""
    n = 6
    L = 1 + 2 * n
    t = torch.arange(L)
    sink = torch.zeros(L, L)
    sink[:, 0] = 1
    prev = torch.zeros(L, L)
    prev[t[1:], t[1:] - 1] = 1
    prev[0, 0] = 1
    ind = prev.clone()
    q = torch.arange(1 + n, L)
    ind[q] = 0
    ind[q, q - n + 1] = 1
    uniform = torch.ones(L, L).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    probs = torch.stack((sink, prev, ind, uniform))[None]
    scores = head_scores(AttentionMaps(probs, probs.log()), n)
    torch.testing.assert_close(scores["sink"][0], torch.tensor(1.0))
    torch.testing.assert_close(scores["previous_token"][1], torch.tensor(1.0))
    torch.testing.assert_close(scores["induction"][2], torch.tensor(1.0))
    assert scores["induction"][1] == 0 and scores["previous_token"][2] == pytest.approx((n + 1 - 1) / (L - 1))
    assert scores["entropy"][:3].abs().max() < 1e-6
    want = torch.log(t[1:] + 1.0).mean()
    torch.testing.assert_close(scores["entropy"][3], want)
    assert induction_prompt(n, bos=0, vocab=10, tokens=list(range(1, n + 1))) == [0, *range(1, n + 1), *range(1, n + 1)]


def test_distance_profile_reads_each_diagonal():
    x = torch.randn(2, 3, 9, 9)
    t = torch.arange(9)
    x = x.masked_fill((t[None, :] > t[:, None]) | (t[:, None] - t[None, :] > 5), float("-inf"))
    total, count = distance_sums(x)
    for d in range(9):
        diag = torch.diagonal(x, -d, -2, -1)
        diag = diag[diag.isfinite()]
        assert count[d] == diag.numel()
        torch.testing.assert_close(total[d], diag.sum())


def test_head_groups_stream_without_changing_the_scores():
    """A budget of one head per group gives the same grids as all heads at once, and a 513-token
    analysis streamed one head at a time peaks at what compiler/patterns.py states (~8 one-head
    maps), far below the [H, L, L] maps of all its layers (24 here)."""
    m = zoo.build("llama3_8b_tiny", ["n_layers=6"], compile=False, max_seq=513)
    ids = torch.tensor([induction_prompt(256, 0, m.spec.vocab_size)])
    L = ids.shape[1]
    one_head = L * L * 4
    whole = analyze(m.engine, ids[:, :101], n_repeat=50)
    split = analyze(m.engine, ids[:, :101], n_repeat=50, budget=101 * 101 * 4)
    assert set(split.heads_per_group.values()) == {1} and set(whole.heads_per_group.values()) == {4}
    for name in ("sink", "previous_token", "induction", "entropy"):
        torch.testing.assert_close(torch.tensor(split.grids[name]), torch.tensor(whole.grids[name]), rtol=1e-6, atol=1e-7)
    peak = peak_cpu_bytes(lambda: analyze(m.engine, ids, n_repeat=256, budget=one_head))
    layers_maps = len(m.module.layers) * 4 * one_head
    assert peak < 10 * one_head < layers_maps / 2, f"peak {peak / 2**20:.0f} MiB, one head's map {one_head / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------- mHC


def test_mhc_stream_mixing_is_doubly_stochastic_across_layers():
    """Each connection's matrices after Sinkhorn and their product over all layers: rows and
    columns sum to 1, spectral norm 1 (section 4.8's closure); the product approaches J/N. The
    same check flags row-softmax matrices without Sinkhorn."""
    m = zoo.build("llama3_8b_tiny", ["residual=mhc", "n_layers=6"], compile=False, max_seq=64, seed=3)
    p = analyze(m.engine, torch.tensor([induction_prompt(20, 0, m.spec.vocab_size)]), n_repeat=20)
    conns = p.streams["connections"]
    assert [(c["layer"], c["connection"]) for c in conns] == [(i, w) for i in range(6) for w in ("mixer_residual", "ffn_residual")]
    for c in conns:
        assert c["row_sum_error"] < 1e-5 and c["col_sum_error"] < 1e-5 and c["min_entry"] >= 0
        assert abs(c["spectral_norm"] - 1) < 1e-5
        assert c["product"]["row_sum_error"] < 1e-4 and c["product"]["col_sum_error"] < 1e-4
        assert abs(c["product"]["spectral_norm"] - 1) < 1e-4
    assert conns[-1]["product"]["to_uniform"] < conns[0]["to_uniform"]
    logits = torch.randn(64, 4, 4) * 2
    assert mixing_summary(torch.softmax(logits, -1))["col_sum_error"] > 0.05
    assert mixing_summary(sinkhorn(logits, 20, 1e-6))["col_sum_error"] < 1e-5


# ----------------------------------------------------------------------------- the command


def test_patterns_command_json_and_plots(tmp_path, capsys):
    """`zoo patterns ... output=json`: n_layers x n_heads grids, null for DeltaNet layers, which
    report their statistics instead; plot= writes the PNGs."""
    assert zoo_main(["patterns", "conf=qwen3_next_tiny", "repeat=12", "output=json", f"plot={tmp_path}"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = out["kinds"]
    assert len(kinds) == 8 and len(out["tokens"]) == 25
    for name in ("sink", "previous_token", "induction"):
        rows = out[name]
        assert len(rows) == 8
        for kind, row, stats in zip(kinds, rows, out["recurrent"]):
            if kind == "gqa":
                assert len(row) == 4 and all(0 <= v <= 1 for v in row) and stats is None
            else:
                assert row is None and set(stats) == {"decay", "write", "state_norm", "output_norm"}
    for f in ("sink", "previous_token", "induction", "entropy", "heads", "distance"):
        assert (tmp_path / f"{f}.png").stat().st_size > 1000, f
    assert zoo_main(["patterns", "conf=llama3_8b_tiny", "repeat=100"]) == 0  # 201 tokens > the conf's 128
    assert "strongest heads" in capsys.readouterr().out
