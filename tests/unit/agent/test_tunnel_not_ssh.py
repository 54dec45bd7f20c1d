"""An agent whose gateway address reaches something that is not an SSH server says so
(issue 23): before, an HTTP server on the gateway's port, a port that sends garbage, or one
that accepts and hangs up all read "cannot reach gateway HOST:PORT: Connection lost", and
one that accepts and says nothing "cannot reach gateway HOST:PORT: " (an empty reason).

Real TCP servers on loopback; the agent's real tunnel dials them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_types import TunnelError
from tests.unit.agent.test_tunnel_backoff import tunnel

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handle: Handler) -> AsyncIterator[int]:
    """A TCP server on a free loopback port running ``handle`` per connection."""
    tasks: set[asyncio.Task[None]] = set()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    srv = await asyncio.start_server(connected, "127.0.0.1", 0)
    try:
        yield int(srv.sockets[0].getsockname()[1])
    finally:
        srv.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await srv.wait_closed()


async def http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readline()  # the agent's SSH version line: a bad request line to HTTP
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"\x15\x03\x01\x00\x02\x02\x50")  # a TLS alert, as a TLS server would say
    await writer.drain()


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    return None


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(60)


async def failure(tmp_path: Path, handle: Handler, *, timeout: float = 5.0) -> tuple[str, Tunnel]:
    async with server(handle) as port:
        t = tunnel(tmp_path, address=f"127.0.0.1:{port}")
        t._cfg = dataclasses.replace(t._cfg, connect_timeout_seconds=timeout)
        with pytest.raises(TunnelError) as failed:
            await t._attempt("127.0.0.1", port)
    return str(failed.value).replace(str(port), "PORT"), t


async def test_an_http_server_is_named_by_what_it_answered(tmp_path: Path) -> None:
    message, t = await failure(tmp_path, http_server)
    assert message == (
        "gateway 127.0.0.1:PORT answered but is not an SSH server "
        "(it sent 'HTTP/1.1 400 Bad Request')"
    )
    assert t.stats.failures == {"not_ssh": 1}


async def test_garbage_is_quoted_as_data(tmp_path: Path) -> None:
    message, t = await failure(tmp_path, garbage)
    assert message == (
        "gateway 127.0.0.1:PORT answered but is not an SSH server "
        "(it sent '\\x15\\x03\\x01\\x00\\x02\\x02P')"
    )
    assert t.stats.failures == {"not_ssh": 1}


async def test_a_server_that_hangs_up_at_once(tmp_path: Path) -> None:
    message, t = await failure(tmp_path, hang_up)
    assert message == (
        "gateway 127.0.0.1:PORT accepted the connection and closed it without an SSH "
        "greeting (not an SSH server, or one turning connections away)"
    )
    assert t.stats.failures == {"no_greeting": 1}


async def test_a_server_that_says_nothing(tmp_path: Path) -> None:
    message, t = await failure(tmp_path, silent, timeout=0.5)
    assert message == (
        "gateway 127.0.0.1:PORT accepted the connection but sent no SSH greeting within "
        "0.5s (not an SSH server, or one too busy to answer)"
    )
    assert t.stats.failures == {"no_greeting": 1}
