"""Jetson memory: the GPU has no framebuffer of its own; it shares the board's RAM.

What the agent publishes for it (docs/jetson.md says so to users):

- **total**: ``MemTotal`` of ``/proc/meminfo``, the RAM the GPU can allocate from;
- **used by the GPU**: ``NvMapMemUsed`` (kB), the memory nvmap, the Tegra allocator that
  CUDA and the multimedia engines allocate through, holds now; NVIDIA's CUDA for Tegra
  application note names this field for "device memory in use", or the ``total`` of
  nvmap's clients (below) where the kernel has no such line (as jetson_stats does);
- **free**: ``MemAvailable``.

Per process: nvmap's debugfs (``/sys/kernel/debug/nvmap/iovmm/clients``, root only)
lists each client as ``<client> <process> <pid> <size>K`` with a ``total`` line last. A
kernel client has pid 0. Without debugfs (not mounted, or the agent not root) there is
no per-process GPU memory on a Jetson: :func:`read_nvmap_clients` says so, and the
process series leave memory out rather than guess it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import Missing, read_text

_MEMINFO = re.compile(r"^(\w+):\s+(\d+)\s*kB$")
_CLIENT = re.compile(r"^(\S+)\s+(\S+)\s+(\d+)\s+(\d+)K$")


@dataclass(frozen=True, slots=True)
class SharedMemory:
    total_bytes: int | None
    available_bytes: int | None
    gpu_bytes: int | None  # nvmap's, None where the kernel has no NvMapMemUsed
    missing: tuple[Missing, ...] = field(default=())


def read_memory(proc_root: Path) -> SharedMemory:
    path = proc_root / "meminfo"
    text = read_text(path, first_line=False)
    if isinstance(text, Missing):
        return SharedMemory(None, None, None, (text,))
    fields = {}
    for line in text.splitlines():
        m = _MEMINFO.match(line.strip())
        if m:
            fields[m.group(1)] = int(m.group(2)) * 1024
    missing = [
        Missing(path, f"no {name} line")
        for name in ("MemTotal", "MemAvailable", "NvMapMemUsed")
        if name not in fields
    ]
    return SharedMemory(
        fields.get("MemTotal"),
        fields.get("MemAvailable"),
        fields.get("NvMapMemUsed"),
        tuple(missing),
    )


def read_nvmap_total(sys_root: Path) -> int | Missing:
    """The ``total`` line of nvmap's clients (bytes): the GPU's memory in use where the
    kernel has no ``NvMapMemUsed`` (NVIDIA's CUDA for Tegra note names both)."""
    path = _clients(sys_root)
    text = read_text(path, first_line=False)
    if isinstance(text, Missing):
        return text
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == "total":
            if words[1].endswith("K") and words[1][:-1].isdigit():
                return int(words[1][:-1]) * 1024
            return Missing(path, f"a total line that is not <n>K: {line.strip()[:40]!r}")
    return Missing(path, "no total line")


def _clients(sys_root: Path) -> Path:
    return sys_root / "kernel" / "debug" / "nvmap" / "iovmm" / "clients"


def read_nvmap_clients(sys_root: Path) -> dict[int, int] | Missing:
    """pid -> bytes of nvmap memory it holds (its clients summed), or why not known."""
    text = read_text(_clients(sys_root), first_line=False)
    if isinstance(text, Missing):
        return text
    out: dict[int, int] = {}
    for line in text.splitlines():
        m = _CLIENT.match(line.strip())
        if m is None or m.group(1) == "total":
            continue
        pid = int(m.group(3))
        if pid:
            out[pid] = out.get(pid, 0) + int(m.group(4)) * 1024
    return out
