"""Scrape any published edge port by node name, through that node's tunnel.

Two forms on the gateway's HTTP port: an HTTP forward proxy for Prometheus ``proxy_url``
(request line ``GET http://NODE:PORT/metrics HTTP/1.1``) and the path form
``/proxy/{node}/{port}/{path}``. The gateway resolves NODE:PORT to the agent that
published it, opens a ``forwarded-tcpip`` channel on that agent's SSH connection, sends
the request as HTTP/1.1 and streams the answer back (Content-Length, chunked or
until-close framing); channels are kept open and reused for the next scrape of the same
endpoint (keep-alive), so a scrape normally costs one tunnel round trip.

Errors name the node and port in one line: unknown node 404, node offline 503 (with when
it was last seen), port not published 403, upstream refused 502, upstream timeout 504.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field

import asyncssh
from aiohttp import web

from cloud_gateway.endpoints import EndpointTable
from cloud_gateway.registry import Registry
from cloud_gateway.self_metrics import SelfMetrics

MAX_HEADER_BYTES = 64 * 1024
MAX_IDLE_PER_ENDPOINT = 4  # keep-alive channels kept open per NODE:PORT
CHUNK = 65536
# Not passed on: hop-by-hop headers and the credentials meant for the gateway itself.
_DROP_REQUEST = frozenset(
    h.lower()
    for h in (
        "Host",
        "Connection",
        "Keep-Alive",
        "Proxy-Authorization",
        "Proxy-Connection",
        "Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Content-Length",
    )
)
_DROP_RESPONSE = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Transfer-Encoding",
        "Trailer",
        "Upgrade",
        "Content-Length",
    )
)


class ProxyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Proxy:
    registry: Registry
    endpoints: EndpointTable
    timeout: float = 10.0
    clock: Callable[[], float] = time.time
    requests: Counter[int] = field(default_factory=Counter)
    self_metrics: SelfMetrics = field(default_factory=SelfMetrics)
    _idle: dict[tuple[str, int], list[_ProxyChannel]] = field(default_factory=dict)

    def resolve(self, node: str, port: int) -> asyncssh.SSHServerConnection:
        endpoint = self.endpoints.lookup(node, port)
        if endpoint is not None:
            return endpoint.conn  # type: ignore[no-any-return]
        now = self.clock()
        via = self.endpoints.siblings.get(node, node)
        view = self.registry.node(via, now=now)
        if view is None:
            raise ProxyError(404, f"unknown node {node!r} (port {port})")
        if view.state == "offline":
            seen = (
                "never"
                if view.last_seen is None
                else (
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(view.last_seen))
                    + f" ({now - view.last_seen:.0f}s ago)"
                )
            )
            through = f", reached through {via}," if via != node else ""
            raise ProxyError(
                503,
                f"node {node!r}{through} is offline (last seen {seen}); port {port} is unavailable",
            )
        published = ", ".join(str(p) for p in self.endpoints.ports(node)) or "none"
        raise ProxyError(
            403, f"port {port} of node {node!r} is not published (published ports: {published})"
        )

    async def relay(
        self, request: web.Request, node: str, port: int, path_qs: str
    ) -> web.StreamResponse:
        started = time.monotonic()
        try:
            response = await self._relay(request, node, port, path_qs, started)
        except ProxyError as exc:
            response = web.Response(status=exc.status, text=f"{exc}\n")
        self.requests[response.status] += 1
        self.self_metrics.observe_proxy(response.status, time.monotonic() - started)
        return response

    def _deadline(self, request: web.Request) -> float:
        timeout = self.timeout
        header = request.headers.get("X-Prometheus-Scrape-Timeout-Seconds")
        if header:
            with suppress(ValueError):
                timeout = min(timeout, float(header))
        return timeout

    async def _channel(
        self, conn: asyncssh.SSHServerConnection, node: str, port: int, timeout: float
    ) -> tuple[_ProxyChannel, bool]:
        """An idle keep-alive channel to NODE:PORT on this connection, or a new one."""
        idle = self._idle.get((node, port), [])
        while idle:
            channel = idle.pop()
            if channel.conn is conn and not channel.reader.at_eof():
                return channel, True
            channel.writer.close()
        try:
            reader, writer = await asyncio.wait_for(conn.open_connection(node, port), timeout)
        except TimeoutError as exc:
            raise ProxyError(504, f"timed out opening a channel to {node}:{port}") from exc
        except asyncssh.ChannelOpenError as exc:
            raise ProxyError(502, f"{node}:{port} refused the connection: {exc.reason}") from exc
        except (OSError, asyncssh.Error) as exc:
            raise ProxyError(502, f"the tunnel to {node}:{port} failed: {exc}") from exc
        return _ProxyChannel(conn, reader, writer), False

    async def _relay(
        self, request: web.Request, node: str, port: int, path_qs: str, started: float
    ) -> web.StreamResponse:
        conn = self.resolve(node, port)
        timeout = self._deadline(request)
        body = await request.read() if request.can_read_body else b""
        head = self._request_head(request, node, port, path_qs, len(body)) + body
        for _attempt in range(2):  # a pooled channel may have been closed by the upstream
            channel, reused = await self._channel(conn, node, port, timeout)
            try:
                channel.writer.write(head)
                remaining = timeout - (time.monotonic() - started)
                upstream = _Buffered(channel.reader)
                status, reason, headers = await asyncio.wait_for(
                    upstream.head(), max(remaining, 0.001)
                )
            except TimeoutError as exc:
                channel.writer.close()
                raise ProxyError(504, f"{node}:{port} did not answer within {timeout:g}s") from exc
            except (_BadUpstream, ConnectionError, asyncssh.Error) as exc:
                channel.writer.close()
                if reused:
                    continue  # stale keep-alive channel: once more on a fresh one
                raise ProxyError(502, f"{node}:{port} sent no valid HTTP response: {exc}") from exc
            return await self._stream(
                request,
                channel,
                upstream=upstream,
                status=status,
                reason=reason,
                headers=headers,
                node=node,
                port=port,
                started=started,
                timeout=timeout,
            )
        raise ProxyError(502, f"{node}:{port} closed the connection")

    async def _stream(
        self,
        request: web.Request,
        channel: _ProxyChannel,
        *,
        upstream: _Buffered,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        node: str,
        port: int,
        started: float,
        timeout: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=status, reason=reason)
        lowered = {k.lower(): v for k, v in headers}
        for name, value in headers:
            if name.lower() not in _DROP_RESPONSE:
                response.headers.add(name, value)
        reusable = "close" not in lowered.get("connection", "").lower()
        try:
            await response.prepare(request)
            if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                chunks = upstream.nothing()
            elif "chunked" in lowered.get("transfer-encoding", "").lower():
                chunks = upstream.chunked()
            elif "content-length" in lowered:
                chunks = upstream.exactly(int(lowered["content-length"]))
            else:
                reusable = False
                chunks = upstream.until_eof()
            while True:
                remaining = timeout - (time.monotonic() - started)
                chunk = await asyncio.wait_for(anext(chunks, b""), max(remaining, 0.001))
                if not chunk:
                    break
                await response.write(chunk)
            await response.write_eof()
        except TimeoutError as exc:
            channel.writer.close()
            raise ProxyError(504, f"{node}:{port} did not answer within {timeout:g}s") from exc
        except (ValueError, _BadUpstream, ConnectionError, asyncssh.Error) as exc:
            channel.writer.close()
            raise ProxyError(502, f"{node}:{port} broke off its response: {exc}") from exc
        if reusable and upstream.clean():
            idle = self._idle.setdefault((node, port), [])
            if len(idle) < MAX_IDLE_PER_ENDPOINT:
                idle.append(channel)
                return response
        channel.writer.close()
        return response

    @staticmethod
    def _request_head(
        request: web.Request, node: str, port: int, path_qs: str, length: int
    ) -> bytes:
        lines = [f"{request.method} {path_qs or '/'} HTTP/1.1", f"Host: {node}:{port}"]
        for name, value in request.headers.items():
            if name.lower() not in _DROP_REQUEST:
                lines.append(f"{name}: {value}")
        if length:
            lines.append(f"Content-Length: {length}")
        lines.append("Connection: keep-alive")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _BadUpstream(Exception):
    pass


@dataclass
class _ProxyChannel:
    conn: asyncssh.SSHServerConnection
    reader: asyncssh.SSHReader[bytes]
    writer: asyncssh.SSHWriter[bytes]


class _Buffered:
    """HTTP/1.1 response framing over a channel: head, then the body as it is framed."""

    def __init__(self, reader: asyncssh.SSHReader[bytes]) -> None:
        self._reader = reader
        self._buf = b""

    async def _fill(self) -> None:
        chunk = await self._reader.read(CHUNK)
        if not chunk:
            raise _BadUpstream("connection closed in the middle of a response")
        self._buf += chunk

    async def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            if len(self._buf) > MAX_HEADER_BYTES:
                raise _BadUpstream("line longer than 64 KiB")
            await self._fill()
        line, _, self._buf = self._buf.partition(b"\r\n")
        return line

    async def head(self) -> tuple[int, str, list[tuple[str, str]]]:
        while b"\r\n\r\n" not in self._buf:
            if len(self._buf) > MAX_HEADER_BYTES:
                raise _BadUpstream("headers larger than 64 KiB")
            await self._fill()
        head, _, self._buf = self._buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise _BadUpstream(f"status line {lines[0][:80]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _BadUpstream(f"header line {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        return int(parts[1]), parts[2] if len(parts) > 2 else "", headers

    async def nothing(self) -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover - makes this an async generator

    async def exactly(self, length: int) -> AsyncIterator[bytes]:
        if length < 0:
            raise _BadUpstream("negative Content-Length")
        while length > 0:
            if not self._buf:
                await self._fill()
            piece, self._buf = self._buf[:length], self._buf[length:]
            length -= len(piece)
            yield piece

    async def chunked(self) -> AsyncIterator[bytes]:
        while True:
            size_line = await self._line()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise _BadUpstream(f"chunk size {size_line[:20]!r}") from exc
            if size == 0:
                while await self._line():  # trailers, up to the empty line
                    pass
                return
            async for piece in self.exactly(size):
                yield piece
            if await self._line() != b"":
                raise _BadUpstream("chunk not followed by CRLF")

    async def until_eof(self) -> AsyncIterator[bytes]:
        if self._buf:
            piece, self._buf = self._buf, b""
            yield piece
        while chunk := await self._reader.read(CHUNK):
            yield chunk

    def clean(self) -> bool:
        """Nothing left over: the channel can carry the next request."""
        return not self._buf
