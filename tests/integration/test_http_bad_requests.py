"""Requests an HTTP server cannot parse, from any client: a 400, the connection closed, and
in the log one throttled WARNING line with the client and the reason, not a traceback per
request (aiohttp's ``aiohttp.server`` logger logs each at ERROR with its traceback).

The gateway's real listener (cloud_gateway.listener around aiohttp) counts them in
``gpurelay_gateway_http_connections_closed_total{reason="bad_request"}``; the agent's own
server (edge_agent.httpd) answers them without logging anything.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from edge_agent.httpd import HttpServer, Request, Response
from harness.fleet import gateway_config, make_pki, metrics_text, running_gateway
from harness.waiting import wait_for

BAD = {
    "nul in a header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "bad transfer-encoding": (
        b"POST /v1/collect HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, identity\r\n\r\n"
    ),
    "two content-lengths": (
        b"POST /v1/collect HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
    ),
    "bad version": b"GET /healthz HTTP/9.x\r\nHost: x\r\n\r\n",
    "header line too long": b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
    "not http at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
}
ROUNDS = 5  # each bad request this many times: a flood, in small


async def exchange(port: int, request: bytes) -> bytes:
    """Send one request, read until the server closes (or 30 s pass: then b'')."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    except (TimeoutError, ConnectionError):
        return b""
    finally:
        writer.close()


def status(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


async def test_the_gateway_logs_one_throttled_line_not_a_traceback_per_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="aiohttp"), caplog.at_level(logging.INFO):
        async with running_gateway(gateway_config(pki)) as gw:
            gw.connections.log_bad_request.every = 3600  # one line, however slow the machine
            for _ in range(ROUNDS):
                for name, request in BAD.items():
                    answer = await exchange(gw.http_port, request)
                    assert status(answer) == 400, (name, answer[:200])
            # the listener still serves, and counts every one of them
            assert status(await exchange(gw.http_port, b"GET /healthz HTTP/1.0\r\n\r\n")) == 200
            family = "gpurelay_gateway_http_connections_closed_total"
            want = f'{family}{{reason="bad_request"}} {ROUNDS * len(BAD)}'

            async def counted() -> bool:
                return want in (await metrics_text(gw)).splitlines()

            await wait_for(counted, what="every bad request counted")
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    lines = [r for r in caplog.records if "could not be parsed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    (line,) = lines
    assert line.levelno == logging.WARNING and line.name == "cloud_gateway.http"
    text = line.getMessage()
    assert text.startswith("HTTP request from ('127.0.0.1', "), text
    assert "answered 400 and closed: " in text and "\n" not in text, text
    assert "\x00" not in text, text


async def test_the_agent_answers_bad_requests_without_logging_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def ok(_req: Request) -> Response:
        return Response.text("ok\n")

    server = HttpServer({"/healthz": ok, "/metrics": ok})
    port = await server.start("127.0.0.1", 0, None)
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(ROUNDS):
                for name, request in BAD.items():
                    answer = await exchange(port, request)
                    assert status(answer) in (400, 411, 431, 505), (name, answer[:200])
            assert status(await exchange(port, b"GET /healthz HTTP/1.0\r\n\r\n")) == 200
    finally:
        await server.cleanup()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
