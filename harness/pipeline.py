"""Build a fully wired agent pipeline over the simulator, with a fixed clock."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from edge_agent.backend import Backend
from edge_agent.config import AgentConfig, load
from edge_agent.pipeline import Pipeline, build_pipeline
from edge_agent.sim import host as simhost
from edge_agent.sim import kubelet as simkubelet
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import Snapshot

FIXED_TIME = 1_790_000_000.0


class FakeClock:
    def __init__(self, start: float = FIXED_TIME) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeTimer:
    """perf_counter stand-in: every call advances 0.5 ms, so durations are fixed."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.0005
        return self.t


def make_pipeline(
    tmp: Path,
    *,
    gpus: int = 2,
    mig: bool = False,
    seed: int = 7,
    processes_per_gpu: int = 4,
    clock: FakeClock | None = None,
    cfg: AgentConfig | None = None,
    timer: Callable[[], float] | None = None,
    profile: str | None = None,
) -> tuple[Pipeline, SimulatedNvml, FakeClock]:
    """An agent pipeline over ``gpus`` simulated GPUs of machine ``profile`` (see
    edge_agent.sim.profiles; None: H100s, GPU 0 in MIG mode with ``mig``)."""
    clock = clock or FakeClock()
    base = cfg or load(None, {})
    pids = simhost.default_pids(gpus * processes_per_gpu, seed)
    host = simhost.build(tmp / "host", pids, seed)
    cfg = dataclasses.replace(
        base,
        node_name=base.node_name or "edge-node-1",
        attribution=simhost.attribution_config(host, base.attribution),
    )
    sim = SimulatedNvml(
        gpus,
        seed=seed,
        mig=mig,
        clock=clock,
        pids=pids,
        processes_per_gpu=processes_per_gpu,
        profile=profile,
    )
    sim.nvmlInit()
    cfg, stop_kubelet = simkubelet.attach(cfg, host, sim)  # [simulate] pod_resources
    backend = Backend(sim, "simulated", cfg, on_close=[stop_kubelet] if stop_kubelet else [])
    pipeline = build_pipeline(backend, clock=clock, timer=timer or FakeTimer())
    return pipeline, sim, clock


def simulated_snapshots(
    *, gpus: int, processes_per_gpu: int, count: int, step: float = 10.0, seed: int = 7
) -> list[Snapshot]:
    """``count`` collections of one simulated node, ``step`` seconds of simulated time
    apart, with the collector's real timer (so the agent's own duration series change from
    collection to collection, as in production). For benchmarks."""
    with tempfile.TemporaryDirectory(prefix="simulated-node-") as tmp:
        pipeline, _sim, clock = make_pipeline(
            Path(tmp),
            gpus=gpus,
            processes_per_gpu=processes_per_gpu,
            seed=seed,
            timer=time.perf_counter,
        )
        snapshots = []
        try:
            for _ in range(count):
                snapshots.append(pipeline.collection.collect())
                clock.advance(step)
        finally:
            pipeline.close()
    return snapshots


def lines_of(body: bytes) -> Iterator[str]:
    return iter(body.decode().splitlines())
