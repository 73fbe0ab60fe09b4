"""`zoo patterns`: the prompt, the printed summary and the heatmaps of compiler/patterns.py's
analysis (sinks, previous-token and induction heads, locality, entropy, RoPE's distance profile,
DSA picks, recurrent-layer statistics, mHC stream mixing).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from .compiler.errors import InputError
from .compiler.patterns import DEFAULT_BUDGET, SCORES, Patterns, analyze, induction_prompt

DEFAULT_REPEAT = 50  # BOS + 50 + 50 tokens: 101 fits every tiny twin's max_seq of 128


def prompt_ids(model, text: Optional[str] = None, repeat: int = DEFAULT_REPEAT, seed: int = 0) -> tuple[list[int], int]:
    """The induction prompt (compiler/patterns.induction_prompt) and its n: `text`'s tokens
    repeated, or `repeat` random ones. BOS is the tokenizer's (token 0 without one)."""
    tok = model.tokenizer
    bos = tok.bos_id if tok is not None and tok.bos_id is not None else 0
    if text is not None:
        if tok is None:
            raise InputError("patterns text=...: this model has no tokenizer; use repeat=N (random tokens) instead")
        tokens = tok.encode(text, add_special_tokens=False)
        if not tokens:
            raise InputError(f"patterns text={text!r}: the text has no tokens")
        return induction_prompt(len(tokens), bos, model.spec.vocab_size, tokens=tokens), len(tokens)
    return induction_prompt(repeat, bos, model.spec.vocab_size, seed=seed), repeat


def token_labels(model, ids: list[int]) -> list[str]:
    tok = model.tokenizer
    if tok is None:
        return [str(i) for i in ids]
    return [tok.decode([i], skip_special_tokens=False).replace("\n", "\\n") or f"<{i}>" for i in ids]


def run(model, text: Optional[str] = None, repeat: int = DEFAULT_REPEAT, seed: int = 0,
        budget: int = DEFAULT_BUDGET) -> Patterns:
    """The analysis of a built zoo Model (zoo.build / from_pretrained) on its induction prompt."""
    ids, n = prompt_ids(model, text, repeat, seed)
    if len(ids) > model.engine.max_seq:
        raise InputError(f"patterns: the prompt has {len(ids)} tokens but the model was built with "
                         f"max_seq={model.engine.max_seq}; give max_seq={len(ids)} (or a shorter text / repeat)")
    return analyze(model.engine, torch.tensor([ids]), n_repeat=n, budget=budget)


# ---------------------------------------------------------------------------- text


def _fmt(v) -> str:
    return "  -  " if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:5.2f}"


def print_patterns(p: Patterns, labels: list[str]) -> None:
    L = len(p.tokens)
    print(f"prompt: {L} tokens (BOS + {p.n_repeat} + the same {p.n_repeat})")
    print(f"memory: head groups of at most {p.budget / 2**20:.0f} MiB per [B, h, L, L] map "
          f"(~8x that alive at once); heads per group: {sorted(set(p.heads_per_group.values())) or '-'}")
    print("\nstrongest heads (layer.head score)")
    for name in SCORES:
        best = p.top_heads(name, 5) if name != "entropy" else sorted(p.top_heads(name, 10**6), key=lambda c: c[2])[:5]
        what = " (lowest)" if name == "entropy" else ""
        print(f"  {name + what:18s} " + "  ".join(f"{i}.{j} {v:.2f}" for i, j, v in best))
    print("\nper layer (mean over heads / max)")
    print(f"  {'layer':>5s} {'kind':16s} {'sink':>11s} {'prev':>11s} {'induct':>11s} {'entropy':>7s}  other")
    for i, kind in enumerate(p.kinds):
        row = f"  {i:5d} {kind:16s}"
        if p.grids["sink"][i] is not None:
            for name in ("sink", "previous_token", "induction"):
                values = [v for v in p.grids[name][i] if not math.isnan(v)]
                row += f" {_fmt(sum(values) / len(values) if values else None)}/{_fmt(max(values) if values else None)}"
            ent = p.grids["entropy"][i]
            row += f" {sum(ent) / len(ent):7.2f}"
            for name in ("learned_sink", "entries", "dsa_captured"):
                values = p.grids[name][i]
                if values is not None:
                    row += f"  {name} {_fmt(sum(values) / len(values))}"
        elif p.recurrent[i] is not None:
            row += "  " + "  ".join(f"{k} {sum(v) / len(v):.3g}" for k, v in p.recurrent[i].items()) + " (mean over heads)"
        else:
            row += "  (no probe)"
        print(row)
    if p.streams is not None:
        print("\nstream mixing (mHC, after Sinkhorn): worst token of each connection | running product")
        print(f"  {'layer':>5s} {'where':15s} {'|row-1|':>8s} {'|col-1|':>8s} {'||.||2':>7s} | "
              f"{'|row-1|':>8s} {'|col-1|':>8s} {'||.||2':>7s} {'to J/N':>7s}")
        for c in p.streams["connections"]:
            q = c["product"]
            print(f"  {c['layer']:5d} {c['connection']:15s} {c['row_sum_error']:8.1e} {c['col_sum_error']:8.1e} "
                  f"{c['spectral_norm']:7.4f} | {q['row_sum_error']:8.1e} {q['col_sum_error']:8.1e} "
                  f"{q['spectral_norm']:7.4f} {q['to_uniform']:7.4f}")
            print("        mean over tokens: " + " | ".join(" ".join(f"{v:.3f}" for v in row) for row in c["mean"]))
    print("\ndistance profile (mean scaled q.k at |t - s| = 0, 1, 2, 4, 8, ...; mean over heads)")
    marks = [d for d in [0] + [2 ** k for k in range(12)] if d < L]
    for i, prof in enumerate(p.distance):
        if prof is not None:  # a profile has L - 1 distances (the sink's column is left out)
            print(f"  {i:5d} " + " ".join(f"{_fmt(prof[d])}" for d in marks if d < len(prof)))


# ---------------------------------------------------------------------------- pictures


def plot_patterns(p: Patterns, labels: list[str], out_dir: str, title: str = "") -> list[Path]:
    """PNG heatmaps in out_dir: one per score grid (layers x heads), the strongest heads' maps
    with token labels, and the distance profile. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (*SCORES, "learned_sink", "entries", "dsa_captured"):
        rows = p.grids.get(name)
        if rows is None or all(r is None for r in rows):
            continue
        width = max(len(r) for r in rows if r is not None)
        grid = np.full((len(rows), width), np.nan)
        for i, r in enumerate(rows):
            if r is not None:
                grid[i, :len(r)] = r
        fig, ax = plt.subplots(figsize=(1.2 + 0.35 * width, 1.0 + 0.22 * len(rows)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                       vmin=0, vmax=None if name == "entropy" else 1)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{title} {name}".strip(), fontsize=9)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if p.maps:
        fig, axes = plt.subplots(1, len(p.maps), figsize=(6 * len(p.maps), 6))
        axes = np.atleast_1d(axes)
        step = max(1, len(labels) // 40)  # at most ~40 readable labels per axis
        for ax, (name, (layer, head, value, probs)) in zip(axes, p.maps.items()):
            ax.imshow(probs.numpy(), cmap="magma", interpolation="nearest", vmin=0, vmax=1)
            ticks = list(range(0, len(labels), step))
            ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=90, fontsize=5)
            ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=5)
            ax.set_title(f"{name}: layer {layer} head {head} ({value:.2f})", fontsize=9)
            ax.set_xlabel("key")
            ax.set_ylabel("query")
        fig.tight_layout()
        path = out / "heads.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    profiles = [(i, d) for i, d in enumerate(p.distance) if d is not None]
    if profiles:
        fig, ax = plt.subplots(figsize=(7, 4))
        cmap = plt.get_cmap("viridis")
        for k, (i, prof) in enumerate(profiles):
            ax.plot(prof, color=cmap(k / max(1, len(profiles) - 1)), lw=0.8, label=f"layer {i}" if k in (0, len(profiles) - 1) else None)
        ax.set_xlabel("distance |t - s|")
        ax.set_ylabel("mean scaled q.k")
        ax.legend(fontsize=7)
        ax.set_title(f"{title} distance profile".strip(), fontsize=9)
        fig.tight_layout()
        path = out / "distance.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
