"""The simulator's GPM and NVLink: pynvml's own structs and errors, per GPU model."""

from __future__ import annotations

import math
from typing import Any

import pynvml
import pytest

from edge_agent.sim.nvml import SimulatedNvml
from harness.pipeline import FakeClock

H100, A100, T4 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4"
ALL_LINKS = 0xFFFFFFFF


def nvml(clock: FakeClock, model: str = H100, **kwargs: Any) -> SimulatedNvml:
    sim = SimulatedNvml(2, seed=9, clock=clock, model=model, **kwargs)
    sim.nvmlInit()
    return sim


def metrics_get(first: Any, second: Any, *ids: int) -> Any:
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    get.numMetrics = len(ids)
    get.sample1, get.sample2 = first, second
    for k, metric in enumerate(ids):
        get.metrics[k].metricId = metric
    return get


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_h100_answers_with_pynvml_structs(clock: FakeClock) -> None:
    sim = nvml(clock)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    support = sim.nvmlGpmQueryDeviceSupport(h)
    assert isinstance(support, pynvml.c_nvmlGpmSupport_t)
    assert (support.version, support.isSupportedDevice) == (pynvml.NVML_GPM_SUPPORT_VERSION, 1)
    first, second = sim.nvmlGpmSampleAlloc(), sim.nvmlGpmSampleAlloc()
    assert isinstance(first, pynvml.c_nvmlGpmSample_t)
    assert sim.nvmlGpmSampleGet(h, first) is first
    clock.advance(10)
    sim.nvmlGpmSampleGet(h, second)
    graphics, pcie = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
    get = metrics_get(first, second, graphics, pcie, pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL, 0)
    assert sim.nvmlGpmMetricsGet(get) is get
    rets = [get.metrics[k].nvmlReturn for k in range(4)]
    assert rets[:2] == [pynvml.NVML_SUCCESS] * 2
    assert rets[2:] == [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT]
    assert 0 <= get.metrics[0].value <= 100  # percent
    assert get.metrics[1].value > 0.01  # MiB/s
    # The same instant twice: no time in between, NaN (DCGM stores a blank for it).
    sim.nvmlGpmSampleGet(h, first)
    sim.nvmlGpmSampleGet(h, second)
    get = metrics_get(first, second, graphics)
    sim.nvmlGpmMetricsGet(get)
    assert get.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS and math.isnan(get.metrics[0].value)
    for sample in (first, second):
        sim.nvmlGpmSampleFree(sample)
    assert sim.gpm_samples_allocated == 0


def test_bad_calls_fail_as_nvml_does(clock: FakeClock) -> None:
    sim = nvml(clock, mig=True)
    gpu0, gpu1 = (sim.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    a, b, never_taken = (sim.nvmlGpmSampleAlloc() for _ in range(3))
    sim.nvmlGpmSampleGet(gpu0, a)
    sim.nvmlGpmSampleGet(gpu1, b)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # samples of two GPUs
        sim.nvmlGpmMetricsGet(metrics_get(a, b, 1))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # nothing sampled into it
        sim.nvmlGpmMetricsGet(metrics_get(never_taken, a, 1))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a NULL sample
        sim.nvmlGpmMetricsGet(metrics_get(pynvml.c_nvmlGpmSample_t(), a, 1))
    wrong = metrics_get(a, a, 1)
    wrong.version = 2
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        sim.nvmlGpmMetricsGet(wrong)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # GPU 1 is not in MIG mode
        sim.nvmlGpmMigSampleGet(gpu1, 1, a)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # no GPU instance 2 on GPU 0
        sim.nvmlGpmMigSampleGet(gpu0, 2, a)
    sim.nvmlGpmSampleFree(b)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed
        sim.nvmlGpmSampleFree(b)
    sim.inject_fault(pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlGpmSampleGet(gpu0, a)
    sim.clear_faults()
    sim.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlGpmSampleAlloc()


@pytest.mark.parametrize("model", [A100, T4])
def test_before_hopper_gpm_is_not_supported(clock: FakeClock, model: str) -> None:
    sim = nvml(clock, model=model, mig=True)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0  # answered, not raised
    sample = sim.nvmlGpmSampleAlloc()  # host memory: works anywhere
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlGpmSampleGet(h, sample)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlGpmMigSampleGet(h, 1, sample)
    sim.nvmlGpmSampleFree(sample)


def test_mig_instances_have_their_own_activity(clock: FakeClock) -> None:
    sim = nvml(clock, mig=True)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)  # GPU instance 1
    ids = (
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
    )

    def over_ten_seconds(take: Any) -> list[tuple[int, float]]:
        first, second = sim.nvmlGpmSampleAlloc(), sim.nvmlGpmSampleAlloc()
        take(first)
        clock.advance(10)
        take(second)
        get = sim.nvmlGpmMetricsGet(metrics_get(first, second, *ids))
        sim.nvmlGpmSampleFree(first)
        sim.nvmlGpmSampleFree(second)
        clock.advance(-10)
        return [(get.metrics[k].nvmlReturn, get.metrics[k].value) for k in range(len(ids))]

    by_parent = over_ten_seconds(lambda s: sim.nvmlGpmMigSampleGet(h, 1, s))
    # A MIG device handle samples its compute instance: the same counters here.
    assert over_ten_seconds(lambda s: sim.nvmlGpmSampleGet(mig, s)) == by_parent
    ok = pynvml.NVML_SUCCESS
    unsupported = pynvml.NVML_ERROR_NOT_SUPPORTED  # PCIe and NVLink: per GPU only
    assert [r for r, _ in by_parent] == [ok, ok, unsupported, unsupported]
    other = over_ten_seconds(lambda s: sim.nvmlGpmMigSampleGet(h, 13, s))
    whole = over_ten_seconds(lambda s: sim.nvmlGpmSampleGet(h, s))
    assert by_parent[0][1] != other[0][1]
    # The parent's activity: its instances' by compute slices (3g, 2g, 1g of 7).
    middle = over_ten_seconds(lambda s: sim.nvmlGpmMigSampleGet(h, 5, s))
    expected = (3 * by_parent[0][1] + 2 * middle[0][1] + 1 * other[0][1]) / 7
    assert math.isclose(whole[0][1], expected, rel_tol=1e-12)
    assert whole[2][0] == whole[3][0] == ok


@pytest.mark.parametrize(("model", "links"), [(H100, 18), (A100, 12), (T4, 0)])
def test_nvlink_throughput_field_values(clock: FakeClock, model: str, links: int) -> None:
    sim = nvml(clock, model=model)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    fields = [
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, links),  # one past the last link
    ]
    clock.advance(60)
    entries = sim.nvmlDeviceGetFieldValues(h, fields)
    assert isinstance(entries[0], pynvml.c_nvmlFieldValue_t)
    if links == 0:
        assert {e.nvmlReturn for e in entries} == {pynvml.NVML_ERROR_NOT_SUPPORTED}
        return
    data, raw, link0, beyond = entries
    assert (data.nvmlReturn, raw.nvmlReturn, link0.nvmlReturn) == (pynvml.NVML_SUCCESS,) * 3
    assert beyond.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert data.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert (data.fieldId, data.scopeId) == (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS)
    assert 0 < data.value.ullVal < raw.value.ullVal  # KiB; raw adds protocol overhead
    assert data.timestamp == int(clock.now * 1e6)
    # Cumulative since driver load: it only grows.
    clock.advance(10)
    (later,) = sim.nvmlDeviceGetFieldValues(h, fields[:1])
    assert later.value.ullVal > data.value.ullVal
