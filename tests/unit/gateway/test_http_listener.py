"""The HTTP listener's guard: who is evicted at the cap, who is refused, who times out.

Fake transports and a fake aiohttp server (a function returning a recording protocol);
the integration tests in tests/integration/test_hostile_http.py use real sockets."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web

from cloud_gateway.listener import ConnectionGuard


class FakeTransport(asyncio.Transport):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.0.0.9", self.port) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


class Handler(asyncio.Protocol):
    """What aiohttp's per-connection handler would be; records what it was given."""

    def __init__(self) -> None:
        self.data = b""

    def data_received(self, data: bytes) -> None:
        self.data += data


def connect(guard: ConnectionGuard, port: int) -> FakeTransport:
    server = cast(web.Server, Handler)
    protocol = guard.protocol_factory(server)()
    transport = FakeTransport(port)
    protocol.connection_made(transport)
    protocol.data_received(b"GET /")
    return transport


async def test_at_the_cap_a_connection_that_never_sent_a_request_goes_first() -> None:
    guard = ConnectionGuard(max_connections=2, header_timeout=60, settle=0)
    served = connect(guard, 1)
    with guard.request(served):
        pass  # one whole request: now a kept-alive connection, idle
    fresh = connect(guard, 2)
    newcomer = connect(guard, 3)
    assert (served.closed, fresh.closed, newcomer.closed) == (False, True, False)
    with guard.request(newcomer):  # busy, and no fresh one left: the idle one goes
        last = connect(guard, 4)
    assert (served.closed, newcomer.closed, last.closed) == (True, False, False)
    assert guard.stats.open == 2 and guard.stats.closed["evicted"] == 2


async def test_when_every_connection_is_busy_a_new_one_gets_a_503() -> None:
    guard = ConnectionGuard(max_connections=2, header_timeout=60, settle=0)
    a, b = connect(guard, 1), connect(guard, 2)
    with guard.request(a), guard.request(b):
        refused = connect(guard, 3)
    assert refused.closed and refused.written.startswith(b"HTTP/1.1 503 ")
    assert not a.closed and not b.closed
    assert guard.stats.closed["refused"] == 1 and guard.stats.open == 2


async def test_a_connection_without_a_whole_request_is_closed_after_the_header_timeout() -> None:
    guard = ConnectionGuard(max_connections=10, header_timeout=0.05)
    silent, talking = connect(guard, 1), connect(guard, 2)
    with guard.request(talking):
        await asyncio.sleep(0.2)
    assert silent.closed and not talking.closed
    assert guard.stats.closed["header_timeout"] == 1 and guard.stats.open == 1
