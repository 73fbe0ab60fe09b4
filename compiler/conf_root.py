"""Where the user's own conf files live ($ZOO_CONF_DIR, default ~/.config/zoo/conf): presets,
import maps, rules, GGUF maps (config.py) and the plugins list (plugins.py). At the bottom: it
imports nothing of zoo's, so the registry can find the plugins list without the config layer."""
from __future__ import annotations

import os
from pathlib import Path


def user_conf_dir() -> Path:
    """The user conf dir: $ZOO_CONF_DIR, else ~/.config/zoo/conf. `zoo import` writes presets
    there; it may hold presets (NAME.yaml), import maps (hf/), rule files (rules/), GGUF maps
    (gguf/) and group options (norm/NAME.yaml, ...) of its own, found after the shipped ones (see
    config.conf_files), and plugins.yaml, the modules that register kinds of its own (plugins.py)."""
    return Path(os.environ.get("ZOO_CONF_DIR") or Path.home() / ".config" / "zoo" / "conf")
