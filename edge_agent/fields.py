"""Where each dcgm-exporter field comes from in NVML.

A :class:`Probe` memoises NVML calls for one device handle during one cycle, so fields
that share a call (the three memory fields, the two utilisation fields) cost one call.
A reader returns the value in dcgm-exporter's unit, or raises ``pynvml.NVMLError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib
from gpurelay.model import MIB


class Probe:
    """Memoised NVML calls on one handle for one collection cycle."""

    __slots__ = ("_memo", "handle", "lib", "xid")

    def __init__(self, lib: NvmlLib, handle: Handle, xid: int | None = None) -> None:
        self.lib = lib
        self.handle = handle
        self.xid = xid
        self._memo: dict[tuple[Any, ...], Any] = {}

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

    def memory(self) -> tuple[int, int, int, int]:
        """(total, reserved, free, used) in bytes; v2 when the driver has it."""
        try:
            m = self.call("nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
            return int(m.total), int(m.reserved), int(m.free), int(m.used)
        except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
            m = self.call("nvmlDeviceGetMemoryInfo")
            total, free, used = int(m.total), int(m.free), int(m.used)
            return total, max(total - free - used, 0), free, used


Reader = Callable[[Probe], float]


@dataclass(frozen=True, slots=True)
class FieldSource:
    read: Reader
    mig: bool = False  # also meaningful on a MIG instance handle


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


def _xid(probe: Probe) -> float:
    if probe.xid is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return float(probe.xid)


_C = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
_U = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_TX, _RX = pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES

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
    "DCGM_FI_PROF_PCIE_TX_BYTES": FieldSource(
        lambda p: p.call("nvmlDeviceGetPcieThroughput", _TX) * 1024.0
    ),
    "DCGM_FI_PROF_PCIE_RX_BYTES": FieldSource(
        lambda p: p.call("nvmlDeviceGetPcieThroughput", _RX) * 1024.0
    ),
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
    "DCGM_FI_DEV_FB_RESERVED": FieldSource(lambda p: p.memory()[1] // MIB, mig=True),
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
}

# Fields whose value becomes a label on every device series (prom type "label").
LABEL_SOURCES: frozenset[str] = frozenset(
    {"DCGM_FI_DRIVER_VERSION", "DCGM_FI_DEV_NAME", "DCGM_FI_DEV_UUID", "DCGM_FI_DEV_PCI_BUSID"}
)

# Why a well-known field has no NVML source, for the start-up report.
NO_SOURCE_REASONS: dict[str, str] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "needs DCGM profiling (not in NVML)",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "needs DCGM profiling (not in NVML)",
    "DCGM_FI_PROF_DRAM_ACTIVE": "needs DCGM profiling (not in NVML)",
    "DCGM_FI_PROF_SM_ACTIVE": "needs DCGM profiling (not in NVML)",
    "DCGM_FI_PROF_SM_OCCUPANCY": "needs DCGM profiling (not in NVML)",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "NVLink counters are not read by this agent yet",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "vGPU licensing is not read through NVML",
}
