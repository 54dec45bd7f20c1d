"""dcgm-exporter's health series, computed from NVML instead of DCGM.

Three series users alert on, under dcgm-exporter's names and labels, each enabled by its
line in the counters CSV (as in dcgm-exporter, whose default CSV lists them commented out):

``DCGM_EXP_XID_ERRORS_COUNT``
    Per GPU and XID, the XIDs the driver reported within the last window
    (``xid_count_window_ms``, 5 minutes by default, dcgm-exporter's
    ``--xid-count-window-size``); labels ``xid`` and ``window_size_in_ms``. A GPU with no
    XID in the window has one series, without ``xid``, at 0.
``DCGM_EXP_CLOCK_EVENTS_COUNT``
    Per GPU and clock-event reason, the collections within the last window
    (``clock_events_count_window_ms``) whose clock-event reasons had that reason's bit
    set; labels ``clock_event`` (``gpu_idle``, ``clocks_setting``, ``power_cap``,
    ``hw_slowdown``, ``sync_boost``, ``sw_thermal``, ``hw_thermal``, ``hw_power_brake``,
    ``display_clocks``) and ``window_size_in_ms``. dcgm-exporter counts DCGM's samples of
    the reasons field, one per watch interval; here one per collection, so the count
    scales with ``interval_seconds`` as dcgm-exporter's does with its collect interval.
    As there, a GPU whose reasons were all clear for the whole window has no series.
``DCGM_EXP_GPU_HEALTH_STATUS``
    Per GPU, one series for each of DCGM's health watches that dcgm-exporter reports
    (:data:`WATCHES`), valued as DCGM's result: 0 pass, 10 warn, 20 fail; labels
    ``health_watch`` and ``health_error_code`` (``DCGM_FR_OK`` while passing). The rules
    are DCGM's own (its health module, ``DcgmHealthWatch.cpp``), applied to what NVML
    reads: see :data:`XID_RULES` and :func:`incidents`. Watches with no NVML source (PMU,
    MCU, SM, DRIVER) always pass here; ``docs/metrics.md`` lists what each watch checks.

Sources read: dcgm-exporter 4.8.2 (``internal/pkg/collector``: the xid, clock-events
and GPU-health collectors and ``expcollector.go``; the window defaults in
``pkg/cmd/app.go``) and DCGM 4.6.0 (``modules/health/DcgmHealthWatch.cpp``,
``common/DcgmGPUHardwareLimits.h``, ``dcgmlib/dcgm_errors.h``).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import pynvml

from gpurelay.model import Labels

if TYPE_CHECKING:
    from edge_agent.fields import Probe

DEFAULT_WINDOW_MS: Final = 300_000  # dcgm-exporter's default for both windows (5 minutes)
VIOLATION_WINDOW: Final = 60.0  # DCGM: thermal and power violation time over the last minute

PASS, WARN, FAIL = 0, 10, 20  # dcgmHealthWatchResults_t
OK: Final = "DCGM_FR_OK"

# dcgm-exporter's order (gpu_health_collector.go: gpuHealthChecks).
WATCHES: Final = (
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

# The clock-event reason bits (NVML's nvmlClocksEventReason*, the same as DCGM's
# DCGM_CLOCKS_EVENT_REASON_*) and dcgm-exporter's names for them.
CLOCK_EVENTS: Final = (
    (0x001, "gpu_idle"),
    (0x002, "clocks_setting"),
    (0x004, "power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal"),
    (0x040, "hw_thermal"),
    (0x080, "hw_power_brake"),
    (0x100, "display_clocks"),
)

# DCGM's XID mappings (DcgmHealthWatch::BuildXidMappings): XID -> (watch, result, error
# code). An XID counts from when it was reported until the agent restarts, as in DCGM
# (its XID history is never cleared). Left out: XID 93 (corrupt InfoROM), which DCGM
# counts on Volta only; NVML's architecture query is not read here.
XID_RULES: Final[dict[int, tuple[str, int, str]]] = {
    # "devastating" XIDs, always on, reported under ALL
    48: ("ALL", FAIL, "DCGM_FR_XID_ERROR"),
    74: ("ALL", FAIL, "DCGM_FR_XID_ERROR"),
    79: ("ALL", FAIL, "DCGM_FR_FALLEN_OFF_BUS"),
    94: ("ALL", WARN, "DCGM_FR_CONTAINED_ERROR"),
    95: ("ALL", FAIL, "DCGM_FR_UNCONTAINED_ERROR"),
    119: ("ALL", FAIL, "DCGM_FR_XID_ERROR"),
    120: ("ALL", FAIL, "DCGM_FR_XID_ERROR"),
    140: ("ALL", FAIL, "DCGM_FR_XID_ERROR"),
    # memory
    31: ("MEM", WARN, "DCGM_FR_XID_ERROR"),
    32: ("MEM", WARN, "DCGM_FR_XID_ERROR"),
    43: ("MEM", WARN, "DCGM_FR_XID_ERROR"),
    63: ("MEM", WARN, "DCGM_FR_PENDING_PAGE_RETIREMENTS"),
    64: ("MEM", FAIL, "DCGM_FR_ROW_REMAP_FAILURE"),
    # PCIe
    38: ("PCIE", WARN, "DCGM_FR_XID_ERROR"),
    39: ("PCIE", WARN, "DCGM_FR_XID_ERROR"),
    42: ("PCIE", WARN, "DCGM_FR_XID_ERROR"),
    # thermal
    60: ("THERMAL", WARN, "DCGM_FR_CLOCKS_EVENT_THERMAL"),
    61: ("THERMAL", WARN, "DCGM_FR_XID_ERROR"),
    62: ("THERMAL", WARN, "DCGM_FR_XID_ERROR"),
    # power
    54: ("POWER", WARN, "DCGM_FR_XID_ERROR"),
    56: ("POWER", WARN, "DCGM_FR_XID_ERROR"),
    57: ("POWER", WARN, "DCGM_FR_CLOCKS_EVENT_POWER"),
    58: ("POWER", WARN, "DCGM_FR_XID_ERROR"),
    78: ("POWER", WARN, "DCGM_FR_XID_ERROR"),
    # NVLink
    67: ("NVLINK", WARN, "DCGM_FR_XID_ERROR"),
    73: ("NVLINK", WARN, "DCGM_FR_XID_ERROR"),
    121: ("NVLINK", WARN, "DCGM_FR_XID_ERROR"),
    137: ("NVLINK", WARN, "DCGM_FR_XID_ERROR"),
}

# DCGM's limits (common/DcgmGPUHardwareLimits.h).
MAX_RETIRED_PAGES: Final = 63  # SBE + DBE retired pages at or above: FAIL
MAX_ROW_REMAP_UNCORRECTABLE: Final = 512  # uncorrectable remapped rows at or above: WARN

T = TypeVar("T")
Incident = tuple[str, int, str]  # (watch, result, error code)
Series = list[tuple[Labels, float]]  # extra labels and value, per series of one GPU


@dataclass(slots=True)
class HealthHistory:
    """What one GPU keeps from one collection to the next for these series."""

    xid_window_ms: int = DEFAULT_WINDOW_MS
    clock_window_ms: int = DEFAULT_WINDOW_MS
    clock_events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, reasons)
    violations: dict[int, deque[tuple[float, int]]] = field(default_factory=dict)  # policy ->

    def violation_grew(self, policy: int, now: float, ns: int) -> bool:
        """Whether the violation time under ``policy`` moved within the last minute (DCGM:
        the first and the last sample of the minute differ)."""
        samples = self.violations.setdefault(policy, deque())
        samples.append((now, ns))
        while samples and samples[0][0] < now - VIOLATION_WINDOW:
            samples.popleft()
        return samples[0][1] != ns


def xid_counts(probe: Probe) -> Series:
    """``DCGM_EXP_XID_ERRORS_COUNT``: the GPU's XIDs within the window, by XID."""
    history, events = _history(probe), probe.xid_events
    if events is None:  # the XID event set could not be registered for this GPU
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    window = (("window_size_in_ms", str(history.xid_window_ms)),)
    since = probe.now - history.xid_window_ms / 1000
    counts = Counter(xid for at, xid in events if at >= since)
    if not counts:
        return [(window, 0.0)]
    return [((*window, ("xid", str(xid))), float(n)) for xid, n in sorted(counts.items())]


def clock_event_counts(probe: Probe, reasons: Callable[[Probe], float]) -> Series:
    """``DCGM_EXP_CLOCK_EVENTS_COUNT``: collections within the window with each reason set.
    ``reasons`` reads the GPU's current clock-event reasons (raises as NVML does)."""
    history = _history(probe)
    samples = history.clock_events
    samples.append((probe.now, int(reasons(probe))))
    since = probe.now - history.clock_window_ms / 1000
    while samples and samples[0][0] < since:
        samples.popleft()
    window = (("window_size_in_ms", str(history.clock_window_ms)),)
    counts = Counter(name for _, mask in samples for bit, name in CLOCK_EVENTS if mask & bit)
    return [
        ((*window, ("clock_event", name)), float(counts[name]))
        for _, name in CLOCK_EVENTS
        if counts[name]
    ]


def health_status(probe: Probe) -> Series:
    """``DCGM_EXP_GPU_HEALTH_STATUS``: one series per watch, its worst incident's result
    and error code (the first found among equals), ``DCGM_FR_OK`` and 0 where none."""
    worst: dict[str, tuple[int, str]] = {}
    for watch, result, code in incidents(probe):
        if result > worst.get(watch, (PASS, OK))[0]:
            worst[watch] = (result, code)
    out: Series = []
    for watch in WATCHES:
        result, code = worst.get(watch, (PASS, OK))
        out.append(((("health_watch", watch), ("health_error_code", code)), float(result)))
    return out


def incidents(probe: Probe) -> list[Incident]:
    """DCGM's health checks that NVML can feed, in DCGM's order within each watch.

    - every watch: the XIDs of :data:`XID_RULES` reported since the agent started;
    - MEM: any volatile uncorrectable (double-bit) ECC error, FAIL; pages pending
      retirement, WARN; 63 or more retired pages (single- plus double-bit), FAIL; a failed
      row remapping, FAIL; 512 or more rows remapped after uncorrectable errors, WARN;
    - THERMAL, POWER: the thermal or power violation time grew within the last minute,
      WARN; POWER: the power reading fails (other than NOT_SUPPORTED), WARN.

    A check whose NVML call fails is skipped, as DCGM skips a blank sample."""
    found: list[Incident] = []
    seen = probe.xids_seen or frozenset()
    found += [XID_RULES[xid] for xid in sorted(seen) if xid in XID_RULES]
    found += _memory(probe)
    history = _history(probe)
    for policy, watch, code in (
        (pynvml.NVML_PERF_POLICY_THERMAL, "THERMAL", "DCGM_FR_CLOCKS_EVENT_THERMAL"),
        (pynvml.NVML_PERF_POLICY_POWER, "POWER", "DCGM_FR_CLOCKS_EVENT_POWER"),
    ):
        status = _read(partial(probe.call, "nvmlDeviceGetViolationStatus", policy))
        ns = None if status is None else int(status.violationTime)
        if ns is not None and history.violation_grew(policy, probe.now, ns):
            found.append((watch, WARN, code))
    try:
        probe.call("nvmlDeviceGetPowerUsage")
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError:
        found.append(("POWER", WARN, "DCGM_FR_POWER_UNREADABLE"))
    return found


def _memory(probe: Probe) -> list[Incident]:
    found: list[Incident] = []
    dbe = _read(
        lambda: probe.call(
            "nvmlDeviceGetTotalEccErrors",
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
    )
    if dbe is not None and dbe > 0:
        found.append(("MEM", FAIL, "DCGM_FR_VOLATILE_DBE_DETECTED"))
    pending = _read(lambda: probe.call("nvmlDeviceGetRetiredPagesPendingStatus"))
    if pending:
        found.append(("MEM", WARN, "DCGM_FR_PENDING_PAGE_RETIREMENTS"))
    retired = [
        _read(partial(probe.call, "nvmlDeviceGetRetiredPages", cause))
        for cause in (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
    ]
    if sum(len(pages) for pages in retired if pages is not None) >= MAX_RETIRED_PAGES:
        found.append(("MEM", FAIL, "DCGM_FR_RETIRED_PAGES_LIMIT"))
    rows = _read(lambda: probe.call("nvmlDeviceGetRemappedRows"))
    if rows is not None:
        _correctable, uncorrectable, _pending, failed = rows
        if failed:
            found.append(("MEM", FAIL, "DCGM_FR_ROW_REMAP_FAILURE"))
        if uncorrectable >= MAX_ROW_REMAP_UNCORRECTABLE:
            found.append(("MEM", WARN, "DCGM_FR_UNCORRECTABLE_ROW_REMAP_LIMIT"))
    return found


def _read(call: Callable[[], T]) -> T | None:
    """The call's answer, or None where NVML has none (unsupported, an error): DCGM skips a
    check whose sample is blank."""
    try:
        value = call()
    except pynvml.NVMLError:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _history(probe: Probe) -> HealthHistory:
    assert probe.carry is not None, "the device collector gives every probe a carryover"
    return probe.carry.health
