"""Imports every concept module so that their kinds are registered (see registry.py)."""
from . import attention, ffn, norm, residual, rope  # noqa: F401
