"""ACK's allocation metrics from a real pod-resources server and the NVML simulator."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.attribute.pod_resources import PodDevices
from edge_agent.collect_alloc import ALLOC_FAMILIES, AllocationCollector
from edge_agent.nvml.devices import GpuDevice, enumerate_gpus
from edge_agent.podresources.model import ContainerDevices
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.sim.pod_resources_server import PodResourcesServer
from gpurelay.model import MIB, SampleSink

H100_MIB = 85_520_809_984 // MIB  # 81559, the simulator's total memory
MIG_1G_MIB = 9_856


def row(ns: str, pod: str, resource: str, *ids: str, container: str = "c") -> ContainerDevices:
    return ContainerDevices(
        namespace=ns, pod=pod, container=container, resource=resource, device_ids=ids
    )


@pytest.fixture
def sock() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="alloc-", dir="/tmp"))
    yield d / "kubelet.sock"
    shutil.rmtree(d, ignore_errors=True)


def collect(
    sock: Path,
    rows: list[ContainerDevices],
    *,
    gpus: int = 2,
    mig: bool = True,
    unit_mib: int = 1024,
    pod_gpus: dict[tuple[str, str, str], set[str]] | None = None,
) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], list[GpuDevice]]:
    sim = SimulatedNvml(gpus, seed=3, mig=mig)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    server = PodResourcesServer(sock, rows).start()
    pods = PodDevices(sock, devices)
    try:
        stage = AllocationCollector(
            sim,
            devices,
            pods,
            node="edge-1",
            memory_unit_mib=unit_mib,
            pod_gpus=lambda: pod_gpus or {},
        )
        sink = SampleSink()
        stage.collect(sink)
    finally:
        pods.close()
        server.stop()
    return {(s.name, s.labels): s.value for s in sink.samples}, devices


def allocated(samples: dict, ns: str, pod: str) -> dict[tuple[str, str], float]:
    """(gpu, GPU_I_ID) -> MiB of one container."""
    out = {}
    for (name, labels), value in samples.items():
        d = dict(labels)
        if name != "DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED":
            continue
        if (d["NamespaceName"], d["PodName"]) == (ns, pod):
            assert d["NodeName"] == "edge-1" and d["ContainerName"] == "c"
            out[(d["gpu"], d["GPU_I_ID"])] = value
    return out


def per_gpu(samples: dict, name: str) -> dict[str, float]:
    return {dict(lb)["gpu"]: v for (n, lb), v in samples.items() if n == name}


def mode(samples: dict) -> float:
    return samples[("DCGM_CUSTOM_ALLOCATE_MODE", (("NodeName", "edge-1"),))]


def test_whole_gpus_and_mig_instances_are_allocated_their_memory(sock: Path) -> None:
    sim = SimulatedNvml(2, seed=3, mig=True)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    gpu0, gpu1 = devices
    small = next(m for m in gpu0.mig if m.gpu_instance_id == 13)
    samples, _ = collect(
        sock,
        [
            row("ml", "whole", "nvidia.com/gpu", gpu1.uuid),
            row("ml", "slice", "nvidia.com/mig-1g.10gb", small.uuid),
        ],
    )
    assert allocated(samples, "ml", "whole") == {("1", ""): H100_MIB}
    assert allocated(samples, "ml", "slice") == {("0", "13"): MIG_1G_MIB}
    assert mode(samples) == 1
    assert per_gpu(samples, "DCGM_CUSTOM_DEV_FB_TOTAL") == {"0": H100_MIB, "1": H100_MIB}
    assert per_gpu(samples, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == pytest.approx(
        {"0": MIG_1G_MIB / H100_MIB, "1": 1.0}
    )


def test_time_sliced_replicas_count_once_per_container(sock: Path) -> None:
    sim = SimulatedNvml(1, seed=3)
    sim.nvmlInit()
    (gpu,) = enumerate_gpus(sim)[0]
    samples, _ = collect(
        sock,
        [
            row("a", "p", "nvidia.com/gpu", f"{gpu.uuid}::0", f"{gpu.uuid}::3"),
            row("b", "q", "nvidia.com/gpu", f"{gpu.uuid}::1"),
        ],
        gpus=1,
        mig=False,
    )
    assert allocated(samples, "a", "p") == {("0", ""): H100_MIB}
    assert allocated(samples, "b", "q") == {("0", ""): H100_MIB}
    assert per_gpu(samples, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == {"0": 1.0}


def test_gpushare_memory_on_a_one_gpu_node(sock: Path) -> None:
    sim = SimulatedNvml(1, seed=3)
    sim.nvmlInit()
    (gpu,) = enumerate_gpus(sim)[0]
    units = [f"{gpu.uuid}-_-{n}" for n in range(10)]
    rows = [
        row("a", "p", "aliyun.com/gpu-mem", *units[:4]),
        row("b", "q", "aliyun.com/gpu-mem", *units[4:]),
    ]
    samples, _ = collect(sock, rows, gpus=1, mig=False)
    assert allocated(samples, "a", "p") == {("0", ""): 4 * 1024}
    assert allocated(samples, "b", "q") == {("0", ""): 6 * 1024}
    assert mode(samples) == 2
    assert per_gpu(samples, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == pytest.approx(
        {"0": 10 * 1024 / H100_MIB}
    )
    mib, _ = collect(sock, rows, gpus=1, mig=False, unit_mib=1)  # gpushare --memory-unit=MiB
    assert allocated(mib, "a", "p") == {("0", ""): 4}


def test_gpushare_memory_on_a_two_gpu_node_follows_the_processes(sock: Path) -> None:
    sim = SimulatedNvml(2, seed=3)
    sim.nvmlInit()
    gpu0, gpu1 = enumerate_gpus(sim)[0]
    # The kubelet handed out units named after GPU 0; the extender bound the pod to GPU 1.
    rows = [row("a", "p", "aliyun.com/gpu-mem", f"{gpu0.uuid}-_-0", f"{gpu0.uuid}-_-1")]
    unknown, _ = collect(sock, rows, mig=False)
    assert allocated(unknown, "a", "p") == {("", ""): 2048}
    assert per_gpu(unknown, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == {"0": 0.0, "1": 0.0}
    known, _ = collect(sock, rows, mig=False, pod_gpus={("a", "p", "c"): {gpu1.uuid}})
    assert allocated(known, "a", "p") == {("1", ""): 2048}
    assert per_gpu(known, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == pytest.approx(
        {"0": 0.0, "1": 2048 / H100_MIB}
    )
    both, _ = collect(sock, rows, mig=False, pod_gpus={("a", "p", "c"): {gpu0.uuid, gpu1.uuid}})
    assert allocated(both, "a", "p") == {("", ""): 2048}


def test_no_gpu_allocated_to_any_pod_is_mode_0(sock: Path) -> None:
    samples, _ = collect(sock, [row("a", "p", "example.com/fpga", "fpga0")])
    assert mode(samples) == 0
    assert per_gpu(samples, "DCGM_CUSTOM_DEV_FB_ALLOCATED") == {"0": 0.0, "1": 0.0}
    assert not allocated(samples, "a", "p")


def test_nothing_before_the_kubelet_answers(sock: Path) -> None:
    sim = SimulatedNvml(1, seed=3)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    pods = PodDevices(sock, devices)  # nobody listens: no socket
    stage = AllocationCollector(sim, devices, pods, node="edge-1")
    sink = SampleSink()
    stage.collect(sink)
    assert not stage.active and not sink.samples and not sink.families
    assert {f.name for f in ALLOC_FAMILIES} == {
        "DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED",
        "DCGM_CUSTOM_ALLOCATE_MODE",
        "DCGM_CUSTOM_DEV_FB_TOTAL",
        "DCGM_CUSTOM_DEV_FB_ALLOCATED",
    }


def test_errors_are_published_by_reason(sock: Path) -> None:
    import grpc

    sim = SimulatedNvml(1, seed=3)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    server = PodResourcesServer(sock).start()
    server.fail(grpc.StatusCode.UNAVAILABLE)
    pods = PodDevices(sock, devices)
    try:
        stage = AllocationCollector(sim, devices, pods, node="edge-1")
        sink = SampleSink()
        stage.collect(sink)
    finally:
        pods.close()
        server.stop()
    assert stage.active
    assert [(s.name, s.labels, s.value) for s in sink.samples] == [
        ("gpurelay_agent_pod_resources_errors_total", (("reason", "unavailable"),), 1.0)
    ]
