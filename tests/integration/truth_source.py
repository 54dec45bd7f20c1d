"""What the simulator said: the source value of every figure the product publishes.

Issue 23, "Truth end to end": each figure a user reads must equal what NVML answered.
This module asks a :class:`~edge_agent.sim.nvml.SimulatedNvml` directly, with the
plain ``pynvml`` calls and dcgm-exporter's units, written out here independently of
``edge_agent.fields``: MiB = bytes // 2**20 (framebuffer), W = mW / 1000, GPM percent /
100 for the ``DCGM_FI_PROF_*`` ratios, PCIe bytes/s = GPM MiB/s * 2**20 (or, where the GPU
has no GPM, NVML's KB/s * 1024), NVLink = KiB moved per second / 1000 (DCGM's rule).

Fields measured over an interval (GPM, NVLink) need the instant the agent's previous
collection saw: :class:`Baseline` takes its own GPM samples and NVLink counters then,
and :func:`read_node` computes the window up to now. A call that fails means "no
value": such a field must be left out everywhere, never shown as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pynvml

from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.naming import by_new

MIB = 2**20
Handle = Any
WHOLE = ""  # the GPU_I_ID of a whole GPU's series (none)
_ALL_LINKS = 0xFFFFFFFF
_NVLINK_DATA: list[Any] = [  # (field id, scope): pynvml takes either
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS),
]
# GPM metric of each profiling field that is a share of time: percent in NVML, 0..1 in DCGM
_ACTIVITY = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "DCGM_FI_PROF_SM_ACTIVE": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "DCGM_FI_PROF_SM_OCCUPANCY": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "DCGM_FI_PROF_DRAM_ACTIVE": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": pynvml.NVML_GPM_METRIC_FP64_UTIL,
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": pynvml.NVML_GPM_METRIC_FP16_UTIL,
}
_PCIE = {  # field: (GPM metric in MiB/s, nvmlDeviceGetPcieThroughput counter in KB/s)
    "DCGM_FI_PROF_PCIE_TX_BYTES": (
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        pynvml.NVML_PCIE_UTIL_TX_BYTES,
    ),
    "DCGM_FI_PROF_PCIE_RX_BYTES": (
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        pynvml.NVML_PCIE_UTIL_RX_BYTES,
    ),
}
_GPM_METRICS = (*_ACTIVITY.values(), *(m for m, _ in _PCIE.values()))
# The same shares under dcgm-exporter 4.9's names (DCGM 4.6's aliases: the same field)
_ACTIVITY_49 = {
    "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "DCGM_FI_PROF_SM_UTIL_RATIO": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "DCGM_FI_PROF_SM_OCCUPANCY_RATIO": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "DCGM_FI_PROF_TENSOR_UTIL_RATIO": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "DCGM_FI_PROF_DRAM_UTIL_RATIO": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "DCGM_FI_PROF_FP64_UTIL_RATIO": pynvml.NVML_GPM_METRIC_FP64_UTIL,
    "DCGM_FI_PROF_FP32_UTIL_RATIO": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "DCGM_FI_PROF_FP16_UTIL_RATIO": pynvml.NVML_GPM_METRIC_FP16_UTIL,
}


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@dataclass(frozen=True)
class Device:
    """A whole GPU (``gpu_instance`` WHOLE) or one MIG GPU instance, and its figures."""

    gpu: str  # the index, as the ``gpu`` label
    gpu_instance: str  # GPU_I_ID
    uuid: str  # the physical GPU's (the UUID label of its instances' series too)
    profile: str  # the GPU instance's profile (GPU_I_PROFILE), "" for a whole GPU
    fields: dict[str, float]  # field -> value; a field NVML could not give is absent
    memory_bytes: tuple[int, int]  # (used, total) as nvmlDeviceGetMemoryInfo says
    # fields of several series (dcgm-exporter's DCGM_EXP_*): (field, their own labels) ->
    series: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @property
    def as48(self) -> dict[str, float]:
        """The figures under dcgm-exporter 4.8's names and units, whichever scheme the agent
        published: what the dashboards, the adapter rules and the page read (a 4.9 field
        in 4.8's unit, as they turn it: bytes / 2^20, a ratio x 100)."""
        out = dict(self.fields)
        for name, value in self.fields.items():
            rename = by_new().get(name)
            if rename is not None:
                out.setdefault(rename.old, rename.to_old(value))
        return out


@dataclass(frozen=True)
class Process:
    pid: int
    gpu: str
    gpu_instance: str
    uuid: str
    mem_mib: float | None  # None: NVML's "not available"
    util: dict[str, float] | None  # SM, MEM_COPY, ENCODE, DECODE %; None: not measured
    pod: tuple[str, str, str] | None  # (namespace, pod, container) of a Kubernetes pod


@dataclass(frozen=True)
class NodeTruth:
    node: str
    profile: str
    gpus: int
    devices: dict[tuple[str, str], Device]  # (gpu, GPU_I_ID) ->
    processes: dict[int, Process]
    backend: str = "simulated"  # gpurelay_agent_info's backend label
    # other series of the node than DCGM_* (a Jetson's gpurelay_jetson_*): (name, labels
    # that tell its series apart) -> value
    extra: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    # a Jetson's nvpmodel mode: (mode_id, mode, source)
    power_mode: tuple[tuple[str, str, str], ...] = ()

    def whole(self) -> list[Device]:
        return [d for (_, gi), d in sorted(self.devices.items()) if gi == WHOLE]

    def field(self, name: str) -> dict[tuple[str, str], float]:
        """(gpu, GPU_I_ID) -> value of ``name`` on every device that has it."""
        return {k: d.as48[name] for k, d in self.devices.items() if name in d.as48}


# --- the MIG layout, as NVML enumerates it ------------------------------------------------


def mig_instances(sim: SimulatedNvml, handle: Handle) -> dict[int, list[Handle]] | None:
    """GPU instance id -> its MIG devices' handles (one per compute instance), or None for
    a GPU not in MIG mode. A MIG device that cannot be opened is not there for anyone."""
    try:
        current, _pending = sim.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return None
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return None
    out: dict[int, list[Handle]] = {}
    for index in range(sim.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError:  # an empty slot, or one the caller may not open
            continue
        out.setdefault(sim.nvmlDeviceGetGpuInstanceId(mig), []).append(mig)
    return out


# --- the previous collection's instant ----------------------------------------------------


@dataclass
class Baseline:
    """GPM samples and NVLink counters taken at the agent's previous collection; freed by
    :func:`read_node`."""

    samples: dict[tuple[int, int | None], Any] = field(default_factory=dict)
    nvlink: dict[int, tuple[float, int]] = field(default_factory=dict)  # KiB, µs
    violations: dict[tuple[int, int], int] = field(default_factory=dict)  # (GPU, policy) -> ns

    @classmethod
    def take(cls, sim: SimulatedNvml) -> Baseline:
        base = cls()
        for index in range(sim.nvmlDeviceGetCount()):
            handle = sim.nvmlDeviceGetHandleByIndex(index)
            for gi in (None, *(mig_instances(sim, handle) or {})):
                sample = _sample(sim, handle, gi)
                if sample is not None:
                    base.samples[(index, gi)] = sample
            reading = _nvlink_counters(sim, handle)
            if reading is not None:
                base.nvlink[index] = reading
            for policy in _POLICIES:
                try:
                    ns = sim.nvmlDeviceGetViolationStatus(handle, policy).violationTime
                except pynvml.NVMLError:
                    continue
                base.violations[(index, policy)] = int(ns)
        return base


def _sample(sim: SimulatedNvml, handle: Handle, gi: int | None) -> Any:
    """A GPM sample of the GPU (or of its GPU instance ``gi``) now; None where NVML has
    none to give (no GPM on this GPU or driver, or sampling refused)."""
    try:
        if not sim.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            return None
        sample = sim.nvmlGpmSampleAlloc()
    except pynvml.NVMLError:
        return None
    try:
        if gi is None:
            sim.nvmlGpmSampleGet(handle, sample)
        else:
            sim.nvmlGpmMigSampleGet(handle, gi, sample)
    except pynvml.NVMLError:
        sim.nvmlGpmSampleFree(sample)
        return None
    return sample


def _nvlink_counters(sim: SimulatedNvml, handle: Handle) -> tuple[float, int] | None:
    """(KiB moved over all NVLinks, RX + TX, since the driver loaded; the reading's µs)."""
    entries = sim.nvmlDeviceGetFieldValues(handle, _NVLINK_DATA)
    if any(e.nvmlReturn != pynvml.NVML_SUCCESS for e in entries):
        return None
    return float(sum(int(e.value.ullVal) for e in entries)), max(int(e.timestamp) for e in entries)


def _gpm_window(sim: SimulatedNvml, first: Any, second: Any) -> dict[int, float]:
    """GPM metrics between two samples (a metric NVML does not give is absent)."""
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    get.numMetrics = len(_GPM_METRICS)
    get.sample1, get.sample2 = first, second
    for slot, metric in zip(get.metrics, _GPM_METRICS, strict=False):
        slot.metricId = metric
    sim.nvmlGpmMetricsGet(get)
    return {
        metric: float(slot.value)
        for slot, metric in zip(get.metrics, _GPM_METRICS, strict=False)
        if slot.nvmlReturn == pynvml.NVML_SUCCESS
    }


# --- device fields ----------------------------------------------------------------------


@dataclass
class _Now:
    """One device now: its handle, and its GPM metrics since the baseline (None: no GPM)."""

    sim: SimulatedNvml
    handle: Handle
    gpm: dict[int, float] | None
    nvlink: float | None = None  # KiB/s since the baseline

    def call(self, function: str, *args: Any) -> Any:
        return getattr(self.sim, function)(self.handle, *args)

    def memory(self) -> tuple[int, int | None, int, int]:
        """(total, reserved, free, used) bytes: memory info v2, or v1 on drivers before
        R510 (whose ``used`` includes the reserved memory, which v1 cannot tell)."""
        try:
            m = self.call("nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
            return int(m.total), int(m.reserved), int(m.free), int(m.used)
        except pynvml.NVMLError_FunctionNotFound:
            m = self.call("nvmlDeviceGetMemoryInfo")
            return int(m.total), None, int(m.free), int(m.used)

    def activity(self, field: str) -> float:
        metric = _ACTIVITY.get(field) or _ACTIVITY_49[field]
        value = None if self.gpm is None else self.gpm.get(metric)
        if value is None:
            raise _not_supported()
        return value / 100

    def pcie(self, field: str) -> float:
        metric, counter = _PCIE[field]
        if self.gpm is None:  # no GPM here: NVML's 20 ms throughput, KB/s
            return float(self.call("nvmlDeviceGetPcieThroughput", counter) * 1024)
        if metric not in self.gpm:
            raise _not_supported()
        return self.gpm[metric] * MIB

    def field_value(self, field_id: int) -> float:
        (entry,) = self.call("nvmlDeviceGetFieldValues", [field_id])
        if entry.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(entry.nvmlReturn)
        return float(entry.value.uiVal)

    def reserved(self) -> float:
        return float(self.reserved_bytes() // MIB)

    def reserved_bytes(self) -> float:
        reserved = self.memory()[1]
        if reserved is None:
            raise _not_supported()
        return float(reserved)

    def clock_reasons(self) -> float:
        try:
            return float(self.call("nvmlDeviceGetCurrentClocksEventReasons"))
        except pynvml.NVMLError_FunctionNotFound:  # before R535: the same bits, old name
            return float(self.call("nvmlDeviceGetCurrentClocksThrottleReasons"))

    def xid(self) -> float:
        """The last XID event of the GPU: none was queued, so 0 where XID events can be
        watched (DCGM: 0 for "none since start")."""
        if not self.call("nvmlDeviceGetSupportedEventTypes") & pynvml.nvmlEventTypeXidCriticalError:
            raise _not_supported()
        return 0.0

    def vgpu_license(self) -> float:
        features = self.call("nvmlDeviceGetGridLicensableFeatures")
        assert not features.isGridLicenseSupported, "the simulator plays bare-metal GPUs"
        return 0.0

    def nvlink_rate(self) -> float:
        """DCGM's "MB/s": KiB/s / 1000."""
        if self.nvlink is None:
            raise _not_supported()
        return self.nvlink / 1000

    def nvlink_bytes(self) -> float:
        """dcgm-exporter 4.9's B/s: KiB/s x 1024."""
        if self.nvlink is None:
            raise _not_supported()
        return self.nvlink * 1024


_C, _U = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_VOL, _AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC


def _violation(policy: int) -> Callable[[_Now], float]:
    return lambda n: float(n.call("nvmlDeviceGetViolationStatus", policy).violationTime)


def _ecc(error: int, counter: int) -> Callable[[_Now], float]:
    return lambda n: float(n.call("nvmlDeviceGetTotalEccErrors", error, counter))


def _retired(cause: int) -> Callable[[_Now], float]:
    return lambda n: float(len(n.call("nvmlDeviceGetRetiredPages", cause)))


# Every field of the agent's default counters file: how NVML gives it, in DCGM's unit.
FIELDS: dict[str, Callable[[_Now], float]] = {
    "DCGM_FI_DEV_SM_CLOCK": lambda n: n.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM),
    "DCGM_FI_DEV_MEM_CLOCK": lambda n: n.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM),
    "DCGM_FI_DEV_MEMORY_TEMP": lambda n: n.field_value(pynvml.NVML_FI_DEV_MEMORY_TEMP),
    "DCGM_FI_DEV_GPU_TEMP": lambda n: n.call(
        "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU
    ),
    "DCGM_FI_DEV_POWER_USAGE": lambda n: n.call("nvmlDeviceGetPowerUsage") / 1000,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda n: n.call("nvmlDeviceGetTotalEnergyConsumption"),
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": lambda n: n.call(
        "nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_TX_BYTES
    ),
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": lambda n: n.call(
        "nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_RX_BYTES
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": lambda n: n.call("nvmlDeviceGetPcieReplayCounter"),
    "DCGM_FI_DEV_GPU_UTIL": lambda n: n.call("nvmlDeviceGetUtilizationRates").gpu,
    "DCGM_FI_DEV_MEM_COPY_UTIL": lambda n: n.call("nvmlDeviceGetUtilizationRates").memory,
    "DCGM_FI_DEV_ENC_UTIL": lambda n: n.call("nvmlDeviceGetEncoderUtilization")[0],
    "DCGM_FI_DEV_DEC_UTIL": lambda n: n.call("nvmlDeviceGetDecoderUtilization")[0],
    "DCGM_FI_DEV_XID_ERRORS": _Now.xid,
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": _Now.clock_reasons,
    "DCGM_FI_DEV_POWER_VIOLATION": _violation(pynvml.NVML_PERF_POLICY_POWER),
    "DCGM_FI_DEV_THERMAL_VIOLATION": _violation(pynvml.NVML_PERF_POLICY_THERMAL),
    "DCGM_FI_DEV_FB_FREE": lambda n: float(n.memory()[2] // MIB),
    "DCGM_FI_DEV_FB_USED": lambda n: float(n.memory()[3] // MIB),
    "DCGM_FI_DEV_FB_RESERVED": _Now.reserved,
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": _ecc(_C, _VOL),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": _ecc(_U, _VOL),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": _ecc(_C, _AGG),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": _ecc(_U, _AGG),
    "DCGM_FI_DEV_RETIRED_SBE": _retired(
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    ),
    "DCGM_FI_DEV_RETIRED_DBE": _retired(pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    "DCGM_FI_DEV_RETIRED_PENDING": lambda n: n.call("nvmlDeviceGetRetiredPagesPendingStatus"),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": _Now.nvlink_rate,
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": _Now.vgpu_license,
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": lambda n: n.call("nvmlDeviceGetRemappedRows")[0],
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": lambda n: n.call("nvmlDeviceGetRemappedRows")[1],
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": lambda n: n.call("nvmlDeviceGetRemappedRows")[3],
    **{name: (lambda n, name=name: n.activity(name)) for name in _ACTIVITY},  # type: ignore[misc]
    **{name: (lambda n, name=name: n.pcie(name)) for name in _PCIE},  # type: ignore[misc]
    # dcgm-exporter 4.9's names (docs/migration.md), each in its own unit, from NVML
    "DCGM_FI_DEV_SM_CLOCK_HERTZ": lambda n: (
        n.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM) * 1_000_000
    ),
    "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ": lambda n: (
        n.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM) * 1_000_000
    ),
    "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS": lambda n: n.field_value(pynvml.NVML_FI_DEV_MEMORY_TEMP),
    "DCGM_FI_DEV_GPU_TEMP_CELSIUS": lambda n: n.call(
        "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU
    ),
    "DCGM_FI_DEV_BOARD_POWER_WATTS": lambda n: n.call("nvmlDeviceGetPowerUsage") / 1000,
    "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL": lambda n: (
        n.call("nvmlDeviceGetTotalEnergyConsumption") / 1000
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_TOTAL": lambda n: n.call("nvmlDeviceGetPcieReplayCounter"),
    "DCGM_FI_DEV_GPU_UTIL_RATIO": lambda n: n.call("nvmlDeviceGetUtilizationRates").gpu / 100,
    "DCGM_FI_DEV_MEMORY_COPY_UTIL_RATIO": lambda n: (
        n.call("nvmlDeviceGetUtilizationRates").memory / 100
    ),
    "DCGM_FI_DEV_ENC_UTIL_RATIO": lambda n: n.call("nvmlDeviceGetEncoderUtilization")[0] / 100,
    "DCGM_FI_DEV_DEC_UTIL_RATIO": lambda n: n.call("nvmlDeviceGetDecoderUtilization")[0] / 100,
    "DCGM_FI_DEV_XID_ERROR": _Now.xid,
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": _Now.clock_reasons,
    "DCGM_FI_DEV_FB_FREE_BYTES": lambda n: float(n.memory()[2]),
    "DCGM_FI_DEV_FB_USED_BYTES": lambda n: float(n.memory()[3]),
    "DCGM_FI_DEV_FB_RESERVED_BYTES": _Now.reserved_bytes,
    "DCGM_FI_DEV_FB_CAPACITY_BYTES": lambda n: float(n.memory()[0]),
    "DCGM_FI_DEV_PAGE_RETIRED_SBE_TOTAL": _retired(
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    ),
    "DCGM_FI_DEV_PAGE_RETIRED_DBE_TOTAL": _retired(
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    ),
    "DCGM_FI_DEV_PAGE_RETIRED_PENDING": lambda n: n.call("nvmlDeviceGetRetiredPagesPendingStatus"),
    "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL": _Now.nvlink_bytes,
    "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL": lambda n: n.call("nvmlDeviceGetRemappedRows")[0],
    "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL": lambda n: n.call("nvmlDeviceGetRemappedRows")[1],
    "DCGM_FI_DEV_ROW_REMAP_FAILED": lambda n: n.call("nvmlDeviceGetRemappedRows")[3],
    **{name: (lambda n, name=name: n.activity(name)) for name in _ACTIVITY_49},  # type: ignore[misc]
}
# --- dcgm-exporter's health series (DCGM_EXP_*), by DCGM's rules -----------------------------
#
# From dcgm-exporter 4.8.2 (internal/pkg/collector) and DCGM 4.6.0 (DcgmHealthWatch.cpp),
# written out here for what the simulator can show: no XID is queued in this test, no
# uncorrectable error, retired page or remapped row exists (the simulator has none), so
# what can move is the violation time, which DCGM warns on when it grew within the last
# minute: here between the two collections, STEP apart (less than a minute). A check whose
# call fails gives nothing, as DCGM skips a blank sample.

_POLICIES = (pynvml.NVML_PERF_POLICY_POWER, pynvml.NVML_PERF_POLICY_THERMAL)
_WATCHES = (
    "PCIE",
    "NVLINK",
    "PMU",
    "MCU",
    "MEM",
    "SM",
    "INFOROM",
    "THERMAL",
    "POWER",
    "DRIVER",
    "ALL",
)
Labelled = list[tuple[tuple[str, tuple[tuple[str, str], ...]], float]]


def _xid_counts(now: _Now, base: Baseline, index: int) -> Labelled:
    """No XID in the 5-minute window: one series at 0, without an xid label."""
    if not now.call("nvmlDeviceGetSupportedEventTypes") & pynvml.nvmlEventTypeXidCriticalError:
        return []
    return [(("DCGM_EXP_XID_ERRORS_COUNT", (("window_size_in_ms", "300000"),)), 0.0)]


def _health(now: _Now, base: Baseline, index: int) -> Labelled:
    verdict = {watch: (0.0, "DCGM_FR_OK") for watch in _WATCHES}
    for policy, watch, code in (
        (pynvml.NVML_PERF_POLICY_THERMAL, "THERMAL", "DCGM_FR_CLOCKS_EVENT_THERMAL"),
        (pynvml.NVML_PERF_POLICY_POWER, "POWER", "DCGM_FR_CLOCKS_EVENT_POWER"),
    ):
        before = base.violations.get((index, policy))
        try:
            after = int(now.call("nvmlDeviceGetViolationStatus", policy).violationTime)
        except pynvml.NVMLError:
            continue
        if before is not None and after != before:
            verdict[watch] = (10.0, code)
    try:
        now.call("nvmlDeviceGetPowerUsage")
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError:
        if verdict["POWER"][0] < 10.0:
            verdict["POWER"] = (10.0, "DCGM_FR_POWER_UNREADABLE")
    return [
        (("DCGM_EXP_GPU_HEALTH_STATUS", (("health_watch", w), ("health_error_code", c))), v)
        for w, (v, c) in verdict.items()
    ]


SEVERAL: dict[str, Callable[[_Now, Baseline, int], Labelled]] = {
    "DCGM_EXP_XID_ERRORS_COUNT": _xid_counts,
    "DCGM_EXP_GPU_HEALTH_STATUS": _health,
}

# What DCGM serves per MIG GPU instance too: its memory and its activity (not PCIe or
# NVLink traffic, which only the whole GPU has).
INSTANCE_FIELDS = frozenset(
    {"DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED", *_ACTIVITY}
    | {"DCGM_FI_DEV_FB_FREE_BYTES", "DCGM_FI_DEV_FB_USED_BYTES", "DCGM_FI_DEV_FB_RESERVED_BYTES"}
    | {"DCGM_FI_DEV_FB_CAPACITY_BYTES", *_ACTIVITY_49}
)


def _fields(now: _Now, names: frozenset[str]) -> dict[str, float]:
    out = {}
    for name in names:
        try:
            out[name] = float(FIELDS[name](now))
        except pynvml.NVMLError:  # NVML gave no value: none may be shown
            continue
    return out


# --- one node -----------------------------------------------------------------------------


def read_node(
    sim: SimulatedNvml,
    base: Baseline,
    *,
    node: str,
    counters: frozenset[str],
    pods: Mapping[int, tuple[str, str, str]],
) -> NodeTruth:
    """Every figure of the node now (the simulator's clock at the agent's latest
    collection), over the window since ``base`` for GPM and NVLink; ``counters``: the
    fields the agent collects; ``pods``: the fake host's pid -> pod."""
    unknown = counters - FIELDS.keys() - SEVERAL.keys()
    assert not unknown, f"fields without a source value here: {sorted(unknown)}"
    devices: dict[tuple[str, str], Device] = {}
    processes: dict[int, Process] = {}
    layout = {gi: profile for profile, gi, _, _ in sim.profile.mig_layout}
    for index in range(sim.nvmlDeviceGetCount()):
        handle = sim.nvmlDeviceGetHandleByIndex(index)
        uuid = sim.nvmlDeviceGetUUID(handle)
        gpu = str(index)
        mig = mig_instances(sim, handle)
        now = _Now(sim, handle, _window(sim, base, index, None))
        reading = _nvlink_counters(sim, handle)
        if reading is not None and index in base.nvlink:
            (kib1, us1), (kib2, us2) = base.nvlink[index], reading
            now.nvlink = (kib2 - kib1) / ((us2 - us1) / 1e6)
        total, _, _, used = now.memory()
        devices[(gpu, WHOLE)] = Device(
            gpu,
            WHOLE,
            uuid,
            "",
            _fields(now, counters - SEVERAL.keys()),
            (used, total),
            {
                k: v
                for name in counters & SEVERAL.keys()
                for k, v in SEVERAL[name](now, base, index)
            },
        )
        targets = {WHOLE: [handle]} if mig is None else {str(gi): h for gi, h in mig.items()}
        for gi, handles in (mig or {}).items():
            inst = _Now(sim, handles[0], _window(sim, base, index, gi))
            total, _, _, used = inst.memory()
            devices[(gpu, str(gi))] = Device(
                gpu,
                str(gi),
                uuid,
                layout[gi],
                _fields(inst, counters & INSTANCE_FIELDS),
                (used, total),
            )
        for gi_label, handles in targets.items():
            for p in _processes(sim, handles, pods, gpu=gpu, gi=gi_label, uuid=uuid):
                processes[p.pid] = p
    for sample in base.samples.values():
        sim.nvmlGpmSampleFree(sample)
    base.samples.clear()
    return NodeTruth(node, sim.profile.name, sim.nvmlDeviceGetCount(), devices, processes)


def _window(
    sim: SimulatedNvml, base: Baseline, index: int, gi: int | None
) -> dict[int, float] | None:
    first = base.samples.get((index, gi))
    if first is None:
        return None
    handle = sim.nvmlDeviceGetHandleByIndex(index)
    second = _sample(sim, handle, gi)
    if second is None:
        return None
    try:
        return _gpm_window(sim, first, second)
    finally:
        sim.nvmlGpmSampleFree(second)


def _processes(
    sim: SimulatedNvml,
    handles: list[Handle],
    pods: Mapping[int, tuple[str, str, str]],
    *,
    gpu: str,
    gi: str,
    uuid: str,
) -> list[Process]:
    """The compute and graphics processes on ``handles`` (a whole GPU, or the compute
    instances of one GPU instance), with their utilisation where NVML measures it."""
    memory: dict[int, int | None] = {}
    for handle in handles:
        for call in (
            sim.nvmlDeviceGetComputeRunningProcesses_v2,  # every driver since R450
            sim.nvmlDeviceGetGraphicsRunningProcesses_v2,
        ):
            for p in call(handle):
                memory[int(p.pid)] = p.usedGpuMemory
    util: dict[int, Any] | None
    try:
        util = {int(s.pid): s for s in sim.nvmlDeviceGetProcessUtilization(handles[0], 0)}
    except pynvml.NVMLError_NotFound:  # no process has a sample: all idle
        util = {}
    except pynvml.NVMLError:  # not measured (MIG devices)
        util = None
    out = []
    for pid, used in memory.items():
        shares = None
        if util is not None:
            s = util.get(pid)
            shares = {
                "SM": float(s.smUtil) if s else 0.0,
                "MEM_COPY": float(s.memUtil) if s else 0.0,
                "ENCODE": float(s.encUtil) if s else 0.0,
                "DECODE": float(s.decUtil) if s else 0.0,
            }
        out.append(
            Process(
                pid=pid,
                gpu=gpu,
                gpu_instance=gi,
                uuid=uuid,
                mem_mib=None if used is None else used / MIB,
                util=shares,
                pod=pods.get(pid),
            )
        )
    return out
