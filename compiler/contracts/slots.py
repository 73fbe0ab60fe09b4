"""The slots: what each kind of module must (abstract) or may (a default here) provide.

A kind is a class registered under a slot (registry.py) with a dataclass `Spec` (a `KindSpec`)
that validates its config node. `register` checks the class against its slot's contract below,
so a kind that lacks a hook fails when its file is imported, naming the hook, not later as a
wrong count. Shape letters are the glossary's (glossary.py).

    slot      contract    built as                       entry points
    mixer     Mixer       cls(spec, ctx: BuildContext)   prefill(x, cache, ctx), decode(x, cache, ctx),
                                                         extend(x, cache, ctx)
    ffn       FFN         cls(spec, ctx: BuildContext)   prefill(x, ctx), decode(x, ctx)
    norm      Norm        cls(spec, dim)                 forward(x)
    rope      Rope        cls(spec)                      table(rot_dim, max_seq, device)
    residual  Residual    static methods on the class    connection(spec, ctx), model_streams(spec, ctx)

ctx is the step context (context.py); a mixer's cache is declared by CacheField (cache.py).
Mixers and FFNs may also declare how they split over the ranks of a tensor/expert-parallel run
(`shard(plan)`, see compiler/parallel/plan.py, with contracts.span); a kind without it refuses
runtime.parallel.
"""
from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from .cache import CacheField


class KindSpec:
    """Base of every kind's dataclass `Spec` (its config node; a `kind` field names the kind).

    resolve(model) -> Spec fills derived dims (returns a new spec), check(model) -> a problem to
    report or None; `model` holds dim, vocab_size, n_layers, max_position, and for mixers and
    ffns also the resolved norm and rope specs, the rope slot names and the names in `mixers`
    (`mixer_names`). Defaults: nothing to derive, nothing to report."""

    def resolve(self, model: dict) -> "KindSpec":
        return self

    def check(self, model: dict) -> Optional[str]:
        return None


class Mixer(nn.Module, ABC):
    """Mixes information across positions: attention, MLA, DSA, DeltaNet, ...

    ctx (prefill, decode, extend): the step context (contracts.StepContext: ids, rope, in decode
    pos, in extend start, and in decode and extend the entries the engine's mixers asked for
    through `decode_context`). The cache is this layer's dict of tensors allocated from
    `cache_fields`.

    Three entry points: `prefill` starts sequences at position 0 (caches zeroed: the fast path
    of a new prompt), `decode` appends one token per row, `extend` appends L tokens to rows that
    already hold some (chunked prefill, prefix reuse, speculative verification).
    """

    Spec: type
    kind: str
    rope_slot: str = "rope"  # which rope schedule the mixer reads: `rope` or a name in `ropes`

    @abstractmethod
    def rope_dims(self) -> list[int]:
        """Rotary widths R the mixer needs cos/sin tables for ([] for none)."""

    @abstractmethod
    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        """The layer's cache: name -> CacheField (shape batch first, at max_batch x max_seq)."""

    @abstractmethod
    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions 0..L-1 -> [B, L, D]; fills the cache for those positions."""

    @abstractmethod
    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] at positions ctx["pos"] [B] -> [B, 1, D]; updates one position per row."""

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] at positions start..start+L-1 of each row (ctx["start"] [B] long: the rows'
        caches hold positions 0..start-1; ctx["rope"] rows [B, L, R/2] gathered at those
        positions) -> [B, L, D]; appends the L positions to the cache.

        Default: L decode steps, one position at a time (exact wherever decode is; a kind with a
        parallel form over the L tokens overrides it)."""
        start, outs = ctx["start"], []
        for i in range(x.shape[1]):
            step = {**ctx, "ids": ctx["ids"][:, i:i + 1], "pos": start + i,
                    "rope": {key: (cos[:, i], sin[:, i]) for key, (cos, sin) in ctx["rope"].items()}}
            step.pop("start")
            outs.append(self.decode(x[:, i:i + 1], cache, step))
        return torch.cat(outs, dim=1)

    @abstractmethod
    def attention_flops(self, context):
        """Context-dependent FLOPs of one decoded token at `context` (T) cached tokens (an int or
        a numpy array of ints); 0 for a mixer whose work does not grow with context."""

    def prefill_attention_flops(self, context):
        """The same for a prompt token that sees `context` tokens, under the prefill algorithm
        (default: the decode count; MLA prefills in the expanded form, DSA gathers)."""
        return self.attention_flops(context)

    def decode_cache_bytes(self, context: int, dtype: torch.dtype) -> int:
        """Cache bytes one decode step reads per sequence at `context` tokens (default: all of
        the fields at that length; DSA reads only its top-k latents)."""
        return sum(f.nbytes for f in self.cache_fields(1, context, dtype).values())

    def decode_context(self, device: torch.device) -> dict:
        """Decode-context entries fixed for an engine's life, made once by the engine outside the
        graphs (whether a native kernel of the kind built on `device`, say): name -> a plain
        value, merged over every layer into each decode step's ctx (two layers may not give one
        name different values). Default: none."""
        return {}

    def shard(self, plan) -> bool:
        """Keep this rank's part for tensor/expert parallelism (compiler/parallel/plan.py): shrink
        the kind's own counts, declare each split parameter with plan.param / column / row, and
        return True when the output is then a partial sum over the ranks (one all-reduce follows).
        Default: the kind has no sharding plan, which is an error when one is asked for."""
        return no_sharding_plan(self, plan)


def extends_by_decode(mixer: Mixer) -> bool:
    """Whether a mixer's extend is the contract's default, one decode step per token (a loop
    over L: a compiled graph of it would specialise on L, so the compiled runner runs it eagerly),
    itself or through a part it delegates to (a mixer whose attribute `steps_extend` is true)."""
    return type(mixer).extend is Mixer.extend or bool(getattr(mixer, "steps_extend", False))


class FFN(nn.Module, ABC):
    """Per-position feed-forward: dense SwiGLU, mixture of experts.

    ctx: as the mixer's ("ids" for hash routing). x [B, L, D] -> [B, L, D] in both entry points.
    """

    Spec: type
    kind: str

    @abstractmethod
    def prefill(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """x [B, L, D] -> [B, L, D]."""

    @abstractmethod
    def decode(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]."""

    def routed_parameters(self) -> int:
        """Parameters of the routed experts, of which a decode step reads only a share (0: dense)."""
        return 0

    def decode_weight_fraction(self, batch: int) -> float:
        """Share of `routed_parameters` a decode step of `batch` tokens reads (1.0: dense)."""
        return 1.0

    def shard(self, plan) -> bool:
        """As Mixer.shard (dense: columns of the hidden width; MoE: experts)."""
        return no_sharding_plan(self, plan)


class Norm(nn.Module, ABC):
    """Built as cls(spec, dim); x [..., D] -> [..., D] in x's dtype."""

    Spec: type
    kind: str

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The identity transform's weights (a random build starts from them)."""


class Rope(ABC):
    """A rotary schedule, built as cls(spec)."""

    Spec: type
    kind: str

    @abstractmethod
    def table(self, rot_dim: int, max_seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [S, R/2] float32, for positions 0..S-1."""

    @abstractmethod
    def softmax_scale_factor(self) -> float:
        """Factor on the attention softmax scale (YaRN's mscale^2; 1.0 otherwise)."""


class Residual(ABC):
    """A residual scheme: per-block connections and the model-level stream adapter.

    connection(spec, ctx) -> module with enter(h) -> (x, aux) (h [B, L, ...D] -> the sub-layer
    input x [B, L, D]) and exit(h, y, aux) -> h (folds the sub-layer output y back).
    model_streams(spec, ctx) -> module with expand(h [B, L, D]) -> [B, L, ...D] and
    collapse([B, L, ...D]) -> [B, L, D] (the final norm's input).
    """

    Spec: type
    kind: str

    @staticmethod
    @abstractmethod
    def connection(spec, ctx) -> nn.Module: ...

    @staticmethod
    @abstractmethod
    def model_streams(spec, ctx) -> nn.Module: ...

    @staticmethod
    @abstractmethod
    def n_streams(spec) -> int:
        """Residual streams N (1 for a plain residual)."""

    @staticmethod
    def parallel(spec) -> Optional[str]:
        """None: the FFN reads the state after the mixer's residual (sequential). "shared_norm" /
        "two_norms": mixer and FFN both read the block's input, through one norm or each its own,
        and their outputs are summed into one residual update (GPT-J, GPT-NeoX, Falcon)."""
        return None


def no_sharding_plan(module, plan) -> bool:
    """The default `shard` hook: a kind without a sharding plan refuses tp / ep, naming itself."""
    layer = "" if plan.layer is None else f" (layers.{plan.layer})"
    raise ConfigError(f"{plan.source}: {plan.where}{layer}: kind {module.kind!r} declares no sharding plan (its shard() "
                      f"hook), so it cannot run with runtime.parallel tp={plan.mesh.tp} ep={plan.mesh.ep}")


CONTRACTS: dict[str, type] = {"mixer": Mixer, "ffn": FFN, "norm": Norm, "rope": Rope, "residual": Residual}


def contract_problems(slot: str, cls: type, kind: Optional[str] = None) -> list[str]:
    """What `cls` lacks to be a `slot` kind (registered as `kind`, when given): [] when it meets
    the contract. Checked: the contract class, every abstract method implemented, every method of
    the contract (and of an optional protocol: `zoo patterns`'s probes) the class overrides
    callable as the engine calls it, and a dataclass `Spec` subclassing KindSpec whose `kind`
    field defaults to the registered name (what a config node omitting `kind:` would build)."""
    base = CONTRACTS[slot]
    problems = []
    if not issubclass(cls, base):
        problems.append(f"is not a subclass of zoo.compiler.contracts.{base.__name__}")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))  # reflection: a class outside ABC has none
    if missing:
        problems.append(f"does not implement {missing}")
    problems += _signature_problems(base, cls)
    spec = cls.__dict__.get("Spec") or next((c.__dict__["Spec"] for c in cls.__mro__ if "Spec" in c.__dict__), None)
    if spec is None or not dataclasses.is_dataclass(spec):
        problems.append("has no dataclass `Spec`")
    elif "kind" not in {f.name for f in dataclasses.fields(spec)}:
        problems.append("its Spec has no `kind` field")
    elif not issubclass(spec, KindSpec):
        problems.append("its Spec does not subclass zoo.compiler.contracts.KindSpec")
    elif kind is not None:
        default = next(f.default for f in dataclasses.fields(spec) if f.name == "kind")
        if default != kind:
            shown = "no default" if default is dataclasses.MISSING else f"the default {default!r}"
            problems.append(f"its Spec's `kind` field has {shown}; expected {kind!r}, the name it registers under")
    return problems


def _signature_problems(base: type, cls: type) -> list[str]:
    """Methods of the contract (and of the optional protocols) that `cls` defines so that the
    caller's arguments do not bind: a wrong arity fails at registration, not at the first step."""
    from .probes import AttentionProbe, MixerStatistics, StreamMixing

    wanted: dict[str, tuple] = {}  # name -> (the contract's function, called on the class)
    for owner in (base, AttentionProbe, MixerStatistics, StreamMixing):
        for name, member in vars(owner).items():
            fn = member.__func__ if isinstance(member, staticmethod) else member
            if not name.startswith("_") and inspect.isfunction(fn):
                wanted.setdefault(name, (fn, isinstance(member, staticmethod)))
    problems = []
    for name, (fn, static) in sorted(wanted.items()):
        own = inspect.getattr_static(cls, name, None)
        if own is None or own is vars(base).get(name):
            continue  # an optional protocol the class does not take, or the contract's own default
        raw = own.__func__ if isinstance(own, (staticmethod, classmethod)) else own
        if not callable(raw):
            problems.append(f"sets {name} = {own!r} where the contract has a method")
            continue
        params = list(inspect.signature(fn).parameters.values())[0 if static else 1:]
        args = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        kwargs = {p.name: p.name for p in params if p.kind is p.KEYWORD_ONLY}
        # as the caller reaches it: on the class (a residual's static hooks) or on an instance
        on_class = static or isinstance(own, (staticmethod, classmethod))
        target, lead = (getattr(cls, name), ()) if on_class else (raw, ("self",))
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue  # no signature to read (a builtin): nothing to check
        try:
            signature.bind(*lead, *args, **kwargs)
        except TypeError:
            call = f"{name}({', '.join(args + [f'{k}=...' for k in kwargs])})"
            problems.append(f"defines {name}{signature}, which cannot be called as the contract calls it: "
                            f"{'the class' if static else 'an instance'}.{call}")
    return problems
