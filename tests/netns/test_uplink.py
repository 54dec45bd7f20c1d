"""The real uplink of :mod:`harness.netns`, with real sockets: the edge namespace reaches
the gateway address through the router until the router is told to go silent or lossy;
nothing is left behind; and a real agent process behind it feeds a real gateway process
until the link goes silent, then again once it is restored."""

from __future__ import annotations

import errno
import itertools
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fleet import TOKEN, make_pki
from harness.netns import Uplink, leftovers, sweep_stale
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

pytestmark = pytest.mark.netns

# Run inside the edge namespace: one TCP exchange with the echo server, the outcome printed.
CLIENT = r"""
import errno, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket()
s.settimeout(timeout)
start = time.monotonic()
try:
    s.connect((host, port))
    s.sendall(b"ping")
    print("ok", s.recv(16).decode())
except TimeoutError:
    print("timeout", round(time.monotonic() - start, 1))
except OSError as exc:
    print("error", errno.errorcode.get(exc.errno, exc.errno))
"""

# Run inside the edge namespace: COUNT datagrams to the sink.
SENDER = r"""
import socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(count):
    s.sendto(b"%d" % i, (host, port))
"""


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(5)
        self.request.sendall(self.request.recv(16))


@pytest.fixture
def echo(uplink: Uplink) -> Iterator[int]:
    """A TCP echo server in the root namespace on the gateway address; yields its port."""
    server = socketserver.ThreadingTCPServer((uplink.gateway_host, 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def from_edge(uplink: Uplink, script: str, *args: object, timeout: float = 20) -> str:
    proc = subprocess.run(
        [*uplink.prefix, sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def dial_edge(uplink: Uplink, port: int, timeout: float) -> str:
    """From the root namespace, connect to a closed port of the edge: "refused" when the
    edge's RST comes back, "timeout" when the link is silent."""
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            s.connect((uplink.edge_host, port))
        except TimeoutError:
            return "timeout"
        except ConnectionRefusedError:
            return "refused"
        except OSError as exc:
            return f"error {errno.errorcode.get(exc.errno or 0, exc.errno)}"
    return "connected"


def test_silence_makes_connects_time_out_both_ways_and_restore_undoes_it(
    uplink: Uplink, echo: int
) -> None:
    host = uplink.gateway_host
    assert from_edge(uplink, CLIENT, host, echo, 5) == "ok ping"
    assert dial_edge(uplink, 9, 5) == "refused"

    uplink.silence()
    # No EPERM, no ECONNREFUSED, no ICMP: the SYNs vanish in the middle.
    assert from_edge(uplink, CLIENT, host, echo, 1.5).startswith("timeout")
    assert dial_edge(uplink, 9, 1.5) == "timeout"
    # the first SYN and the retransmission after 1 s, each way
    assert uplink.dropped() >= 2, uplink.counters()

    uplink.restore()
    assert from_edge(uplink, CLIENT, host, echo, 5) == "ok ping"
    assert dial_edge(uplink, 9, 5) == "refused"
    counters = uplink.counters()
    assert counters.dropped == 0, counters
    assert counters.seen > 0, counters


def test_lossy_drops_about_the_given_share(uplink: Uplink) -> None:
    count = 500
    received: list[bytes] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind((uplink.gateway_host, 0))
        sink.settimeout(0.5)
        port = sink.getsockname()[1]

        # Room for every datagram before any is read (root may exceed rmem_max), so what
        # arrives does not depend on when a reader gets the CPU: with the default buffer
        # (~210 KiB, ~256 small datagrams) a busy machine lost the rest in the socket.
        sink.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 4 << 20)
        uplink.lossy(0.2)
        from_edge(uplink, SENDER, uplink.gateway_host, port, count)
        while True:  # all sent: read until nothing more comes
            try:
                received.append(sink.recv(64))
            except TimeoutError:
                break
    counters = uplink.counters()
    report = f"{counters}, received {len(received)} of {count}"
    print(report)
    assert counters.seen == count, report
    # 100 expected, standard deviation 9: bounds at more than 4 sigma
    assert 60 <= counters.dropped <= 140, report
    assert len(received) == count - counters.dropped, report


def test_drop_every_drops_exactly_that_share_and_never_two_in_a_row(uplink: Uplink) -> None:
    count = 500
    received: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind((uplink.gateway_host, 0))
        sink.settimeout(0.5)
        port = sink.getsockname()[1]
        sink.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 4 << 20)
        uplink.drop_every(5)
        from_edge(uplink, SENDER, uplink.gateway_host, port, count)
        while True:
            try:
                received.append(int(sink.recv(64).split(b" ")[0]))
            except (TimeoutError, ValueError):
                break
    counters = uplink.counters()
    report = f"{counters}, received {len(received)} of {count}"
    assert counters.seen == count and counters.dropped == count // 5, report
    gaps = [b - a for a, b in itertools.pairwise(received)]
    assert len(received) == count - count // 5 and max(gaps) == 2, report


def test_nothing_is_left_behind_on_exit_on_error_or_by_a_dead_process(netns_ok: None) -> None:
    me = os.getpid()
    with Uplink() as link:
        inside = subprocess.Popen([*link.prefix, "sleep", "60"])
        assert {link.edge, link.router} <= set(leftovers(me))
    assert leftovers(me) == []
    # what still ran in the edge namespace was killed with it
    assert inside.wait(timeout=10) == -9

    with pytest.raises(RuntimeError, match="the body failed"):
        with Uplink() as link:
            assert link.edge in leftovers(me)
            raise RuntimeError("the body failed")
    assert leftovers(me) == []

    # a process that died before cleaning up: its pid is free, its names are not
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = [f"grl{dead.pid}n0e", f"grl{dead.pid}n0d"]
    try:
        subprocess.run(["ip", "netns", "add", stale[0]], check=True, timeout=10)
        subprocess.run(
            ["ip", "link", "add", "name", stale[1], "type", "veth", "peer", "name",
             f"grl{dead.pid}n0c"],
            check=True,
            timeout=10,
        )  # fmt: skip
        assert set(stale) <= set(leftovers(dead.pid))
        assert set(stale) <= set(sweep_stale())
        assert leftovers(dead.pid) == []
    finally:
        subprocess.run(
            ["ip", "netns", "del", stale[0]], capture_output=True, timeout=10, check=False
        )
        subprocess.run(
            ["ip", "link", "del", stale[1]], capture_output=True, timeout=10, check=False
        )


def test_agent_behind_a_silenced_uplink_stops_then_resumes(uplink: Uplink, tmp_path: Path) -> None:
    """A real gateway (SSH on the uplink's address, HTTP on loopback) and a real agent in
    the edge namespace, collecting every second."""
    node = "edge-netns"
    pki = make_pki(tmp_path, gateway_names=[uplink.gateway_host])
    gateway = GatewayProc(pki, tmp_path, ssh_host=uplink.gateway_host)
    agent = AgentProc(
        pki, tmp_path, node, gateway, spool_dir=tmp_path / "spool", prefix=uplink.prefix
    )
    procs = [gateway, agent]

    def view() -> dict[str, Any]:
        r = httpx.get(
            f"{gateway.url}/api/v1/nodes/{node}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def batches() -> int:
        return int(view()["batches_received"])

    try:
        gateway.start()
        wait_until(gateway.ready, 30, "gateway ready", alive=[gateway])
        agent.start()
        wait_until(
            lambda: view()["state"] == "online" and batches() >= 2,
            30,
            "the agent's batches through the uplink",
            alive=procs,
        )

        uplink.silence()
        time.sleep(0.5)  # what was already through is counted
        before = batches()
        time.sleep(3)
        during = batches()
        assert during == before, f"{during - before} batches went through a silent link"
        assert uplink.dropped() > 0, uplink.counters()

        uplink.restore()
        restored = time.monotonic()
        wait_until(lambda: batches() > during, 30, "batches after restore", alive=procs)
        print(f"batches again {time.monotonic() - restored:.1f}s after restore")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{gateway.tail()}\n{agent.tail()}") from exc
    finally:
        agent.stop(timeout=10)
        gateway.stop(timeout=10)
