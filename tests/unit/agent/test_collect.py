"""The collection pipeline over the simulator: degradation, XID, MIG, attribution."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from edge_agent.catalog import parse_counters
from edge_agent.config import load
from edge_agent.nvml.backend import explain_init_failure
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import Snapshot
from harness.pipeline import make_pipeline


def value(snap: Snapshot, name: str, **labels: str) -> float | None:
    """Like prometheus_client's registry.get_sample_value: None when absent."""
    for s in snap.samples:
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items()):
            return s.value
    return None


def series(snap: Snapshot, name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for s in snap.samples if s.name == name]


def test_device_labels_follow_dcgm_exporter(tmp_path: Path) -> None:
    pipeline, _sim, _ = make_pipeline(tmp_path, gpus=2)
    snap = pipeline.collection.collect()
    pipeline.close()
    (gpu1,) = [lbl for lbl in series(snap, "DCGM_FI_DEV_GPU_UTIL") if lbl["gpu"] == "1"]
    assert list(gpu1) == [
        "gpu",
        "UUID",
        "device",
        "modelName",
        "pci_bus_id",
        "Hostname",
        "NodeName",
        "DCGM_FI_DRIVER_VERSION",
    ]
    assert gpu1["device"] == "nvidia1"
    assert gpu1["Hostname"] == gpu1["NodeName"] == "edge-node-1"  # NodeName: as ACK's
    assert gpu1["UUID"].startswith("GPU-")
    assert 0 <= (value(snap, "DCGM_FI_DEV_GPU_UTIL", gpu="1") or -1) <= 100
    power = value(snap, "DCGM_FI_DEV_POWER_USAGE", gpu="0")
    assert power is not None and 50 < power < 800  # watts, not milliwatts
    used = value(snap, "DCGM_FI_DEV_FB_USED", gpu="0")
    free = value(snap, "DCGM_FI_DEV_FB_FREE", gpu="0")
    reserved = value(snap, "DCGM_FI_DEV_FB_RESERVED", gpu="0")
    assert used is not None and free is not None and reserved is not None
    assert 80_000 < used + free + reserved <= 81_560  # MiB of an H100 80GB
    assert value(snap, "gpurelay_agent_info", backend="simulated") == 1


def test_energy_is_a_counter_that_grows(tmp_path: Path) -> None:
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=1)
    first = value(pipeline.collection.collect(), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    clock.advance(60)
    second = value(pipeline.collection.collect(), "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    pipeline.close()
    assert first is not None and second is not None
    assert 60 * 50_000 < second - first < 60 * 800_000  # mJ over a minute at 50..800 W


def test_lost_gpu_degrades_only_that_gpu_and_recovers(tmp_path: Path) -> None:
    pipeline, sim, clock = make_pipeline(tmp_path, gpus=2)
    pipeline.collection.collect()
    sim.inject_fault(pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    clock.advance(10)
    snap = pipeline.collection.collect()
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="1") is None
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="0") is not None
    assert value(snap, "gpurelay_agent_gpu_healthy", gpu="1") == 0
    assert value(snap, "gpurelay_agent_gpu_healthy", gpu="0") == 1
    assert value(snap, "gpurelay_collector_success", collector="device") == 0
    sim.clear_faults()
    clock.advance(10)
    snap = pipeline.collection.collect()
    pipeline.close()
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="1") is not None
    assert value(snap, "gpurelay_collector_success", collector="device") == 1


def test_field_unsupported_everywhere_is_reported_once(tmp_path: Path) -> None:
    pipeline, sim, clock = make_pipeline(tmp_path, gpus=2)
    sim.inject_fault(pynvml.NVML_ERROR_NOT_SUPPORTED, function="nvmlDeviceGetPowerUsage")
    snap = pipeline.collection.collect()
    clock.advance(10)
    snap = pipeline.collection.collect()
    pipeline.close()
    assert value(snap, "DCGM_FI_DEV_POWER_USAGE") is None
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="1") is not None
    assert value(snap, "gpurelay_agent_unsupported_field", field="DCGM_FI_DEV_POWER_USAGE") == 1


def test_transient_nvml_error_is_counted_and_the_series_returns(tmp_path: Path) -> None:
    pipeline, sim, clock = make_pipeline(tmp_path, gpus=1)
    sim.inject_fault(pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetTemperature")
    snap = pipeline.collection.collect()
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP") is None
    assert value(snap, "DCGM_FI_DEV_SM_CLOCK") is not None
    assert (
        value(
            snap,
            "gpurelay_agent_nvml_errors_total",
            field="DCGM_FI_DEV_GPU_TEMP",
            error="NVMLError_Unknown",
        )
        == 1
    )
    sim.clear_faults()
    clock.advance(10)
    snap = pipeline.collection.collect()
    pipeline.close()
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP") is not None


def test_xid_is_read_from_the_event_thread_without_blocking(tmp_path: Path) -> None:
    pipeline, sim, _ = make_pipeline(tmp_path, gpus=2)
    pipeline.xid.start()
    try:
        assert value(pipeline.collection.collect(), "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 0
        sim.inject_xid(1, 79)
        deadline = time.monotonic() + 5
        while pipeline.xid.last(pipeline.collection._device._devices[1].uuid) != 79:
            assert time.monotonic() < deadline, "XID event never arrived"
            time.sleep(0.01)
        started = time.perf_counter()
        snap = pipeline.collection.collect()
        assert time.perf_counter() - started < 0.4  # never waits for the event set
    finally:
        pipeline.close()
    assert value(snap, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79
    assert value(snap, "DCGM_FI_DEV_XID_ERRORS", gpu="0") == 0


def test_mig_instances_are_their_own_series(tmp_path: Path) -> None:
    pipeline, _sim, _ = make_pipeline(tmp_path, gpus=2, mig=True)
    snap = pipeline.collection.collect()
    pipeline.close()
    mig = [lbl for lbl in series(snap, "DCGM_FI_DEV_FB_USED") if "GPU_I_ID" in lbl]
    assert {(m["gpu"], m["GPU_I_PROFILE"]) for m in mig} == {
        ("0", "3g.40gb"),
        ("0", "2g.20gb"),
        ("0", "1g.10gb"),
    }
    assert all(m["UUID"] == mig[0]["UUID"] for m in mig)  # the parent GPU's UUID
    # utilisation is not defined for a GPU in MIG mode; its MIG processes are still listed
    assert value(snap, "DCGM_FI_DEV_GPU_UTIL", gpu="0") is None
    procs = [lbl for lbl in series(snap, "DCGM_CUSTOM_PROCESS_MEM_USED") if lbl["gpu"] == "0"]
    assert procs and all(p["GPU_I_ID"] in {m["GPU_I_ID"] for m in mig} for p in procs)


def test_processes_are_attributed_and_summed_per_container(tmp_path: Path) -> None:
    pipeline, _sim, _ = make_pipeline(tmp_path, gpus=2)
    snap = pipeline.collection.collect()
    pipeline.close()
    procs = series(snap, "DCGM_CUSTOM_PROCESS_MEM_USED")
    assert len(procs) == 8
    pods = [p for p in procs if p["PodName"]]
    host = [p for p in procs if not p["container_id"]]
    docker = [p for p in procs if p["container_id"] and not p["PodName"]]
    assert pods and host and docker
    assert all(p["NamespaceName"] and p["ContainerName"] for p in pods)
    assert all(len(p["container_id"]) == 12 for p in pods + docker)
    assert all(p["NodeName"] == "edge-node-1" for p in procs)
    assert all(p["ProcessName"] == "gpu_burn" for p in host)
    for p in pods + docker:
        own = value(snap, "DCGM_CUSTOM_PROCESS_MEM_USED", ProcessId=p["ProcessId"])
        total = value(
            snap, "DCGM_CUSTOM_CONTAINER_MEM_USED", container_id=p["container_id"], gpu=p["gpu"]
        )
        assert own is not None and total is not None and total >= own
    containers = series(snap, "DCGM_CUSTOM_CONTAINER_MEM_USED")
    assert all(c["container_id"] for c in containers)  # host processes are not a container
    sm = [value(snap, "DCGM_CUSTOM_PROCESS_SM_UTIL", ProcessId=p["ProcessId"]) for p in procs]
    assert all(v is not None and 0 <= v <= 100 for v in sm)


def test_user_counters_file_selects_the_fields(tmp_path: Path) -> None:
    csv = tmp_path / "mine.csv"
    csv.write_text("DCGM_FI_DEV_GPU_UTIL, gauge, util\nDCGM_FI_DEV_FB_USED, gauge, used\n")
    cfg = load(None, {"EDGE_AGENT_COUNTERS_FILE": str(csv)})
    pipeline, _sim, _ = make_pipeline(tmp_path, gpus=1, cfg=cfg)
    snap = pipeline.collection.collect()
    pipeline.close()
    dcgm = {s.name for s in snap.samples if s.name.startswith("DCGM_FI_")}
    assert dcgm == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}
    assert parse_counters(csv.read_text())[0].help == "util"


def test_driver_not_loaded_explains_itself() -> None:
    sim = SimulatedNvml(1, driver_loaded=False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded) as info:
        sim.nvmlInit()
    assert "kernel driver is not loaded" in explain_init_failure(info.value)


def test_cli_without_nvml_prints_one_line_not_a_traceback() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has working NVML; the no-NVML path cannot be shown here")
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent", "once"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edge-agent: error: NVML is not available")
    assert "--simulate" in lines[0]


def test_a_collector_that_raises_is_logged_and_reported_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each collector runs through one timed-and-caught step (issue 25, item 5): a bug in
    one is logged, its gpurelay_collector_success is 0, the others' series still go out,
    and the process collector's families stay declared (empty)."""
    pipeline, _sim, _clock = make_pipeline(tmp_path, gpus=1)
    collection = pipeline.collection
    process = collection._process
    assert process is not None

    def broken(sink: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(process, "collect", broken)
    snap = collection.collect()
    pipeline.close()
    assert value(snap, "gpurelay_collector_success", collector="process") == 0
    assert value(snap, "gpurelay_collector_success", collector="device") == 1
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="0") is not None
    declared = {f.name for f in snap.families}
    assert {f.name for f in process.families} <= declared
    assert "process collector failed" in caplog.text
