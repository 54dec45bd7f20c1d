"""dcgm-exporter's health series from NVML: DCGM_EXP_XID_ERRORS_COUNT,
DCGM_EXP_CLOCK_EVENTS_COUNT and DCGM_EXP_GPU_HEALTH_STATUS (edge_agent.health).

The rules under test are DCGM's (modules/health/DcgmHealthWatch.cpp, DCGM 4.6.0) and the
names and labels dcgm-exporter's (internal/pkg/collector, 4.8.2); each expected value
below is the one those sources give for the NVML answer the test sets up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from edge_agent import health
from edge_agent.config import load
from edge_agent.errors import ConfigError
from edge_agent.fields import Carryover, Probe
from edge_agent.health import FAIL, PASS, WARN, HealthHistory
from gpurelay.model import Snapshot
from harness.pipeline import make_pipeline


class Answers:
    """The NVML seam: each function answers what the test set, or raises the NVML error
    set for it (an int code), as the driver would."""

    def __init__(self, **answers: Any) -> None:
        self.answers = {
            "nvmlDeviceGetTotalEccErrors": 0,
            "nvmlDeviceGetRetiredPagesPendingStatus": 0,
            "nvmlDeviceGetRetiredPages": [],
            "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
            "nvmlDeviceGetViolationStatus": 0,
            "nvmlDeviceGetPowerUsage": 250_000,
            "nvmlDeviceGetCurrentClocksEventReasons": 0,
            **answers,
        }

    def __getattr__(self, name: str) -> Any:
        def call(_handle: object, *args: object) -> Any:
            answer = self.answers[name]
            if callable(answer):
                answer = answer(*args)
            if isinstance(answer, int) and name in self.errors:
                raise pynvml.NVMLError(answer)
            if name == "nvmlDeviceGetViolationStatus":
                return pynvml.c_nvmlViolationTime_t(referenceTime=0, violationTime=answer)
            return answer

        return call

    errors: frozenset[str] = frozenset()


def failing(name: str, code: int, **answers: Any) -> Answers:
    lib = Answers(**{name: code}, **answers)
    lib.errors = frozenset({name})
    return lib


def probe(lib: Answers, now: float, carry: Carryover, **kw: Any) -> Probe:
    return Probe(lib, object(), carry=carry, now=now, **kw)


def statuses(series: health.Series) -> dict[str, tuple[float, str]]:
    return {dict(lbl)["health_watch"]: (v, dict(lbl)["health_error_code"]) for lbl, v in series}


# --- DCGM_EXP_XID_ERRORS_COUNT ---------------------------------------------------------------


def test_xid_count_counts_each_xid_in_the_window() -> None:
    carry = Carryover(health=HealthHistory(xid_window_ms=60_000))
    events = ((10.0, 13), (50.0, 79), (55.0, 13), (65.0, 13))
    out = health.xid_counts(probe(Answers(), 100.0, carry, xid_events=events))
    # the window is [40, 100]: the XID 13 at t=10 is out of it
    assert out == [
        ((("window_size_in_ms", "60000"), ("xid", "13")), 2.0),
        ((("window_size_in_ms", "60000"), ("xid", "79")), 1.0),
    ]


def test_no_xid_in_the_window_is_one_series_at_zero_without_an_xid_label() -> None:
    carry = Carryover()
    out = health.xid_counts(probe(Answers(), 1_000.0, carry, xid_events=((1.0, 79),)))
    assert out == [((("window_size_in_ms", "300000"),), 0.0)]


def test_xid_count_is_not_supported_where_xids_are_not_watched() -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        health.xid_counts(probe(Answers(), 0.0, Carryover(), xid_events=None))


# --- DCGM_EXP_CLOCK_EVENTS_COUNT -------------------------------------------------------------


def test_clock_events_count_collections_with_each_reason_in_the_window() -> None:
    masks = iter([0x1, 0x1 | 0x40, 0x4, 0x40])
    lib = Answers(nvmlDeviceGetCurrentClocksEventReasons=lambda: next(masks))
    carry = Carryover(health=HealthHistory(clock_window_ms=25_000))
    reasons = _clock_reasons()
    out: health.Series = []
    for now in (0.0, 10.0, 20.0, 30.0):
        out = health.clock_event_counts(probe(lib, now, carry), reasons)
    # at t=30 the window [5, 30] holds the collections at 10 (0x41), 20 (0x4) and 30 (0x40)
    assert {dict(lbl)["clock_event"]: v for lbl, v in out} == {
        "gpu_idle": 1.0,
        "hw_thermal": 2.0,
        "power_cap": 1.0,
    }
    assert all(dict(lbl)["window_size_in_ms"] == "25000" for lbl, _ in out)


def test_reasons_clear_for_the_whole_window_give_no_series() -> None:
    carry = Carryover()
    out = health.clock_event_counts(probe(Answers(), 0.0, carry), _clock_reasons())
    assert out == []  # as dcgm-exporter: samples, but none with a reason set


def test_clock_events_read_error_raises_and_keeps_the_history() -> None:
    carry = Carryover()
    lib = failing("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        health.clock_event_counts(probe(lib, 0.0, carry), _clock_reasons())
    assert not carry.health.clock_events


def _clock_reasons() -> Any:
    from edge_agent.fields import _clock_reasons as reasons

    return reasons


# --- DCGM_EXP_GPU_HEALTH_STATUS --------------------------------------------------------------


def test_every_watch_passes_on_a_healthy_gpu() -> None:
    out = health.health_status(probe(Answers(), 0.0, Carryover(), xids_seen=frozenset()))
    assert [dict(lbl)["health_watch"] for lbl, _ in out] == list(health.WATCHES)
    assert set(statuses(out).values()) == {(PASS, "DCGM_FR_OK")}


@pytest.mark.parametrize(
    ("xid", "watch", "result", "code"),
    [
        (79, "ALL", FAIL, "DCGM_FR_FALLEN_OFF_BUS"),
        (48, "ALL", FAIL, "DCGM_FR_XID_ERROR"),
        (94, "ALL", WARN, "DCGM_FR_CONTAINED_ERROR"),
        (95, "ALL", FAIL, "DCGM_FR_UNCONTAINED_ERROR"),
        (63, "MEM", WARN, "DCGM_FR_PENDING_PAGE_RETIREMENTS"),
        (64, "MEM", FAIL, "DCGM_FR_ROW_REMAP_FAILURE"),
        (39, "PCIE", WARN, "DCGM_FR_XID_ERROR"),
        (60, "THERMAL", WARN, "DCGM_FR_CLOCKS_EVENT_THERMAL"),
        (57, "POWER", WARN, "DCGM_FR_CLOCKS_EVENT_POWER"),
        (74, "ALL", FAIL, "DCGM_FR_XID_ERROR"),
        (137, "NVLINK", WARN, "DCGM_FR_XID_ERROR"),
    ],
)
def test_xids_map_to_dcgm_watches(xid: int, watch: str, result: int, code: str) -> None:
    out = statuses(health.health_status(probe(Answers(), 0.0, Carryover(), xids_seen={xid})))
    assert out[watch] == (result, code)
    assert all(v == (PASS, "DCGM_FR_OK") for w, v in out.items() if w != watch)


def test_an_xid_outside_dcgm_mappings_changes_no_watch() -> None:
    out = statuses(health.health_status(probe(Answers(), 0.0, Carryover(), xids_seen={13})))
    assert set(out.values()) == {(PASS, "DCGM_FR_OK")}  # 13: an application's fault


@pytest.mark.parametrize(
    ("answers", "code", "result"),
    [
        ({"nvmlDeviceGetTotalEccErrors": 1}, "DCGM_FR_VOLATILE_DBE_DETECTED", FAIL),
        ({"nvmlDeviceGetRetiredPagesPendingStatus": 1}, "DCGM_FR_PENDING_PAGE_RETIREMENTS", WARN),
        ({"nvmlDeviceGetRetiredPages": list(range(32))}, "DCGM_FR_RETIRED_PAGES_LIMIT", FAIL),
        ({"nvmlDeviceGetRemappedRows": (0, 0, 0, 1)}, "DCGM_FR_ROW_REMAP_FAILURE", FAIL),
        (
            {"nvmlDeviceGetRemappedRows": (0, 512, 0, 0)},
            "DCGM_FR_UNCORRECTABLE_ROW_REMAP_LIMIT",
            WARN,
        ),
    ],
)
def test_memory_rules(answers: dict[str, Any], code: str, result: int) -> None:
    out = statuses(health.health_status(probe(Answers(**answers), 0.0, Carryover())))
    assert out["MEM"] == (result, code)


def test_memory_rules_stay_below_dcgm_limits() -> None:
    lib = Answers(
        nvmlDeviceGetRetiredPages=list(range(31)),  # 31 + 31 = 62 < 63
        nvmlDeviceGetRemappedRows=(100, 511, 0, 0),
    )
    assert statuses(health.health_status(probe(lib, 0.0, Carryover())))["MEM"][0] == PASS


def test_the_worst_incident_of_a_watch_wins() -> None:
    lib = Answers(nvmlDeviceGetRetiredPagesPendingStatus=1, nvmlDeviceGetTotalEccErrors=2)
    out = statuses(health.health_status(probe(lib, 0.0, Carryover(), xids_seen={63})))
    assert out["MEM"] == (FAIL, "DCGM_FR_VOLATILE_DBE_DETECTED")


def test_violation_time_that_grew_within_a_minute_warns_then_clears() -> None:
    ns = {pynvml.NVML_PERF_POLICY_THERMAL: 0, pynvml.NVML_PERF_POLICY_POWER: 0}
    lib = Answers(nvmlDeviceGetViolationStatus=lambda policy: ns[policy])
    carry = Carryover()

    def at(now: float) -> dict[str, tuple[float, str]]:
        return statuses(health.health_status(probe(lib, now, carry)))

    assert at(0.0)["THERMAL"] == (PASS, "DCGM_FR_OK")
    ns[pynvml.NVML_PERF_POLICY_THERMAL] = 5_000_000
    assert at(10.0)["THERMAL"] == (WARN, "DCGM_FR_CLOCKS_EVENT_THERMAL")
    assert at(10.0)["POWER"] == (PASS, "DCGM_FR_OK")
    # DCGM compares the first and the last sample of the last minute: the sample before
    # the growth (t=0) is in it until t=60
    assert at(59.0)["THERMAL"][0] == WARN
    assert at(61.0)["THERMAL"] == (PASS, "DCGM_FR_OK")
    ns[pynvml.NVML_PERF_POLICY_POWER] = 1
    assert at(80.0)["POWER"] == (WARN, "DCGM_FR_CLOCKS_EVENT_POWER")


def test_power_unreadable_warns_but_unsupported_does_not() -> None:
    broken = failing("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN)
    out = statuses(health.health_status(probe(broken, 0.0, Carryover())))
    assert out["POWER"] == (WARN, "DCGM_FR_POWER_UNREADABLE")
    absent = failing("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert statuses(health.health_status(probe(absent, 0.0, Carryover())))["POWER"][0] == PASS


def test_a_check_whose_call_fails_is_skipped_as_dcgm_skips_a_blank_sample() -> None:
    lib = failing("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_UNKNOWN)
    out = statuses(health.health_status(probe(lib, 0.0, Carryover())))
    assert out["MEM"] == (PASS, "DCGM_FR_OK")


# --- through the agent's pipeline and its configuration --------------------------------------

COUNTERS = """\
DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).
DCGM_EXP_XID_ERRORS_COUNT, counter, Count of XID Errors within user-specified time window.
DCGM_EXP_CLOCK_EVENTS_COUNT, counter, Count of clock events within user-specified time window.
DCGM_EXP_GPU_HEALTH_STATUS, counter, DCGM reported health status.
"""


def exp(snap: Snapshot, name: str, gpu: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), s.value)
        for s in snap.samples
        if s.name == name and dict(s.labels)["gpu"] == gpu
    ]


def test_an_xid_reaches_the_count_and_the_health_status(tmp_path: Path) -> None:
    csv = tmp_path / "counters.csv"
    csv.write_text(COUNTERS)
    cfg = load(None, {"EDGE_AGENT_COUNTERS_FILE": str(csv)})
    pipeline, sim, _ = make_pipeline(tmp_path, gpus=2, cfg=cfg)
    pipeline.xid.start()
    try:
        before = pipeline.collection.collect()
        sim.inject_xid(1, 79)
        uuid = pipeline.collection._device._devices[1].uuid
        deadline = time.monotonic() + 5
        while pipeline.xid.seen(uuid) != frozenset({79}):
            assert time.monotonic() < deadline, "XID event never arrived"
            time.sleep(0.01)
        after = pipeline.collection.collect()
    finally:
        pipeline.close()
    assert [v for _, v in exp(before, "DCGM_EXP_XID_ERRORS_COUNT", "1")] == [0.0]
    ((labels, count),) = exp(after, "DCGM_EXP_XID_ERRORS_COUNT", "1")
    assert (labels["xid"], labels["window_size_in_ms"], count) == ("79", "300000", 1.0)
    assert labels["UUID"] == uuid and labels["Hostname"] == "edge-node-1"
    ((_, zero),) = exp(after, "DCGM_EXP_XID_ERRORS_COUNT", "0")
    assert zero == 0.0
    status = {
        lbl["health_watch"]: (v, lbl["health_error_code"])
        for lbl, v in exp(after, "DCGM_EXP_GPU_HEALTH_STATUS", "1")
    }
    assert status["ALL"] == (FAIL, "DCGM_FR_FALLEN_OFF_BUS")
    other = {lbl["health_watch"]: v for lbl, v in exp(after, "DCGM_EXP_GPU_HEALTH_STATUS", "0")}
    assert other["ALL"] == PASS
    assert "DCGM_EXP_GPU_HEALTH_STATUS" not in pipeline.collection.unsupported


def test_windows_are_configurable_and_bounded() -> None:
    cfg = load(None, {"EDGE_AGENT_XID_COUNT_WINDOW_MS": "60000"})
    assert cfg.xid_count_window_ms == 60_000
    with pytest.raises(ConfigError, match="clock_events_count_window_ms"):
        load(None, {"EDGE_AGENT_CLOCK_EVENTS_COUNT_WINDOW_MS": "0"})
