"""Violation times are nanoseconds, as NVML gives them and dcgm-exporter documents them.

NVML's ``nvmlViolationTime_t.violationTime`` counts nanoseconds; dcgm-exporter's counters
CSVs say "(in ns)" since its PR #589, which checked real values. The agent once divided by
1000 (microseconds), 1000x too small for every query written against dcgm-exporter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest

from edge_agent.config import load
from edge_agent.nvml.backend import Handle
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import Snapshot
from harness.pipeline import make_pipeline

POLICIES = {
    "DCGM_FI_DEV_POWER_VIOLATION": pynvml.NVML_PERF_POLICY_POWER,
    "DCGM_FI_DEV_THERMAL_VIOLATION": pynvml.NVML_PERF_POLICY_THERMAL,
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": pynvml.NVML_PERF_POLICY_SYNC_BOOST,
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": pynvml.NVML_PERF_POLICY_RELIABILITY,
}


def _value(snap: Snapshot, name: str, gpu: str) -> float:
    (v,) = [s.value for s in snap.samples if s.name == name and dict(s.labels)["gpu"] == gpu]
    return v


def _known_ns(gpu: int, policy: int) -> int:
    """A distinct violation time per GPU and policy, not a multiple of 1000 (so a division
    or a rounding shows), and exactly representable as a float (< 2**53)."""
    return 3_600_123_456_789 + 1_000_003 * policy + 7 * gpu


def _with_known_violation_times(sim: SimulatedNvml) -> None:
    """Replace the simulator's violation status with one whose values the test knows,
    answered in NVML's own struct (the seam the agent reads through)."""
    index = {sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(i)): i for i in range(2)}

    def status(handle: Handle, policy: int) -> Any:
        gpu = index[sim.nvmlDeviceGetUUID(handle)]
        return pynvml.c_nvmlViolationTime_t(
            referenceTime=1_790_000_000_000_000, violationTime=_known_ns(gpu, policy)
        )

    sim.nvmlDeviceGetViolationStatus = status  # type: ignore[method-assign]


@pytest.mark.parametrize("field", sorted(POLICIES))
def test_every_violation_field_is_nvml_nanoseconds_unchanged(tmp_path: Path, field: str) -> None:
    csv = tmp_path / "violations.csv"
    csv.write_text(f"{field}, counter, Throttling duration (in ns).\n")
    cfg = load(None, {"EDGE_AGENT_COUNTERS_FILE": str(csv)})
    pipeline, sim, _clock = make_pipeline(tmp_path, gpus=2, cfg=cfg)
    _with_known_violation_times(sim)
    snap = pipeline.collection.collect()
    pipeline.close()
    for gpu in (0, 1):
        assert _value(snap, field, str(gpu)) == _known_ns(gpu, POLICIES[field])


def _nvml_ns(sim: SimulatedNvml, gpu: int, policy: int) -> int:
    status = sim.nvmlDeviceGetViolationStatus(sim.nvmlDeviceGetHandleByIndex(gpu), policy)
    assert isinstance(status, pynvml.c_nvmlViolationTime_t)  # the real struct
    return int(status.violationTime)


def test_default_counters_expose_the_simulators_ns_and_say_ns(tmp_path: Path) -> None:
    pipeline, sim, clock = make_pipeline(tmp_path, gpus=2)
    clock.advance(3600)
    snap = pipeline.collection.collect()
    nvml = {
        (gpu, policy): _nvml_ns(sim, gpu, policy)
        for gpu in (0, 1)
        for policy in (pynvml.NVML_PERF_POLICY_POWER, pynvml.NVML_PERF_POLICY_THERMAL)
    }
    pipeline.close()
    for gpu in (0, 1):
        power = nvml[gpu, pynvml.NVML_PERF_POLICY_POWER]
        assert _value(snap, "DCGM_FI_DEV_POWER_VIOLATION", str(gpu)) == power
        thermal = nvml[gpu, pynvml.NVML_PERF_POLICY_THERMAL]
        assert _value(snap, "DCGM_FI_DEV_THERMAL_VIOLATION", str(gpu)) == thermal
    helps = {f.name: f.help for f in snap.families if f.name.endswith("_VIOLATION")}
    assert len(helps) == 2
    assert all("(ns)" in text for text in helps.values()), helps


def test_simulated_violation_time_is_plausible_nanoseconds() -> None:
    """Over an hour a GPU is held down for a fraction of that hour (the simulator: up to 3 %
    by power, 0.2 % by temperature): in nanoseconds, between 0 and 3 % of 3600e9."""
    now = [1_790_000_000.0]
    sim = SimulatedNvml(2, seed=7, clock=lambda: now[0])
    sim.nvmlInit()
    now[0] += 3600
    for gpu in (0, 1):
        power = _nvml_ns(sim, gpu, pynvml.NVML_PERF_POLICY_POWER)
        thermal = _nvml_ns(sim, gpu, pynvml.NVML_PERF_POLICY_THERMAL)
        assert 0 <= thermal < power <= 0.03 * 3600e9
        assert power > 3600e6  # over 1 ms a second: nanoseconds, not microseconds
    sim.nvmlShutdown()
