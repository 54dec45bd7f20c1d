"""A busy gateway must not look dead to a reconnecting fleet: while its loop is busy (a
thousand agents' first DECLAREs after a restart took ~16 s of CPU on 2 cores,
bench/gateway_ingest.py), the kernel completes TCP handshakes into the SSH listener's
accept queue. With asyncssh's default backlog of 100, the 101st SYN was dropped, which an
agent cannot tell from a dead uplink (edge_agent.dial: ``unanswered``), so it kept
redialling every second or two."""

from __future__ import annotations

import socket
from pathlib import Path

from harness.fleet import gateway_config, make_pki, running_gateway

SOMAXCONN = int(Path("/proc/sys/net/core/somaxconn").read_text())  # the kernel's cap
QUEUED = min(400, SOMAXCONN - 8)  # agents reconnecting at once, more than the old backlog


async def test_the_ssh_listener_queues_hundreds_of_connections_while_the_loop_is_busy(
    tmp_path: Path,
) -> None:
    assert QUEUED > 200, f"net.core.somaxconn is {SOMAXCONN}: too low to show anything here"
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        opened: list[socket.socket] = []
        try:
            # synchronous on purpose: the event loop cannot accept while this runs, as
            # when it is busy; only the kernel's accept queue holds the connections
            for k in range(QUEUED):
                try:
                    opened.append(socket.create_connection(("127.0.0.1", gw.ssh_port), timeout=1))
                except OSError as exc:
                    raise AssertionError(
                        f"connection {k + 1} of {QUEUED} not queued: {exc}"
                    ) from None
        finally:
            for s in opened:
                s.close()
