"""The import-map expression language: values and conditions over config.json keys.

An import map (conf/hf/*.yaml) may compute a zoo value or test a condition instead of copying
one key. The text is parsed with Python's `ast` and only the nodes below are evaluated; nothing
is ever handed to `eval`, and no attribute, subscript or call outside this list exists:

    names        config.json keys; dotted names reach into sub-dicts (rope_parameters.factor);
                 `null` / `true` / `false` (YAML's spelling) and None / True / False are literals;
                 a layout `when:` test also sees `layer` (the 0-based layer index)
    literals     numbers, strings, lists of literals
    indexing     `key[i]` with an integer literal i (negative from the end): one item of a list
    arithmetic   + - * / // %  and unary -   (`/` is true division: 64 / 128 == 0.5)
    comparisons  == != < <= > >= in, not in; `is None` / `is not None` (only against None)
    logic        and, or, not; `a if cond else b`
    defaults     `key ?? v`: v when config.json lacks key or gives null
                 `default(key, v)`: v when config.json lacks key (an explicit null stays null)
                 `has(key)`: whether config.json has key (null included)
    functions    min, max, abs, len, int, float, round, sqrt; common(m, 'k') (the one value of k
                 the sub-mappings of m share), inner_keys(m) (the keys they use, sorted)

A key config.json lacks is an error naming it (unless read through ??, default or has): the
config class's default is a choice the import map states, never one the language guesses.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError

MAX_LENGTH = 400  # longer text is a program, not an import-map value
LITERAL_NAMES = {"null": None, "None": None, "true": True, "True": True, "false": False, "False": False}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
def _common(mapping: Any, name: str) -> Any:
    """The one value of `name` every entry of a mapping of mappings gives (Gemma 4's
    per_layer_config: {layer: {head_dim: ...}}); entries that lack it or disagree are an error."""
    if not isinstance(mapping, Mapping) or not mapping or not all(isinstance(v, Mapping) for v in mapping.values()):
        raise ValueError(f"common(..., {name!r}) expects a non-empty mapping of mappings, got {mapping!r}")
    values = {repr(v.get(name, "<absent>")): v.get(name) for v in mapping.values()}
    if len(values) != 1 or any(name not in v for v in mapping.values()):
        raise ValueError(f"common(..., {name!r}): its entries give {sorted(values)}; expected one value in all")
    return next(iter(values.values()))


def _inner_keys(mapping: Any) -> list:
    """The sorted keys the entries of a mapping of mappings use (to require which ones it holds)."""
    if not isinstance(mapping, Mapping) or not all(isinstance(v, Mapping) for v in mapping.values()):
        raise ValueError(f"inner_keys(...) expects a mapping of mappings, got {mapping!r}")
    return sorted({k for v in mapping.values() for k in v})


_FUNCTIONS = {"min": min, "max": max, "abs": abs, "len": len, "int": int, "float": float, "round": round,
              "sqrt": math.sqrt,  # sqrt: MiniCPM3's residual scale_depth / sqrt(num_hidden_layers)
              "common": _common, "inner_keys": _inner_keys}  # Gemma 4's per_layer_config
_KEY_FUNCTIONS = ("default", "has")  # their first argument is a key, read without requiring it
ALLOWED = ("config keys, numbers, strings, lists, key[i], + - * / // %, comparisons, and/or/not, "
           "`x if c else y`, `is None`, `key ?? v`, default(key, v), has(key), "
           f"{', '.join(_FUNCTIONS)}")


class Missing(Exception):
    """config.json lacks `key` (raised while evaluating; the caller names the entry)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


ABSENT = object()  # a key config.json does not have (None is a present null)


def lookup(config: Mapping, dotted: str) -> Any:
    """config.json's value at a dotted key, or ABSENT."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ABSENT
        node = node[part]
    return node


def _replace_coalesce(source: str) -> str:
    """`??` -> `|` outside string literals (`|` has the precedence we want: looser than
    arithmetic, tighter than comparisons); a `|` the author wrote is refused by the caller."""
    out, quote, i = [], None, 0
    while i < len(source):
        c = source[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif source.startswith("??", i):
            out.append("|")
            i += 2
            continue
        elif c == "|":
            out.append("$")  # not valid Python: reported as the `|` the author wrote
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` -> "a.b.c" for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


@dataclass(frozen=True)
class Expr:
    """One parsed expression. `keys`: the config.json keys (dotted) it may read."""

    source: str
    entry: str  # where it is written: "fields.mixers.attn.rotary_fraction"
    file: str
    tree: ast.Expression = field(repr=False, compare=False)
    keys: frozenset = frozenset()

    @property
    def roots(self) -> set[str]:
        """Top-level config.json keys it may read (for the import map's key coverage)."""
        return {k.split(".")[0] for k in self.keys}

    @property
    def bare_key(self) -> str | None:
        """The key when the expression is one (dotted) key and nothing else."""
        key = _dotted(self.tree.body)
        return key if key is not None and key.split(".")[0] not in LITERAL_NAMES else None

    def evaluate(self, config: Mapping, where: str, local: Mapping[str, Any] | None = None) -> Any:
        """The value over config.json. A key config.json lacks (outside ??, default, has), a
        value of the wrong type (None < 3, x / 0) is a ConfigError naming the entry, the file,
        the expression and the values of the keys it read."""
        try:
            return _Evaluator(config, local or {}).run(self.tree.body)
        except Missing as e:
            raise ConfigError(f"{where}: config.json lacks required key {e.key!r} (read by {self.entry} = "
                              f"{self.source!r} in {self.file}; `{e.key} ?? VALUE` or "
                              f"`default({e.key}, VALUE)` states the value an absent key means)") from None
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(f"{where}: {self.entry} = {self.source!r} in {self.file} cannot be computed for "
                              f"this config.json: {e} (with {self.describe(config, local)})") from None

    def describe(self, config: Mapping, local: Mapping[str, Any] | None = None) -> str:
        """`key=value` for every key the expression reads ("key absent" for those config.json lacks)."""
        parts = []
        for key in sorted(self.keys):
            if local and key in local:
                parts.append(f"{key}={local[key]!r}")
                continue
            value = lookup(config, key)
            parts.append(f"{key} absent" if value is ABSENT else f"{key}={_short(value)}")
        return ", ".join(parts) or "no config.json keys"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse(source: Any, file: str, entry: str, local: tuple[str, ...] = ()) -> Expr:
    """Parse `source` (a string, or a number / bool / null taken as a literal) into an Expr.
    Anything outside the language is a ConfigError naming the file, the entry and the text.
    `local`: names bound by the caller (a layout test's `layer`), which are not config keys."""
    if source is None or isinstance(source, (bool, int, float)):
        source = repr(source)
    if not isinstance(source, str):
        raise ConfigError(f"{file}: {entry}: expected an expression (a string), got {source!r}")
    where = f"{file}: {entry} = {source!r}"
    if len(source) > MAX_LENGTH:
        raise ConfigError(f"{where}: longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(_replace_coalesce(source.strip()), mode="eval")
    except SyntaxError as e:
        hint = " (`|` is not an operator here: `or` for conditions, `??` for defaults)" if "|" in source else ""
        raise ConfigError(f"{where}: not an expression: {e.msg}{hint}") from None
    keys: set[str] = set()
    _check(tree.body, where, keys, set(local))
    return Expr(source, entry, file, tree, frozenset(keys))


def _check(node: ast.AST, where: str, keys: set[str], local: set[str]) -> None:
    """Refuse every node outside the language; collect the config keys read."""
    def refuse(what: str):
        raise ConfigError(f"{where}: {what} is not part of the import-map language (it has: {ALLOWED})")

    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, bool, type(None))):
            refuse(f"the literal {node.value!r}")
        return
    if isinstance(node, (ast.Name, ast.Attribute)):
        key = _dotted(node)
        if key is None:
            refuse("an attribute of a computed value")
        if key not in LITERAL_NAMES and key not in local:
            keys.add(key)
        return
    if isinstance(node, (ast.List, ast.Tuple)):
        for elt in node.elts:
            _check(elt, where, keys, local)
        return
    if isinstance(node, ast.Subscript):
        i = node.slice
        if isinstance(i, ast.UnaryOp) and isinstance(i.op, ast.USub):
            i = i.operand
        if not (isinstance(i, ast.Constant) and type(i.value) is int):
            refuse(f"`{ast.unparse(node)}`: an index other than an integer literal")
        _check(node.value, where, keys, local)
        return
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.BitOr):  # `??`
            if not (isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.BitOr)) \
                    and _dotted(node.left) is None:
                refuse("`??` after something other than a config key")
        elif type(node.op) not in _BINARY:
            refuse(f"the operator {type(node.op).__name__}")
        _check(node.left, where, keys, local)
        _check(node.right, where, keys, local)
        return
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            refuse(f"the operator {type(node.op).__name__}")
        _check(node.operand, where, keys, local)
        return
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            _check(value, where, keys, local)
        return
    if isinstance(node, ast.Compare):
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)):
                if not (isinstance(right, ast.Constant) and right.value is None) \
                        and not (isinstance(right, ast.Name) and right.id in ("null", "None")):
                    refuse("`is` against something other than None (use ==)")
            elif type(op) not in _COMPARE:
                refuse(f"the comparison {type(op).__name__}")
        for sub in [node.left, *node.comparators]:
            _check(sub, where, keys, local)
        return
    if isinstance(node, ast.IfExp):
        for sub in (node.test, node.body, node.orelse):
            _check(sub, where, keys, local)
        return
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in _FUNCTIONS and name not in _KEY_FUNCTIONS:
            refuse(f"the call {ast.unparse(node.func)}(...)")
        if node.keywords:
            refuse(f"keyword arguments to {name}")
        if name in _KEY_FUNCTIONS:
            want = 2 if name == "default" else 1
            if len(node.args) != want or _dotted(node.args[0]) is None:
                refuse(f"{name}(...) without {'a config key and a value' if want == 2 else 'one config key'}")
        for arg in node.args:
            _check(arg, where, keys, local)
        return
    refuse(f"`{ast.unparse(node)}` ({type(node).__name__})")


def _coalesced(node: ast.AST) -> list[ast.AST]:
    """The operands of a chain `a ?? b ?? c` (parsed as `(a | b) | c`), in order."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _coalesced(node.left) + [node.right]
    return [node]


class _Evaluator:
    def __init__(self, config: Mapping, local: Mapping[str, Any]):
        self.config, self.local = config, local

    def key(self, node: ast.AST) -> Any:
        """The value of a key node, or ABSENT (literal and local names are never absent)."""
        name = _dotted(node)
        if name in LITERAL_NAMES:
            return LITERAL_NAMES[name]
        if name in self.local:
            return self.local[name]
        return lookup(self.config, name)

    def run(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            value = self.key(node)
            if value is ABSENT:
                raise Missing(_dotted(node))
            return value
        if isinstance(node, ast.List):
            return [self.run(e) for e in node.elts]
        if isinstance(node, ast.Subscript):
            value, i = self.run(node.value), ast.literal_eval(node.slice)
            if not isinstance(value, (list, tuple)) or not -len(value) <= i < len(value):
                raise TypeError(f"index [{i}] of {_short(value)} (expected a list with an item there)")
            return value[i]
        if isinstance(node, ast.Tuple):
            return tuple(self.run(e) for e in node.elts)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.BitOr):  # a ?? b ?? v: the first present, non-null key, else v
                *keys, last = _coalesced(node)
                for sub in keys:
                    value = self.key(sub) if _dotted(sub) is not None else self.run(sub)
                    if value is not ABSENT and value is not None:
                        return value
                return self.run(last)
            left, right = self.run(node.left), self.run(node.right)
            for value in (left, right):  # numbers only: "x" * 10**9 is not an import-map value
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(f"arithmetic on {_short(value)} (a {type(value).__name__}, not a number)")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            value = self.run(node.operand)
            if isinstance(node.op, ast.Not):
                return not value
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"arithmetic on {_short(value)} (a {type(value).__name__}, not a number)")
            return -value if isinstance(node.op, ast.USub) else +value
        if isinstance(node, ast.BoolOp):
            value = None
            for sub in node.values:  # Python's short circuit: `has(x) and x > 3` reads x only if present
                value = self.run(sub)
                if isinstance(node.op, ast.And) != bool(value):
                    return value
            return value
        if isinstance(node, ast.Compare):
            left = self.run(node.left)
            for op, sub in zip(node.ops, node.comparators):
                right = self.run(sub)
                if isinstance(op, (ast.Is, ast.IsNot)):
                    ok = (left is None) == isinstance(op, ast.Is)
                else:
                    ok = _COMPARE[type(op)](left, right)
                if not ok:
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self.run(node.body) if self.run(node.test) else self.run(node.orelse)
        if isinstance(node, ast.Call):
            name = node.func.id
            if name == "has":
                return self.key(node.args[0]) is not ABSENT
            if name == "default":
                value = self.key(node.args[0])
                return self.run(node.args[1]) if value is ABSENT else value
            return _FUNCTIONS[name](*(self.run(a) for a in node.args))
        raise AssertionError(f"unchecked node {type(node).__name__}")  # _check refused it


def parse_range(source: Any, file: str, entry: str) -> tuple[Expr, Expr]:
    """`START..END` (inclusive, each an expression) -> the two parsed ends."""
    parts = re.split(r"(?<!\.)\.\.(?!\.)", source) if isinstance(source, str) else []
    if len(parts) != 2 or "..." in source:
        raise ConfigError(f"{file}: {entry} = {source!r}: expected an inclusive layer range `START..END` "
                          f"(each an expression, e.g. `first_k_dense_replace..num_hidden_layers - 1`)")
    start, end = parts
    return parse(start, file, f"{entry} (start)"), parse(end, file, f"{entry} (end)")


__all__ = ["Expr", "parse", "parse_range", "lookup", "Missing"]
