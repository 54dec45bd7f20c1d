"""The NVML simulator returns pynvml's own structs and raises pynvml's own errors."""

from __future__ import annotations

import ctypes
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest

from edge_agent.nvml.backend import NvmlLib
from edge_agent.sim.nvml import SimulatedNvml
from harness.pipeline import FakeClock

T0 = 1_700_000_000.0
MIB = 1 << 20


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def sim(clock: FakeClock) -> Iterator[SimulatedNvml]:
    nvml = SimulatedNvml(3, seed=7, clock=clock)
    nvml.nvmlInit()
    yield nvml
    nvml.clear_faults()
    nvml.nvmlShutdown()


@pytest.fixture
def mig_sim(clock: FakeClock) -> SimulatedNvml:
    nvml = SimulatedNvml(2, seed=3, mig=True, clock=clock)
    nvml.nvmlInit()
    return nvml


def handles(nvml: SimulatedNvml) -> list[Any]:
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]


def snapshot(nvml: SimulatedNvml, handle: Any) -> dict[str, Any]:
    """Everything a collector reads from one GPU, as plain values."""
    util = nvml.nvmlDeviceGetUtilizationRates(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    (field,) = nvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    except pynvml.NVMLError_NotFound:
        samples = []
    return {
        "name": nvml.nvmlDeviceGetName(handle),
        "uuid": nvml.nvmlDeviceGetUUID(handle),
        "bus": nvml.nvmlDeviceGetPciInfo(handle).busId,
        "util": (util.gpu, util.memory),
        "enc": nvml.nvmlDeviceGetEncoderUtilization(handle),
        "dec": nvml.nvmlDeviceGetDecoderUtilization(handle),
        "memory": (memory.total, memory.reserved, memory.free, memory.used),
        "temp": nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        "mem_temp": field.value.uiVal,
        "power": nvml.nvmlDeviceGetPowerUsage(handle),
        "energy": nvml.nvmlDeviceGetTotalEnergyConsumption(handle),
        "sm": nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
        "mem_clock": nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
        "replays": nvml.nvmlDeviceGetPcieReplayCounter(handle),
        "tx": nvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES),
        "rx": nvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES),
        "ecc": nvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC
        ),
        "reasons": nvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
        "violation": nvml.nvmlDeviceGetViolationStatus(
            handle, pynvml.NVML_PERF_POLICY_POWER
        ).violationTime,
        "compute": [
            (p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ],
        "graphics": [
            (p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
        ],
        "samples": [(s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil) for s in samples],
    }


def sweep(clock: FakeClock, seconds: int, step: int) -> Iterator[float]:
    for offset in range(0, seconds, step):
        clock.now = T0 + offset
        yield clock.now


# --- the seam ------------------------------------------------------------------------------


def test_implements_every_nvmllib_function_with_pynvml_parameter_names() -> None:
    names = [n for n in dir(NvmlLib) if n.startswith("nvml")]
    assert names
    for name in names:
        expected = list(inspect.signature(getattr(NvmlLib, name)).parameters)
        assert list(inspect.signature(getattr(SimulatedNvml, name)).parameters) == expected
    assert SimulatedNvml.backend_name == "simulated"


def test_returns_real_pynvml_types(sim: SimulatedNvml) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert isinstance(sim.nvmlSystemGetDriverVersion(), str)
    assert sim.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert isinstance(sim.nvmlDeviceGetUtilizationRates(h), pynvml.c_nvmlUtilization_t)
    memory = sim.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(memory, pynvml.c_nvmlMemory_t)
    assert memory.total == 85_520_809_984 == memory.free + memory.used
    memory_v2 = sim.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert isinstance(memory_v2, pynvml.c_nvmlMemory_v2_t)
    assert memory_v2.version == pynvml.nvmlMemory_v2
    assert memory_v2.reserved == 595_591_168
    assert memory_v2.total == memory_v2.reserved + memory_v2.free + memory_v2.used
    pci = sim.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:1B:00.0"  # pynvml's structs decode char arrays to str
    assert isinstance(sim.nvmlDeviceGetViolationStatus(h, 0), pynvml.c_nvmlViolationTime_t)
    (entry,) = sim.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert isinstance(entry, pynvml.c_nvmlFieldValue_t)
    assert entry.nvmlReturn == pynvml.NVML_SUCCESS
    assert entry.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert entry.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP
    _, period = sim.nvmlDeviceGetEncoderUtilization(h)
    assert period == 167_000
    assert sim.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    assert sim.nvmlDeviceGetRetiredPages(h, 0) == []
    assert sim.nvmlDeviceGetRetiredPagesPendingStatus(h) == 0
    assert sim.nvmlDeviceGetMigMode(h) == [0, 0]
    assert sim.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeXidCriticalError
    processes = sim.nvmlDeviceGetComputeRunningProcesses(h)
    assert processes
    assert all(isinstance(p, pynvml.nvmlFriendlyObject) for p in processes)
    assert all(p.gpuInstanceId == 0xFFFFFFFF for p in processes)
    samples = sim.nvmlDeviceGetProcessUtilization(h, 0)
    assert all(isinstance(s, pynvml.c_nvmlProcessUtilizationSample_t) for s in samples)


def test_identity_is_distinct_per_gpu(sim: SimulatedNvml) -> None:
    hs = handles(sim)
    uuids = [sim.nvmlDeviceGetUUID(h) for h in hs]
    buses = [sim.nvmlDeviceGetPciInfo(h).busId for h in hs]
    assert len(set(uuids)) == len(set(buses)) == 3
    assert all(
        u.startswith("GPU-") and [len(x) for x in u[4:].split("-")] == [8, 4, 4, 4, 12]
        for u in uuids
    )
    assert [sim.nvmlDeviceGetMinorNumber(h) for h in hs] == [0, 1, 2]


def test_handles_are_fresh_pointers_to_the_same_device(sim: SimulatedNvml) -> None:
    a, b = sim.nvmlDeviceGetHandleByIndex(1), sim.nvmlDeviceGetHandleByIndex(1)
    assert a is not b
    assert ctypes.addressof(a.contents) == ctypes.addressof(b.contents)


# --- errors and lifecycle ------------------------------------------------------------------


def test_calls_before_init_and_after_shutdown_are_uninitialized(clock: FakeClock) -> None:
    nvml = SimulatedNvml(1, clock=clock)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlInit()  # NVML counts nested init/shutdown pairs
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetPowerUsage(h) > 0
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_driver_not_loaded() -> None:
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        SimulatedNvml(1, driver_loaded=False).nvmlInit()


def test_bad_arguments_are_invalid_argument(sim: SimulatedNvml) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(0)
    calls: list[Callable[[], object]] = [
        lambda: sim.nvmlDeviceGetHandleByIndex(3),
        lambda: sim.nvmlDeviceGetPowerUsage(None),
        lambda: sim.nvmlDeviceGetPowerUsage(pynvml.c_nvmlDevice_t()),  # NULL
        lambda: sim.nvmlDeviceGetPowerUsage(pynvml.c_nvmlDevice_t(pynvml.struct_c_nvmlDevice_t())),
        lambda: sim.nvmlDeviceGetTemperature(h, 5),
        lambda: sim.nvmlDeviceGetClockInfo(h, 42),
        lambda: sim.nvmlDeviceGetGpuInstanceId(h),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call()


# --- values --------------------------------------------------------------------------------


def test_same_seed_and_clock_give_identical_values() -> None:
    clock = FakeClock(T0)
    a, b, c = (SimulatedNvml(2, seed=s, clock=clock) for s in (11, 11, 12))
    for nvml in (a, b, c):
        nvml.nvmlInit()
    for _ in sweep(clock, 1200, 150):
        for i in range(2):
            same = snapshot(a, a.nvmlDeviceGetHandleByIndex(i))
            assert same == snapshot(b, b.nvmlDeviceGetHandleByIndex(i))
            assert same != snapshot(c, c.nvmlDeviceGetHandleByIndex(i))


def test_values_change_over_time_and_stay_in_range(sim: SimulatedNvml, clock: FakeClock) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(1)
    seen: dict[str, set[Any]] = {}
    for _ in sweep(clock, 3600, 23):
        s = snapshot(sim, h)
        for key in ("util", "power", "temp", "sm", "tx", "reasons"):
            seen.setdefault(key, set()).add(s[key] if key != "util" else s["util"][0])
        assert 0 <= s["util"][0] <= 100 and 0 <= s["util"][1] <= 100
        assert 0 <= s["enc"][0] <= 100 and 0 <= s["dec"][0] <= 100
        assert 70_000 <= s["power"] <= 700_000
        assert 30 <= s["temp"] <= 85 and 30 <= s["mem_temp"] <= 95
        assert s["sm"] <= 1980 and s["mem_clock"] == 2619
        total, reserved, free, used = s["memory"]
        assert used == sum(memory for _, memory in set(s["compute"]) | set(s["graphics"]))
        assert free == total - reserved - used >= 0
        assert sum(smutil for _, _, smutil, _, _ in s["samples"]) <= s["util"][0]
    assert all(len(seen[key]) > 10 for key in ("util", "power", "temp", "tx"))
    assert seen["sm"] > {1980} and seen["reasons"] > {0}


def test_energy_integrates_power_and_counters_never_decrease(
    sim: SimulatedNvml, clock: FakeClock
) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(2)
    assert sim.nvmlDeviceGetTotalEnergyConsumption(h) == 0  # counts from driver load

    def read() -> dict[str, int]:
        return {
            "power": sim.nvmlDeviceGetPowerUsage(h),
            "energy": sim.nvmlDeviceGetTotalEnergyConsumption(h),
            "replays": sim.nvmlDeviceGetPcieReplayCounter(h),
            "ecc": sim.nvmlDeviceGetTotalEccErrors(h, 0, pynvml.NVML_VOLATILE_ECC),
            "violation": sim.nvmlDeviceGetViolationStatus(h, 0).violationTime,
        }

    previous = read()
    for _ in sweep(clock, 7200, 4):
        clock.now += 4
        now = read()
        for counter in ("energy", "replays", "ecc", "violation"):
            assert now[counter] >= previous[counter], counter
        # over 4 s, energy (mJ) ~ the mean of the powers (mW) at both ends * 4 s
        mean_power = (now["power"] + previous["power"]) / 2
        assert now["energy"] - previous["energy"] == pytest.approx(4 * mean_power, rel=0.02)
        previous = now
    assert previous["replays"] > 0 and previous["violation"] > 0


# --- processes -----------------------------------------------------------------------------


def test_processes_come_and_go(sim: SimulatedNvml, clock: FakeClock) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(0)
    pids_over_time, graphics = [], set()
    for _ in sweep(clock, 3600, 60):
        processes = sim.nvmlDeviceGetComputeRunningProcesses(h)
        graphics |= {p.pid for p in sim.nvmlDeviceGetGraphicsRunningProcesses(h)}
        assert len(processes) <= 4
        for p in processes:
            assert 1000 <= p.pid < 4_000_000
            assert p.usedGpuMemory % MIB == 0
            assert 256 * MIB <= p.usedGpuMemory <= 20 * 1024 * MIB
        pids_over_time.append(frozenset(p.pid for p in processes))
    assert len(set(pids_over_time)) > 10
    assert graphics


def test_fixed_pids_are_stable_and_spread_over_gpus(clock: FakeClock) -> None:
    nvml = SimulatedNvml(2, clock=clock, pids=[101, 102, 103, 104, 105])
    nvml.nvmlInit()
    expected = [{101, 103, 105}, {102, 104}]
    for _ in sweep(clock, 1800, 90):
        for h, pids in zip(handles(nvml), expected, strict=True):
            listed = nvml.nvmlDeviceGetComputeRunningProcesses(h)
            listed += nvml.nvmlDeviceGetGraphicsRunningProcesses(h)
            assert {p.pid for p in listed} == pids


def test_process_utilization_returns_only_newer_samples(
    sim: SimulatedNvml, clock: FakeClock
) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(0)
    samples = sim.nvmlDeviceGetProcessUtilization(h, 0)
    running = {p.pid for p in sim.nvmlDeviceGetComputeRunningProcesses(h)}
    running |= {p.pid for p in sim.nvmlDeviceGetGraphicsRunningProcesses(h)}
    assert {s.pid for s in samples} == running
    last_seen = max(s.timeStamp for s in samples)
    assert last_seen <= clock.now * 1e6
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetProcessUtilization(h, last_seen)
    clock.now += 1
    newer = sim.nvmlDeviceGetProcessUtilization(h, last_seen)
    assert all(s.timeStamp > last_seen for s in newer)
    assert sum(s.smUtil for s in newer) <= sim.nvmlDeviceGetUtilizationRates(h).gpu


def test_no_processes_means_idle_and_no_samples(clock: FakeClock) -> None:
    nvml = SimulatedNvml(1, clock=clock, processes_per_gpu=0)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 0
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(h, 0)


# --- MIG -----------------------------------------------------------------------------------


def test_mig_gpu_has_three_instances(mig_sim: SimulatedNvml) -> None:
    parent, other = handles(mig_sim)
    assert mig_sim.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert mig_sim.nvmlDeviceGetMigMode(other) == [0, 0]
    assert mig_sim.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig = [mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in range(3)]
    for index in range(3, 7):
        with pytest.raises(pynvml.NVMLError_NotFound):
            mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
    assert [mig_sim.nvmlDeviceGetGpuInstanceId(m) for m in mig] == [1, 5, 13]
    assert [mig_sim.nvmlDeviceGetName(m) for m in mig] == [
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "NVIDIA H100 80GB HBM3 MIG 2g.20gb",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
    ]
    assert all(mig_sim.nvmlDeviceGetUUID(m).startswith("MIG-") for m in mig)
    sizes = [mig_sim.nvmlDeviceGetMemoryInfo(m).total for m in mig]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) < 85_520_809_984


def test_mig_processes_carry_their_instance(mig_sim: SimulatedNvml) -> None:
    parent = mig_sim.nvmlDeviceGetHandleByIndex(0)
    on_parent = mig_sim.nvmlDeviceGetComputeRunningProcesses(parent)
    on_instances = []
    for i, gpu_instance in enumerate((1, 5, 13)):
        m = mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        processes = mig_sim.nvmlDeviceGetComputeRunningProcesses(m)
        assert all(p.gpuInstanceId == gpu_instance and p.computeInstanceId == 0 for p in processes)
        used = sum(p.usedGpuMemory for p in processes)
        assert mig_sim.nvmlDeviceGetMemoryInfo(m).used == used
        on_instances += processes
    assert sorted(p.pid for p in on_parent) == sorted(p.pid for p in on_instances)


def test_mig_unsupported_calls(mig_sim: SimulatedNvml) -> None:
    parent = mig_sim.nvmlDeviceGetHandleByIndex(0)
    m = mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    for call in (
        lambda: mig_sim.nvmlDeviceGetUtilizationRates(parent),
        lambda: mig_sim.nvmlDeviceGetProcessUtilization(parent, 0),
        lambda: mig_sim.nvmlDeviceGetUtilizationRates(m),
        lambda: mig_sim.nvmlDeviceGetProcessUtilization(m, 0),
        lambda: mig_sim.nvmlDeviceGetPowerUsage(m),
        lambda: mig_sim.nvmlDeviceGetClockInfo(m, pynvml.NVML_CLOCK_SM),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert mig_sim.nvmlDeviceGetPowerUsage(parent) > 0
    (entry,) = mig_sim.nvmlDeviceGetFieldValues(m, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert entry.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(mig_sim.nvmlDeviceGetHandleByIndex(1), 0)


# --- XID events ----------------------------------------------------------------------------


def test_xid_is_delivered_to_a_waiting_thread(sim: SimulatedNvml) -> None:
    h1 = sim.nvmlDeviceGetHandleByIndex(1)
    event_set = sim.nvmlEventSetCreate()
    assert isinstance(event_set, pynvml.c_nvmlEventSet_t)
    sim.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, event_set)
    waiter, received = wait_in_thread(sim, event_set)
    sim.inject_xid(0, 13)  # not registered: never delivered
    sim.inject_xid(1, 79)
    waiter.join(timeout=5)
    (data,) = received
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert data.eventData == 79
    assert data.gpuInstanceId == data.computeInstanceId == 0xFFFFFFFF
    assert sim.nvmlDeviceGetUUID(data.device) == sim.nvmlDeviceGetUUID(h1)
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait_v2(event_set, 20)
    sim.nvmlEventSetFree(event_set)


def test_every_registered_set_gets_the_event(sim: SimulatedNvml) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(2)
    sets = [sim.nvmlEventSetCreate() for _ in range(2)]
    for event_set in sets:
        sim.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    sim.inject_xid(2, 48)
    assert [sim.nvmlEventSetWait_v2(s, 0).eventData for s in sets] == [48, 48]


def wait_in_thread(nvml: SimulatedNvml, event_set: Any) -> tuple[threading.Thread, list[Any]]:
    """Start a thread blocked in nvmlEventSetWait_v2; it appends what it gets or raises."""
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(nvml.nvmlEventSetWait_v2(event_set, 10_000))
        except pynvml.NVMLError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.02)  # most likely blocked by now; a late waiter ends the same way
    return waiter, outcome


def test_freeing_the_set_wakes_the_waiter(sim: SimulatedNvml) -> None:
    event_set = sim.nvmlEventSetCreate()
    waiter, outcome = wait_in_thread(sim, event_set)
    sim.nvmlEventSetFree(event_set)
    waiter.join(timeout=5)
    assert [type(e) for e in outcome] == [pynvml.NVMLError_Uninitialized]
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlEventSetWait_v2(event_set, 0)


def test_shutdown_wakes_the_waiter(clock: FakeClock) -> None:
    nvml = SimulatedNvml(1, clock=clock)
    nvml.nvmlInit()
    waiter, outcome = wait_in_thread(nvml, nvml.nvmlEventSetCreate())
    nvml.nvmlShutdown()
    waiter.join(timeout=5)
    assert [type(e) for e in outcome] == [pynvml.NVMLError_Uninitialized]


# --- fault injection -----------------------------------------------------------------------


def test_lost_gpu_fails_every_call_with_its_handle(mig_sim: SimulatedNvml) -> None:
    parent, other = handles(mig_sim)
    m = mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    mig_sim.inject_fault(pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    for call in (
        lambda: mig_sim.nvmlDeviceGetHandleByIndex(0),
        lambda: mig_sim.nvmlDeviceGetPowerUsage(parent),
        lambda: mig_sim.nvmlDeviceGetMemoryInfo(m),
        lambda: mig_sim.nvmlDeviceGetFieldValues(parent, [pynvml.NVML_FI_DEV_MEMORY_TEMP]),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert mig_sim.nvmlDeviceGetPowerUsage(other) > 0
    assert mig_sim.nvmlDeviceGetCount() == 2
    mig_sim.clear_faults()
    assert mig_sim.nvmlDeviceGetPowerUsage(parent) > 0


def test_function_fault_applies_to_all_gpus(sim: SimulatedNvml) -> None:
    sim.inject_fault(pynvml.NVML_ERROR_NOT_SUPPORTED, function="nvmlDeviceGetPowerUsage")
    for h in handles(sim):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            sim.nvmlDeviceGetPowerUsage(h)
        assert sim.nvmlDeviceGetTotalEnergyConsumption(h) >= 0


def test_field_value_faults_go_into_each_entry(sim: SimulatedNvml) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(1)
    sim.inject_fault(pynvml.NVML_ERROR_UNKNOWN, gpu=1, function="nvmlDeviceGetFieldValues")
    entries = sim.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP, 1])
    assert [e.nvmlReturn for e in entries] == [pynvml.NVML_ERROR_UNKNOWN] * 2
    sim.clear_faults()
    entries = sim.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP, 1])
    assert [e.nvmlReturn for e in entries] == [
        pynvml.NVML_SUCCESS,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
    ]


def test_fault_on_init_and_bad_fault_arguments(clock: FakeClock) -> None:
    nvml = SimulatedNvml(1, clock=clock)
    nvml.inject_fault(pynvml.NVML_ERROR_NO_PERMISSION, function="nvmlInit")
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlInit()
    for kwargs in ({"gpu": 1}, {"function": "nvmlDeviceGetPower"}):
        with pytest.raises(ValueError):
            nvml.inject_fault(pynvml.NVML_ERROR_UNKNOWN, **kwargs)
    with pytest.raises(ValueError):
        nvml.inject_fault(0)
    with pytest.raises(ValueError):
        nvml.inject_xid(-1, 79)
