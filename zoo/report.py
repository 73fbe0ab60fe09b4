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


def build_rows(model, shapes: dict | None = None) -> list[tuple[str, str]]:
    spec, info = model.spec, model.info
    rt = spec.runtime
    layout = ", ".join(f"{kind} x{n}" for kind, n in spec.layout_runs())
    rows = [
        ("config", f"{spec.name}  ({spec.source})"),
        ("layers", f"{spec.n_layers}: {layout}"),
        ("parameters", f"{info.params:,}  ({info.params})"),
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
