"""Run the gateway under tracemalloc for bench/fleet.py ``--tracemalloc FILE``.

``python bench/traced_gateway.py FILE cloud_gateway run --config ...``: starts tracemalloc
(one frame per allocation), then runs the module as ``python -m`` would. On SIGUSR2 it
writes the biggest live allocations by source line to FILE (text), with the traced total
beside the process's RSS, so what Python holds can be told from what the allocator keeps.
"""

from __future__ import annotations

import runpy
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType

TOP = 60


def dump(path: Path) -> None:
    snapshot = tracemalloc.take_snapshot()
    stats = snapshot.statistics("lineno")
    traced, peak = tracemalloc.get_traced_memory()
    rss = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    own = tracemalloc.get_tracemalloc_memory()
    lines = [
        f"traced {traced / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB), "
        f"RSS {rss / 1024:.1f} MiB, tracemalloc's own {own / 2**20:.1f} MiB",
    ]
    lines += [f"{s.size / 2**20:9.2f} MiB {s.count:9d} blocks  {s.traceback}" for s in stats[:TOP]]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    out = Path(sys.argv[1])
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    tracemalloc.start(1)

    def on_usr2(signum: int, frame: FrameType | None) -> None:
        dump(out)

    signal.signal(signal.SIGUSR2, on_usr2)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
