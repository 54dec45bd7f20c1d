"""Rootless Podman and Docker: per-user sockets found by the default patterns, each asked
only about its own user's containers. A fake /proc (tests/fixtures/attribution/rootless) and
real HTTP servers on unix sockets under a fake ``/run/user/<uid>/``, speaking the Docker
Engine API subset the agent uses (``GET /containers/<id>/json``).

As root the sockets are given to uid 1000 (``chown``), as another user the fixture's uids
are rewritten to that user's; either way a socket's owner is a real file owner.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import shutil
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.attribute import Attributor
from edge_agent.attribute.attributor import DEFAULT_RUNTIME_SOCKETS
from edge_agent.attribute.runtime_api import EngineClient, RuntimeApiError, RuntimeDownError
from edge_agent.attribute.runtime_sockets import RuntimeSockets
from edge_agent.config import load
from tests.unit.agent.test_attribute import FakeEngine

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "attribution"
API = FIXTURES / "docker-api"
ROOTLESS_DOCKER = "5b71c237b5c838eebc7cb3dcbde74353946a4b202cd2135c322a1fc7017ccc38"
ROOTLESS_POD = "6bdd59091bb6023959d332b34966a092352c01a67f76e0fe119c0a2c46d84c29"
OTHER_USER = "e1f8dd5c0cd163c8ef9b43433080d82131427611ce793a9244fedf0cd1ed2491"
ROOTFUL = "a581e819b2e5292b7834eb3895f286c5f80d4310ead5c2c5b79a77777230bff0"
ROOT = os.geteuid() == 0
USER_A = 1000 if ROOT else os.geteuid()  # owns the sockets in these tests
USER_B = USER_A + 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """The rootless tree's /proc with its users renamed to USER_A (1000) and USER_B (1001)."""
    root = tmp_path / "proc"
    shutil.copytree(FIXTURES / "rootless" / "proc", root)
    for cgroup in root.glob("*/cgroup"):
        text = cgroup.read_text().replace("1001", "{B}").replace("1000", "{A}")
        cgroup.write_text(text.format(A=USER_A, B=USER_B))
    return root


@pytest.fixture
def host() -> Iterator[Path]:
    """A short directory (AF_UNIX paths are limited to 107 bytes) standing for ``/``."""
    path = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        engine.stop()


def serve(
    engines: list[FakeEngine], path: Path, bodies: dict[str, str], *, owner: int | None = None
) -> FakeEngine:
    """A fake engine on ``path`` answering for ``bodies`` (id → docker-api/ file); the
    socket file is given to ``owner`` (only root can give it away; otherwise it is ours)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = FakeEngine(str(path), {cid: (API / f).read_bytes() for cid, f in bodies.items()})
    engines.append(engine)
    if owner is not None and ROOT:
        os.chown(path, owner, owner)
    return engine


def patterns(host: Path) -> tuple[Path, ...]:
    """The default runtime_sockets, under ``host`` instead of ``/``."""
    return tuple(host / str(p).lstrip("/") for p in DEFAULT_RUNTIME_SOCKETS)


def attributor(proc: Path, host: Path, clock: Clock | None = None) -> Attributor:
    return Attributor(
        proc_root=proc,
        container_log_dir=host / "var/log/containers",
        pod_log_dir=host / "var/log/pods",
        runtime_sockets=patterns(host),
        cache_ttl=60.0,
        clock=clock or time.monotonic,
    )


def test_the_defaults_find_rootless_sockets_and_config_agrees() -> None:
    assert Path("/run/user/*/podman/podman.sock") in DEFAULT_RUNTIME_SOCKETS
    assert Path("/run/user/*/docker.sock") in DEFAULT_RUNTIME_SOCKETS
    assert load(None, {}).attribution.runtime_sockets == DEFAULT_RUNTIME_SOCKETS


def test_rootless_containers_are_named_by_their_users_sockets(
    proc: Path, host: Path, engines: list[FakeEngine]
) -> None:
    user = host / f"run/user/{USER_A}"
    docker = serve(
        engines, user / "docker.sock", {ROOTLESS_DOCKER: "rootless-docker.json"}, owner=USER_A
    )
    podman = serve(
        engines,
        user / "podman/podman.sock",
        {ROOTLESS_POD: "rootless-podman-pod.json"},
        owner=USER_A,
    )
    system = serve(engines, host / "var/run/docker.sock", {ROOTFUL: "plain-docker.json"})
    a = attributor(proc, host)
    try:
        bert, vllm, rootful = a.attribute(12001), a.attribute(12002), a.attribute(12004)
    finally:
        a.close()
    assert (bert.container_id, bert.runtime, bert.container_name) == (
        ROOTLESS_DOCKER[:12],
        "docker",
        "bert-finetune",
    )
    assert (vllm.runtime, vllm.container_name, vllm.process_name) == (
        "podman",
        "vllm-serve",
        "vllm",
    )
    assert (rootful.runtime, rootful.container_name) == ("docker", "ivws-channels")
    # The user's sockets first, in path order; the rootful container never reaches them.
    assert docker.requests == [
        f"/containers/{ROOTLESS_DOCKER}/json",
        f"/containers/{ROOTLESS_POD}/json",
    ]
    assert podman.requests == [f"/containers/{ROOTLESS_POD}/json"]
    assert system.requests == [f"/containers/{ROOTFUL}/json"]
    assert a.errors() == {}


def test_a_users_socket_is_never_asked_about_anyone_elses_container(
    proc: Path, host: Path, engines: list[FakeEngine]
) -> None:
    """User A's runtime claims to know user B's container and the rootful one: it is not
    asked, so it cannot name them."""
    liar = serve(
        engines,
        host / f"run/user/{USER_A}/podman/podman.sock",
        {OTHER_USER: "rootless-podman-other-user.json", ROOTFUL: "rootless-docker.json"},
        owner=USER_A,
    )
    a = attributor(proc, host)
    try:
        other, rootful = a.attribute(12003), a.attribute(12004)
    finally:
        a.close()
    assert (other.container_id, other.runtime, other.container_name) == (
        OTHER_USER[:12],
        "podman",
        "",
    )
    assert (rootful.container_id, rootful.container_name) == (ROOTFUL[:12], "")
    assert liar.requests == []


def test_a_socket_that_appears_later_is_found_after_the_ttl(
    proc: Path, host: Path, engines: list[FakeEngine]
) -> None:
    clock = Clock()
    a = attributor(proc, host, clock)
    try:
        assert a.attribute(12001).container_name == ""  # nobody logged in yet
        serve(
            engines,
            host / f"run/user/{USER_A}/docker.sock",
            {ROOTLESS_DOCKER: "rootless-docker.json"},
            owner=USER_A,
        )
        clock.now += 59.0
        assert a.attribute(12001).container_name == ""  # not rescanned yet
        clock.now += 1.0
        assert a.attribute(12001).container_name == "bert-finetune"
    finally:
        a.close()


def test_a_symlink_is_not_a_users_socket(proc: Path, host: Path, engines: list[FakeEngine]) -> None:
    elsewhere = serve(engines, host / "srv/engine.sock", {ROOTLESS_DOCKER: "rootless-docker.json"})
    link = host / f"run/user/{USER_A}/docker.sock"
    link.parent.mkdir(parents=True)
    link.symlink_to(host / "srv/engine.sock")
    a = attributor(proc, host)
    try:
        assert a.attribute(12001).container_name == ""
    finally:
        a.close()
    assert elsewhere.requests == []


def test_a_socket_swapped_for_a_symlink_after_the_scan_is_not_asked(
    host: Path, engines: list[FakeEngine]
) -> None:
    path = host / f"run/user/{USER_A}/docker.sock"
    engine = serve(engines, path, {ROOTLESS_DOCKER: "rootless-docker.json"}, owner=USER_A)
    client = EngineClient(path, timeout=1.0, owner=USER_A)
    try:
        info = client.inspect(ROOTLESS_DOCKER)
        assert info is not None and info.name == "bert-finetune"
        moved = host / "moved.sock"
        path.rename(moved)
        path.symlink_to(moved)
        assert client.inspect(ROOTLESS_DOCKER) is None
    finally:
        client.close()
    assert len(engine.requests) == 1


@pytest.mark.skipif(not ROOT, reason="only root can make sockets owned by other users")
def test_a_socket_owned_by_another_uid_than_expected_is_not_asked(
    host: Path, engines: list[FakeEngine]
) -> None:
    path = host / f"run/user/{USER_A}/docker.sock"
    engine = serve(engines, path, {ROOTLESS_DOCKER: "rootless-docker.json"}, owner=USER_B)
    client = EngineClient(path, timeout=1.0, owner=USER_A)
    try:
        assert client.inspect(ROOTLESS_DOCKER) is None
    finally:
        client.close()
    assert engine.requests == []


def test_the_number_of_sockets_kept_is_bounded(
    host: Path, engines: list[FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    for n in range(4):
        serve(engines, host / f"run/user/{USER_A}/{n}/docker.sock", {}, owner=USER_A)
    caplog.set_level(logging.INFO, logger="edge_agent.attribute.runtime_sockets")
    sockets = RuntimeSockets(
        (host / "run/user/*/*/docker.sock",), timeout=1.0, refresh=60.0, clock=Clock(), limit=3
    )
    try:
        found = sockets.for_container(USER_A)
        assert [c.socket.parent.name for c in found] == ["0", "1", "2"]
        assert sockets.for_container(None) == []  # no configured socket, none of root's
        sockets.rescan()
    finally:
        sockets.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "runtime sockets: 1 more socket(s) matched than the 3 kept; their containers get no "
        "container_name"
    ]  # once, not once per scan


def test_configured_paths_are_asked_about_every_container(
    proc: Path, host: Path, engines: list[FakeEngine]
) -> None:
    """A socket named in the config (not found by pattern) is the operator's choice: asked
    about rootless containers too, after the owner's own sockets, as before this change."""
    configured = serve(
        engines, host / "opt/podman.sock", {ROOTLESS_POD: "rootless-podman-pod.json"}
    )
    a = Attributor(proc_root=proc, runtime_sockets=(host / "opt/podman.sock",))
    try:
        assert a.attribute(12002).container_name == "vllm-serve"
    finally:
        a.close()
    assert configured.requests == [f"/containers/{ROOTLESS_POD}/json"]


# -- a hostile or broken user runtime costs a bounded amount ----------------------------


class _Hostile(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, mode: str) -> None:
        self.mode = mode
        self.stop_event = threading.Event()
        super().__init__(path, _HostileHandler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.shutdown()
        self.server_close()
        self._thread.join()


class _HostileHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Hostile

    def do_GET(self) -> None:
        with contextlib.suppress(OSError):  # the client hung up, as it should
            self._answer()

    def _answer(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.server.mode == "huge":
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            chunk = b" " * 65536
            for _ in range(1024):  # 64 MiB if nobody stops reading
                if self.server.stop_event.is_set():
                    return
                self.wfile.write(chunk)
        else:  # a byte at a time, never finishing
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            while not self.server.stop_event.wait(0.02):
                self.wfile.write(b" ")
                self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.mark.parametrize(
    ("mode", "error"), [("huge", RuntimeApiError), ("trickle", RuntimeDownError)]
)
def test_an_endless_answer_is_cut_off(host: Path, mode: str, error: type[Exception]) -> None:
    path = host / "hostile.sock"
    server = _Hostile(str(path), mode)
    client = EngineClient(path, timeout=0.1)
    try:
        with pytest.raises(RuntimeApiError) as raised:
            client.inspect(ROOTLESS_DOCKER)
        assert type(raised.value) is error
    finally:
        client.close()
        server.stop()
