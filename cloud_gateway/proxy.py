"""Scrape any published edge port by node name, through that node's tunnel.

Two forms on the gateway's HTTP port: an HTTP forward proxy for Prometheus ``proxy_url``
(request line ``GET http://NODE:PORT/metrics HTTP/1.1``) and the path form
``/proxy/{node}/{port}/{path}``. The gateway resolves NODE:PORT to the agent that
published it, opens a ``forwarded-tcpip`` channel on that agent's SSH connection, sends
the request as HTTP/1.0 (so the body ends with the channel) and streams the answer back.

Errors name the node and port in one line: unknown node 404, node offline 503 (with when
it was last seen), port not published 403, upstream refused 502, upstream timeout 504.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import asyncssh
from aiohttp import web

from cloud_gateway.endpoints import EndpointTable
from cloud_gateway.registry import Registry

MAX_HEADER_BYTES = 64 * 1024
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
            self.requests[exc.status] += 1
            return web.Response(status=exc.status, text=f"{exc}\n")
        self.requests[response.status] += 1
        return response

    def _deadline(self, request: web.Request) -> float:
        timeout = self.timeout
        header = request.headers.get("X-Prometheus-Scrape-Timeout-Seconds")
        if header:
            with suppress(ValueError):
                timeout = min(timeout, float(header))
        return timeout

    async def _relay(
        self, request: web.Request, node: str, port: int, path_qs: str, started: float
    ) -> web.StreamResponse:
        conn = self.resolve(node, port)
        timeout = self._deadline(request)
        try:
            reader, writer = await asyncio.wait_for(conn.open_connection(node, port), timeout)
        except TimeoutError as exc:
            raise ProxyError(504, f"timed out opening a channel to {node}:{port}") from exc
        except asyncssh.ChannelOpenError as exc:
            raise ProxyError(502, f"{node}:{port} refused the connection: {exc.reason}") from exc
        except (OSError, asyncssh.Error) as exc:
            raise ProxyError(502, f"the tunnel to {node}:{port} failed: {exc}") from exc
        try:
            body = await request.read() if request.can_read_body else b""
            writer.write(self._request_head(request, node, port, path_qs, len(body)) + body)
            remaining = timeout - (time.monotonic() - started)
            status, reason, headers, rest = await asyncio.wait_for(
                _read_head(reader), max(remaining, 0.001)
            )
            response = web.StreamResponse(status=status, reason=reason)
            for name, value in headers:
                if name.lower() not in _DROP_RESPONSE:
                    response.headers.add(name, value)
            await response.prepare(request)
            if rest:
                await response.write(rest)
            while True:
                remaining = timeout - (time.monotonic() - started)
                chunk = await asyncio.wait_for(reader.read(CHUNK), max(remaining, 0.001))
                if not chunk:
                    break
                await response.write(chunk)
            await response.write_eof()
            return response
        except TimeoutError as exc:
            raise ProxyError(504, f"{node}:{port} did not answer within {timeout:g}s") from exc
        except _BadUpstream as exc:
            raise ProxyError(502, f"{node}:{port} sent an invalid HTTP response: {exc}") from exc
        except (ConnectionError, asyncssh.Error) as exc:
            raise ProxyError(502, f"{node}:{port} closed the connection: {exc}") from exc
        finally:
            writer.close()

    @staticmethod
    def _request_head(
        request: web.Request, node: str, port: int, path_qs: str, length: int
    ) -> bytes:
        lines = [f"{request.method} {path_qs or '/'} HTTP/1.0", f"Host: {node}:{port}"]
        for name, value in request.headers.items():
            if name.lower() not in _DROP_REQUEST:
                lines.append(f"{name}: {value}")
        if length:
            lines.append(f"Content-Length: {length}")
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _BadUpstream(Exception):
    pass


async def _read_head(
    reader: asyncssh.SSHReader[bytes],
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEADER_BYTES:
            raise _BadUpstream("headers larger than 64 KiB")
        chunk = await reader.read(CHUNK)
        if not chunk:
            raise _BadUpstream("connection closed before the headers ended")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
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
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers, rest
