"""Agent cycle cost: CPU per device cycle, per process-attribution pass, and agent RSS.

Setup: 8 simulated GPUs, 64 GPU processes (8 per GPU) in a fake host tree (containerd and
CRI-O pods on cgroup v2, Docker on cgroup v1, host processes), default counters file.
The simulator's own Python cost is *included* in the figures (real NVML calls are ioctls
of a few microseconds each), so these are upper bounds for a real box.

Targets (issue 2): <= 2 ms CPU per device cycle, <= 20 ms per process-attribution pass,
RSS <= 60 MB.

Run: .venv/bin/python bench/agent_cycle.py [--cycles 300]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent.backend import Backend
from edge_agent.config import load
from edge_agent.pipeline import build_pipeline
from edge_agent.sim import host as simhost
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import SampleSink
from harness.ports import free_ports
from harness.process import Process
from harness.waiting import wait_until

GPUS, PROCS_PER_GPU = 8, 8


class ReplayNvml:
    """Answers every NVML call from a cache filled on first use.

    Wrapping the simulator in this isolates the agent's own CPU cost: after the first
    cycle an NVML call costs a dict lookup, less than a real NVML ioctl. ``calls`` counts
    the calls by function, which on a real box are each a driver call (2.5-12 us).
    """

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self._memo: dict[tuple[object, ...], object] = {}
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._lib, name)
        if not callable(fn):  # the simulator's own attributes (its profile...)
            return fn

        def call(*args: object) -> object:
            self.calls[name] += 1
            if name == "nvmlGpmMetricsGet":
                return self._metrics_get(fn, args[0])
            # GPM sample buffers are the agent's own, and an event wait blocks (a replayed
            # timeout would return at once): both must be real
            if name.startswith(("nvmlGpm", "nvmlEvent")):
                return fn(*args)
            # ctypes handles are unhashable; the agent keeps its handles, so identity works
            key = (name, *(id(a) if isinstance(a, ctypes._Pointer) else a for a in args))
            try:
                hit = self._memo[key]
            except KeyError:
                try:
                    hit = fn(*args)
                except pynvml.NVMLError as exc:
                    hit = exc
                self._memo[key] = hit
            if isinstance(hit, pynvml.NVMLError):
                raise hit
            return hit

        setattr(self, name, call)
        return call

    def _metrics_get(self, fn: Any, get: Any) -> Any:
        """nvmlGpmMetricsGet fills the caller's struct: replay the first answer into it."""
        ids = tuple(get.metrics[k].metricId for k in range(get.numMetrics))
        key = ("nvmlGpmMetricsGet", ids)
        cached = self._memo.get(key)
        if cached is None:
            fn(get)
            self._memo[key] = type(get).from_buffer_copy(get)
            return get
        size = ctypes.sizeof(get.metrics)
        ctypes.memmove(ctypes.addressof(get.metrics), ctypes.addressof(cached.metrics), size)
        return get


def _cpu_ms(fn: object, cycles: int, advance: object) -> list[float]:
    out = []
    for _ in range(cycles):
        advance()  # type: ignore[operator]
        start = time.process_time()
        fn()  # type: ignore[operator]
        out.append((time.process_time() - start) * 1000)
    return out


def _summary(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p95 = ms[int(len(ms) * 0.95) - 1]
    return (
        f"{name:<34} median {statistics.median(ms):7.3f} ms   p95 {p95:7.3f} ms   "
        f"mean {statistics.fmean(ms):7.3f} ms   (n={len(ms)})"
    )


def in_process(cycles: int) -> None:
    clock_now = [1_790_000_000.0]
    with tempfile.TemporaryDirectory() as tmp:
        pids = simhost.default_pids(GPUS * PROCS_PER_GPU)
        host = simhost.build(Path(tmp), pids)
        base = load(None, {})
        cfg = dataclasses.replace(
            base,
            node_name="bench-node",
            attribution=simhost.attribution_config(host, base.attribution),
        )
        sim = SimulatedNvml(
            GPUS, clock=lambda: clock_now[0], pids=pids, processes_per_gpu=PROCS_PER_GPU
        )
        sim.nvmlInit()
        pipeline = build_pipeline(Backend(sim, "simulated", cfg), clock=lambda: clock_now[0])
        device = pipeline.collection._device
        process = pipeline.collection._process
        assert process is not None

        def advance() -> None:
            clock_now[0] += 10.0

        sink = SampleSink()
        device.collect(sink)
        n_device = len(sink.samples)
        cold = SampleSink()
        start = time.process_time()
        process.collect(cold)
        cold_ms = (time.process_time() - start) * 1000
        n_proc = sum(1 for s in cold.samples if s.name == "DCGM_CUSTOM_PROCESS_MEM_USED")
        dev_ms = _cpu_ms(lambda: device.collect(SampleSink()), cycles, advance)
        proc_ms = _cpu_ms(lambda: process.collect(SampleSink()), cycles, advance)
        full_ms = _cpu_ms(pipeline.collection.collect, cycles, advance)
        pipeline.close()
        sim2 = SimulatedNvml(
            GPUS, clock=lambda: clock_now[0], pids=pids, processes_per_gpu=PROCS_PER_GPU
        )
        sim2.nvmlInit()
        replay = build_pipeline(Backend(ReplayNvml(sim2), "simulated", cfg))  # type: ignore[arg-type]
        rdev = replay.collection._device
        rproc = replay.collection._process
        assert rproc is not None
        agent_dev_ms = _cpu_ms(lambda: rdev.collect(SampleSink()), cycles, lambda: None)
        agent_proc_ms = _cpu_ms(lambda: rproc.collect(SampleSink()), cycles, lambda: None)
        replay.close()
    print(f"setup: {GPUS} simulated GPUs, {n_proc} GPU processes, {n_device} device series")
    print(_summary("device cycle (CPU)", dev_ms))
    print(_summary("process+attribution pass (CPU)", proc_ms))
    print(f"{'process+attribution, cold cache':<34} {cold_ms:7.3f} ms")
    print(_summary("full collection incl. self (CPU)", full_ms))
    print("agent's own cost (NVML answers replayed from a cache, simulator cost removed):")
    print(_summary("device cycle (CPU)", agent_dev_ms))
    print(_summary("process+attribution pass (CPU)", agent_proc_ms))


def agent_rss() -> None:
    """Start the real agent binary and read its resident memory after it settles."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}/metrics"
    env = {**os.environ, "EDGE_AGENT_SIMULATE_PROCESSES_PER_GPU": str(PROCS_PER_GPU)}
    argv = ["-m", "edge_agent", "run", "--simulate", str(GPUS), "--listen", f"127.0.0.1:{port}"]
    with tempfile.TemporaryDirectory(prefix="agent-rss-") as tmp:
        agent = Process(
            "agent", [sys.executable, *argv, "--interval", "0.5"], Path(tmp) / "agent.log", env
        )
        agent.start()
        try:
            wait_until(
                lambda: httpx.get(url, timeout=1).status_code == 200,
                30,
                "the agent's /metrics",
                poll=0.1,
                alive=(agent,),
            )
            for _ in range(20):  # let it collect and serve for a while
                httpx.get(url, timeout=2)
                time.sleep(0.25)
            memory = agent.sample()
        finally:
            agent.stop()
    rss, peak = memory.rss_kib / 1024, memory.peak_rss_kib / 1024
    print(f"{'agent process RSS (run, 8 GPUs)':<34} {rss:7.1f} MB   (peak {peak:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    in_process(args.cycles)
    agent_rss()


if __name__ == "__main__":
    main()
