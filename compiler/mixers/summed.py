"""Mixers side by side in one layer, their outputs summed (Falcon-H1: attention and Mamba2 on
the same normed input).

    x [B, L, D] -> sum over members m of  out_scale_m * m(in_scale_m * x)  -> [B, L, D]

`members` names other entries of the model's `mixers` (each built whole, at
`layers.{i}.mixer.<name>`, so checkpoint rules name `mixer.attn.*`, `mixer.ssm.*`); `in_scales` /
`out_scales` are µP-style multipliers, one per member (default 1). A member is any mixer kind but
another `summed` or `none`.

Cache: every member's fields, each name prefixed `<member>.` (a member sees only its own, under
its own names). Entry points, rope widths, FLOPs, cache bytes and decode-context entries are the
members' (summed or merged); a member whose extend is the decode loop makes this one's that too
(`steps_extend`, read by contracts.extends_by_decode). `zoo patterns`: the attention maps of the one member that has them
(contracts.AttentionProbe) are the layer's. Tensor / expert parallelism: no plan (a clear refusal,
contracts.no_sharding_plan).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..contracts import AttentionProbe, CacheField, KindSpec, Mixer, extends_by_decode
from ..errors import ConfigError
from ..registry import lookup, register


@register("mixer", "summed")
class SummedMixers(Mixer):
    """Members' outputs summed; see the module docstring."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "summed"
        members: List[str] = field(default_factory=list)  # names in the model's `mixers`
        in_scales: Optional[List[float]] = None  # one per member; None: all 1
        out_scales: Optional[List[float]] = None  # one per member; None: all 1

        def resolve(self, model: dict) -> "SummedMixers.Spec":
            n = len(self.members)
            return SummedMixers.Spec(self.kind, list(self.members),
                                     [1.0] * n if self.in_scales is None else list(self.in_scales),
                                     [1.0] * n if self.out_scales is None else list(self.out_scales))

        def check(self, model: dict) -> Optional[str]:
            if len(self.members) < 2 or len(set(self.members)) != len(self.members):
                return f"members={list(self.members)}: expected two or more different names in `mixers`"
            for key in ("in_scales", "out_scales"):
                if len(getattr(self, key)) != len(self.members):
                    return (f"{key}={list(getattr(self, key))}: expected one per member "
                            f"({len(self.members)}: {list(self.members)})")
            names = model.get("mixer_names")
            if names is not None:
                missing = [m for m in self.members if m not in names]
                if missing:
                    return f"members {missing} are not in mixers {sorted(names)}"
            return None

    def __init__(self, spec: "SummedMixers.Spec", model):
        super().__init__()
        self.names = list(spec.members)
        self.in_scales = [float(s) for s in spec.in_scales]
        self.out_scales = [float(s) for s in spec.out_scales]
        for name in self.names:
            member = model.spec.mixers[name]
            if member.kind in ("summed", "none") or hasattr(self, name):
                raise ConfigError(f"{model.spec.source}: mixers.{name}: kind {member.kind!r} cannot be a member of "
                                  f"a summed mixer (expected a mixer kind other than summed / none, named other "
                                  f"than an attribute of the module)")
            self.add_module(name, lookup("mixer", member.kind, f"mixers.{name}")(member, model))
        slots = {m.rope_slot for m in self.members() if m.rope_dims()}
        if len(slots) > 1:
            raise ConfigError(f"{model.spec.source}: summed mixer of {self.names}: the members read different rope "
                              f"slots {sorted(slots)}; expected one")
        self.rope_slot = slots.pop() if slots else "rope"
        probes = [m for m in self.members() if isinstance(m, AttentionProbe)]
        self.probe = probes[0] if len(probes) == 1 else None

    def members(self) -> list[Mixer]:
        return [getattr(self, name) for name in self.names]

    @property
    def steps_extend(self) -> bool:
        """Whether a member's extend is the decode loop (contracts.extends_by_decode): then so is
        this one's, and the compiled runner runs it eagerly."""
        return any(extends_by_decode(m) for m in self.members())

    def rope_dims(self) -> list[int]:
        return sorted({r for m in self.members() for r in m.rope_dims()})

    def cache_fields(self, max_batch: int, max_seq: int, dtype: torch.dtype) -> dict[str, CacheField]:
        return {f"{name}.{key}": f for name, m in zip(self.names, self.members())
                for key, f in m.cache_fields(max_batch, max_seq, dtype).items()}

    def decode_context(self, device: torch.device) -> dict:
        out: dict = {}
        for m in self.members():
            out.update(m.decode_context(device))
        return out

    def attention_flops(self, context):
        return sum(m.attention_flops(context) for m in self.members())

    def prefill_attention_flops(self, context):
        return sum(m.prefill_attention_flops(context) for m in self.members())

    def decode_cache_bytes(self, context: int, dtype: torch.dtype) -> int:
        return sum(m.decode_cache_bytes(context, dtype) for m in self.members())

    def _sum(self, entry: str, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        """x [B, L, D] -> sum of out_scale * member.entry(in_scale * x) [B, L, D]; each member's
        cache is its own fields, under its own names."""
        y = None
        for name, m, a, b in zip(self.names, self.members(), self.in_scales, self.out_scales):
            own = {key[len(name) + 1:]: t for key, t in cache.items() if key.startswith(name + ".")}
            out = getattr(m, entry)(x * a if a != 1.0 else x, own, ctx)
            out = out * b if b != 1.0 else out
            y = out if y is None else y + out
        return y

    def prefill(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        return self._sum("prefill", x, cache, ctx)

    def decode(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        return self._sum("decode", x, cache, ctx)

    def extend(self, x: torch.Tensor, cache: dict, ctx: dict) -> torch.Tensor:
        return self._sum("extend", x, cache, ctx)

    @property
    def n_heads(self) -> int:
        """The attention member's query heads (`zoo patterns` groups its probe by them)."""
        if self.probe is None:
            raise AttributeError("n_heads: this summed mixer has no (single) attention member")
        return self.probe.n_heads

    def attention_probe(self, x: torch.Tensor, ctx: dict, heads: slice = slice(None)):
        """The attention member's maps on its own input (x [B, L, D] times its in_scale)."""
        if self.probe is None:
            raise NotImplementedError(f"summed mixer of {self.names}: no single member with attention weights")
        a = self.in_scales[self.names.index(next(n for n, m in zip(self.names, self.members())
                                                  if m is self.probe))]
        return self.probe.attention_probe(x * a, ctx, heads)
