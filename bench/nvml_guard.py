"""What the NVML deadline costs: a device cycle through GpuGuard vs the same calls inline.

Setup: 8 simulated GPUs, 8 processes each, the default counters file; the device collector
alternates between the real guard (edge_agent/nvml/guard.py: one worker thread per cycle,
each GPU waited for at most the deadline) and an inline stand-in that calls the same
functions on the collecting thread, ROUNDS times CYCLES cycles each, in one process, so
both see the same machine. Prints CPU per cycle (process time, all threads) and the ratio.

Run: .venv/bin/python bench/nvml_guard.py [--rounds 30] [--cycles 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent.nvml.guard import GpuGuard
from gpurelay.model import SampleSink
from harness.pipeline import make_pipeline


class Inline:
    """The guard's interface without a thread or a deadline (what the cycle cost before)."""

    def each(self, items: Sequence[tuple[str, Callable[[], Any]]], timeout: float) -> list[Any]:
        out: list[Any] = []
        for _key, fn in items:
            try:
                out.append(fn())
            except Exception as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as tmp:
        pipeline, _sim, clock = make_pipeline(Path(tmp), gpus=8, processes_per_gpu=8)
        device = pipeline.collection._device
        guard = GpuGuard()
        times: dict[str, list[float]] = {"guard": [], "inline": []}
        for _ in range(args.rounds):
            for name, g in (("guard", guard), ("inline", Inline())):
                device.guard = g  # type: ignore[assignment]
                for _ in range(args.cycles):
                    clock.advance(1)
                    start = time.process_time()
                    device.collect(SampleSink())
                    times[name].append(time.process_time() - start)
        guard.close()
        pipeline.close()
    print(f"python {sys.version.split()[0]}, 8 simulated GPUs x 8 processes")
    for name, values in times.items():
        print(f"device cycle via {name:<7} median {statistics.median(values) * 1000:7.3f} ms CPU")
    ratio = statistics.median(times["guard"]) / statistics.median(times["inline"])
    print(f"guard / inline: {ratio:.3f}x")


if __name__ == "__main__":
    main()
