"""Mixer kinds: what mixes information across positions (attention, MLA, DSA, Gated DeltaNet,
sink and compressed attention), one module per kind, plus the KV-cache writers they share.

Importing this package registers every kind in it: a new kind is one new file here.
"""
from ..registry import register_folder

register_folder(__name__, __path__)
