"""Shared test helpers: tiny reference checkpoints, a real local Hub cache, parity checks.

transformers is the oracle here (test-only); zoo loads what transformers saved through the same
path a user takes.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch


def save_reference(model, path: Path, max_shard_size: str | None = None) -> Path:
    """save_pretrained a transformers model (Hub key names, safetensors) to `path`."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def build_references(tmp_path_factory, variants: dict, make_reference) -> dict:
    """{name: (reference model, checkpoint dir, batch)} for variants {name: (config overrides,
    batch, save kwargs)}, each written by make_reference(path, overrides, save_kwargs)."""
    out = {}
    for name, (overrides, batch, save_kwargs) in variants.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (make_reference(path, overrides, save_kwargs), path, batch)
    return out


def populate_hub_cache(src: Path, cache: Path, repo_id: str, revision: str = "main") -> str:
    """Lay out `src`'s files as huggingface_hub's cache does for `repo_id` at `revision`:
    blobs/<sha>, snapshots/<commit>/<file> (symlinks into blobs), refs/<revision>. Returns the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in src.rglob("*") if p.is_file())
    commit = hashlib.sha1("".join(p.name for p in files).encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / sha
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(f.relative_to(src).parts) + 1)) / "blobs" / sha)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = ""):
    """|a - e| <= rtol * |e| + rtol * max|e|: relative, with a floor at the logits scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")


@torch.no_grad()
def check_parity(ref, model, ids: torch.Tensor, steps: int, rtol: float = 1e-5) -> torch.Tensor:
    """Prefill and every greedy decode step of `model` (zoo) against `ref`'s (transformers) full
    forward over the same tokens. Returns the generated sequence [B, L + steps]."""
    seq = ids.clone()
    logits = model.prefill(ids)
    assert_logits_close(logits, ref(seq).logits, rtol, "prefill")
    for step in range(steps):
        tok = logits[:, -1].argmax(-1) if logits.dim() == 3 else logits.argmax(-1)
        seq = torch.cat((seq, tok[:, None]), dim=1)
        logits = model.decode(tok)
        assert_logits_close(logits, ref(seq).logits[:, -1], rtol, f"decode step {step}")
    return seq


@torch.no_grad()
def check_decode_equals_prefill(model, seq: torch.Tensor, prompt_len: int, rtol: float = 1e-5) -> None:
    """Decoding seq[prompt_len:] token by token through the caches gives the same logits as one
    prefill of the whole sequence."""
    full = model.prefill(seq)
    logits = model.prefill(seq[:, :prompt_len])
    assert_logits_close(logits, full[:, :prompt_len], rtol, "prefill of the prompt")
    for t in range(prompt_len, seq.shape[1]):
        step = model.decode(seq[:, t])
        assert_logits_close(step, full[:, t], rtol, f"decode at position {t}")


def check_flagship_count(preset: str, config) -> None:
    """The preset's exact parameter count equals transformers' for the published `config` (a
    transformers config, models built on the meta device), and importing that config gives the
    preset's layers."""
    import transformers

    import zoo
    from zoo.compiler.hf_import import import_config
    from zoo.compiler.spec import validate

    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(config)
    want = sum(p.numel() for p in ref.parameters())  # tied weights appear once
    m = zoo.build(preset, dry=True)
    assert m.info.params == want
    imported = validate(import_config(config.to_dict(), preset), preset)
    assert imported.layers == m.spec.layers and imported.dim == m.spec.dim


@torch.no_grad()
def randomize_constant_vectors(model: torch.nn.Module) -> None:
    """Every constant-initialised vector of a transformers model (norm weights at 1, biases at 0)
    made random, so that a misplaced or missing one shows."""
    for p in model.parameters():
        if p.dim() == 1 and torch.all(p == p.flatten()[0]):
            p.uniform_(0.5, 1.5) if p.flatten()[0] == 1 else p.normal_(0.0, 0.2)


def auto_reference(config, seed: int = 0, randomize=randomize_constant_vectors):
    """transformers' causal LM of `config` (eval, seeded), its constant vectors randomized."""
    import transformers

    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(ref)
    return ref


def check_import_refused(config: dict, words) -> None:
    """Importing config.json values `config` is a ConfigError naming every one of `words`."""
    import pytest

    import zoo
    from zoo.compiler.hf_import import import_config

    with pytest.raises(zoo.ConfigError) as e:
        import_config(config, "config.json")
    assert all(w in str(e.value) for w in words), str(e.value)
