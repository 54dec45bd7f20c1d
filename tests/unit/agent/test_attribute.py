"""The Attributor over fixture trees (tests/fixtures/attribution), with a real Docker API server.

The fake Docker Engine is a stdlib HTTP server on a unix socket in a short /tmp directory
(AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer).
"""

from __future__ import annotations

import gc
import http.server
import shutil
import socket
import socketserver
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from edge_agent.attribute import HOST, Attribution, Attributor

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "attribution"
API = FIXTURES / "docker-api"

# Ids and uids of the fixture trees (see tests/fixtures/attribution/README.md).
DOCKER_V1 = "384147e683311294f50b248811b4844a20fd40f215daeb60e31c23b5776876ff"
SHIM = "84c7a5d95794aac91071b3c92af67135bcb16da612d7cf7b6da9679e95a38c2d"
SHIM_UID = "4450292c-fec7-4b62-a790-b528cb8165f5"
SHIM_NOLOG = "0e122e940abb77479037bebb2002ee4fdd4ad738997b0b34b15e8eb32061b70a"
PODMAN_ROOTFUL = "815c356c49fe4a97e6613a9cb16379ade8dbe560410979d6898c0780bdf2e8ce"


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def attributor(
    tree: str | Path,
    *,
    runtime_sockets: Sequence[Path] = (),
    cache_ttl: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> Attributor:
    """An Attributor over a fixture tree; no runtime sockets unless given."""
    root = FIXTURES / tree
    return Attributor(
        proc_root=root / "proc",
        container_log_dir=root / "var/log/containers",
        pod_log_dir=root / "var/log/pods",
        runtime_sockets=runtime_sockets,
        cache_ttl=cache_ttl,
        clock=clock,
    )


# -- one test per layout ---------------------------------------------------------------


def test_docker_cgroupfs_v1() -> None:
    a = attributor("docker-cgroupfs-v1")
    assert a.attribute(31337) == Attribution(
        container_id="384147e68331", runtime="docker", process_name="python3"
    )
    assert a.errors() == {}


def test_docker_systemd_v2() -> None:
    a = attributor("docker-systemd-v2")
    assert a.attribute(4021) == Attribution(
        container_id="2f8cac75e7e7", runtime="docker", process_name="pt_main_thread"
    )


@pytest.mark.parametrize(
    ("pid", "container_id", "pod_uid", "pod_name", "namespace", "k8s_container", "comm"),
    [
        (221484, "a71533c375a8", "3ec5219b-c8ec-4001-9b29-f4199838f2f6",
         "triton-resnet50-7d9f8b6c5-x2x9k", "inference", "triton", "tritonserver"),
        (37412, "d893347e2655", "7b6a1c4b-ef45-435e-8b26-32a8d7914a56",
         "llama.finetune-worker-0", "ml-training", "trainer", "python"),
        (159355, "9ee0fa2277eb", "57e87ca1-7ea5-4d70-93ea-08db135accce",
         "transcode-batch-28650412-q7tqs", "media", "encoder", "ffmpeg"),
    ],
    ids=["burstable", "guaranteed", "besteffort"],
)  # fmt: skip
def test_containerd_cgroupfs_v1(
    pid: int,
    container_id: str,
    pod_uid: str,
    pod_name: str,
    namespace: str,
    k8s_container: str,
    comm: str,
) -> None:
    # The runtime is "" by design: containerd and dockershim write the same cgroupfs path.
    a = attributor("containerd-cgroupfs-v1")
    assert a.attribute(pid) == Attribution(
        container_id=container_id,
        pod_uid=pod_uid,
        pod_name=pod_name,
        namespace=namespace,
        k8s_container=k8s_container,
        process_name=comm,
    )
    assert a.errors() == {}


@pytest.mark.parametrize(
    ("pid", "expected"),
    [
        (88210, Attribution(container_id="e93a3d062cc2", runtime="containerd",
                            pod_uid="eafacc61-5f63-4d7d-bac3-dcde28d65484",
                            pod_name="bert-pretrain-master-0", namespace="ml-training",
                            k8s_container="pytorch", process_name="python3")),
        (88305, Attribution(container_id="2e70c4028b7c", runtime="containerd",
                            pod_uid="e315713c-9589-4883-97c6-a22476d8c313",
                            pod_name="nvidia-dcgm-validator-kq8pt", namespace="gpu-operator",
                            k8s_container="dcgm-validator", process_name="dcgmproftester")),
    ],
    ids=["burstable", "guaranteed"],
)  # fmt: skip
def test_containerd_systemd_v2(pid: int, expected: Attribution) -> None:
    assert attributor("containerd-systemd-v2").attribute(pid) == expected


def test_crio_systemd_v2() -> None:
    a = attributor("crio-systemd-v2")
    assert a.attribute(51022) == Attribution(
        container_id="12a239e084da",
        runtime="crio",
        pod_uid="d7942333-18ff-4b0c-b5fe-c6716bff1ab7",
        pod_name="sd-webui-5c7f9d8b69-hw4xr",
        namespace="genai",
        k8s_container="webui",
        process_name="stable-diffusion",
    )


def test_crio_conmon_is_not_the_container() -> None:
    # conmon sits in the pod's slice: it is charged to the pod, but is no container.
    got = attributor("crio-systemd-v2").attribute(51007)
    assert (got.container_id, got.runtime, got.k8s_container) == ("", "", "webui")
    assert (got.pod_name, got.namespace) == ("sd-webui-5c7f9d8b69-hw4xr", "genai")


@pytest.mark.parametrize(
    ("pid", "container_id", "process_name"),
    [(7781, "815c356c49fe", "ollama"), (9120, "619e9a32dd03", "python3"),
     (9344, "6cd3941bf1f7", "comfyui")],
    ids=["rootful", "rootless", "nested"],
)  # fmt: skip
def test_podman(pid: int, container_id: str, process_name: str) -> None:
    a = attributor("podman")
    expected = Attribution(container_id=container_id, runtime="podman", process_name=process_name)
    assert a.attribute(pid) == expected


def test_podman_conmon_is_a_host_process() -> None:
    assert attributor("podman").attribute(7770) == Attribution(process_name="conmon")


def test_dockershim_cgroupfs_v1_without_docker_socket() -> None:
    # Without the Docker API the runtime cannot be told from containerd's: "" (documented).
    a = attributor("dockershim-cgroupfs-v1", runtime_sockets=(Path("/nonexistent/docker.sock"),))
    assert a.attribute(220678) == Attribution(
        container_id="84c7a5d95794",
        pod_uid=SHIM_UID,
        pod_name="aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl",
        namespace="iat",
        k8s_container="dx-tel-gpu01-418",
        process_name="aiges",
    )
    assert a.errors() == {}  # a missing socket is not an error


@pytest.mark.parametrize("pid", [1893, 912, 1, 2211, 3050])
def test_host_processes(pid: int) -> None:
    a = attributor("host")
    got = a.attribute(pid)
    assert got == Attribution(process_name=got.process_name)
    assert got.process_name
    assert a.errors() == {}


# -- pod log directory fallback --------------------------------------------------------


def test_pod_dir_fallback_single_container() -> None:
    got = attributor("containerd-cgroupfs-v1").attribute(160001)
    assert (got.pod_name, got.namespace, got.k8s_container) == (
        "notebook-alice-0",
        "research",
        "jupyter",
    )


def test_pod_dir_fallback_several_containers_leaves_container_empty() -> None:
    got = attributor("containerd-cgroupfs-v1").attribute(160002)
    assert (got.pod_name, got.namespace, got.k8s_container) == (
        "vllm-qwen-6b8f9c7d4-2mzpl",
        "serving",
        "",
    )


# -- per-PID problems ------------------------------------------------------------------


def test_vanished_pid() -> None:
    a = attributor("host")
    assert a.attribute(999_999) is HOST
    assert a.errors() == {"vanished": 1}


def test_unreadable_cgroup(tmp_path: Path) -> None:
    pid_dir = tmp_path / "proc" / "77"
    (pid_dir / "cgroup").mkdir(parents=True)  # open() raises IsADirectoryError, even as root
    (pid_dir / "comm").write_text("python3\n")
    a = Attributor(proc_root=tmp_path / "proc", runtime_sockets=())
    assert a.attribute(77) == Attribution(process_name="python3")
    assert a.errors() == {"unreadable": 1}


def test_garbage_cgroup() -> None:
    a = attributor("broken")
    assert a.attribute(6001) == Attribution(process_name="weird")
    assert a.attribute(6001) == Attribution(process_name="weird")
    assert a.errors() == {"unparsed": 2}


def test_missing_comm_is_fine(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "docker-systemd-v2", tmp_path / "t", symlinks=True)
    (tmp_path / "t/proc/4021/comm").unlink()
    got = attributor(tmp_path / "t").attribute(4021)
    assert (got.container_id, got.process_name) == ("2f8cac75e7e7", "")


def test_cgroup_is_reread_every_call(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "docker-systemd-v2", tmp_path / "t", symlinks=True)
    a = attributor(tmp_path / "t")
    assert a.attribute(4021).container_id == "2f8cac75e7e7"
    (tmp_path / "t/proc/4021/cgroup").write_text("0::/system.slice/sshd.service\n")
    (tmp_path / "t/proc/4021/comm").write_text("sshd\n")
    assert a.attribute(4021) == Attribution(process_name="sshd")  # the PID was reused


def test_unlistable_log_dir_is_counted(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "containerd-systemd-v2", tmp_path / "t", symlinks=True)
    shutil.rmtree(tmp_path / "t/var/log/containers")
    (tmp_path / "t/var/log/containers").write_text("not a directory")
    a = attributor(tmp_path / "t")
    got = a.attribute(88210)
    assert (got.pod_name, got.k8s_container) == ("bert-pretrain-master-0", "pytorch")  # fallback
    assert a.errors() == {"log_dir": 1}


# -- the kubelet index's schedule ------------------------------------------------------


def test_new_pod_is_found_after_the_early_rescan_window(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    shutil.copytree(FIXTURES / "containerd-systemd-v2", tree, symlinks=True)
    logs = tree / "var/log/containers"
    link = next(logs.glob("bert-pretrain-master-0_*"))
    target = link.readlink()
    link.unlink()
    pod_dir = tree / "var/log/pods" / target.parts[2]
    shutil.move(pod_dir, tmp_path / "later")  # the pod's logs do not exist yet
    clock = FakeClock()
    a = attributor(tree, clock=clock)
    got = a.attribute(88210)
    assert (got.container_id, got.pod_uid, got.pod_name) == (
        "e93a3d062cc2",
        "eafacc61-5f63-4d7d-bac3-dcde28d65484",
        "",
    )
    shutil.move(tmp_path / "later", pod_dir)
    link.symlink_to(target)
    clock.now += 4.0
    assert a.attribute(88210).pod_name == ""  # rescans are rate-limited
    clock.now += 1.0
    got = a.attribute(88210)
    assert (got.pod_name, got.namespace, got.k8s_container) == (
        "bert-pretrain-master-0",
        "ml-training",
        "pytorch",
    )


def test_deleted_pod_leaves_the_index_after_the_ttl(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    shutil.copytree(FIXTURES / "containerd-systemd-v2", tree, symlinks=True)
    clock = FakeClock()
    a = attributor(tree, clock=clock, cache_ttl=30.0)
    assert a.attribute(88305).pod_name == "nvidia-dcgm-validator-kq8pt"
    shutil.rmtree(tree / "var/log/containers")
    shutil.rmtree(tree / "var/log/pods")
    clock.now += 29.0
    assert a.attribute(88305).pod_name == "nvidia-dcgm-validator-kq8pt"
    clock.now += 1.0
    assert a.attribute(88305).pod_name == ""


# -- the Docker Engine API over a unix socket ------------------------------------------


class FakeEngine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """``GET /containers/<id>/json`` from a dict of bodies; 404 otherwise, or always ``status``."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, containers: dict[str, bytes], status: int = 200) -> None:
        self.containers = containers
        self.status = status
        self.requests: list[str] = []
        super().__init__(path, _EngineHandler)
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()


class _EngineHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeEngine

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        parts = self.path.split("/")  # "", "containers", id, "json"
        body = None
        if len(parts) == 4 and parts[1] == "containers" and parts[3] == "json":
            body = self.server.containers.get(parts[2])
        if self.server.status != 200:
            status, body = self.server.status, b'{"message":"Internal Server Error"}'
        elif body is None:
            status, body = 404, b'{"message":"No such container"}'
        else:
            status = 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Api-Version", "1.43")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="attr-", dir="/tmp"))
    (path / "podman").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        engine.stop()


def serve(
    engines: list[FakeEngine], path: Path, bodies: dict[str, str] | None = None, status: int = 200
) -> FakeEngine:
    """Start a fake engine answering for ``bodies`` (container id → file in docker-api/)."""
    containers = {cid: (API / name).read_bytes() for cid, name in (bodies or {}).items()}
    engine = FakeEngine(str(path), containers, status)
    engines.append(engine)
    return engine


def test_docker_name_is_used_and_cached(sockdir: Path, engines: list[FakeEngine]) -> None:
    engine = serve(engines, sockdir / "docker.sock", {DOCKER_V1: "plain-docker.json"})
    a = attributor("docker-cgroupfs-v1", runtime_sockets=(sockdir / "docker.sock",))
    try:
        for _ in range(3):
            assert a.attribute(31337) == Attribution(
                container_id="384147e68331",
                runtime="docker",
                container_name="ivws-channels",
                process_name="python3",
            )
    finally:
        a.close()
    assert engine.requests == [f"/containers/{DOCKER_V1}/json"]
    assert a.errors() == {}


def test_cache_expires_after_the_ttl(sockdir: Path, engines: list[FakeEngine]) -> None:
    engine = serve(engines, sockdir / "docker.sock", {DOCKER_V1: "plain-docker.json"})
    clock = FakeClock()
    a = attributor("docker-cgroupfs-v1", runtime_sockets=(sockdir / "docker.sock",), clock=clock)
    try:
        a.attribute(31337)
        clock.now += 59.9
        a.attribute(31337)
        assert len(engine.requests) == 1
        clock.now += 0.1
        assert a.attribute(31337).container_name == "ivws-channels"
        assert len(engine.requests) == 2
    finally:
        a.close()


def test_dockershim_labels_and_runtime(sockdir: Path, engines: list[FakeEngine]) -> None:
    serve(
        engines,
        sockdir / "docker.sock",
        {SHIM: "dockershim.json", SHIM_NOLOG: "dockershim-nolog.json"},
    )
    a = attributor("dockershim-cgroupfs-v1", runtime_sockets=(sockdir / "docker.sock",))
    try:
        in_log_dir = a.attribute(220678)
        only_labels = a.attribute(2482)  # no kubelet log link: the pod comes from the labels
    finally:
        a.close()
    assert in_log_dir == Attribution(
        container_id="84c7a5d95794",
        runtime="docker",
        container_name=(
            f"k8s_dx-tel-gpu01-418_aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl_iat_{SHIM_UID}_0"
        ),
        pod_uid=SHIM_UID,
        pod_name="aiges-tel-418.iat-tel-gpu01-bb7cf87b-szrdl",
        namespace="iat",
        k8s_container="dx-tel-gpu01-418",
        process_name="aiges",
    )
    assert (only_labels.runtime, only_labels.pod_name, only_labels.namespace) == (
        "docker",
        "ivws.ivws-66549f8f96-m2gkc",
        "ivw",
    )
    assert only_labels.k8s_container == "ivw-1014"
    assert only_labels.container_name.startswith("k8s_ivw-1014_")
    assert a.errors() == {}


def test_404_tries_the_next_socket(sockdir: Path, engines: list[FakeEngine]) -> None:
    docker = serve(engines, sockdir / "docker.sock")
    podman = serve(engines, sockdir / "podman/podman.sock", {PODMAN_ROOTFUL: "podman.json"})
    sockets = (sockdir / "docker.sock", sockdir / "podman/podman.sock")
    a = attributor("podman", runtime_sockets=sockets)
    try:
        assert a.attribute(7781).container_name == "ollama"
        assert a.attribute(9120).container_name == ""  # unknown to both: negatively cached
        a.attribute(9120)
    finally:
        a.close()
    assert len(docker.requests) == 2
    assert len(podman.requests) == 2
    assert a.errors() == {}


def test_server_error_is_counted_not_fatal(sockdir: Path, engines: list[FakeEngine]) -> None:
    engine = serve(engines, sockdir / "docker.sock", status=500)
    a = attributor("docker-cgroupfs-v1", runtime_sockets=(sockdir / "docker.sock",))
    try:
        for _ in range(3):
            assert a.attribute(31337) == Attribution(
                container_id="384147e68331", runtime="docker", process_name="python3"
            )
    finally:
        a.close()
    assert len(engine.requests) == 1  # the failure is cached too
    assert a.errors() == {"runtime_api": 1}


def test_dead_daemon_is_counted_and_skipped(sockdir: Path) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sockdir / "docker.sock"))  # the file exists, nobody listens: refused
    a = attributor("podman", runtime_sockets=(sockdir / "docker.sock",))
    with warnings.catch_warnings():
        # httpcore 1.0 leaves the socket of a failed unix connect to the garbage collector.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            assert a.attribute(7781).container_id == "815c356c49fe"
            assert a.attribute(9120).container_id == "619e9a32dd03"  # socket skipped for the TTL
        finally:
            a.close()
            dead.close()
            gc.collect()
    assert a.errors() == {"runtime_api": 1}


def test_containerd_and_crio_never_ask_the_docker_api(
    sockdir: Path, engines: list[FakeEngine]
) -> None:
    engine = serve(engines, sockdir / "docker.sock")
    for tree, pid in (("containerd-systemd-v2", 88210), ("crio-systemd-v2", 51022)):
        a = attributor(tree, runtime_sockets=(sockdir / "docker.sock",))
        a.attribute(pid)
        a.close()
    assert engine.requests == []
