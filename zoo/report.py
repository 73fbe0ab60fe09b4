"""The build report (read from compiler/build.py's BuildReport and stage records: layout, exact
parameter count, cache bytes, memory, runner, compile and load times), `zoo report`, `zoo diff`
and `zoo check`."""
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
        ("weights", f"{human_bytes(info.param_bytes)} in {rt.dtype}"
                    + (f", linears {info.quant.summary()}" if info.quant else "")
                    + (f"; {info.float32_products} linears multiply many-token rows in float32 (this CPU has "
                       f"no native bfloat16 GEMM)" if info.float32_products else "")),
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
                     + f"  (runner {model.engine.runner}; graphs: {model.engine.graph_counts()})"))
    else:
        rows.append(("compile", "off (eager)"))
    rows.append(("runner", _RUNNER_TEXT[info.runner]))
    if info.load is not None:
        rows.append(("weights loaded", f"{info.load.tensors_read} tensors, {human_bytes(info.load.bytes_read)} "
                                       f"in {info.load.seconds:.2f} s"))
        if info.load.cache:  # compiler/checkpoint/weight_cache.py
            rows.append(("  weight cache", info.load.cache))
        for outcome, text in held_rows(info.load.held):
            rows.append(("  " + outcome, text))
        for what, names in _by_outcome(info.load.tensors).items():
            rows.append(("  " + what, f"{len(names)} tensor{'s' if len(names) > 1 else ''}: {_names(names)}"))
        for name, why in info.load.ignored[:10]:
            rows.append(("  skipped", f"{name}: {why}"))
        if len(info.load.ignored) > 10:
            rows.append(("  skipped", f"... {len(info.load.ignored) - 10} more"))
    if info.quant is not None:
        for pattern, why in _by_pattern(info.quant.kept_float).items():
            rows.append(("  float", f"{pattern}: {why}"))
    if shapes:
        rows.append(("shape check", f"prefill logits {list(shapes['prefill'])}, decode logits "
                                    f"{list(shapes['decode']) if shapes['decode'] else '-'}"))
    return rows


_RUNNER_TEXT = {  # compiler/build.py RUNNERS
    "eager": "eager (plain PyTorch)",
    "compiled": "compiled regions (torch.compile)",
    "aot": "AOTInductor packages (torch's C++ runner)",
    "cuda_graph": "decode replayed as a CUDA graph",
}


_HELD = {"kept": "kept as stored", "quantized": "quantized at load", "float": "float as stored",
         "dequantized": "dequantized"}  # LoadReport.held's outcomes, in this order


def held_rows(held: dict) -> list[tuple[str, str]]:
    """LoadReport.held as report rows: per outcome, each stored type's tensors and stored bytes
    ("kept as stored", "Q4_K 154 tensors (60.12 MiB), Q6_K 31 tensors (21.40 MiB)")."""
    rows = []
    for outcome, label in _HELD.items():
        types = held.get(outcome)
        if types:
            rows.append((label, ", ".join(f"{t} {n} tensor{'s' if n != 1 else ''} ({human_bytes(b)})"
                                          for t, (n, b) in sorted(types.items()))))
    return rows


def load_line(model) -> str | None:
    """One line on what the model holds of its checkpoint (`zoo generate` / `zoo serve` print it
    on stderr): "weights: kept as stored: Q4_1 210 tensors (...); float as stored: F32 ...", or
    None for random weights."""
    load = model.info.load
    if load is None or not load.held:
        return None
    return "weights: " + "; ".join(f"{what}: {text}" for what, text in held_rows(load.held))


def _by_outcome(tensors: dict[str, str]) -> dict[str, list[str]]:
    """Per-tensor load outcomes grouped: "kept Q4_1 blocks as int4 g32" -> [names]."""
    out: dict[str, list[str]] = {}
    for name, what in tensors.items():
        out.setdefault(what, []).append(name)
    return out


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def _by_pattern(kept: dict[str, str]) -> dict[str, str]:
    """Parameter paths with layer indices folded ("layers.{i}.ffn_norm.weight") -> why."""
    import re

    out: dict[str, str] = {}
    for name, why in kept.items():
        out.setdefault(re.sub(r"\.\d+\.", ".{i}.", name), why)
    return out


def _mtp_row(model) -> str:
    from .compiler.model import count_parameters

    n = len(model.spec.mtp_layers)
    what = f"{n} multi-token-prediction layer{'s' if n > 1 else ''}"
    if not model.records.cast.mtp:
        return f"{what} in the checkpoint, not built (checkpoint.mtp=false)"
    return f"{what}, {count_parameters(model.module.mtp):,} of the parameters"


def _residual_row(model) -> str:
    from .compiler.model import count_parameters
    from .compiler.residual.prenorm import residual_kind

    spec = model.spec.residual
    streams = residual_kind(spec).n_streams(spec)
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


def _kinds_text(r: dict) -> str:
    """Slot names -> kinds, e.g. "attn=mla, dense=swiglu, moe=moe" (slot names are the config's own)."""
    seen: dict[str, str] = {}
    for k in r["kinds"]:
        mixer, ffn = k["name"].split("+")
        seen.setdefault(mixer, k["mixer"])
        seen.setdefault(ffn, k["ffn"])
    return ", ".join(f"{name}={kind}" for name, kind in seen.items())


def _parallel_rows(t: Table, r: dict) -> None:
    """The per-rank rows of `zoo report ... tp=N ep=M` (analysis.parallel_plan)."""
    p = r["parallel"]
    t.add_row(f"per rank (tp={p['tp']} ep={p['ep']})",
              f"{p['ranks']} ranks: weights {human_bytes(p['weight_bytes_per_rank'])} ({p['params_per_rank']:,} "
              f"parameters); cache {p['cache_bytes_per_token_per_rank']:,} B per token, "
              f"{p['state_bytes_per_sequence_per_rank']:,} B state per sequence; head {p['head']}")
    if "max_batch_at_context" in p:
        t.add_row("", f"one {r['device']['name']} per rank: at most {p['max_batch_at_context']:,} sequences of "
                      f"{r['context']:,} tokens, or batch {r['batch']} up to {p['max_context_at_batch']:,} tokens "
                      f"({'fits' if p['fits_per_rank'] else 'does NOT fit'} at batch {r['batch']} x {r['context']:,})")
        need = ", ".join(f"{w} {n if n is not None else '> 1024'}" for w, n in p["devices_needed"].items())
        t.add_row("devices needed", f"{need} (tp = ep = N, powers of two, batch {r['batch']} x context "
                                    f"{r['context']:,} of cache)")


def print_analysis(r: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"zoo report: {r['name']}  ({r['source']})", show_header=False, title_justify="left")
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    t.add_row("layers", f"{r['n_layers']}: {_layout_text([tuple(x) for x in r['layout']])}  ({_kinds_text(r)})")
    t.add_row("parameters", f"{r['params_total']:,} total ({_si(r['params_total'])}); {r['params_active']:,} "
                            f"active per token ({_si(r['params_active'])})")
    t.add_row("", f"active: {r['params_active_convention']}; decoder blocks alone "
                  f"{_si(r['params_active_layers'])}, embedding {_si(r['params_embedding'])}, head "
                  f"{_si(r['params_head'])}")
    if r["params_mtp"]:
        t.add_row("mtp", f"{r['params_mtp']:,} more in the multi-token-prediction layers (not counted above)")
    if r["residual_streams"] > 1:
        t.add_row("residual", f"{r['residual_streams']} streams (mHC)")
    t.add_row(f"cache ({r['cache_dtype']})", f"{r['cache_bytes_per_token']:,} B per token (growing); "
                                           f"{r['state_bytes_per_sequence']:,} B constant per sequence")
    t.add_row(f"at context {r['context']:,}", f"{human_bytes(r['cache_bytes_at_context'] + r['state_bytes_per_sequence'])}"
                                            f" of cache per sequence; weights {human_bytes(r['weight_bytes'])} "
                                            f"({r['weight_dtype']})")
    t.add_row("FLOPs per token", f"decode at context {r['context']:,}: {_si(r['decode_flops_per_token'], 'FLOP')}; "
                                 f"prefill of {r['context']:,}: {_si(r['prefill_flops_per_token'], 'FLOP')}")
    t.add_row("", f"FLOPs: {r['flops_convention']}")
    t.add_row(f"decode, batch {r['batch']}", f"{human_bytes(r['decode_bytes_per_step'])} moved per step "
                                             f"({human_bytes(r['decode_cache_bytes_read_per_sequence'])} of cache "
                                             f"per sequence); arithmetic intensity "
                                             f"{r['decode_arithmetic_intensity']:.2f} FLOP/B")
    if "device" in r:
        d = r["device"]
        t.add_row(f"on {d['name']}", f"ridge point {d['ridge_point']:.0f} FLOP/B -> decode is {d['decode_bound']}-bound; "
                                     f">= {d['decode_step_seconds_at_roofline'] * 1e3:.2f} ms per step")
        fit = "fits" if d["fits"] else "does NOT fit"
        if r["weight_bytes"] > d["memory"]:
            most = f" (the weights alone need {human_bytes(r['weight_bytes'])})"
        elif d["max_batch_at_context"] is None:
            most = ""
        else:
            most = f"; at most {d['max_batch_at_context']:,} sequences of {r['context']:,} tokens"
        t.add_row("memory plan", f"batch {r['batch']} x context {r['context']:,}: needs {human_bytes(d['memory_needed'])} "
                                 f"of {human_bytes(d['memory'])} -> {fit}{most}")
    if "parallel" in r:
        _parallel_rows(t, r)
    console.print(t)
    k = Table(title="per layer kind", title_justify="left")
    for col in ("kind", "layers", "params/layer", "active/layer", "cache B/token/layer", "state B/seq/layer",
                f"decode FLOP/token/layer @{r['context']:,}"):
        k.add_column(col, justify="right" if col != "kind" else "left")
    for kind in r["kinds"]:
        k.add_row(f"{kind['name']} ({kind['mixer']}+{kind['ffn']})", str(kind["layers"]),
                  f"{kind['params_per_layer']:,}", f"{kind['active_per_layer']:,}",
                  f"{kind['cache_bytes_per_token']:,.1f}", f"{kind['state_bytes_per_sequence']:,}",
                  _si(kind["decode_flops_per_layer"], "FLOP"))
    console.print(k)
    c = Table(title="cache fields (all layers)", title_justify="left")
    for col in ("field", "mixer", "layers", "dtype", "B/token", "state B/seq"):
        c.add_column(col, justify="left" if col in ("field", "mixer", "dtype") else "right")
    for f in r["cache_fields"]:
        c.add_row(f["field"], f["mixer"], str(f["layers"]), f["dtype"], f"{f['bytes_per_token']:,}",
                  f"{f['state_bytes_per_sequence']:,}")
    console.print(c)


def _bytes_axis(ax) -> None:
    """Log-scale y ticks as KiB / MiB / GiB."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.yaxis.set_major_locator(LogLocator(base=2, numticks=30))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".00", "")))
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    if len(ticks) > 10:  # every power of 2 is too many: keep every 2nd or 4th
        step = -(-len(ticks) // 8)
        ax.set_yticks(ticks[::step])


def plot_cache(specs, path: str, max_context: int = 131072, dtype: str = "bfloat16", reports=None) -> None:
    """Cache memory of one sequence (growing fields + constant state) against context length,
    one line per config, log-log: slope 1 is a cache that grows per token, a flat part a constant
    state. reports: the specs' `analyze` results at `dtype`, when the caller has them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .compiler.errors import ZooError

        raise ZooError("plot= needs matplotlib: pip install -e .[plot]") from None
    import numpy as np

    from .compiler.analysis import analyze, cache_curve

    contexts = np.unique(np.geomspace(128, max(max_context, 256), 40).astype(int))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ends: list[tuple[float, str]] = []
    for i, spec in enumerate(specs):
        r = reports[i] if reports else analyze(spec, context=128, cache_dtype=dtype, weight_dtype=dtype)
        kinds = sorted({k["mixer"] for k in r["kinds"]})
        label = (f"{spec.name} [{'+'.join(kinds)}]: {r['cache_bytes_per_token']:,} B/token"
                 + (f" + {human_bytes(r['state_bytes_per_sequence'])} state" if r["state_bytes_per_sequence"] else ""))
        curve = np.array(cache_curve(spec, contexts, dtype), dtype=float)
        line, = ax.plot(contexts, curve, lw=2, label=label)
        ends.append((curve[-1], line.get_color()))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlim(contexts[0], contexts[-1] * 1.9)
    ax.autoscale_view()
    # end labels, pushed apart (>= 10 points) where lines end close together
    placed: list[float] = []
    for value, color in sorted(ends, reverse=True):
        y = ax.transData.transform((contexts[-1], value))[1] * 72 / fig.dpi
        shift = min(0.0, placed[-1] - 10 - y) if placed else 0.0
        placed.append(y + shift)
        ax.annotate(human_bytes(value), (contexts[-1], value), xytext=(4, shift), textcoords="offset points",
                    va="center", fontsize=8, color=color)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    _bytes_axis(ax)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"cache per sequence ({dtype})")
    ax.set_title("KV / latent / state cache of one sequence vs context (log-log)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- zoo diff

_IGNORED = ("runtime", "checkpoint", "name", "layout")
FIGURES = ("params_total", "params_active", "params_active_layers", "params_mtp", "cache_bytes_per_token",
           "state_bytes_per_sequence", "cache_bytes_at_context", "weight_bytes", "decode_flops_per_token",
           "prefill_flops_per_token", "decode_bytes_per_step", "decode_arithmetic_intensity")


def resolved_tree(spec, rope_slots: list[str]) -> dict:
    """A spec as nested plain data: the config's top-level keys with every `kind:` node (norm,
    rope, residual, mixers.*, ffns.*, ropes.*) replaced by its resolved Spec (derived dims filled
    in, defaults explicit). Only what the model is built from: mixers, ffns and rope slots no
    layer uses are left out (rope_slots: the slots the built layers read, analysis's
    `rope_slots`), and the mtp node when there are no MTP layers."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(spec.config, resolve=True)
    tree.update(norm=asdict(spec.norm), rope=asdict(spec.rope), residual=asdict(spec.residual))
    layers = (*spec.layers, *spec.mtp_layers)
    mixers, ffns = {x.mixer_name for x in layers}, {x.ffn_name for x in layers}
    tree["mixers"] = {k: asdict(v) for k, v in spec.mixers.items() if k in mixers}
    tree["ffns"] = {k: asdict(v) for k, v in spec.ffns.items() if k in ffns}
    tree["ropes"] = {k: asdict(v) for k, v in spec.ropes.items() if k in rope_slots}
    if not tree["ropes"]:
        del tree["ropes"]
    if not spec.mtp_layers:
        tree.pop("mtp", None)
    return tree


def _summary(value) -> str:
    """A value or a whole node on one line: kind(key=value, ...)."""
    if isinstance(value, dict):
        items = ", ".join(f"{k}={_summary(v)}" for k, v in value.items() if k != "kind" and v is not None)
        return f"{value['kind']}({items})" if "kind" in value else "{" + items + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_summary(v) for v in value) + "]"
    return str(value)


def _compare(a: dict, b: dict, path: str, rows: list) -> None:
    """Rows for what differs under two nodes: a node present on one side only is one row; a kind
    node whose kind changed is its kind, the keys both kinds have that differ, and the keys only
    one kind has as one row per side; other nodes recurse down to the differing leaves."""
    for key in sorted(set(a) | set(b)):
        p = f"{path}.{key}" if path else key
        if not path and key in _IGNORED:
            continue
        if key not in b or key not in a:
            rows.append({"key": p, "a": a.get(key), "b": b.get(key), "only": "a" if key not in b else "b"})
            continue
        va, vb = a[key], b[key]
        if isinstance(va, dict) and isinstance(vb, dict):
            if "kind" in va and "kind" in vb and va["kind"] != vb["kind"]:
                rows.append({"key": f"{p}.kind", "a": va["kind"], "b": vb["kind"], "only": None})
                for k in sorted((set(va) & set(vb)) - {"kind"}):
                    if va[k] != vb[k]:
                        rows.append({"key": f"{p}.{k}", "a": va[k], "b": vb[k], "only": None})
                for side, mine, other in (("a", va, vb), ("b", vb, va)):
                    extra = {k: v for k, v in mine.items() if k not in other}
                    if extra:
                        rows.append({"key": f"{p} ({mine['kind']} only)", "a": extra if side == "a" else None,
                                     "b": extra if side == "b" else None, "only": side})
            else:
                _compare(va, vb, p, rows)
        elif va != vb:
            rows.append({"key": p, "a": va, "b": vb, "only": None})


def config_diff(a, b, ra: dict, rb: dict) -> dict:
    """What differs between two resolved specs (structure-aware, layout as runs of layer kinds),
    and their derived figures (analysis dicts ra, rb) side by side with ratios B / A."""
    rows: list[dict] = []
    _compare(resolved_tree(a, ra["rope_slots"]), resolved_tree(b, rb["rope_slots"]), "", rows)
    runs_a, runs_b = a.layout_runs(), b.layout_runs()
    figures = [{"figure": f, "a": ra[f], "b": rb[f], "ratio": (rb[f] / ra[f]) if ra[f] else None} for f in FIGURES]
    return {"changed": rows,
            "context": ra["context"],
            "layout": {"a": _layout_text(runs_a), "b": _layout_text(runs_b), "same": runs_a == runs_b,
                       "kinds_a": _kinds_text(ra), "kinds_b": _kinds_text(rb),
                       "runs_a": [list(r) for r in runs_a], "runs_b": [list(r) for r in runs_b]},
            "figures": figures}


def _figure(v) -> str:
    return f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"


def print_diff(label_a: str, label_b: str, diff: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"[bold]zoo diff[/bold]  A = {label_a}   B = {label_b}", highlight=False)
    t = Table(title="what differs (resolved configs)", title_justify="left")
    t.add_column("key", style="bold cyan")
    t.add_column("A")
    t.add_column("B")
    if not diff["layout"]["same"]:
        t.add_row("layers", f"{diff['layout']['a']}  ({diff['layout']['kinds_a']})",
                  f"{diff['layout']['b']}  ({diff['layout']['kinds_b']})")
    for row in diff["changed"]:
        t.add_row(row["key"], "-" if row["only"] == "b" else _summary(row["a"]),
                  "-" if row["only"] == "a" else _summary(row["b"]))
    if not diff["changed"] and diff["layout"]["same"]:
        t.add_row("(no architectural difference)", "", "")
    console.print(t)
    f = Table(title=f"derived figures (context {diff['context']:,})", title_justify="left")
    for col in ("figure", "A", "B", "B / A"):
        f.add_column(col, justify="left" if col == "figure" else "right")
    for row in diff["figures"]:
        f.add_row(row["figure"], _figure(row["a"]), _figure(row["b"]),
                  "-" if row["ratio"] is None else f"{row['ratio']:.3f}x")
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
