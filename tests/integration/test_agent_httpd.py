"""The agent's own HTTP/1.1 server (edge_agent.httpd) over real sockets: what a client
sends wrong gets a bounded, well-formed answer."""

from __future__ import annotations

import asyncio
import base64
import gzip
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import bcrypt
import pytest

from edge_agent import http_server, httpd
from gpurelay.web_config import BasicAuth
from harness.pipeline import make_pipeline

Served = tuple[http_server.LatestSnapshot, int]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=1)
    published = http_server.LatestSnapshot(clock=clock)
    published.publish(pipeline.collection.collect())
    listening = await http_server.serve(published, "127.0.0.1", 0)
    try:
        yield published, listening.port
    finally:
        await listening.close()
        pipeline.close()


async def exchange(port: int, data: bytes, *, responses: int = 1) -> list[tuple[bytes, bytes]]:
    """Send ``data`` raw; read ``responses`` responses (head, body) by Content-Length."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        out = []
        for _ in range(responses):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            head_only = data.startswith(b"HEAD")
            out.append((head, b"" if head_only else await reader.readexactly(length)))
        return out
    finally:
        writer.close()


def status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


async def closed_by_server(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(1 << 20), timeout) + await asyncio.wait_for(
            reader.read(), timeout
        )
    finally:
        writer.close()


async def test_keep_alive_pipelining_head_and_gzip(served: Served) -> None:
    published, port = served
    get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    (a, body_a), (b, body_b) = await exchange(port, get + get, responses=2)  # one connection
    assert status(a) == status(b) == 200 and body_a == body_b == published.body(False, False)
    ((head, body),) = await exchange(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status(head) == 200 and body == b""
    assert f"Content-Length: {len(body_a)}".encode() in head
    gz = b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip, deflate\r\n\r\n"
    ((head, body),) = await exchange(port, gz)
    assert b"Content-Encoding: gzip" in head and gzip.decompress(body) == body_a
    absolute = b"GET http://edge:9400/v1/collect HTTP/1.1\r\nHost: x\r\n\r\n"
    ((head, body),) = await exchange(port, absolute)
    assert status(head) == 200 and body.startswith(b"{") and b"application/json" in head


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n folded: x\r\nHost: x\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host (RFC 9112 3.2)
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\n",
            400,
        ),  # isdigit, not int
        (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
        (b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * httpd.MAX_HEAD + b"\r\n\r\n", 431),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
            + b"X: y\r\n" * (httpd.MAX_HEADERS + 1)
            + b"\r\n",
            431,
        ),
    ],
)
async def test_bad_requests_get_a_status_and_the_connection_closes(
    served: Served, request_bytes: bytes, code: int
) -> None:
    _published, port = served
    answer = await closed_by_server(port, request_bytes)
    assert status(answer) == code, answer[:200]
    assert b"Connection: close" in answer


async def test_unknown_paths_and_methods_keep_the_connection(served: Served) -> None:
    _published, port = served
    (nope, _), (post, _), (ok, _) = await exchange(
        port,
        b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        responses=3,
    )
    assert [status(nope), status(post), status(ok)] == [404, 405, 200]
    assert b"Allow: GET, HEAD" in post


async def test_http10_closes_and_close_is_honoured(served: Served) -> None:
    """HTTP/1.0 connections close after one response, keep-alive asked or not (h11, as
    uvicorn); HTTP/1.1 ones when the client says ``Connection: close``."""
    _published, port = served
    for req in (
        b"GET /healthz HTTP/1.0\r\n\r\n",
        b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ):
        answer = await closed_by_server(port, req)  # returns: the server closed
        assert status(answer) == 200 and b"Connection: close" in answer


async def test_a_slow_or_silent_client_is_dropped(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    _published, port = served
    monkeypatch.setattr(httpd, "HEAD_TIMEOUT", 0.3)
    monkeypatch.setattr(httpd, "IDLE_TIMEOUT", 0.3)
    # A head that never ends (slowloris): 408, then closed.
    answer = await closed_by_server(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: b\r\n")
    assert status(answer) == 408
    # Nothing sent at all, or idle after a response: closed without a word.
    assert await closed_by_server(port, b"") == b""
    answer = await closed_by_server(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status(answer) == 200 and answer.count(b"HTTP/1.1") == 1


@asynccontextmanager
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[int, BasicAuth]]:
    """The agent's server with one collection and basic auth (user prom, password secret):
    its port and its BasicAuth; stopped on the way out."""
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=1)
    published = http_server.LatestSnapshot(clock=clock)
    published.publish(pipeline.collection.collect())
    users = BasicAuth({"prom": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4))})
    server = http_server.make_app(published, users)
    port = await server.start("127.0.0.1", 0, None)
    try:
        yield port, users
    finally:
        await server.cleanup()
        pipeline.close()


async def test_basic_auth_guards_every_path_but_the_probes(tmp_path: Path) -> None:
    async with guarded(tmp_path) as (port, _users):
        for path, code in (("/metrics", 401), ("/nope", 401), ("/healthz", 200)):
            answer = await closed_by_server(port, f"GET {path} HTTP/1.0\r\n\r\n".encode())
            assert status(answer) == code, path
        # not ASCII: was a 500 and a traceback (base64 refuses such a str); found by make fuzz
        latin = b"GET /metrics HTTP/1.0\r\nAuthorization: Basic cHJvbTpzZWNyZXQ\xff\r\n\r\n"
        assert status(await closed_by_server(port, latin)) == 401
        ok = b"GET /metrics HTTP/1.0\r\nAuthorization: Basic cHJvbTpzZWNyZXQ=\r\n\r\n"
        assert status(await closed_by_server(port, ok)) == 200


async def test_wrong_passwords_are_throttled_per_client_address(tmp_path: Path) -> None:
    """Issue 24 #6: after BasicAuth's failure budget from one address, that address is
    refused without a bcrypt (the agent passes the peer's address as the source)."""
    wrong = b"GET /metrics HTTP/1.0\r\nAuthorization: Basic cHJvbTp3cm9uZw==\r\n\r\n"
    ok = b"GET /metrics HTTP/1.0\r\nAuthorization: Basic cHJvbTpzZWNyZXQ=\r\n\r\n"
    async with guarded(tmp_path) as (port, users):
        for guess in range(20):  # distinct wrong passwords, no cache hit
            attempt = wrong.replace(b"cHJvbTp3cm9uZw==", _basic(f"prom:wrong{guess}"))
            assert status(await closed_by_server(port, attempt)) == 401
        assert users.refused_fast > 0, "20 wrong passwords from one address: none throttled"
        assert status(await closed_by_server(port, ok)) == 401  # 127.0.0.1 is throttled now


def _basic(credentials: str) -> bytes:
    return base64.b64encode(credentials.encode())


async def test_a_full_house_of_idle_connections_does_not_lock_out_the_probe(
    served: Served,
) -> None:
    """Issue 24 #2: the connection cap's worth of kept-alive idle connections (one client,
    a few requests a second) made every new connection, the liveness probe's included,
    close at once. The oldest idle one makes room instead."""
    _published, port = served
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        for _ in range(httpd.MAX_CONNECTIONS):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(probe)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert status(head) == 200 and b"Connection: close" not in head
            held.append((reader, writer))
        await asyncio.sleep(1.0)  # past httpd.SETTLE_SECONDS: a just-answered one stays
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(probe)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert status(head) == 200, head
        finally:
            writer.close()
        oldest, newest = held[0], held[-1]
        rest = await asyncio.wait_for(oldest[0].read(), 5)  # returns at end of file:
        assert rest.startswith(b"ok: node")  # the oldest was closed, after its body
        await asyncio.wait_for(newest[0].readuntil(b"ago\n"), 5)  # the rest of its body
        newest[1].write(probe)  # still open, still served
        again = await asyncio.wait_for(newest[0].readuntil(b"\r\n\r\n"), 5)
        assert status(again) == 200, again
    finally:
        for _reader, writer in held:
            writer.close()


async def test_an_undecodable_path_gets_a_400_and_no_traceback(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24 #2: ``GET /%ff`` escaped the parser as UnicodeDecodeError: no answer, and a
    traceback in the log for every such request."""
    _published, port = served
    with caplog.at_level(logging.DEBUG):
        for target in (b"/%ff", b"/metrics%ff?x", b"http://edge/%c3%28"):
            answer = await closed_by_server(
                port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            assert status(answer) == 400 and b"Connection: close" in answer, (target, answer)
        ((head, _),) = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(head) == 200
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]


async def test_a_flood_of_silent_connections_churns_among_itself(served: Served) -> None:
    """Connections that never send a whole request are the first to make room, so a
    probe that connects and asks at once is answered while the flood goes on."""
    _published, port = served
    silent = [
        await asyncio.open_connection("127.0.0.1", port) for _ in range(httpd.MAX_CONNECTIONS)
    ]
    try:
        for _ in range(3):
            ((head, body),) = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status(head) == 200 and body.startswith(b"ok: node"), head
        assert await asyncio.wait_for(silent[0][0].read(), 5) == b""  # the oldest went first
    finally:
        for _reader, writer in silent:
            writer.close()
