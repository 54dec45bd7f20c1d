"""The agent over machines that fail as real ones do (issue 23, items 1-9).

Each test drives a named simulator profile or an injected failure through the real
pipeline and checks two things: what the hardware said is published unchanged, and what
it did not say is left out (never a 0) with a reason in ``gpurelay_agent_degraded`` or
``gpurelay_agent_unsupported_field``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pynvml
import pytest

from edge_agent.config import load
from edge_agent.pipeline import Pipeline
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.bie import collect_document
from gpurelay.model import MIB, Snapshot
from harness.pipeline import FakeClock, make_pipeline


@contextmanager
def agent(tmp: Path, **kwargs: object) -> Iterator[tuple[Pipeline, SimulatedNvml, FakeClock]]:
    """make_pipeline, closed (and every injected hang released) on the way out."""
    pipeline, sim, clock = make_pipeline(tmp, **kwargs)  # type: ignore[arg-type]
    try:
        yield pipeline, sim, clock
    finally:
        sim.clear_faults()
        pipeline.close()


def samples(snap: Snapshot, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), s.value)
        for s in snap.samples
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items())
    ]


def one(snap: Snapshot, name: str, **labels: str) -> float:
    found = samples(snap, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0][1]


def degraded(snap: Snapshot) -> dict[tuple[str, str], str]:
    return {
        (lbl["gpu"], lbl["part"]): lbl["reason"]
        for lbl, _ in samples(snap, "gpurelay_agent_degraded")
    }


def process_memory(sim: SimulatedNvml, gpu: int) -> dict[int, int | None]:
    """pid -> bytes, as NVML lists them on ``gpu`` right now (the _v2 calls every driver
    since R450 has); None where NVML answered its not-available sentinel."""
    handle = sim.nvmlDeviceGetHandleByIndex(gpu)
    out: dict[int, int | None] = {}
    for call in (
        sim.nvmlDeviceGetComputeRunningProcesses_v2,
        sim.nvmlDeviceGetGraphicsRunningProcesses_v2,
    ):
        for p in call(handle):
            out[int(p.pid)] = p.usedGpuMemory
    return out


def published_memory(snap: Snapshot, gpu: str) -> dict[int, float]:
    return {
        int(lbl["ProcessId"]): v
        for lbl, v in samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED", gpu=gpu)
    }


# --- 1. drivers older than NVML 11.6 ---------------------------------------------------------


def test_old_driver_processes_come_from_the_v2_calls(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2, profile="r470") as (pipeline, sim, _):
        with pytest.raises(pynvml.NVMLLibraryMismatchError):  # what pynvml does on R470
            sim.nvmlDeviceGetComputeRunningProcesses(sim.nvmlDeviceGetHandleByIndex(0))
        snap = pipeline.collection.collect()
        for gpu in (0, 1):
            source = process_memory(sim, gpu)
            assert source, "the profile runs processes"
            expected = {pid: b / MIB for pid, b in source.items() if b is not None}
            assert published_memory(snap, str(gpu)) == expected
        assert one(snap, "gpurelay_collector_success", collector="process") == 1
        assert not degraded(snap)


# --- 2. process utilisation: a failed pass is not an idle pass ------------------------------


def test_a_failed_utilisation_pass_publishes_no_zero(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=1) as (pipeline, sim, clock):
        first = pipeline.collection.collect()
        assert samples(first, "DCGM_CUSTOM_PROCESS_SM_UTIL")
        sim.inject_fault(
            pynvml.NVML_ERROR_UNKNOWN, function="nvmlDeviceGetProcessUtilization", times=1
        )
        clock.advance(10)
        snap = pipeline.collection.collect()
        for family in (
            "DCGM_CUSTOM_PROCESS_SM_UTIL",
            "DCGM_CUSTOM_PROCESS_MEM_COPY_UTIL",
            "DCGM_CUSTOM_PROCESS_ENCODE_UTIL",
            "DCGM_CUSTOM_PROCESS_DECODE_UTIL",
            "DCGM_CUSTOM_CONTAINER_SM_UTIL",
        ):
            assert samples(snap, family) == [], f"{family} published although not measured"
        assert samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED"), "memory was measured"
        assert "Unknown Error" in degraded(snap)[("0", "process_utilization")]
        clock.advance(10)
        again = pipeline.collection.collect()
        assert samples(again, "DCGM_CUSTOM_PROCESS_SM_UTIL")
        assert ("0", "process_utilization") not in degraded(again)


def test_a_process_starting_between_the_sizing_calls_is_retried(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=1) as (pipeline, sim, clock):
        pipeline.collection.collect()
        clock.advance(10)
        handle = sim.nvmlDeviceGetHandleByIndex(0)
        source = {
            int(s.pid): float(s.smUtil) for s in sim.nvmlDeviceGetProcessUtilization(handle, 0)
        }
        sim.inject_fault(
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE, function="nvmlDeviceGetProcessUtilization", times=2
        )
        snap = pipeline.collection.collect()
        published = {
            int(lbl["ProcessId"]): v for lbl, v in samples(snap, "DCGM_CUSTOM_PROCESS_SM_UTIL")
        }
        assert published == source
        assert not degraded(snap)


# --- 3. the graphics list refused --------------------------------------------------------------


def test_a_refused_graphics_list_keeps_the_compute_processes(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=1) as (pipeline, sim, _):
        sim.inject_fault(
            pynvml.NVML_ERROR_NO_PERMISSION, function="nvmlDeviceGetGraphicsRunningProcesses"
        )
        snap = pipeline.collection.collect()
        compute = sim.nvmlDeviceGetComputeRunningProcesses(sim.nvmlDeviceGetHandleByIndex(0))
        assert compute
        expected = {int(p.pid): p.usedGpuMemory / MIB for p in compute}
        assert published_memory(snap, "0") == expected
        assert "Insufficient Permissions" in degraded(snap)[("0", "graphics_process_list")]


# --- 4. GPM sampling refused ------------------------------------------------------------------


def test_refused_gpm_sampling_falls_back_and_says_why(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2, profile="h100-nocaps") as (pipeline, sim, clock):
        snaps = []
        for _ in range(3):
            snaps.append(pipeline.collection.collect())
            clock.advance(10)
        last = snaps[-1]
        handle = sim.nvmlDeviceGetHandleByIndex(1)
        clock.advance(-10)  # the instant of the last collection
        tx_kbps = sim.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        assert one(last, "DCGM_FI_PROF_PCIE_TX_BYTES", gpu="1") == tx_kbps * 1024.0
        unsupported = {
            lbl["field"]: lbl["reason"]
            for lbl, _ in samples(last, "gpurelay_agent_unsupported_field")
        }
        assert "Insufficient Permissions" in unsupported["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]
        assert "CAP_SYS_ADMIN" in unsupported["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]
        assert samples(last, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") == []
        assert "Insufficient Permissions" in degraded(last)[("1", "profiling_counters")]


# --- 5. MIG instances that cannot be opened ---------------------------------------------------


def test_mig_instances_refused_keep_the_whole_gpu(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2, profile="h100-nocaps") as (pipeline, sim, _):
        snap = pipeline.collection.collect()
        handle = sim.nvmlDeviceGetHandleByIndex(0)
        assert one(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="0") == sim.nvmlDeviceGetTemperature(
            handle, pynvml.NVML_TEMPERATURE_GPU
        )
        memory = sim.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert one(snap, "DCGM_FI_DEV_FB_USED", gpu="0") == memory.used // MIB
        assert one(snap, "gpurelay_agent_gpu_healthy", gpu="0") == 1
        assert "Insufficient Permissions" in degraded(snap)[("0", "mig_instances")]


# --- 6. a GPU instance holding two compute instances ------------------------------------------


def test_two_compute_instances_are_one_gpu_instance(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2, profile="h100-mig") as (pipeline, sim, clock):
        pipeline.collection.collect()
        clock.advance(10)
        snap = pipeline.collection.collect()
        used = samples(snap, "DCGM_FI_DEV_FB_USED", gpu="0")
        by_instance = {lbl.get("GPU_I_ID"): (lbl.get("GPU_I_PROFILE"), v) for lbl, v in used}
        assert len(used) == len(by_instance) == 4, used  # the GPU and its three GPU instances
        assert by_instance["2"][0] == "3g.40gb"  # the GPU instance's profile, not 1c.3g.40gb
        keys = [(*sorted(s.labels), s.name) for s in snap.samples]
        assert len(keys) == len(set(keys)), "two series with one label set"
        # the instance's memory, once: what its MIG devices (both) report
        parent = sim.nvmlDeviceGetHandleByIndex(0)
        handles = [sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in range(4)]
        in_gi2 = [h for h in handles if sim.nvmlDeviceGetGpuInstanceId(h) == 2]
        assert len(in_gi2) == 2
        memory = sim.nvmlDeviceGetMemoryInfo(in_gi2[0], version=pynvml.nvmlMemory_v2)
        assert by_instance["2"][1] == memory.used // MIB
        # the processes of both compute instances, each once
        pids = {int(p.pid) for h in in_gi2 for p in sim.nvmlDeviceGetComputeRunningProcesses(h)}
        pids |= {int(p.pid) for h in in_gi2 for p in sim.nvmlDeviceGetGraphicsRunningProcesses(h)}
        published = [
            int(lbl["ProcessId"])
            for lbl, _ in samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED", gpu="0", GPU_I_ID="2")
        ]
        assert sorted(published) == sorted(pids) and pids
        # one GPM stream per GPU instance: a whole interval, not the microseconds between two
        activity = samples(snap, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu="0", GPU_I_ID="2")
        assert len(activity) == 1 and not math.isnan(activity[0][1])


# --- 7. memory info v1 only -------------------------------------------------------------------


def test_reserved_memory_before_r510_is_unsupported_not_zero(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2, profile="r470") as (pipeline, sim, _):
        snap = pipeline.collection.collect()
        assert samples(snap, "DCGM_FI_DEV_FB_RESERVED") == []
        v1 = sim.nvmlDeviceGetMemoryInfo(sim.nvmlDeviceGetHandleByIndex(0))
        assert one(snap, "DCGM_FI_DEV_FB_USED", gpu="0") == v1.used // MIB
        assert one(snap, "DCGM_FI_DEV_FB_FREE", gpu="0") == v1.free // MIB
        unsupported = {lbl["field"] for lbl, _ in samples(snap, "gpurelay_agent_unsupported_field")}
        assert "DCGM_FI_DEV_FB_RESERVED" in unsupported


# --- 8. process memory NVML cannot tell -------------------------------------------------------


def test_unavailable_process_memory_is_left_out(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2) as (pipeline, sim, _):
        sim.inject_memory_unavailable(0)
        snap = pipeline.collection.collect()
        assert set(process_memory(sim, 0).values()) == {None}
        assert samples(snap, "DCGM_CUSTOM_PROCESS_MEM_USED", gpu="0") == []
        assert samples(snap, "DCGM_CUSTOM_CONTAINER_MEM_USED", gpu="0") == []
        assert samples(snap, "DCGM_CUSTOM_PROCESS_SM_UTIL", gpu="0"), "utilisation was measured"
        assert samples(snap, "DCGM_CUSTOM_CONTAINER_PROCESSES", gpu="0")
        expected = {pid: b / MIB for pid, b in process_memory(sim, 1).items() if b is not None}
        assert published_memory(snap, "1") == expected


# --- 9. a hung NVML call ----------------------------------------------------------------------


def test_a_hung_call_stalls_its_gpu_not_the_cycle(tmp_path: Path) -> None:
    cfg = dataclasses.replace(load(None, {}), nvml_deadline_seconds=0.3)
    with agent(tmp_path, gpus=3, cfg=cfg) as (pipeline, sim, clock):
        pipeline.collection.collect()
        sim.inject_delay(math.inf, gpu=1, function="nvmlDeviceGetTemperature")
        for _ in range(2):  # the second cycle finds GPU 1's call still hanging
            clock.advance(10)
            snap = pipeline.collection.collect()
            for family in (
                "DCGM_FI_DEV_GPU_TEMP",
                "DCGM_FI_DEV_POWER_USAGE",
                "DCGM_CUSTOM_PROCESS_MEM_USED",
            ):
                assert samples(snap, family, gpu="1") == []
                for other in ("0", "2"):  # before and after the hung GPU
                    assert samples(snap, family, gpu=other), f"{family} of GPU {other}"
            assert one(snap, "gpurelay_agent_gpu_healthy", gpu="1") == 0
            assert one(snap, "gpurelay_agent_gpu_healthy", gpu="2") == 1
            assert "has not returned" in degraded(snap)[("1", "nvml_calls")]
        sim.clear_faults()  # the call returns
        clock.advance(10)
        snap = pipeline.collection.collect()
        clock.advance(10)
        snap = pipeline.collection.collect()
        assert samples(snap, "DCGM_FI_DEV_GPU_TEMP", gpu="1")
        assert one(snap, "gpurelay_agent_gpu_healthy", gpu="1") == 1
        assert ("1", "nvml_calls") not in degraded(snap)


def test_a_gpu_not_read_is_not_an_empty_card_in_bie(tmp_path: Path) -> None:
    with agent(tmp_path, gpus=2) as (pipeline, sim, _):
        sim.inject_fault(pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
        snap = pipeline.collection.collect()
    (node,) = collect_document(snap.node, snap.gpus).values()
    assert node["deviceNum"] == 1
    assert [d["totalMemory"] for d in node["devices"]] == [snap.gpus[0].memory_total_bytes]
    assert node["usedMemory"] == snap.gpus[0].memory_used_bytes > 0
