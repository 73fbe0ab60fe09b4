"""The memory a build may hold: what the device has free for new allocations, or a limit the
settings give. The build's fit stage (compiler/build.py) compares the bytes a model will hold,
counted from the checkpoint's headers, with it before anything is allocated.

    CPU    MemAvailable (/proc/meminfo, what psutil's `available` reads), capped by the room left
           under the process's cgroup limit (cgroup v2 memory.max, v1 memory.limit_in_bytes):
           in a container MemAvailable is the host's, the limit is what the kernel enforces
    CUDA   torch.cuda.mem_get_info's free bytes
    limit  runtime.memory_limit, else $ZOO_MEMORY_LIMIT (bytes), replaces what was measured
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .errors import ConfigError

ENV = "ZOO_MEMORY_LIMIT"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # where the figure came from, named in a refusal (e.g. "MemAvailable in /proc/meminfo")


def parse_limit(value, where: str) -> int:
    """A memory limit in bytes (an int, or a string of digits): positive, else ConfigError naming
    `where` and the value."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"{where}={value!r}: expected a positive number of bytes (e.g. 8589934592 for 8 GiB)")
    return int(text)


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_room(root: Path = CGROUP_ROOT) -> Optional[Budget]:
    """The bytes left under the cgroup's memory limit at `root` (v2 memory.max, else v1's
    memory/memory.limit_in_bytes), or None without a limit. Usage counts the page cache; its
    inactive part is reclaimed before the limit is hit, so it is not taken as used (the working
    set, as container runtimes count it)."""
    for limit_file, usage_file, stat_file, inactive in (
            (root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file"),
            (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes",
             root / "memory" / "memory.stat", "total_inactive_file")):
        limit = _read_int(limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue
        used = max(0, (_read_int(usage_file) or 0) - _stat(stat_file, inactive))
        return Budget(max(0, limit - used), f"the cgroup limit {limit_file} ({limit / 2**30:.2f} GiB) less "
                                            f"{used / 2**30:.2f} GiB in use")
    return None


def host_available(cgroup: Path = CGROUP_ROOT) -> Budget:
    """The CPU's memory free for new allocations: MemAvailable, capped by the room under the
    cgroup mounted at `cgroup`."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = Budget(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
                    break
    except OSError:
        pass
    if found is None:
        found = Budget(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the free physical pages")
    room = cgroup_room(cgroup)
    return room if room is not None and room.bytes < found.bytes else found


def available_memory(device: torch.device) -> Budget:
    """Bytes free for new allocations on `device`, and where the figure came from."""
    if device.type == "cuda":
        return Budget(torch.cuda.mem_get_info(device)[0], f"{device}'s free memory")
    if device.type == "meta":
        return Budget(1 << 62, "meta (holds nothing)")
    return host_available()


def memory_budget(device: torch.device, limit: Optional[int] = None) -> Budget:
    """What a build on `device` may hold: runtime.memory_limit (`limit`) when set, else
    $ZOO_MEMORY_LIMIT when set, else what the device has available."""
    if limit is not None:
        return Budget(parse_limit(limit, "runtime.memory_limit"), "runtime.memory_limit")
    if os.environ.get(ENV):
        return Budget(parse_limit(os.environ[ENV], f"${ENV}"), f"${ENV}")
    return available_memory(device)
