"""Wire cost of the telemetry stream: bytes per frame and CPU per batch, both ends.

Setup: 8 simulated GPUs with their processes attributed through a fake host tree (the
same pipeline as the tests), one collection every 10 s of simulated time. Each snapshot
goes through SnapshotEncoder + FrameEncoder (the agent) and FrameDecoder (the gateway).
The collector timer is the real ``perf_counter``, so the agent's own duration series
change every cycle as they do in production.

Target: <= 512 bytes per steady-state batch frame for an 8-GPU node.

Run: .venv/bin/python bench/wire_size.py [--cycles 60] [--gpus 8] [--processes-per-gpu 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_agent.encode import SnapshotEncoder
from gpurelay.model import Snapshot
from gpurelay.wire import Batch, Declare, FrameDecoder, FrameEncoder, Hello
from harness.pipeline import simulated_snapshots

SEED = 7


def collect(gpus: int, processes_per_gpu: int, cycles: int) -> list[Snapshot]:
    return simulated_snapshots(
        gpus=gpus, processes_per_gpu=processes_per_gpu, count=cycles, step=10, seed=SEED
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _line(name: str, values: list[float], unit: str, fmt: str = "6.0f") -> str:
    return (
        f"{name:<36} median {statistics.median(values):{fmt}}  p95 {_pct(values, 0.95):{fmt}}  "
        f"max {max(values):{fmt}} {unit}"
    )


@dataclass
class Figures:
    hello: int = 0
    first_declare: int = 0
    first_batch: int = 0
    batch_bytes: list[float] = field(default_factory=list)
    declare_bytes: list[int] = field(default_factory=list)  # steady-state cycles with new series
    values: list[float] = field(default_factory=list)
    snapshot_ms: list[float] = field(default_factory=list)
    encode_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)


def measure(snapshots: list[Snapshot]) -> Figures:
    fig = Figures()
    snap_enc, frame_enc, frame_dec = SnapshotEncoder(), FrameEncoder(), FrameDecoder()
    first = snapshots[0]
    hello = frame_enc.encode(Hello(agent_version="bench", node=first.node, gpus=first.gpus))
    frame_dec.feed(hello)
    fig.hello = len(hello)
    for i, snap in enumerate(snapshots):
        t0 = time.process_time()
        frames = snap_enc.frames(snap)
        t1 = time.process_time()
        encoded = [frame_enc.encode(f) for f in frames]
        t2 = time.process_time()
        decoded = frame_dec.feed(b"".join(encoded))
        t3 = time.process_time()
        assert [type(f) for f in decoded] == [type(f) for f in frames]
        batch = frames[-1]
        assert isinstance(batch, Batch)
        declare = sum(
            len(b) for f, b in zip(frames, encoded, strict=True) if isinstance(f, Declare)
        )
        if i == 0:
            fig.first_declare, fig.first_batch = declare, len(encoded[-1])
            continue
        if declare:
            fig.declare_bytes.append(declare)
        fig.batch_bytes.append(len(encoded[-1]))
        fig.values.append(len(batch.values))
        fig.snapshot_ms.append((t1 - t0) * 1000)
        fig.encode_ms.append((t2 - t1) * 1000)
        fig.decode_ms.append((t3 - t2) * 1000)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes-per-gpu", type=int, default=4)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    snapshots = collect(args.gpus, args.processes_per_gpu, args.cycles)
    fig = measure(snapshots)
    per_value = [b / v for b, v in zip(fig.batch_bytes, fig.values, strict=True) if v]
    print(
        f"setup: {args.gpus} simulated GPUs, {args.processes_per_gpu} processes per GPU, "
        f"{len(snapshots[0].samples)} series, {args.cycles} cycles 10 s apart"
    )
    print(f"{'HELLO frame':<36} {fig.hello:6d} bytes")
    print(f"{'first DECLARE frame (every series)':<36} {fig.first_declare:6d} bytes")
    print(f"{'first BATCH frame (full)':<36} {fig.first_batch:6d} bytes")
    print(_line("steady-state BATCH frame", fig.batch_bytes, "bytes") + "  (target <= 512)")
    print(_line("values in a steady-state batch", fig.values, ""))
    print(_line("bytes per value sent", per_value, "", "6.2f"))
    print(
        f"{'steady-state cycles with a DECLARE':<36} {len(fig.declare_bytes):6d} of "
        f"{len(fig.batch_bytes)}"
        + (f", max {max(fig.declare_bytes)} bytes" if fig.declare_bytes else "")
    )
    print("CPU per steady-state cycle (time.process_time):")
    print(_line("  agent: SnapshotEncoder.frames", fig.snapshot_ms, "ms", "6.3f"))
    print(_line("  agent: FrameEncoder.encode", fig.encode_ms, "ms", "6.3f"))
    print(_line("  gateway: FrameDecoder.feed", fig.decode_ms, "ms", "6.3f"))


if __name__ == "__main__":
    main()
