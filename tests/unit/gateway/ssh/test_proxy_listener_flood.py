"""A flood of connections without a PROXY header costs one log line per reason per 10 s,
not one per connection; every one is still counted."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cloud_gateway.ssh.balancer_listener import ProxiedListener


async def test_a_flood_of_refused_connections_logs_one_line_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cloud_gateway")
    listener = ProxiedListener(timeout=5.0)
    server = await listener.create_server(lambda *_: asyncio.Protocol(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")  # no header first
            await writer.drain()
            assert await reader.read() == b""  # aborted, nothing sent back
            writer.close()
        for _ in range(100):
            if listener.refused["missing"] == 40:
                break
            await asyncio.sleep(0.01)
        assert listener.refused["missing"] == 40
        lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "before SSH (missing)" in lines[0].getMessage()
    finally:
        server.close()
        await server.wait_closed()
