"""The build report: layout, exact parameter count, cache bytes, memory, compile and load times."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _layout_text(runs: list[tuple[str, int]]) -> str:
    """Runs of layer kinds as text; a repeating group of runs is shown once with its count
    ("12 x (linear+moe x3, attn+moe x1)")."""
    n = len(runs)
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(runs[i] == runs[i % p] for i in range(n)))
    group = ", ".join(f"{kind} x{count}" for kind, count in runs[:period])
    return group if period == n else f"{n // period} x ({group})"


def build_rows(model, shapes: dict | None = None) -> list[tuple[str, str]]:
    spec, info = model.spec, model.info
    rt = spec.runtime
    layout = _layout_text(spec.layout_runs())
    rows = [
        ("config", f"{spec.name}  ({spec.source})"),
        ("layers", f"{spec.n_layers}: {layout}"),
        ("parameters", f"{info.params:,}  ({info.params})"),
        *([("mtp", _mtp_row(model))] if spec.mtp_layers else []),
        ("residual", _residual_row(model)),
        ("weights", f"{human_bytes(info.param_bytes)} in {rt.dtype}"),
        ("cache per token", f"{info.cache_bytes_per_token:,} B  (grows with context, "
                            f"{rt.cache_dtype or rt.dtype})"),
        ("state per sequence", f"{info.state_bytes_per_sequence:,} B  (constant)"),
        ("caches", f"{human_bytes(info.cache_bytes)} for max_batch={rt.max_batch} x max_seq={rt.max_seq}"),
        ("memory", f"needs {human_bytes(info.needed_bytes)}, {rt.device} has "
                   f"{human_bytes(info.available_bytes)} available"
                   + ("  -> dry build on the meta device" if info.dry else "")),
    ]
    if info.dry:
        rows.append(("compile", "skipped (dry build)"))
    elif info.compile_seconds:
        rows.append(("compile", ", ".join(f"{k} {v:.1f} s" for k, v in info.compile_seconds.items())
                     + f"  (graphs: {model.engine.graph_counts()})"))
    else:
        rows.append(("compile", "off (eager)"))
    if info.load is not None:
        rows.append(("weights loaded", f"{info.load.tensors_read} tensors, {human_bytes(info.load.bytes_read)} "
                                       f"in {info.load.seconds:.2f} s"))
        for name, why in info.load.ignored[:10]:
            rows.append(("  skipped", f"{name}: {why}"))
        if len(info.load.ignored) > 10:
            rows.append(("  skipped", f"... {len(info.load.ignored) - 10} more"))
    if shapes:
        rows.append(("shape check", f"prefill logits {list(shapes['prefill'])}, decode logits "
                                    f"{list(shapes['decode']) if shapes['decode'] else '-'}"))
    return rows


def _mtp_row(model) -> str:
    from compiler.model import count_parameters

    n = len(model.spec.mtp_layers)
    what = f"{n} multi-token-prediction layer{'s' if n > 1 else ''}"
    if not len(model.module.mtp):
        return f"{what} in the checkpoint, not built (checkpoint.mtp=false)"
    return f"{what}, {count_parameters(model.module.mtp):,} of the parameters"


def _residual_row(model) -> str:
    from compiler.model import count_parameters

    spec = model.spec.residual
    streams = getattr(spec, "streams", 1)
    modules = [model.module.streams] + [m for b in model.module.layers for m in (b.mixer_residual, b.ffn_residual)]
    added = sum(count_parameters(m) for m in modules)
    return f"{spec.kind}, {streams} stream{'s' if streams > 1 else ''}" + (f", {added:,} parameters" if added else "")


def print_build_report(model, shapes: dict | None = None, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"zoo build: {model.spec.name}", show_header=False, title_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, value in build_rows(model, shapes):
        table.add_row(key, value)
    console.print(table)


# ----------------------------------------------------------------------------- zoo report

def _si(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {suffix}{unit}"
    return f"{n:,.0f} {unit}".rstrip()


def print_analysis(r: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"zoo report: {r['name']}  ({r['source']})", show_header=False, title_justify="left")
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    layout = ", ".join(f"{k} x{n}" for k, n in r["layout"])
    t.add_row("layers", f"{r['n_layers']}: {layout}")
    t.add_row("parameters", f"{r['params_total']:,} total; {r['params_active']:,} active per token")
    t.add_row("", f"active: {r['params_active_convention']}")
    if r["residual_streams"] > 1:
        t.add_row("residual", f"{r['residual_streams']} streams (mHC)")
    t.add_row(f"cache ({r['cache_dtype']})", f"{r['cache_bytes_per_token']:,} B per token (growing); "
                                           f"{r['state_bytes_per_sequence']:,} B constant per sequence")
    t.add_row(f"at context {r['context']:,}", f"{human_bytes(r['cache_bytes_at_context'] + r['state_bytes_per_sequence'])}"
                                            f" of cache per sequence; weights {human_bytes(r['weight_bytes'])} "
                                            f"({r['weight_dtype']})")
    t.add_row("FLOPs per token", f"decode at context {r['context']:,}: {_si(r['decode_flops_per_token'], 'FLOP')}; "
                                 f"prefill of {r['context']:,}: {_si(r['prefill_flops_per_token'], 'FLOP')}")
    t.add_row(f"decode, batch {r['batch']}", f"{human_bytes(r['decode_bytes_per_step'])} moved per step; "
                                             f"arithmetic intensity {r['decode_arithmetic_intensity']:.2f} FLOP/B")
    if "device" in r:
        d = r["device"]
        t.add_row(f"on {d['name']}", f"ridge point {d['ridge_point']:.0f} FLOP/B -> decode is {d['decode_bound']}-bound; "
                                     f">= {d['decode_step_seconds_at_roofline'] * 1e3:.2f} ms per step")
        t.add_row("memory plan", f"batch {r['batch']} x context {r['context']:,}: needs {human_bytes(d['memory_needed'])} "
                                 f"of {human_bytes(d['memory'])} -> {'fits' if d['fits'] else 'does NOT fit'}")
    console.print(t)
    k = Table(title="per layer kind", title_justify="left")
    for col in ("kind", "layers", "params/layer", "active/layer", "cache B/token/layer", "state B/seq/layer"):
        k.add_column(col, justify="right" if col != "kind" else "left")
    for kind in r["kinds"]:
        k.add_row(kind["name"], str(kind["layers"]), f"{kind['params_per_layer']:,}", f"{kind['active_per_layer']:,}",
                  f"{kind['cache_bytes_per_token']:,.1f}", f"{kind['state_bytes_per_sequence']:,}")
    console.print(k)


def plot_cache(specs, path: str, max_context: int = 131072, dtype: str = "bfloat16") -> None:
    """Cache memory of one sequence against context length, one line per config."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from compiler.errors import ZooError

        raise ZooError("plot= needs matplotlib: pip install -e .[plot]") from None
    import numpy as np

    from compiler.analysis import cache_curve

    contexts = np.unique(np.geomspace(128, max_context, 24).astype(int))
    fig, ax = plt.subplots(figsize=(8, 5))
    for spec in specs:
        ax.plot(contexts, np.array(cache_curve(spec, contexts, dtype)) / 2**30, marker="o", ms=3, label=spec.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"cache per sequence (GiB, {dtype})")
    ax.set_title("KV / latent / state cache vs context")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- zoo diff

_IGNORED = ("runtime", "checkpoint", "name", "layout")
FIGURES = ("params_total", "params_active", "cache_bytes_per_token", "state_bytes_per_sequence",
           "weight_bytes", "decode_flops_per_token", "prefill_flops_per_token")


def _flatten(node, prefix: str = "") -> dict:
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(node, list):
        out[prefix[:-1]] = node
    else:
        out[prefix[:-1]] = node
    return out


def config_diff(a, b, ra: dict, rb: dict) -> dict:
    """What differs between two resolved configs (layout as runs), and their figures."""
    from omegaconf import OmegaConf

    fa = {k: v for k, v in _flatten(OmegaConf.to_container(a, resolve=True)).items() if k.split(".")[0] not in _IGNORED}
    fb = {k: v for k, v in _flatten(OmegaConf.to_container(b, resolve=True)).items() if k.split(".")[0] not in _IGNORED}
    missing = object()
    changed = [{"key": k, "a": fa.get(k), "b": fb.get(k), "only": "a" if k not in fb else "b" if k not in fa else None}
               for k in sorted(set(fa) | set(fb)) if fa.get(k, missing) != fb.get(k, missing)]
    layout_a = ", ".join(f"{k} x{n}" for k, n in ra["layout"])
    layout_b = ", ".join(f"{k} x{n}" for k, n in rb["layout"])
    figures = [{"figure": f, "a": ra[f], "b": rb[f], "ratio": (rb[f] / ra[f]) if ra[f] else None} for f in FIGURES]
    return {"changed": changed, "layout": {"a": layout_a, "b": layout_b, "same": layout_a == layout_b},
            "figures": figures}


def print_diff(label_a: str, label_b: str, diff: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"zoo diff: {label_a}  vs  {label_b}", title_justify="left")
    t.add_column("key", style="bold cyan")
    t.add_column("A")
    t.add_column("B")
    if not diff["layout"]["same"]:
        t.add_row("layers", diff["layout"]["a"], diff["layout"]["b"])
    for row in diff["changed"]:
        t.add_row(row["key"], "-" if row["only"] == "b" else str(row["a"]), "-" if row["only"] == "a" else str(row["b"]))
    if not diff["changed"] and diff["layout"]["same"]:
        t.add_row("(no architectural difference)", "", "")
    console.print(t)
    f = Table(title="derived figures", title_justify="left")
    for col in ("figure", "A", "B", "B / A"):
        f.add_column(col, justify="left" if col == "figure" else "right")
    for row in diff["figures"]:
        f.add_row(row["figure"], f"{row['a']:,}", f"{row['b']:,}", "-" if row["ratio"] is None else f"{row['ratio']:.3f}x")
    console.print(f)


# ----------------------------------------------------------------------------- zoo check

def print_check(source: str, label: str, plan, data_problems: list[str], console: Console | None = None) -> None:
    console = console or Console(soft_wrap=True)  # one line per finding, never wrapped
    mapped = len({s.name for a in plan.assignments for s in a.node.stored()})
    console.print(f"[bold]zoo check[/bold] {source} against {label} (headers only, no tensor data read)")
    console.print(f"  {plan.n_stored} stored tensors: {mapped} mapped to {len({a.param for a in plan.assignments})} "
                  f"parameters, {len(plan.ignored)} ignored by rule; the load will read "
                  f"{human_bytes(plan.bytes_to_read)}")
    for name, why in plan.ignored[:20]:
        console.print(f"  ignored  {name}: {why}")
    for kind in ("unexpected", "missing", "mismatched", "invalid"):
        for line in plan.problems.get(kind, []):
            console.print(f"  [red]{kind}[/red]  {line}", highlight=False)
    for line in data_problems:
        console.print(f"  [red]data[/red]  {line}", highlight=False)
    console.print("  [green]OK[/green]: every tensor accounted for, every parameter filled once"
                  if plan.ok and not data_problems else "  [red]does not fit[/red]")
