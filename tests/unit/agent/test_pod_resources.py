"""Pod identity from the kubelet's pod-resources API, against a real gRPC server.

The server (:class:`edge_agent.sim.pod_resources_server.PodResourcesServer`) speaks the
generated proto on a Unix socket, like the kubelet; the GPUs are the NVML simulator's, so
UUIDs, indices and MIG instances are the ones the device collector labels series with.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from edge_agent.attribute.device_ids import DeviceIndex
from edge_agent.attribute.pod_resources import PodDevices
from edge_agent.errors import PodResourcesError
from edge_agent.nvml.devices import GpuDevice, enumerate_gpus
from edge_agent.podresources import api_pb2, api_pb2_grpc
from edge_agent.podresources.client import PodResourcesClient, target
from edge_agent.podresources.model import ContainerDevices
from edge_agent.sim.nvml import SimulatedNvml
from edge_agent.sim.pod_resources_server import PodResourcesServer
from harness.pipeline import FakeClock


def row(ns: str, pod: str, container: str, resource: str, *ids: str) -> ContainerDevices:
    return ContainerDevices(
        namespace=ns, pod=pod, container=container, resource=resource, device_ids=ids
    )


def pod(name: str, ns: str = "default", container: str = "main") -> tuple[tuple[str, str], ...]:
    return (("pod", name), ("namespace", ns), ("container", container))


@pytest.fixture
def sock() -> Iterator[Path]:
    """A socket path short enough for sockaddr_un (pytest's tmp_path can be too deep)."""
    d = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))
    yield d / "kubelet.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sock: Path) -> Iterator[PodResourcesServer]:
    server = PodResourcesServer(sock).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gpus() -> list[GpuDevice]:
    """Two simulated H100s, GPU 0 in MIG mode (3g.40gb gi 1, 2g.20gb gi 5, 1g.10gb gi 13)."""
    sim = SimulatedNvml(2, seed=3, mig=True)
    sim.nvmlInit()
    devices, problems = enumerate_gpus(sim)
    assert not problems
    return devices


def pods_of(kubelet: PodResourcesServer, gpus: list[GpuDevice], **kw: object) -> PodDevices:
    return PodDevices(kubelet.socket, gpus, **kw)


# ------------------------------------------------------------------------- the client


def test_client_lists_what_the_server_holds(kubelet: PodResourcesServer) -> None:
    rows = [
        row("ml", "serve-0", "triton", "nvidia.com/gpu", "GPU-a", "GPU-b"),
        row("ml", "serve-0", "sidecar", "example.com/nic", "eth1"),
        row("ml", "serve-0", "triton", "aliyun.com/gpu-mem", "GPU-a-_-0", "GPU-a-_-1"),
        row("research", "train-1", "pytorch", "nvidia.com/mig-1g.10gb", "MIG-x"),
    ]
    kubelet.set_rows(rows)
    client = PodResourcesClient(kubelet.socket, timeout=2.0)
    try:
        assert sorted(client.list(), key=repr) == sorted(rows, key=repr)
    finally:
        client.close()


def test_the_server_answers_get_allocatable_resources(sock: Path) -> None:
    server = PodResourcesServer(sock, allocatable=[("nvidia.com/gpu", ["GPU-a", "GPU-b"])])
    server.start()
    try:
        with grpc.insecure_channel(target(sock)) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            answer = stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=2)
        assert [(d.resource_name, list(d.device_ids)) for d in answer.devices] == [
            ("nvidia.com/gpu", ["GPU-a", "GPU-b"])
        ]
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (grpc.StatusCode.UNIMPLEMENTED, "unimplemented"),
        (grpc.StatusCode.PERMISSION_DENIED, "permission_denied"),
    ],
)
def test_client_errors_carry_the_status_code(
    kubelet: PodResourcesServer, code: grpc.StatusCode, reason: str
) -> None:
    kubelet.fail(code, "nope")
    client = PodResourcesClient(kubelet.socket, timeout=2.0)
    try:
        with pytest.raises(PodResourcesError) as err:
            client.list()
    finally:
        client.close()
    assert err.value.reason == reason
    assert str(kubelet.socket) in str(err.value) and "nope" in str(err.value)


def test_client_gives_up_at_its_deadline(kubelet: PodResourcesServer) -> None:
    kubelet.delay = 30.0  # released when the server stops
    client = PodResourcesClient(kubelet.socket, timeout=0.2)
    try:
        with pytest.raises(PodResourcesError) as err:
            client.list()
    finally:
        client.close()
    assert err.value.reason == "deadline_exceeded"


# ------------------------------------------------------------------------- device ids


def test_uuid_ids_label_the_allocated_gpu_only(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    gpu1 = gpus[1].uuid
    kubelet.set_rows([row("ml", "serve-0", "triton", "nvidia.com/gpu", gpu1)])
    pods = pods_of(kubelet, gpus)
    try:
        assert pods.device_labels(gpu1) == pod("serve-0", "ml", "triton")
        assert pods.device_labels(gpus[0].uuid) == ()
        assert not pods.errors
    finally:
        pods.close()


@pytest.mark.parametrize("device_id", ["1", "01", "nvidia1", "nvidia1/vgpu3"])
def test_index_and_gke_ids_name_the_gpu(
    kubelet: PodResourcesServer, gpus: list[GpuDevice], device_id: str
) -> None:
    assert (gpus[1].index, gpus[1].minor) == (1, 1)
    kubelet.set_rows([row("ml", "a", "c", "nvidia.com/gpu", device_id)])
    pods = pods_of(kubelet, gpus)
    try:
        assert pods.device_labels(gpus[1].uuid) == pod("a", "ml", "c")
    finally:
        pods.close()


def test_mig_instances_get_their_own_pods(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    gpu0 = gpus[0]
    by_gi = {m.gpu_instance_id: m for m in gpu0.mig}
    assert sorted(by_gi) == [1, 5, 13]
    kubelet.set_rows(
        [
            row("a", "small", "c", "nvidia.com/mig-1g.10gb", by_gi[13].uuid),
            row("b", "medium", "c", "nvidia.com/mig-2g.20gb", "nvidia0/gi5"),  # GKE
            row("c", "large", "c", "nvidia.com/gpu", f"MIG-{gpu0.uuid}/1/0"),  # before R470
        ]
    )
    pods = pods_of(kubelet, gpus)
    try:
        assert pods.device_labels(gpu0.uuid, 13) == pod("small", "a", "c")
        assert pods.device_labels(gpu0.uuid, 5) == pod("medium", "b", "c")
        assert pods.device_labels(gpu0.uuid, 1) == pod("large", "c", "c")
        assert pods.device_labels(gpu0.uuid) == ()  # the GPU as a whole belongs to nobody
        assert not pods.errors
    finally:
        pods.close()


def test_a_gpu_shared_by_two_containers_is_labelled_with_the_first(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    uuid = gpus[1].uuid
    kubelet.set_rows(
        [
            row("alpha", "early", "c", "nvidia.com/gpu", f"{uuid}::0"),
            row("zeta", "late", "c", "nvidia.com/gpu", f"{uuid}::1"),  # listed last
        ]
    )
    pods = pods_of(kubelet, gpus)
    try:
        assert pods.device_labels(uuid) == pod("early", "alpha", "c")
        answer = pods.current()
        assert answer is not None
        assert sorted(owner for owner, _ in answer.devices) == [
            ("alpha", "early", "c"),
            ("zeta", "late", "c"),
        ]
    finally:
        pods.close()


def test_unknown_device_ids_are_counted_and_logged_once(
    kubelet: PodResourcesServer, gpus: list[GpuDevice], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    kubelet.set_rows(
        [
            row("ml", "a", "c", "nvidia.com/gpu", "GPU-00000000-dead-beef-0000-000000000000"),
            row("ml", "b", "c", "nvidia.com/gpu", gpus[1].uuid),
            row("ml", "b", "c", "nvidia.com/gpu", "7"),  # no GPU 7 here
        ]
    )
    pods = pods_of(kubelet, gpus, clock=clock, ttl=10.0)
    try:
        with caplog.at_level(logging.WARNING):
            assert pods.device_labels(gpus[1].uuid) == pod("b", "ml", "c")
            clock.advance(10)
            pods.current()
        assert pods.errors == {"unknown_device": 4}  # two ids, two answers
        warned = [r.getMessage() for r in caplog.records if "no GPU on this node" in r.message]
        assert len(warned) == 2 and any("dead-beef" in m for m in warned)
    finally:
        pods.close()


def test_device_ids_of_non_ascii_or_endless_digits_are_unknown_not_a_crash(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    """str.isdigit() is True for "²" (int() refuses it) and for 5,000 ASCII digits (int()
    refuses over 4,300): both are unknown ids, and the other rows are still read."""
    kubelet.set_rows(
        [
            row("ml", "a", "c", "nvidia.com/gpu", "\N{SUPERSCRIPT TWO}"),
            row("ml", "a", "c", "nvidia.com/gpu", "9" * 5000),
            row("ml", "b", "c", "nvidia.com/gpu", gpus[1].uuid),
        ]
    )
    pods = pods_of(kubelet, gpus)
    try:
        assert pods.device_labels(gpus[1].uuid) == pod("b", "ml", "c")
        assert pods.errors == {"unknown_device": 2}
    finally:
        pods.close()


def test_other_resources_are_ignored_and_extra_gpu_names_are_taken(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    uuid = gpus[1].uuid
    kubelet.set_rows(
        [
            row("ml", "a", "c", "example.com/fpga", "fpga0"),
            row("ml", "a", "c", "nvidia.com/a100", uuid),
        ]
    )
    plain = pods_of(kubelet, gpus)
    named = pods_of(kubelet, gpus, gpu_resources=("nvidia.com/a100",))
    try:
        assert plain.device_labels(uuid) == () and not plain.errors
        assert named.device_labels(uuid) == pod("a", "ml", "c")
    finally:
        plain.close()
        named.close()


def test_old_label_names_as_dcgm_exporter_use_old_namespace(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    kubelet.set_rows([row("ml", "serve-0", "triton", "nvidia.com/gpu", gpus[1].uuid)])
    pods = pods_of(kubelet, gpus, old_label_names=True)
    try:
        assert pods.device_labels(gpus[1].uuid) == (
            ("pod_name", "serve-0"),
            ("pod_namespace", "ml"),
            ("container_name", "triton"),
        )
    finally:
        pods.close()


def test_gpushare_memory_units_by_container() -> None:
    sim = SimulatedNvml(1, seed=3)
    sim.nvmlInit()
    devices, _ = enumerate_gpus(sim)
    index = DeviceIndex(devices)
    uuid = devices[0].uuid
    assert index.gpushare_gpu(f"{uuid}-_-12") is devices[0]
    assert index.gpushare_gpu(f"{uuid}::1") is None


# ------------------------------------------------------------------------- failures, TTL


def test_a_failing_kubelet_keeps_the_last_answer_counts_and_logs_once(
    kubelet: PodResourcesServer, gpus: list[GpuDevice], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    uuid = gpus[1].uuid
    kubelet.set_rows([row("ml", "a", "c", "nvidia.com/gpu", uuid)])
    pods = pods_of(kubelet, gpus, clock=clock, ttl=5.0)
    try:
        assert pods.device_labels(uuid) == pod("a", "ml", "c")
        kubelet.fail(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                clock.advance(5)
                assert pods.device_labels(uuid) == pod("a", "ml", "c")  # kept
            kubelet.fail(None)
            kubelet.set_rows([])
            clock.advance(5)
            assert pods.device_labels(uuid) == ()
        assert pods.errors == {"unavailable": 3}
        messages = [r.getMessage() for r in caplog.records]
        failed = [m for m in messages if "kubelet restarting" in m]
        assert len(failed) == 1 and "keeping the last answer" in failed[0]
        assert any("answers again" in m for m in messages)
    finally:
        pods.close()


def test_a_kubelet_that_does_not_answer_in_time(
    kubelet: PodResourcesServer, gpus: list[GpuDevice]
) -> None:
    kubelet.delay = 30.0  # released when the server stops
    pods = pods_of(kubelet, gpus, timeout=0.2)
    try:
        assert pods.current() is None
        assert pods.errors == {"deadline_exceeded": 1}
    finally:
        pods.close()


def test_no_socket_is_not_an_error(
    sock: Path, gpus: list[GpuDevice], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    connected: list[Path] = []
    pods = PodDevices(sock, gpus, clock=clock, ttl=1.0, connect=lambda s, _t: connected.append(s))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert pods.current() is None
            clock.advance(1)
    assert not pods.errors and not pods.active and not connected
    assert sum("no kubelet pod-resources socket" in r.message for r in caplog.records) == 1


def test_a_socket_that_disappears_counts(sock: Path, gpus: list[GpuDevice]) -> None:
    clock = FakeClock()
    uuid = gpus[1].uuid
    server = PodResourcesServer(sock, [row("ml", "a", "c", "nvidia.com/gpu", uuid)]).start()
    pods = PodDevices(sock, gpus, clock=clock, ttl=1.0)
    try:
        assert pods.device_labels(uuid) == pod("a", "ml", "c")
        server.stop()  # removes the socket, as a kubelet restart does
        clock.advance(1)
        assert pods.device_labels(uuid) == pod("a", "ml", "c")
        assert pods.errors == {"socket_missing": 1} and pods.active
    finally:
        pods.close()
        server.stop()


def test_list_is_asked_once_per_ttl(kubelet: PodResourcesServer, gpus: list[GpuDevice]) -> None:
    clock = FakeClock()
    uuid = gpus[1].uuid
    kubelet.set_rows([row("ml", "a", "c", "nvidia.com/gpu", uuid)])
    pods = pods_of(kubelet, gpus, clock=clock, ttl=10.0)
    try:
        for _ in range(5):
            pods.device_labels(uuid)
            pods.current()
        assert kubelet.calls == 1
        kubelet.set_rows([row("ml", "b", "c", "nvidia.com/gpu", uuid)])
        clock.advance(9.9)
        assert pods.device_labels(uuid) == pod("a", "ml", "c") and kubelet.calls == 1
        clock.advance(0.1)
        assert pods.device_labels(uuid) == pod("b", "ml", "c") and kubelet.calls == 2
    finally:
        pods.close()
