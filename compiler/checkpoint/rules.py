"""Mapping rules: checkpoint tensor names -> model parameters, as data (conf/rules/NAME.yaml).

A rule file is one stage. Stages apply in order (`checkpoint.rules` in the config): `rename`
stages rewrite some names and pass the rest through (dequantization, format renames such as
llama.cpp's), and the last, a `params` stage, must account for every tensor left.

    stage: params                       # or: rename
    map:
      - from: model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight
        to: layers.{layer}.ffn.w1       # a parameter path (params) or a new name (rename)
        stack: expert                   # fills row {expert} of the parameter
      - from: [a.{layer}.q, a.{layer}.k, a.{layer}.v]
        to: layers.{layer}.mixer.wqkv.weight
        op: cat                         # see ops.py; args: {dim: 0}, order: where each input goes
      - from: blk.{layer}.ssm_conv1d.weight
        to: layers.{layer}.mixer.conv_weight
        op: transpose_blocks            # then: more one-input ops, each on the previous result
        args: {blocks: [3, 2], start: 8}
        then: [{op: unsqueeze, args: {dim: 1}}]
      - from: lm_head.weight
        to: head.weight
        when: ${zoo.not:${cfg.tie_embeddings}}   # interpolations see the model config as `cfg`
    ignore:
      - from: model.layers.{layer}.self_attn.rotary_emb.inv_freq
        why: recomputed from the rope config

A rule file may build on others (`include:`, the same stage kind):

    include: [llama]                    # llama's map and ignore entries, in llama's order
    map:
      - from: model.layers.{layer}.self_attn.q_norm.weight   # a new pattern: added after them
        to: layers.{layer}.mixer.q_norm.weight
      - from: model.norm.weight         # the same first `from` pattern as an included entry:
        to: norm.weight                 #   replaces that entry, where it stood

An entry is identified by its first `from` pattern, as written, within its list (map or ignore).
Includes apply in order and may include others; a pattern given by two includes must be
overridden here, and a pattern twice in one file, an include cycle or an include of another
stage kind are errors. Rule files are found in conf/rules/, then in the user conf dir's rules/.

Placeholders: `{path}` matches any dotted path; every other name matches a decimal index. A name
that repeats in one pattern must take the same value. Rules are tried in file order; the first
rule whose first `from` pattern matches a tensor takes it, together with the other tensors its
`from` list names for the same placeholder values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import conf_files, conf_label, find_conf, user_conf_dir
from ..errors import CheckpointError
from ..resolvers import register_resolvers
from .ops import check_op_args, get_op

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_ANY_PATH = {"path"}


def compile_pattern(pattern: str) -> re.Pattern:
    out, seen, pos = [], set(), 0
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if name in seen:
            out.append(f"(?P={name})")
        else:
            seen.add(name)
            out.append(f"(?P<{name}>.+?)" if name in _ANY_PATH else f"(?P<{name}>0|[1-9][0-9]*)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


def fill(pattern: str, binds: dict[str, str], where: str) -> str:
    def sub(m):
        if m.group(1) not in binds:
            raise CheckpointError(f"{where}: placeholder {{{m.group(1)}}} in {pattern!r} is not bound by "
                                  f"the first 'from' pattern")
        return binds[m.group(1)]
    return _PLACEHOLDER.sub(sub, pattern)


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]
    targets: tuple[str, ...]  # empty for ignore rules
    op: str = "identity"
    args: dict = field(default_factory=dict)
    stack: Optional[str] = None
    then: tuple = ()  # (op, args) applied in turn to the op's result
    why: str = ""
    where: str = ""  # "conf/rules/llama.yaml map[3]" for messages

    @property
    def regex(self) -> re.Pattern:
        return compile_pattern(self.sources[0])


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str  # "rename" | "params"
    rules: tuple[Rule, ...]
    ignores: tuple[Rule, ...]


def load_stage(name: str, cfg: Any) -> Stage:
    """Read the rule file NAME (conf/rules/NAME.yaml, else the user conf dir's rules/NAME.yaml)
    with its includes, resolving `${cfg...}` against the model config."""
    kind, entries = _rule_entries(name, ())
    items = {"map": [e[2] for e in entries["map"]], "ignore": [e[2] for e in entries["ignore"]]}
    try:
        register_resolvers()
        root = OmegaConf.create({"cfg": cfg, "file": items})
        data = OmegaConf.to_container(root.file, resolve=True)
    except OmegaConfBaseException as e:
        raise CheckpointError(f"{_rule_path(name)[1]}: {str(e).splitlines()[0]}") from None
    rules = tuple(r for item, (_, where, _) in zip(data["map"], entries["map"])
                  if (r := _parse_rule(item, where, ignore=False)))
    ignores = tuple(r for item, (_, where, _) in zip(data["ignore"], entries["ignore"])
                    if (r := _parse_rule(item, where, ignore=True)))
    return Stage(name, kind, rules, ignores)


def _rule_path(name: str):
    """(path, label) of the rule file NAME over the conf search path; CheckpointError if absent."""
    path = find_conf("rules", name)
    if path is None:
        raise CheckpointError(f"unknown rule file {name!r} (no conf/rules/{name}.yaml, nor rules/{name}.yaml in "
                              f"the user conf dir {user_conf_dir()}); available: {sorted(conf_files('rules'))}")
    return path, conf_label(path)


def _entry_key(item: Any, where: str) -> str:
    """What an included entry is overridden by: its first `from` pattern, as written."""
    if not isinstance(item, dict) or "from" not in item:
        raise CheckpointError(f"{where}: expected a mapping with 'from', got {item!r}")
    first = item["from"][0] if isinstance(item["from"], list) and item["from"] else item["from"]
    return str(first)


def _rule_entries(name: str, chain: tuple[str, ...]):
    """A rule file's stage kind and its `map` and `ignore` entries (key, where, unresolved item),
    its includes' first. `include: [a, b]` puts a's entries, then b's, then this file's; an entry
    of this file whose first `from` pattern equals an included entry's (in the same list) replaces
    that entry where it stood. Two includes giving the same pattern, a pattern twice in one file,
    include cycles and includes of another stage kind are errors."""
    path, where = _rule_path(name)
    if name in chain:
        raise CheckpointError(f"{where}: include cycle {' -> '.join([*chain, name])}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except OmegaConfBaseException as e:
        raise CheckpointError(f"{where}: {str(e).splitlines()[0]}") from None
    unknown = sorted(set(data) - {"stage", "map", "ignore", "include"})
    if unknown:
        raise CheckpointError(f"{where}: unknown key(s) {unknown}; expected stage, map, ignore, include")
    kind = data.get("stage", "params")
    if kind not in ("rename", "params"):
        raise CheckpointError(f"{where}: stage must be 'rename' or 'params', got {kind!r}")
    includes = data.get("include") or []
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise CheckpointError(f"{where}: include must be a list of rule file names, got {includes!r}")
    included = []
    for inc in includes:
        inc_kind, inc_entries = _rule_entries(inc, (*chain, name))
        if inc_kind != kind:
            raise CheckpointError(f"{where}: includes {inc!r}, a {inc_kind!r} stage, into a {kind!r} stage")
        included.append(inc_entries)
    lists: dict[str, list] = {"map": [], "ignore": []}
    for lst in lists:
        own = {}
        for i, item in enumerate(data.get(lst) or []):
            at = f"{where} {lst}[{i}]"
            key = _entry_key(item, at)
            if key in own:
                raise CheckpointError(f"{at}: 'from' {key!r} is already given by {own[key][1]}")
            own[key] = (key, at, item)
        inherited: dict[str, tuple] = {}
        for inc_entries in included:
            for entry in inc_entries[lst]:
                prev = inherited.get(entry[0])
                if prev is not None and prev[1] != entry[1] and entry[0] not in own:
                    raise CheckpointError(f"{where}: its includes both give 'from' {entry[0]!r} ({prev[1]} and "
                                          f"{entry[1]}); override it in {where} to choose")
                inherited.setdefault(entry[0], entry)
        # included entries in order, each replaced by this file's entry of the same pattern;
        # then this file's other entries
        lists[lst] = [own.get(k, e) for k, e in inherited.items()] + [e for k, e in own.items() if k not in inherited]
    return kind, lists


def _parse_rule(item: Any, where: str, ignore: bool) -> Optional[Rule]:
    allowed = {"from", "why", "when"} if ignore else {"from", "to", "op", "args", "stack", "when", "then"}
    if not isinstance(item, dict) or "from" not in item:
        raise CheckpointError(f"{where}: expected a mapping with 'from', got {item!r}")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise CheckpointError(f"{where}: unknown key(s) {unknown}; expected {sorted(allowed)}")
    when = item.get("when", True)
    if not isinstance(when, bool):
        raise CheckpointError(f"{where}: 'when' must resolve to true/false, got {when!r}")
    if not when:
        return None
    sources = tuple(item["from"]) if isinstance(item["from"], list) else (item["from"],)
    if ignore:
        return Rule(sources=sources, targets=(), why=item.get("why", ""), where=where)
    if "to" not in item:
        raise CheckpointError(f"{where}: a map rule needs 'to'")
    targets = tuple(item["to"]) if isinstance(item["to"], list) else (item["to"],)
    op = item.get("op", "identity")
    args = dict(item.get("args") or {})
    op_ = get_op(op, where)
    check_op_args(op_, {**args, **({"index": 0} if len(targets) > 1 else {})}, where)
    if op_.n_inputs is not None and op_.n_inputs != len(sources):
        raise CheckpointError(f"{where}: op {op!r} takes {op_.n_inputs} input(s), 'from' lists {len(sources)}")
    stack = item.get("stack")
    if stack is not None and f"{{{stack}}}" not in sources[0]:
        raise CheckpointError(f"{where}: stack: {stack!r} but the first 'from' pattern has no {{{stack}}}")
    return Rule(sources=sources, targets=targets, op=op, args=args, stack=stack, then=_parse_then(item, where),
                where=where)


def _parse_then(item: dict, where: str) -> tuple:
    """A rule's `then:` list, [{op, args}], as ((op, args), ...): each a one-input op."""
    then = item.get("then") or []
    if not isinstance(then, list):
        raise CheckpointError(f"{where}: then must be a list of {{op, args}} mappings, got {then!r}")
    out = []
    for i, step in enumerate(then):
        at = f"{where} then[{i}]"
        if not isinstance(step, dict) or "op" not in step or set(step) - {"op", "args"}:
            raise CheckpointError(f"{at}: expected a mapping with 'op' (and 'args'), got {step!r}")
        op_ = get_op(step["op"], at)
        args = dict(step.get("args") or {})
        check_op_args(op_, args, at)
        if op_.n_inputs not in (None, 1):
            raise CheckpointError(f"{at}: op {step['op']!r} takes {op_.n_inputs} inputs; a then step takes "
                                  f"the one result before it")
        out.append((step["op"], args))
    return tuple(out)


def checkpoint_stages(source, spec) -> list[Stage]:
    """Every rule stage a load of `source` into `spec` runs, in order: the format's own renames
    (llama.cpp names in GGUF) first, then the family's `checkpoint.rules`."""
    names = [*source.format_stages(), *spec.checkpoint.rules]
    return [load_stage(name, spec.config) for name in names]
