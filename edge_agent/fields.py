"""Where each dcgm-exporter field comes from in NVML.

A :class:`Probe` memoises NVML calls for one device handle during one cycle, so fields
that share a call (the three memory fields, the two utilisation fields) cost one call.
A reader returns the value in dcgm-exporter's unit, or raises ``pynvml.NVMLError``, or
:class:`NoValueYet` for a rate whose first reading only starts the interval.

Fields measured over an interval (the ``DCGM_FI_PROF_*`` fields from NVML GPM, NVLink
bandwidth from cumulative counters) keep what they need from one cycle to the next in a
:class:`Carryover` per GPU or GPU instance, which the device collector owns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml

from edge_agent import health
from edge_agent.health import HealthHistory
from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.gpm import GpmStream
from gpurelay.model import MIB
from gpurelay.naming import DRIVER_LABEL, Rename, renames


class NoValueYet(Exception):
    """A field measured over an interval has no value in the first cycle: not an error."""


@dataclass(slots=True)
class Carryover:
    """What one GPU or GPU instance keeps from one cycle to the next."""

    gpm: GpmStream | None = None  # None: no NVML GPM here (or no longer: gpm_lost says why)
    totals: dict[str, tuple[float, float]] = field(default_factory=dict)  # (total, seconds)
    gpm_lost: str = ""  # why sampling was given up (NO_PERMISSION, ...), for the report
    health: HealthHistory = field(default_factory=HealthHistory)  # the DCGM_EXP_* series'

    def give_up_gpm(self, reason: str) -> None:
        """Sampling fails for good here: free the samples, read what has another source
        from it (PCIe throughput), leave the rest out."""
        if self.gpm is not None:
            self.gpm.close()
        self.gpm, self.gpm_lost = None, reason

    def rate(self, name: str, total: float, seconds: float) -> float:
        """Per second since the previous reading of the cumulative ``total``."""
        previous = self.totals.get(name)
        self.totals[name] = (total, seconds)
        if previous is None or seconds <= previous[1] or total < previous[0]:
            raise NoValueYet  # first reading, same instant, or the counter was reset
        return (total - previous[0]) / (seconds - previous[1])


class Probe:
    """Memoised NVML calls on one handle for one collection cycle."""

    __slots__ = ("_memo", "carry", "handle", "lib", "now", "xid", "xid_events", "xids_seen")

    def __init__(
        self,
        lib: NvmlLib,
        handle: Handle,
        xid: int | None = None,
        carry: Carryover | None = None,
        *,
        now: float = 0.0,
        xid_events: Sequence[tuple[float, int]] | None = None,
        xids_seen: frozenset[int] | None = None,
    ) -> None:
        self.lib = lib
        self.handle = handle
        self.xid = xid  # the last XID (None: XIDs cannot be watched on this GPU)
        self.carry = carry
        self.now = now  # monotonic seconds of this cycle (windows of the DCGM_EXP_* series)
        self.xid_events = xid_events  # (monotonic time, XID) the GPU reported, oldest first
        self.xids_seen = xids_seen  # every XID since the agent started
        self._memo: dict[tuple[Any, ...], Any] = {}

    @property
    def has_gpm(self) -> bool:
        return self.carry is not None and self.carry.gpm is not None

    def gpm(self, metric: int) -> float:
        """NVML GPM ``metric`` since the previous cycle (one sample per cycle, memoised)."""
        stream = self.carry.gpm if self.carry is not None else None
        if stream is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        try:
            hit = self._memo[("gpm",)]
        except KeyError:
            try:
                hit = stream.advance()
            except pynvml.NVMLError as exc:
                hit = exc
                reason = stream.gave_up()
                if reason is not None and self.carry is not None:
                    self.carry.give_up_gpm(reason)
            self._memo[("gpm",)] = hit
        if isinstance(hit, pynvml.NVMLError):
            raise hit
        if hit is None:
            raise NoValueYet
        value = hit[metric]
        if isinstance(value, pynvml.NVMLError):
            raise value
        if math.isnan(value):  # no time between the samples (DCGM publishes a blank)
            raise NoValueYet
        return float(value)

    def call(self, fn: str, *args: Any) -> Any:
        key = (fn, *args)
        try:
            hit = self._memo[key]
        except KeyError:
            try:
                hit = getattr(self.lib, fn)(self.handle, *args)
            except pynvml.NVMLError as exc:
                hit = exc
            self._memo[key] = hit
        if isinstance(hit, pynvml.NVMLError):
            raise hit
        return hit

    def memory(self) -> tuple[int, int | None, int, int]:
        """(total, reserved, free, used) in bytes; v2 when the driver has it.

        Before R510 only v1 exists, whose ``used`` includes the reserved memory and which
        cannot tell it: reserved is then None (DCGM reports FB_RESERVED unsupported there),
        and used is v1's, as nvidia-smi showed it on those drivers."""
        try:
            m = self.call("nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
            return int(m.total), int(m.reserved), int(m.free), int(m.used)
        except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
            m = self.call("nvmlDeviceGetMemoryInfo")
            return int(m.total), None, int(m.free), int(m.used)


Reader = Callable[[Probe], float]
SeriesReader = Callable[[Probe], health.Series]


@dataclass(frozen=True, slots=True)
class FieldSource:
    read: Reader
    mig: bool = False  # also meaningful on a MIG instance handle
    gpm: int = 0  # the NVML GPM metric it reads (0: none)
    gpm_only: bool = False  # no value at all without GPM (no other NVML source)
    # Several series per GPU, each with labels of its own (the DCGM_EXP_* health series):
    # read instead of ``read``.
    series: SeriesReader | None = None


def _several(reader: SeriesReader) -> FieldSource:
    def single(_probe: Probe) -> float:
        raise TypeError("a field of several series is read with FieldSource.series")

    return FieldSource(single, series=reader)


def _gpm(
    metric: int,
    scale: float = 1.0,
    *,
    per: float = 1.0,
    mig: bool = False,
    other: Reader | None = None,
) -> FieldSource:
    """A field from NVML GPM ``metric`` times ``scale`` over ``per``; where the GPU has no GPM, from
    ``other`` if given (else NOT_SUPPORTED)."""

    def read(p: Probe) -> float:
        if other is not None and not p.has_gpm:
            return other(p)
        try:
            return p.gpm(metric) * scale / per
        except pynvml.NVMLError:
            if other is not None and not p.has_gpm:  # sampling was just given up
                return other(p)
            raise

    return FieldSource(read, mig=mig, gpm=metric, gpm_only=other is None)


def _field_value(probe: Probe, field_id: int) -> float:
    (fv,) = probe.call("nvmlDeviceGetFieldValues", (field_id,))
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(fv.nvmlReturn)
    kind = fv.valueType
    v = fv.value
    if kind == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(v.ullVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(v.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(v.sllVal)
    return float(v.uiVal)


def _nvlink_rate(probe: Probe, key: str, scale: int) -> float:
    """The NVLink data counters (KiB, RX + TX, all links) times ``scale``, per second since
    the previous cycle (``key``: its carryover)."""
    entries = probe.call("nvmlDeviceGetFieldValues", _NVLINK_DATA_ALL_LINKS)
    for fv in entries:
        if fv.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(fv.nvmlReturn)
    total = float(sum(int(fv.value.ullVal) for fv in entries) * scale)
    seconds = max(int(fv.timestamp) for fv in entries) / 1e6
    assert probe.carry is not None, "the device collector gives every probe a carryover"
    return probe.carry.rate(key, total, seconds)


def _nvlink_total(probe: Probe) -> float:
    """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL as DCGM computes it: KiB per second / 1000."""
    return _nvlink_rate(probe, "nvlink_kib", 1) / 1000.0


def _nvlink_bytes(probe: Probe) -> float:
    """DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL under dcgm-exporter 4.9's unit: bytes per second
    (KiB x 1024)."""
    return _nvlink_rate(probe, "nvlink_bytes", 1024)


def _vgpu_license(probe: Probe) -> float:
    """1 while the vGPU feature is licensed, else 0 (also where vGPU licensing does not
    apply, such as a bare-metal GPU), as DCGM reads it."""
    features = probe.call("nvmlDeviceGetGridLicensableFeatures")
    if not features.isGridLicenseSupported:
        return 0.0
    count = min(int(features.licensableFeaturesCount), len(features.gridLicensableFeatures))
    for feature in features.gridLicensableFeatures[:count]:
        if feature.featureCode == pynvml.NVML_GRID_LICENSE_FEATURE_CODE_VGPU:
            return 1.0 if feature.featureState > 0 else 0.0
    return 0.0


def _clock_reasons(probe: Probe) -> float:
    try:
        return float(probe.call("nvmlDeviceGetCurrentClocksEventReasons"))
    except pynvml.NVMLError_FunctionNotFound:  # drivers older than 535
        return float(probe.call("nvmlDeviceGetCurrentClocksThrottleReasons"))


def _violation_ns(policy: int) -> Reader:
    """Nanoseconds, as NVML's ``violationTime`` counts them and dcgm-exporter documents them."""
    return lambda p: float(p.call("nvmlDeviceGetViolationStatus", policy).violationTime)


def _ecc(error_type: int, counter: int) -> Reader:
    return lambda p: float(p.call("nvmlDeviceGetTotalEccErrors", error_type, counter))


def _retired(cause: int) -> Reader:
    return lambda p: float(len(p.call("nvmlDeviceGetRetiredPages", cause)))


def _reserved_bytes(probe: Probe) -> float:
    reserved = probe.memory()[1]
    if reserved is None:  # memory info v1 only (before R510)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return float(reserved)


def _reserved(probe: Probe) -> float:
    return _reserved_bytes(probe) // MIB


def _xid(probe: Probe) -> float:
    if probe.xid is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return float(probe.xid)


_C = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
_U = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_TX, _RX = pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES
_PERCENT = 100.0  # GPM activity is in percent, DCGM's profiling fields are ratios (0-1):
# divided, so that 70 % is 0.7 exactly (70 * 0.01 is 0.7000000000000001)
_ALL_LINKS = 0xFFFFFFFF  # field value scope: every NVLink of the GPU
_NVLINK_DATA_ALL_LINKS = (
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS),
)

SOURCES: dict[str, FieldSource] = {
    "DCGM_FI_DEV_SM_CLOCK": FieldSource(
        lambda p: p.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM)
    ),
    "DCGM_FI_DEV_MEM_CLOCK": FieldSource(
        lambda p: p.call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM)
    ),
    "DCGM_FI_DEV_GPU_TEMP": FieldSource(
        lambda p: p.call("nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU)
    ),
    "DCGM_FI_DEV_MEMORY_TEMP": FieldSource(
        lambda p: _field_value(p, pynvml.NVML_FI_DEV_MEMORY_TEMP)
    ),
    "DCGM_FI_DEV_POWER_USAGE": FieldSource(lambda p: p.call("nvmlDeviceGetPowerUsage") / 1000.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": FieldSource(
        lambda p: p.call("nvmlDeviceGetTotalEnergyConsumption")
    ),
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": FieldSource(
        lambda p: p.call("nvmlDeviceGetPcieThroughput", _TX)
    ),
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": FieldSource(
        lambda p: p.call("nvmlDeviceGetPcieThroughput", _RX)
    ),
    # PCIe bytes/s from GPM (MiB/s) where the GPU has it, else NVML's 20 ms throughput (KB/s).
    "DCGM_FI_PROF_PCIE_TX_BYTES": _gpm(
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        MIB,
        other=lambda p: p.call("nvmlDeviceGetPcieThroughput", _TX) * 1024.0,
    ),
    "DCGM_FI_PROF_PCIE_RX_BYTES": _gpm(
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        MIB,
        other=lambda p: p.call("nvmlDeviceGetPcieThroughput", _RX) * 1024.0,
    ),
    # DCGM's profiling fields from NVML GPM, as DCGM maps them (DcgmFieldIdToNvmlGpmMetricId);
    # the activity fields per GPU instance too, PCIe and NVLink per GPU only.
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": _gpm(
        pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, per=_PERCENT, mig=True
    ),
    "DCGM_FI_PROF_SM_ACTIVE": _gpm(pynvml.NVML_GPM_METRIC_SM_UTIL, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_SM_OCCUPANCY": _gpm(pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": _gpm(
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, per=_PERCENT, mig=True
    ),
    "DCGM_FI_PROF_DRAM_ACTIVE": _gpm(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": _gpm(pynvml.NVML_GPM_METRIC_FP64_UTIL, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": _gpm(pynvml.NVML_GPM_METRIC_FP32_UTIL, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": _gpm(pynvml.NVML_GPM_METRIC_FP16_UTIL, per=_PERCENT, mig=True),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": _gpm(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, MIB),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": _gpm(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, MIB),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": FieldSource(_nvlink_total),
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": FieldSource(_vgpu_license),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": FieldSource(
        lambda p: p.call("nvmlDeviceGetPcieReplayCounter")
    ),
    "DCGM_FI_DEV_GPU_UTIL": FieldSource(lambda p: p.call("nvmlDeviceGetUtilizationRates").gpu),
    "DCGM_FI_DEV_MEM_COPY_UTIL": FieldSource(
        lambda p: p.call("nvmlDeviceGetUtilizationRates").memory
    ),
    "DCGM_FI_DEV_ENC_UTIL": FieldSource(lambda p: p.call("nvmlDeviceGetEncoderUtilization")[0]),
    "DCGM_FI_DEV_DEC_UTIL": FieldSource(lambda p: p.call("nvmlDeviceGetDecoderUtilization")[0]),
    "DCGM_FI_DEV_XID_ERRORS": FieldSource(_xid),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": FieldSource(_clock_reasons),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": FieldSource(_clock_reasons),
    "DCGM_FI_DEV_POWER_VIOLATION": FieldSource(_violation_ns(pynvml.NVML_PERF_POLICY_POWER)),
    "DCGM_FI_DEV_THERMAL_VIOLATION": FieldSource(_violation_ns(pynvml.NVML_PERF_POLICY_THERMAL)),
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": FieldSource(
        _violation_ns(pynvml.NVML_PERF_POLICY_SYNC_BOOST)
    ),
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": FieldSource(
        _violation_ns(pynvml.NVML_PERF_POLICY_BOARD_LIMIT)
    ),
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": FieldSource(
        _violation_ns(pynvml.NVML_PERF_POLICY_LOW_UTILIZATION)
    ),
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": FieldSource(
        _violation_ns(pynvml.NVML_PERF_POLICY_RELIABILITY)
    ),
    "DCGM_FI_DEV_FB_FREE": FieldSource(lambda p: p.memory()[2] // MIB, mig=True),
    "DCGM_FI_DEV_FB_USED": FieldSource(lambda p: p.memory()[3] // MIB, mig=True),
    "DCGM_FI_DEV_FB_RESERVED": FieldSource(_reserved, mig=True),
    "DCGM_FI_DEV_FB_TOTAL": FieldSource(lambda p: p.memory()[0] // MIB, mig=True),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": FieldSource(_ecc(_C, pynvml.NVML_VOLATILE_ECC)),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": FieldSource(_ecc(_U, pynvml.NVML_VOLATILE_ECC)),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": FieldSource(_ecc(_C, pynvml.NVML_AGGREGATE_ECC)),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": FieldSource(_ecc(_U, pynvml.NVML_AGGREGATE_ECC)),
    "DCGM_FI_DEV_RETIRED_SBE": FieldSource(
        _retired(pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    ),
    "DCGM_FI_DEV_RETIRED_DBE": FieldSource(
        _retired(pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    ),
    "DCGM_FI_DEV_RETIRED_PENDING": FieldSource(
        lambda p: p.call("nvmlDeviceGetRetiredPagesPendingStatus")
    ),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": FieldSource(
        lambda p: p.call("nvmlDeviceGetRemappedRows")[0]
    ),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": FieldSource(
        lambda p: p.call("nvmlDeviceGetRemappedRows")[1]
    ),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": FieldSource(lambda p: p.call("nvmlDeviceGetRemappedRows")[3]),
    # dcgm-exporter's own health series (edge_agent.health)
    "DCGM_EXP_XID_ERRORS_COUNT": _several(health.xid_counts),
    "DCGM_EXP_CLOCK_EVENTS_COUNT": _several(lambda p: health.clock_event_counts(p, _clock_reasons)),
    "DCGM_EXP_GPU_HEALTH_STATUS": _several(health.health_status),
}

# dcgm-exporter 4.9's names (gpurelay.naming): the same reading under the DCGM 4.7 name,
# in 4.9's unit. Where 4.8's unit loses precision (whole MiB, MB/s of KiB), the 4.9 field
# is read from NVML's own figure, not from the 4.8 value.
_READ_IN_NEW_UNIT: dict[str, FieldSource] = {
    "DCGM_FI_DEV_FB_FREE_BYTES": FieldSource(lambda p: float(p.memory()[2]), mig=True),
    "DCGM_FI_DEV_FB_USED_BYTES": FieldSource(lambda p: float(p.memory()[3]), mig=True),
    "DCGM_FI_DEV_FB_RESERVED_BYTES": FieldSource(_reserved_bytes, mig=True),
    "DCGM_FI_DEV_FB_CAPACITY_BYTES": FieldSource(lambda p: float(p.memory()[0]), mig=True),
    "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL": FieldSource(_nvlink_bytes),
}


def _renamed(old: FieldSource, rename: Rename) -> FieldSource:
    if not rename.rescales:
        return old
    return replace(old, read=lambda p: rename.to_new(old.read(p)))


SOURCES.update(
    {
        r.new: _READ_IN_NEW_UNIT.get(r.new) or _renamed(SOURCES[r.old], r)
        for r in renames()
        if r.old in SOURCES
    }
)

# The fields read from the XID event set (none where it cannot be opened).
XID_FIELDS: frozenset[str] = frozenset(
    {"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR", "DCGM_EXP_XID_ERRORS_COUNT"}
)

# Fields whose value becomes a label on every device series (prom type "label").
DRIVER_LABELS: frozenset[str] = frozenset(DRIVER_LABEL.values())  # either scheme's name
LABEL_SOURCES: frozenset[str] = DRIVER_LABELS | {
    "DCGM_FI_DEV_NAME",
    "DCGM_FI_DEV_UUID",
    "DCGM_FI_DEV_PCI_BUSID",
}

# Why a well-known field has no NVML source, for the start-up report.
NO_SOURCE_REASONS: dict[str, str] = {
    "DCGM_EXP_P2P_STATUS": "dcgm-exporter's own NVLink P2P check (not in NVML)",
}
