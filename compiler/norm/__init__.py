"""Norm kinds: RMSNorm, LayerNorm.

Importing this package registers every kind in it: a new kind is one new file here.
"""
from ..registry import register_folder

register_folder(__name__, __path__)
