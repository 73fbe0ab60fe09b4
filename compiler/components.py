"""Imports every concept module so that their kinds are registered (see registry.py)."""
from . import attention, ffn, mhc, norm, residual, rope  # noqa: F401
from . import mla, moe  # noqa: F401
from . import dsa  # noqa: F401
from . import gated_deltanet  # noqa: F401
from . import sink_attention  # noqa: F401
from . import compressed_attention  # noqa: F401
