"""Profiling fields from NVML GPM, and NVLink bandwidth, through the device collector.

The simulator answers GPM with pynvml's own structs (see test_gpm_simulator.py); here the
agent's side: two samples one interval apart per GPU and GPU instance, DCGM's units, the
MIG sample call, GPUs without GPM said once and never sampled, sample buffers that do
not leak, and the NVLink total as DCGM computes it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
from collections import Counter
from typing import Any

import pynvml
import pytest

from edge_agent.catalog import parse_counters
from edge_agent.collect import Collector
from edge_agent.collect_device import DeviceCollector
from edge_agent.fields import Carryover, NoValueYet
from edge_agent.nvml.devices import enumerate_gpus
from edge_agent.nvml.gpm import GpmStream
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.xid import XidWatcher
from gpurelay.model import Snapshot
from harness.pipeline import FakeClock

MIB = 1 << 20
H100, A100, T4 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4"
RATIOS = {  # DCGM field -> the GPM metric it is (DcgmFieldIdToNvmlGpmMetricId), in percent
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "DCGM_FI_PROF_SM_ACTIVE": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "DCGM_FI_PROF_SM_OCCUPANCY": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "DCGM_FI_PROF_DRAM_ACTIVE": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": pynvml.NVML_GPM_METRIC_FP64_UTIL,
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": pynvml.NVML_GPM_METRIC_FP16_UTIL,
}
RATES = {  # in MiB/s
    "DCGM_FI_PROF_PCIE_TX_BYTES": pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    "DCGM_FI_PROF_PCIE_RX_BYTES": pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    "DCGM_FI_PROF_NVLINK_TX_BYTES": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    "DCGM_FI_PROF_NVLINK_RX_BYTES": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
}
GPM_ONLY = sorted({*RATIOS, "DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES"})
COUNTERS = "\n".join(
    f"{field}, gauge, {field}"
    for field in [
        *RATIOS,
        *RATES,
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    ]
)


class SpyNvml(SimulatedNvml):
    """The simulator, counting GPM calls and keeping what nvmlGpmMetricsGet was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.mig_samples: list[tuple[int, int]] = []  # (GPU index, GPU instance id)
        self.gets: list[tuple[int, int, int, list[int]]] = []  # (version, sample1, sample2, ids)
        self.override: dict[int, tuple[int, float]] = {}  # metric -> (nvmlReturn, value)

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        self.calls["nvmlGpmQueryDeviceSupport"] += 1
        return super().nvmlGpmQueryDeviceSupport(device)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        self.calls["nvmlGpmSampleGet"] += 1
        return super().nvmlGpmSampleGet(device, gpmSample)

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        self.calls["nvmlGpmMigSampleGet"] += 1
        index = next(i for i in range(self.nvmlDeviceGetCount()) if same(device, self, i))
        self.mig_samples.append((index, gpuInstanceId))
        return super().nvmlGpmMigSampleGet(device, gpuInstanceId, gpmSample)

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        assert isinstance(metricsGet, pynvml.c_nvmlGpmMetricsGet_t)
        ids = [metricsGet.metrics[k].metricId for k in range(metricsGet.numMetrics)]
        first, second = (
            ctypes.addressof(s.contents) for s in (metricsGet.sample1, metricsGet.sample2)
        )
        self.gets.append((metricsGet.version, first, second, ids))
        super().nvmlGpmMetricsGet(metricsGet)
        for k in range(metricsGet.numMetrics):
            slot = metricsGet.metrics[k]
            if slot.metricId in self.override:
                slot.nvmlReturn, slot.value = self.override[slot.metricId]
        return metricsGet


def same(handle: Any, sim: SimulatedNvml, index: int) -> bool:
    other = sim.nvmlDeviceGetHandleByIndex(index)
    return bool(ctypes.addressof(handle.contents) == ctypes.addressof(other.contents))


class Node:
    """A device collector (and the cycle wrapper that reports unsupported fields)."""

    def __init__(self, sim: SimulatedNvml, clock: FakeClock, counters: str = COUNTERS) -> None:
        devices, problems = enumerate_gpus(sim)
        assert not problems
        self.xid = XidWatcher(sim, devices)  # registered, not started: XID 0 until one comes
        self.device = DeviceCollector(
            sim,
            devices,
            parse_counters(counters),
            node="edge-1",
            driver_version="550.54.15",
            xid=self.xid,
        )
        self.collector = Collector(
            node="edge-1", backend="simulated", device=self.device, process=None, clock=clock
        )

    def collect(self) -> Snapshot:
        return self.collector.collect()

    def close(self) -> None:
        self.xid.stop()
        self.collector.close()


def values(snap: Snapshot, name: str, **labels: str) -> dict[str, float]:
    """gpu (or gpu/GPU_I_ID) -> value of ``name``."""
    out = {}
    for s in snap.samples:
        lbl = dict(s.labels)
        if s.name == name and all(lbl.get(k) == v for k, v in labels.items()):
            key = lbl["gpu"] + (f"/{lbl['GPU_I_ID']}" if "GPU_I_ID" in lbl else "")
            out[key] = s.value
    return out


def unsupported(snap: Snapshot) -> dict[str, str]:
    return {
        dict(s.labels)["field"]: dict(s.labels)["reason"]
        for s in snap.samples
        if s.name == "gpurelay_agent_unsupported_field"
    }


def mean_over(sim: SimulatedNvml, clock: FakeClock, t1: float, t2: float, read: Any) -> float:
    """What the simulated counters integrate: ``read()`` at the middle of each second
    (of five equal steps at most)."""
    now, n = clock.now, min(5, math.ceil(t2 - t1))
    total = 0.0
    for k in range(n):
        clock.now = t1 + (k + 0.5) * (t2 - t1) / n
        total += read()
    clock.now = now
    return total / n


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def spy(clock: FakeClock, gpus: int = 2, **kwargs: Any) -> SpyNvml:
    sim = SpyNvml(gpus, seed=5, clock=clock, **kwargs)
    sim.nvmlInit()
    return sim


# --- the maths, from two samples ----------------------------------------------------------------


def test_fields_come_from_two_samples_one_interval_apart(clock: FakeClock) -> None:
    sim = spy(clock)
    node = Node(sim, clock)
    first = node.collect()
    for name in [*RATIOS, *RATES, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]:
        assert values(first, name) == {}, f"{name} has no value before a second sample"
    assert values(first, "DCGM_FI_DEV_GPU_UTIL")
    assert unsupported(first) == {}
    t1 = clock.now
    clock.advance(10)
    snap = node.collect()

    # One nvmlGpmMetricsGet per GPU, every field's metric in it, real structs.
    assert len(sim.gets) == 2
    for version, first_sample, second_sample, ids in sim.gets:
        assert version == pynvml.NVML_GPM_METRICS_GET_VERSION
        assert first_sample != second_sample
        assert sorted(ids) == sorted({*RATIOS.values(), *RATES.values()})

    h = sim.nvmlDeviceGetHandleByIndex(1)
    util = mean_over(sim, clock, t1, clock.now, lambda: sim.nvmlDeviceGetUtilizationRates(h).gpu)
    memory = mean_over(
        sim, clock, t1, clock.now, lambda: sim.nvmlDeviceGetUtilizationRates(h).memory
    )
    tx_kbps = mean_over(
        sim,
        clock,
        t1,
        clock.now,
        lambda: sim.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES),
    )
    assert util > 0, "GPU 1 is busy in this window"
    got = {name: values(snap, name)["1"] for name in [*RATIOS, *RATES]}
    # Ratios, not percent: the graphics engine as busy as NVML's utilisation says on average.
    assert math.isclose(got["DCGM_FI_PROF_GR_ENGINE_ACTIVE"], util / 100, rel_tol=1e-12)
    assert math.isclose(got["DCGM_FI_PROF_DRAM_ACTIVE"], memory / 100, rel_tol=1e-12)
    for name in RATIOS:
        assert 0 <= got[name] <= got["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] <= 1, name
    # Bytes per second: GPM's MiB/s times 2^20, here the same traffic NVML samples in KB/s.
    assert math.isclose(got["DCGM_FI_PROF_PCIE_TX_BYTES"], tx_kbps * 1024, rel_tol=1e-9)
    assert 1e9 < got["DCGM_FI_PROF_NVLINK_RX_BYTES"] < 18 * 25e9  # an H100's 18 links


def test_values_are_scaled_to_dcgm_units_and_failed_metrics_are_skipped(
    clock: FakeClock,
) -> None:
    sim = spy(clock, gpus=1)
    sim.override = {
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: (pynvml.NVML_SUCCESS, 42.5),
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (pynvml.NVML_SUCCESS, 3.0),
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (pynvml.NVML_SUCCESS, 0.5),
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0),
        pynvml.NVML_GPM_METRIC_FP64_UTIL: (pynvml.NVML_ERROR_UNKNOWN, 0.0),
        pynvml.NVML_GPM_METRIC_FP16_UTIL: (pynvml.NVML_SUCCESS, math.nan),
    }
    node = Node(sim, clock)
    node.collect()
    clock.advance(10)
    snap = node.collect()
    assert values(snap, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") == {"0": 0.425}
    assert values(snap, "DCGM_FI_PROF_PCIE_TX_BYTES") == {"0": 3.0 * MIB}
    assert values(snap, "DCGM_FI_PROF_NVLINK_TX_BYTES") == {"0": 0.5 * MIB}
    # NOT_SUPPORTED for one metric: that field only, and never asked for again (below);
    # another error is counted; NaN (DCGM publishes a blank) is no value this time.
    assert values(snap, "DCGM_FI_PROF_SM_OCCUPANCY") == {}
    assert values(snap, "DCGM_FI_PROF_PIPE_FP64_ACTIVE") == {}
    assert values(snap, "DCGM_FI_PROF_PIPE_FP16_ACTIVE") == {}
    assert node.device.errors[("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "NVMLError_Unknown")] == 1
    assert values(snap, "DCGM_FI_PROF_SM_ACTIVE")
    sim.override = {}
    clock.advance(10)
    snap = node.collect()
    assert values(snap, "DCGM_FI_PROF_SM_OCCUPANCY") == {}
    assert values(snap, "DCGM_FI_PROF_PIPE_FP64_ACTIVE")
    assert values(snap, "DCGM_FI_PROF_PIPE_FP16_ACTIVE")


def test_the_two_sample_buffers_alternate(clock: FakeClock) -> None:
    sim = spy(clock, gpus=1)
    stream = GpmStream(sim, sim.nvmlDeviceGetHandleByIndex(0), [1, 2])
    assert stream.advance() is None
    for _ in range(4):
        clock.advance(5)
        metrics = stream.advance()
        assert metrics is not None and set(metrics) == {1, 2}
    pairs = [(first, second) for _, first, second, _ in sim.gets]
    # Each interval starts where the previous one ended, in the other buffer.
    for (_, end), (start, _) in itertools.pairwise(pairs):
        assert start == end
    assert len({address for pair in pairs for address in pair}) == 2
    assert sim.gpm_samples_allocated == 2
    stream.close()
    stream.close()  # twice is harmless
    assert sim.gpm_samples_allocated == 0


# --- MIG ----------------------------------------------------------------------------------------


def test_gpu_instances_are_sampled_through_the_parent_gpu(clock: FakeClock) -> None:
    sim = spy(clock, mig=True)
    node = Node(sim, clock)
    node.collect()
    clock.advance(10)
    snap = node.collect()
    instances = {"0/1", "0/5", "0/13"}  # GPU 0's three GPU instances (simulator layout)
    assert sorted(sim.mig_samples) == sorted([(0, 1), (0, 5), (0, 13)] * 2)
    for name in RATIOS:
        got = values(snap, name)
        assert set(got) == {"0", "1", *instances}, name
        assert all(0 <= v <= 1 for v in got.values()), name
    for name in [*RATES, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]:
        assert set(values(snap, name)) == {"0", "1"}, f"{name} is per GPU only, as in DCGM"
    labels = next(
        dict(s.labels)
        for s in snap.samples
        if s.name == "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" and ("GPU_I_ID", "5") in s.labels
    )
    assert labels["GPU_I_PROFILE"] == "2g.20gb" and labels["gpu"] == "0"


# --- GPUs without GPM ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", [A100, T4])
def test_no_gpm_before_hopper_is_said_once_and_never_retried(
    model: str, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = spy(clock, model=model)
    node = Node(sim, clock)
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            snap = node.collect()
            clock.advance(10)
    reasons = unsupported(snap)
    assert sorted(f for f in reasons if f in GPM_ONLY) == GPM_ONLY
    for field in GPM_ONLY:
        assert f"GPU 0 ({model}): the GPU does not support GPM" in reasons[field]
        assert "GPU 1" in reasons[field] and "Hopper or newer" in reasons[field]
        said = [r for r in caplog.records if field in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert said[0].levelno == logging.WARNING
        assert values(snap, field) == {}
    # Asked once per GPU; no sample is ever attempted.
    assert sim.calls == {"nvmlGpmQueryDeviceSupport": 2}
    assert sim.gpm_samples_allocated == 0
    # PCIe bytes from NVML's throughput instead (KB/s -> B/s).
    h = sim.nvmlDeviceGetHandleByIndex(0)
    clock.advance(-10)
    tx = sim.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    assert values(snap, "DCGM_FI_PROF_PCIE_TX_BYTES")["0"] == tx * 1024
    # NVLink bandwidth is a field value: an A100 has NVLink, a T4 has none.
    nvlink = values(snap, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL")
    if model == A100:
        assert set(nvlink) == {"0", "1"} and all(v > 0 for v in nvlink.values())
    else:
        assert nvlink == {}
        assert (
            reasons["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == "not supported by any GPU on this node"
        )


def test_a_driver_without_gpm_says_which(clock: FakeClock) -> None:
    sim = spy(clock)
    sim.inject_fault(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, function="nvmlGpmQueryDeviceSupport")
    node = Node(sim, clock)
    reasons = unsupported(node.collect())
    assert "R520 or newer" in reasons["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]
    assert sim.calls["nvmlGpmSampleGet"] == 0


def test_a_gpu_without_gpm_beside_one_with_it(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = spy(clock)
    sim.inject_fault(pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1, function="nvmlGpmQueryDeviceSupport")
    with caplog.at_level(logging.INFO):
        node = Node(sim, clock)
        for _ in range(3):
            snap = node.collect()
            clock.advance(10)
    assert unsupported(snap) == {}
    assert set(values(snap, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")) == {"0"}
    assert set(values(snap, "DCGM_FI_PROF_PCIE_RX_BYTES")) == {"0", "1"}  # GPU 1: fallback
    said = [r.getMessage() for r in caplog.records if "GPM" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("GPU 1 ("), said
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" in said[0]
    assert sim.calls["nvmlGpmSampleGet"] == 3  # GPU 0 only, once per cycle


# --- sample lifetimes ---------------------------------------------------------------------------


def test_sample_buffers_do_not_leak_over_many_intervals(clock: FakeClock) -> None:
    sim = spy(clock, mig=True)
    node = Node(sim, clock)
    streams = 2 + 3  # two GPUs, GPU 0's three GPU instances
    for _ in range(200):
        node.collect()
        clock.advance(1)
    assert sim.gpm_samples_allocated == 2 * streams
    # A failed sample: no leak, and the next interval spans both.
    sim.inject_fault(pynvml.NVML_ERROR_UNKNOWN, gpu=1, function="nvmlGpmSampleGet")
    t1 = clock.now - 1
    snap = node.collect()
    assert values(snap, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu="1") == {}
    assert node.device.errors[("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "NVMLError_Unknown")] == 1
    sim.clear_faults()
    clock.advance(1)
    snap = node.collect()
    h = sim.nvmlDeviceGetHandleByIndex(1)
    util = mean_over(sim, clock, t1, clock.now, lambda: sim.nvmlDeviceGetUtilizationRates(h).gpu)
    got = values(snap, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu="1")["1"]
    assert math.isclose(got, util / 100, rel_tol=1e-12)
    assert sim.gpm_samples_allocated == 2 * streams
    node.device.close()
    assert sim.gpm_samples_allocated == 0


def test_the_pipeline_frees_its_samples_before_nvml_shuts_down(tmp_path: Any) -> None:
    from harness.pipeline import make_pipeline

    pipeline, sim, clock = make_pipeline(tmp_path, gpus=2, mig=True)
    for _ in range(3):
        pipeline.collection.collect()
        clock.advance(10)
    assert sim.gpm_samples_allocated == 2 * 5
    pipeline.close()
    assert sim.gpm_samples_allocated == 0


# --- NVLink totals ------------------------------------------------------------------------------


def test_nvlink_bandwidth_total_is_dcgms_rate_of_the_data_counters(clock: FakeClock) -> None:
    sim = spy(clock)
    node = Node(sim, clock)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    all_links = 0xFFFFFFFF
    fields = [
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, all_links),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, all_links),
    ]
    before = sum(fv.value.ullVal for fv in sim.nvmlDeviceGetFieldValues(h, fields))
    node.collect()
    clock.advance(10)
    after = sum(fv.value.ullVal for fv in sim.nvmlDeviceGetFieldValues(h, fields))
    snap = node.collect()
    total = values(snap, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL")["0"]
    # KiB per second over the interval, / 1000 (DcgmCacheManager::ReadAndCacheNvLinkBandwidth)
    assert total == (after - before) / 10 / 1000
    # The same traffic GPM counts, in other units.
    gpm = sum(values(snap, name)["0"] for name in RATES if "NVLINK" in name)
    assert math.isclose(total * 1000 * 1024, gpm, rel_tol=1e-5)


def test_a_rate_needs_two_readings_and_survives_a_counter_reset() -> None:
    carry = Carryover()
    with pytest.raises(NoValueYet):
        carry.rate("x", 100.0, 10.0)
    assert carry.rate("x", 150.0, 20.0) == 5.0
    with pytest.raises(NoValueYet):
        carry.rate("x", 150.0, 20.0)  # the same instant
    with pytest.raises(NoValueYet):
        carry.rate("x", 3.0, 30.0)  # the counter went back: a reset, not a negative rate
    assert carry.rate("x", 13.0, 40.0) == 1.0
