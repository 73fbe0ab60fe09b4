"""The compiler's floors, read from its own imports (every import statement, in functions and
under TYPE_CHECKING too): no import circle between files, and no import from a lower floor up
(docs/architecture.md, "Floors"). Pure ast: nothing of zoo is imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILER = ROOT / "compiler"

# the bottom floor: imports nothing of the compiler but these
BOTTOM = {"errors", "glossary", "resolvers", "cache_root", "conf_root"}
# parts that import only the bottom (and what is listed here)
ONLY = {
    "contracts": set(),  # the types everything shares import nothing else of zoo's
    "registry": {"contracts", "plugins"},
    "plugins": set(),  # where plugin modules are named: the user conf dir (bottom) and entry points
    "native": set(),
    "import_expr": set(),
    "memory": set(),  # what a build may hold: the machine's memory, read before anything is built
}
# what each part may not import (besides the bottom, any part not named may be imported)
MAY_NOT = {
    "mixers": {"engine", "parallel", "quant", "checkpoint", "build", "model", "analysis", "mtp", "hf_import"},
    "ffn": {"engine", "parallel", "quant", "checkpoint", "build", "model", "analysis", "mtp", "hf_import"},
    "norm": {"engine", "parallel", "quant", "checkpoint", "build", "model", "analysis", "mtp", "hf_import"},
    "position": {"engine", "parallel", "quant", "checkpoint", "build", "model", "analysis", "mtp", "hf_import"},
    "residual": {"engine", "parallel", "quant", "checkpoint", "build", "model", "analysis", "mtp", "hf_import"},
    "parallel": {"quant", "checkpoint", "engine", "build", "analysis", "mixers", "ffn"},
    "quant": {"checkpoint", "parallel", "engine", "build", "analysis", "mixers", "ffn"},
    "checkpoint": {"parallel", "engine", "build", "analysis", "mixers", "ffn"},
    "model": {"engine", "build", "analysis", "checkpoint", "parallel", "quant"},
    "engine": {"mixers", "ffn", "norm", "residual", "build", "analysis", "checkpoint", "parallel", "quant"},
}


def _part(module: str) -> str:
    """compiler.a.b -> a (the folder or file a module belongs to)."""
    return module.split(".")[1] if "." in module else module


def _imports() -> dict[str, set[str]]:
    """compiler module (dotted, from compiler.) -> compiler modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in COMPILER.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rsplit(".", 1)[0]
        out = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:  # `from . import x` may name a module
                    sub = f"{target}.{alias.name}"
                    known = (COMPILER.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (COMPILER.parent / sub.replace(".", "/")).is_dir()
                    out.add(sub if known else target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                out |= {m.removeprefix("zoo.") for m in mods if m.startswith("zoo.compiler")}
    return {k: {m for m in v if m != k and m.startswith("compiler")} for k, v in graph.items()}


def _resolve(graph: dict[str, set[str]], module: str) -> str:
    """A module name as a file of the graph (a package's __init__ stands for it)."""
    while module not in graph and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def test_no_import_circle_between_files():
    graph = {k: {_resolve(graph_, m) for m in v} for graph_ in [_imports()] for k, v in graph_.items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_import_runs_up_a_floor():
    bad = []
    for module, targets in sorted(_imports().items()):
        part = _part(module)
        for t in sorted(targets):
            other = _part(t)
            if other == part or other in BOTTOM or other == "compiler":
                continue
            if (part in ONLY and other not in ONLY[part]) or other in MAY_NOT.get(part, set()):
                bad.append(f"{module} imports {t}")
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)
