"""Where zoo keeps what it builds between processes ($ZOO_CACHE_DIR, default ~/.cache/zoo):
compiled graphs (engine/compiling.py), built kernels (native.py), composed configs (config.py).
At the bottom: it imports nothing of zoo's."""
from __future__ import annotations

import os
from pathlib import Path


def zoo_cache_root() -> Path:
    """$ZOO_CACHE_DIR, default ~/.cache/zoo: compiled graphs, built kernels, composed configs."""
    return Path(os.environ.get("ZOO_CACHE_DIR") or Path.home() / ".cache" / "zoo")
