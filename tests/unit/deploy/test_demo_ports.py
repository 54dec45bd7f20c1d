"""`make demo`'s check that its ports are free (deploy/dev/demo.py, issue 23).

Run again within a minute of the last demo, it said "port 9400 on 127.0.0.1 is taken"
while nothing listened: the last run's connections sat in TIME_WAIT, and the check bound
without SO_REUSEADDR, which the servers themselves set (asyncio, aiohttp, asyncssh)."""

from __future__ import annotations

import importlib.util
import socket
import time
from pathlib import Path
from types import ModuleType

import pytest

DEMO = Path(__file__).resolve().parents[3] / "deploy" / "dev" / "demo.py"
TIME_WAIT = "06"  # the state column of /proc/net/tcp


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_time_wait(port: int) -> bool:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rpartition(":")[2], 16) == port and fields[3] == TIME_WAIT:
            return True
    return False


def time_wait_on_a_port() -> int:
    """A loopback port nothing listens on, with a connection of a server that was there
    in TIME_WAIT (the server closed first, as the demo's servers do at Ctrl-C). The
    server set SO_REUSEADDR, as asyncio's do: Linux lets a bind share the port with a
    TIME_WAIT connection only when both sockets set it."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
    accepted.close()  # the server's side first: it is the side left in TIME_WAIT
    time.sleep(0.05)
    client.close()
    deadline = time.monotonic() + 5
    while not in_time_wait(port):
        assert time.monotonic() < deadline, f"no TIME_WAIT on port {port}"
        time.sleep(0.02)
    return port


def test_a_port_with_only_a_time_wait_connection_is_free(demo: ModuleType) -> None:
    port = time_wait_on_a_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old check did: "taken"
    assert demo.port_free(port)
    # and a server can indeed listen there now, as the demo's will
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_port_something_listens_on_is_taken(demo: ModuleType, host: str) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen()
        assert not demo.port_free(int(server.getsockname()[1]))
