"""What a build may hold (compiler/memory.py): the cgroup's room read from its files (v2 and v1,
the reclaimable page cache not counted as used), MemAvailable capped by it, and the limit's
setting and variable ahead of both. The fit check that uses it: tests/test_gguf_kept_default.py."""
from __future__ import annotations

import pytest
import torch

from zoo.compiler.errors import ConfigError
from zoo.compiler.memory import cgroup_room, host_available, memory_budget

GiB = 2**30


def _files(root, **files):
    for name, text in files.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_room_is_the_limit_less_the_working_set(tmp_path):
    root = _files(tmp_path, **{"memory.max": f"{4 * GiB}\n", "memory.current": f"{3 * GiB}\n",
                               "memory.stat": f"anon 1024\ninactive_file {GiB}\nactive_file 5\n"})
    room = cgroup_room(root)
    assert room.bytes == 2 * GiB and str(root / "memory.max") in room.source and "4.00 GiB" in room.source


def test_cgroup_v1_room_and_no_limit(tmp_path):
    v1 = _files(tmp_path / "v1", **{"memory__memory.limit_in_bytes": str(2 * GiB),
                                    "memory__memory.usage_in_bytes": str(GiB // 2),
                                    "memory__memory.stat": "total_inactive_file 0\n"})
    assert cgroup_room(v1).bytes == 2 * GiB - GiB // 2
    assert cgroup_room(_files(tmp_path / "v2max", **{"memory.max": "max\n"})) is None
    assert cgroup_room(_files(tmp_path / "v1max", **{"memory__memory.limit_in_bytes": "9223372036854771712"})) is None
    assert cgroup_room(tmp_path / "absent") is None


def test_host_memory_is_capped_by_the_cgroup(tmp_path):
    free = host_available(tmp_path / "absent")
    assert free.source == "MemAvailable in /proc/meminfo" and free.bytes > 0
    tight = _files(tmp_path / "tight", **{"memory.max": str(GiB // 4), "memory.current": "0"})
    assert host_available(tight).bytes == GiB // 4 and "memory.max" in host_available(tight).source
    roomy = _files(tmp_path / "roomy", **{"memory.max": str(1 << 55), "memory.current": "0"})
    assert host_available(roomy).source == free.source


def test_the_setting_then_the_variable(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "12345")
    assert (memory_budget(cpu).bytes, memory_budget(cpu).source) == (12345, "$ZOO_MEMORY_LIMIT")
    assert (memory_budget(cpu, 777).bytes, memory_budget(cpu, 777).source) == (777, "runtime.memory_limit")
    for bad in ("-5", "1.5e9", "8GiB", "0"):
        monkeypatch.setenv("ZOO_MEMORY_LIMIT", bad)
        with pytest.raises(ConfigError, match=rf"\$ZOO_MEMORY_LIMIT='{bad}': expected a positive number of bytes"):
            memory_budget(cpu)
    monkeypatch.delenv("ZOO_MEMORY_LIMIT")
    assert memory_budget(cpu).source == host_available().source  # unset: the machine's
