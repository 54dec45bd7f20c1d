"""Run the gateway with a memory report on SIGUSR2, for bench/fleet.py ``--tracemalloc FILE``.

``python bench/traced_gateway.py FILE cloud_gateway run --config ...``: starts tracemalloc
(one frame per allocation; ``FILE`` ending in ``.stats``: without tracemalloc, so the
process is as fast as the plain one), then runs the module as ``python -m`` would. On
SIGUSR2 it writes to FILE:

- RSS, and what Python's own allocator holds (``sys._debugmallocstats``: arenas, pools and
  the bytes in use in them), so what the objects use can be told from what the allocators
  keep;
- RSS again after ``malloc_trim(0)`` (glibc gives back the free pages of its heaps): how
  much of the RSS was memory glibc had freed but kept;
- with tracemalloc, the biggest live allocations by source line.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import runpy
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType

TOP = 60


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pymalloc_summary() -> list[str]:
    """The summary lines of ``sys._debugmallocstats`` (it writes to the C stderr)."""
    read, write = os.pipe()
    saved = os.dup(2)
    os.dup2(write, 2)
    try:
        sys._debugmallocstats()  # type: ignore[attr-defined]
    finally:
        os.dup2(saved, 2)
        os.close(write)
        os.close(saved)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    keep = ("# arenas", "# bytes in", "Total", "arenas allocated", "arenas reclaimed")
    return [line for line in io.StringIO(text) if any(k in line for k in keep)]


def dump(path: Path) -> None:
    lines = [f"RSS {rss_mib():.1f} MiB"]
    lines += [f"pymalloc: {line.rstrip()}" for line in pymalloc_summary()]
    if tracemalloc.is_tracing():
        traced, peak = tracemalloc.get_traced_memory()
        own = tracemalloc.get_tracemalloc_memory()
        lines.append(
            f"traced {traced / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB), "
            f"tracemalloc's own {own / 2**20:.1f} MiB"
        )
        stats = tracemalloc.take_snapshot().statistics("lineno")
        lines += [
            f"{s.size / 2**20:9.2f} MiB {s.count:9d} blocks  {s.traceback}" for s in stats[:TOP]
        ]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        lines.insert(1, f"RSS after malloc_trim(0) {rss_mib():.1f} MiB")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    out = Path(sys.argv[1])
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    if out.suffix != ".stats":
        tracemalloc.start(1)

    def on_usr2(signum: int, frame: FrameType | None) -> None:
        dump(out)

    signal.signal(signal.SIGUSR2, on_usr2)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
