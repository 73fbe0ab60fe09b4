"""Rotary position embeddings: frequency schedules (default, proportional, linear, llama3, yarn, longrope) and rotation.

A rope spec gives the inverse frequencies of the rotated channels; the engine turns them into
cos/sin tables [max_seq, R/2] once, and each step hands the rows for the current positions to
every layer. Two channel layouts exist in checkpoints:

    rotate-half  (Llama, HF q/k rows):  pairs are (i, i + R/2)
    interleaved  (DeepSeek MLA rope):   pairs are (2i, 2i + 1)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..contracts import KindSpec, Rope
from ..errors import ConfigError
from ..registry import lookup, register


class _Rope(Rope):
    """Base: a frequency schedule. Subclasses define `inv_freq(rot_dim)` and may scale cos/sin."""

    def __init__(self, spec):
        self.spec = spec

    def inv_freq(self, rot_dim: int) -> torch.Tensor:
        """[R/2] float32 inverse frequencies for a rotation over `rot_dim` channels."""
        return 1.0 / (self.spec.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))

    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (YaRN's attention factor); 1 otherwise."""
        return 1.0

    def softmax_scale_factor(self) -> float:
        """Factor on the attention softmax scale (YaRN mscale^2 in DeepSeek MLA); 1 otherwise."""
        return 1.0

    def table(self, rot_dim: int, max_seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [max_seq, R/2] float32."""
        inv = self.inv_freq(rot_dim).to(device)
        t = torch.arange(max_seq, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        s = self.cos_sin_scale()
        return freqs.cos() * s, freqs.sin() * s


@register("rope", "default")
class DefaultRope(_Rope):
    @dataclass
    class Spec(KindSpec):
        kind: str = "default"
        theta: float = 10000.0


@register("rope", "proportional")
class ProportionalRope(_Rope):
    """Gemma 4's global layers: frequencies theta ** (-2i / R) over the whole width R, the first
    int(fraction * R / 2) of them kept and the rest 0 (those pairs do not rotate). Unlike a
    partial rotary (rotary_fraction), the exponent's denominator is the whole width and the
    rotated pairs are (i, i + R/2) of the whole head."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "proportional"
        theta: float = 10000.0
        fraction: float = 1.0
        factor: float = 1.0  # every frequency divided by it (linear scaling)

        def check(self, model: dict) -> Optional[str]:
            if not 0.0 <= self.fraction <= 1.0:
                return f"fraction must be in [0, 1], got {self.fraction}"
            return None if self.factor > 0 else f"factor must be positive, got {self.factor}"

    def inv_freq(self, rot_dim: int) -> torch.Tensor:
        kept = int(self.spec.fraction * rot_dim // 2)
        inv = 1.0 / (self.spec.theta ** (torch.arange(0, 2 * kept, 2, dtype=torch.int64).float() / rot_dim))
        return torch.cat((inv, torch.zeros(rot_dim // 2 - kept))) / self.spec.factor


@register("rope", "linear")
class LinearRope(_Rope):
    @dataclass
    class Spec(KindSpec):
        kind: str = "linear"
        theta: float = 10000.0
        factor: float = 1.0

    def inv_freq(self, rot_dim: int) -> torch.Tensor:
        return super().inv_freq(rot_dim) / self.spec.factor


@register("rope", "llama3")
class Llama3Rope(_Rope):
    """Llama 3.1 schedule: long wavelengths slowed by `factor`, short kept, smooth in between."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "llama3"
        theta: float = 500000.0
        factor: float = 8.0
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_position: int = 8192

    def inv_freq(self, rot_dim: int) -> torch.Tensor:
        s = self.spec
        inv = super().inv_freq(rot_dim)
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@register("rope", "yarn")
class YarnRope(_Rope):
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between.

    `mscale`/`mscale_all_dim` follow DeepSeek: cos/sin are scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), and MLA multiplies its softmax scale
    by mscale(factor, mscale_all_dim)^2.
    """

    @dataclass
    class Spec(KindSpec):
        kind: str = "yarn"
        theta: float = 10000.0
        factor: float = 1.0
        original_max_position: int = 4096
        beta_fast: float = 32.0
        beta_slow: float = 1.0
        mscale: float = 1.0
        mscale_all_dim: float = 0.0
        attention_factor: Optional[float] = None  # overrides the cos/sin factor when given
        truncate: bool = True

    def inv_freq(self, rot_dim: int) -> torch.Tensor:
        s = self.spec
        pos_freqs = s.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (s.factor * pos_freqs)

        def correction_dim(num_rotations: float) -> float:
            return (rot_dim * math.log(s.original_max_position / (num_rotations * 2 * math.pi))) / (
                2 * math.log(s.theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def cos_sin_scale(self) -> float:
        s = self.spec
        if s.attention_factor is not None:
            return s.attention_factor
        if s.mscale and s.mscale_all_dim:
            return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
        return yarn_mscale(s.factor)

    def softmax_scale_factor(self) -> float:
        s = self.spec
        return yarn_mscale(s.factor, s.mscale_all_dim) ** 2 if s.mscale_all_dim else 1.0


@register("rope", "longrope")
class LongRope(_Rope):
    """LongRoPE (Phi-3 / Phi-3.5 long-context checkpoints): the default frequencies, each channel
    pair's divided by its own factor, one list for contexts up to `original_max_position`
    (`short_factor`) and one beyond (`long_factor`); cos and sin are scaled by `attention_factor`
    (absent: sqrt(1 + ln(factor) / ln(original_max_position)), 1 for factor <= 1).

    Which list: transformers picks per forward call (by the largest position in it), so its
    cached keys mix both lists once a sequence crosses original_max_position. zoo picks once per
    engine, from its context: the long list when max_seq > original_max_position (as vLLM does),
    so decode always equals a prefill of the same tokens, and both equal transformers' forward
    over any sequence on the same side of original_max_position as max_seq. `long: true/false`
    forces a list."""

    @dataclass
    class Spec(KindSpec):
        kind: str = "longrope"
        theta: float = 10000.0
        short_factor: List[float] = field(default_factory=lambda: [1.0])
        long_factor: List[float] = field(default_factory=lambda: [1.0])
        original_max_position: int = 4096
        factor: float = 1.0  # context extension; only sets the default attention_factor
        attention_factor: Optional[float] = None
        long: Optional[bool] = None  # None: long when the engine's max_seq > original_max_position

        def check(self, model: dict) -> Optional[str]:
            if not self.short_factor or not self.long_factor or len(self.short_factor) != len(self.long_factor):
                return (f"short_factor and long_factor need one entry per rotated channel pair, the same "
                        f"number each; got {len(self.short_factor)} and {len(self.long_factor)}")
            if min(self.short_factor + self.long_factor) <= 0 or self.original_max_position <= 0:
                return "factors and original_max_position must be positive"
            return None

    def uses_long(self, max_seq: int) -> bool:
        return self.spec.long if self.spec.long is not None else max_seq > self.spec.original_max_position

    def factors(self, rot_dim: int, max_seq: int) -> torch.Tensor:
        """[R/2] float32: the per-pair divisors for an engine of context max_seq."""
        name = "long_factor" if self.uses_long(max_seq) else "short_factor"
        values = getattr(self.spec, name)
        if len(values) != rot_dim // 2:
            raise ConfigError(f"rope longrope: {name} has {len(values)} entries, but the rotation over {rot_dim} "
                              f"channels has {rot_dim // 2} pairs")
        return torch.tensor(values, dtype=torch.float32)

    def table(self, rot_dim: int, max_seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        # transformers' order of operations: 1 / (factor * theta^(2i/R))
        exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        inv = (1.0 / (self.factors(rot_dim, max_seq) * s.theta ** exponent)).to(device)
        freqs = torch.outer(torch.arange(max_seq, device=device, dtype=torch.int64).float(), inv)
        scale = self.cos_sin_scale()
        return freqs.cos() * scale, freqs.sin() * scale

    def cos_sin_scale(self) -> float:
        s = self.spec
        if s.attention_factor is not None:
            return s.attention_factor
        return 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position))


def make_rope(spec) -> _Rope:
    return lookup("rope", spec.kind, "rope")(spec)


def rope_key(rot_dim: int, slot: str = "rope") -> str:
    """The key under which layers find the cos/sin rows of one (rope slot, rot_dim)."""
    return f"{slot}:{rot_dim}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x (R channels) by angles whose cos/sin broadcast to [..., R/2].

    Computed in float32 and cast back, like the references.
    """
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


__all__ = ["make_rope", "apply_rotary", "rope_key", "yarn_mscale"]
