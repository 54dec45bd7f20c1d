"""deploy/haproxy/haproxy.cfg, run: the shipped example with only its addresses changed
(loopback ports, a temporary admin socket) in front of three stand-in gateways, each an
SSH port that holds connections and a /readyz that answers 200 or 503 as told.

Shows what the operator guide relies on: haproxy takes a gateway out of rotation when its
/readyz turns 503 (starting, draining) with the example's check settings, sends no new
connection there meanwhile, puts it back when /readyz answers 200 again, and spreads held
tunnels by least connections. Waits are bounded by deadlines far above the example's
check period (2 s x 2 failures), never by sleeps that must be long enough.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness.ports import free_ports
from harness.process import Process

CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
DEADLINE = 30.0  # a state change takes 2 checks 2 s apart (rise/fall 2, inter 2s)


class StandIn:
    """One gateway as haproxy sees it: SSH accepts and holds, /readyz as told."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = True
        self.held: list[socket.socket] = []
        self.ssh = socket.create_server(("127.0.0.1", 0))
        self.ssh_port = self.ssh.getsockname()[1]
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path == "/readyz" and stand_in.ready
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.ssh.accept()
            except OSError:
                return
            conn.sendall(f"SSH-2.0-{self.name}\r\n".encode())
            self.held.append(conn)

    def kill(self) -> None:
        """As kill -9 does: its ports refuse, its tunnels are closed."""
        self.ssh.shutdown(socket.SHUT_RDWR)  # wakes the accept thread: close alone does not
        self.close()
        self.held.clear()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.ssh.close()
        for conn in self.held:
            conn.close()


def example_for(gateways: list[StandIn], lb_port: int, admin: Path) -> str:
    """The shipped file with loopback addresses, each server's own check port, no syslog
    and a smaller maxconn; every other line as shipped."""
    text = CFG.read_text(encoding="utf-8")
    text = text.replace("    log /dev/log local0\n", "")
    # 2 descriptors per connection: 20,000 needs a file limit above a test machine's (and
    # root); 100 fits any default limit.
    text = text.replace("    maxconn 20000\n", "    maxconn 100\n")
    text = re.sub(r"stats socket \S+", f"stats socket {admin}", text)
    text = text.replace("bind :2222", f"bind 127.0.0.1:{lb_port}")
    assert " port 9410 " in text
    text = text.replace(" port 9410 ", " ")
    servers = re.findall(r"^    server (gw\d) \S+\n", text, re.MULTILINE)
    assert servers == ["gw1", "gw2", "gw3"]
    for gw in gateways:
        text = re.sub(
            rf"^    server {gw.name} \S+$",
            f"    server {gw.name} 127.0.0.1:{gw.ssh_port} port {gw.http_port}",
            text,
            flags=re.MULTILINE,
        )
    return text


def command(admin: Path, line: str) -> str:
    with closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as s:
        s.settimeout(5)
        s.connect(str(admin))
        s.sendall(line.encode() + b"\n")
        return b"".join(iter(lambda: s.recv(65536), b"")).decode()


def servers(admin: Path) -> dict[str, tuple[str, int]]:
    """Each server's status (UP, DOWN, ...) and current connections."""
    lines = command(admin, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    out = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "cloud_gateways" and row.get("svname", "").startswith("gw"):
            out[row["svname"]] = (row["status"].split()[0], int(row["scur"] or 0))
    return out


def wait_for(admin: Path, name: str, status: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while servers(admin)[name][0] != status:
        assert time.monotonic() < deadline, f"{name} not {status}: {servers(admin)}"
        time.sleep(0.2)


def dial(port: int) -> tuple[socket.socket, str]:
    """A connection through haproxy and the name of the stand-in that answered."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    banner = conn.recv(64).decode()
    assert banner.startswith("SSH-2.0-gw"), banner
    return conn, banner.strip().removeprefix("SSH-2.0-")


@pytest.fixture
def running(haproxy_bin: Path, tmp_path: Path) -> Iterator[tuple[list[StandIn], int, Path]]:
    with ExitStack() as stack:
        gateways = [StandIn(f"gw{i}") for i in (1, 2, 3)]
        for gw in gateways:
            stack.callback(gw.close)
        (lb_port,) = free_ports(1)
        admin = tmp_path / "admin.sock"
        config = tmp_path / "haproxy.cfg"
        config.write_text(example_for(gateways, lb_port, admin))
        proc = Process("haproxy", [str(haproxy_bin), "-db", "-f", str(config)], tmp_path / "log")
        proc.start()
        stack.callback(proc.stop)
        deadline = time.monotonic() + DEADLINE
        while not admin.exists():
            proc.check_alive()
            assert time.monotonic() < deadline, proc.tail()
            time.sleep(0.05)
        for gw in gateways:
            wait_for(admin, gw.name, "UP")
        yield gateways, lb_port, admin


def test_the_example_routes_by_readyz_and_least_connections(
    running: tuple[list[StandIn], int, Path],
) -> None:
    gateways, lb_port, admin = running
    held = []
    try:
        # Least connections: six held tunnels, two on each gateway.
        for _ in range(6):
            held.append(dial(lb_port)[0])
        assert sorted(n for _, n in servers(admin).values()) == [2, 2, 2]

        # gw2 starts draining (/readyz 503): out of rotation, no new tunnel goes there.
        gateways[1].ready = False
        wait_for(admin, "gw2", "DOWN")
        names = []
        for _ in range(6):
            conn, name = dial(lb_port)
            held.append(conn)
            names.append(name)
        assert "gw2" not in names and set(names) == {"gw1", "gw3"}

        # Ready again: back in rotation (slowstart then ramps its share up).
        gateways[1].ready = True
        wait_for(admin, "gw2", "UP")
    finally:
        for conn in held:
            conn.close()


def test_a_killed_gateway_gets_no_agent_before_its_health_check_notices(
    running: tuple[list[StandIn], int, Path],
) -> None:
    """kill -9 of a gateway: its tunnels close, so leastconn favours it (no tunnels) until
    two health checks failed, up to ~4 s. Agents reconnecting meanwhile must not be sent
    there: the example's retries/redispatch send a refused connection to another gateway,
    and observe layer4 marks the dead one down at once. Without those lines haproxy closed
    these connections (the agents' handshakes failed and they backed off)."""
    gateways, lb_port, admin = running
    held = []
    try:
        for _ in range(6):
            held.append(dial(lb_port)[0])
        gateways[0].kill()
        names = []
        for _ in range(6):  # right away: the health check has not failed twice yet
            conn, name = dial(lb_port)
            held.append(conn)
            names.append(name)
        assert set(names) <= {"gw2", "gw3"}, names
        assert servers(admin)["gw1"][0] == "DOWN"  # marked at its first refusal
    finally:
        for conn in held:
            conn.close()
