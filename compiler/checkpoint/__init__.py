"""Checkpoint mapping as data: sources (safetensors, GGUF, Hub), rules (conf/rules/*.yaml), loader."""
