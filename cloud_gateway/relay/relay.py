"""Scrape any published edge port by node name, through that node's tunnel.

Two forms on the gateway's HTTP port: an HTTP forward proxy for Prometheus ``proxy_url``
(request line ``GET http://NODE:PORT/metrics HTTP/1.1``) and the path form
``/proxy/{node}/{port}/{path}``. The gateway resolves NODE:PORT to the agent that
published it, opens a ``forwarded-tcpip`` channel on that agent's SSH connection, sends
the request as HTTP/1.1 and streams the answer back; channels are kept open and reused
for the next scrape of the same endpoint (keep-alive), so a scrape normally costs one
tunnel round trip. HTTP on the channel is h11's (:mod:`cloud_gateway.relay.upstream`), never
hand-written framing.

What a client or an upstream cannot make the proxy do:

- put a control byte, space, CR/LF or non-ASCII character into the upstream request: the
  target is the path and query re-encoded (:func:`~cloud_gateway.relay.upstream.request_target`),
  headers go through h11, so one client request is exactly one upstream request;
- hand one client's response to another: a channel goes back to the pool only after a
  complete response to a complete request with nothing left over, and leaves the pool at
  once if the upstream sends anything unasked or closes while it waits;
- hold the gateway: the response head is at most 64 KiB (502 beyond), and opening the
  channel, the head and the body all finish within the scrape timeout
  (``X-Prometheus-Scrape-Timeout-Seconds``, at most ``timeout``; 504 after). A response
  that breaks off after its head was relayed closes the client's connection, so the
  client sees a truncated body as an error, never as a complete one.

Not passed on: hop-by-hop headers (also those named in ``Connection``) and the
credentials meant for the gateway itself. Errors name the node and port in one line:
unknown node 404, node offline 503 (with when it was last seen), port not published 403,
a request h11 will not write 400, upstream refused or broke HTTP 502, timeout 504.

A browser holding an operator's credentials (basic auth) sends them to ``/proxy/...`` by
itself, so the proxy serves node content as untrusted on the gateway's origin: every
answer is sandboxed (:func:`~cloud_gateway.relay.upstream.sandbox`: no script, no sniffing,
no framing, no cookies, CORS or other origin-wide policy from a node); a request another
site made the browser send (``Sec-Fetch-Site`` other than ``same-origin``/``none``, or an
``Origin`` that is not the gateway's) is refused with 403 before anything is relayed; and
only the methods of ``http.proxy_methods`` (GET and HEAD unless the operator lists more)
are relayed, any other is a 405. Prometheus sends GET with neither header.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from http import HTTPStatus

import asyncssh
import h11
from aiohttp import web
from yarl import URL

from cloud_gateway.metrics import FamilySamples, fixed
from cloud_gateway.registry.store import Registry
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.relay.peers import PeerClient
from cloud_gateway.relay.upstream import (
    UpstreamChannel,
    UpstreamError,
    header_bytes,
    request_target,
    sandbox,
)
from cloud_gateway.self_metrics import SelfMetrics

MAX_IDLE_PER_ENDPOINT = 4  # keep-alive channels kept open per NODE:PORT
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

HTTP_STATUSES = tuple(str(int(s)) for s in HTTPStatus)  # code label values


class RelayError(Exception):
    def __init__(self, status: int, message: str, **headers: str) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


class _BrokenOff(RelayError):
    """The upstream failed after the response head went to the client."""

    def __init__(self, status: int, message: str, response: web.StreamResponse) -> None:
        super().__init__(status, message)
        self.response = response


def _connection_listed(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Header names a ``Connection`` header declares hop-by-hop."""
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    )


def _same_origin(origin: str, host: str) -> bool:
    """True when ``origin`` (an Origin header) names the host and port of ``host`` (the
    request's Host), the scheme's default port where either names none."""
    try:
        url = URL(origin)
        ours = URL(f"{url.scheme}://{host}") if url.scheme in ("http", "https") else None
    except ValueError:
        return False
    if ours is None or not url.host or url.raw_path not in ("", "/") or ours.raw_path != "/":
        return False  # "null" (sandboxed frames, data: URLs), a malformed value
    return (url.host.lower(), url.port) == ((ours.host or "").lower(), ours.port)


def cross_site(request: web.Request) -> str | None:
    """Why ``request`` was sent by a page of another site, or None: a browser says where a
    request comes from in ``Sec-Fetch-Site`` (``none``: typed in, a bookmark) and, for
    anything but a plain navigation, ``Origin``; a page cannot forge either. Prometheus
    and other programs send neither."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in ("same-origin", "none"):
        return f"Sec-Fetch-Site is {site[:40]!r}"
    origin = request.headers.get("Origin")
    if origin is not None and not _same_origin(origin.strip(), request.host):
        return f"Origin {origin[:100]!r} is not this gateway ({request.host[:100]!r})"
    return None


@dataclass
class Relay:
    registry: Registry
    endpoints: EndpointTable
    timeout: float = 10.0
    clock: Callable[[], float] = time.time
    requests: Counter[int] = field(default_factory=Counter)
    self_metrics: SelfMetrics = field(default_factory=SelfMetrics)
    # Several gateways: nodes owned by another gateway are asked of it (one hop).
    peers: PeerClient | None = None
    # http.proxy_methods: what is relayed; any other method is a 405.
    methods: tuple[str, ...] = ("GET", "HEAD")
    _idle: dict[tuple[str, int], list[UpstreamChannel]] = field(default_factory=dict)

    def families(self) -> list[FamilySamples]:
        """The relay's own metrics: requests by the status returned, endpoints."""
        codes = {str(code): count for code, count in self.requests.items()}
        return [
            fixed("gpurelay_gateway_proxy_requests_total", "code", codes, HTTP_STATUSES),
            *self.endpoints.families(),
        ]

    def resolve(self, node: str, port: int) -> asyncssh.SSHServerConnection:
        endpoint = self.endpoints.lookup(node, port)
        if endpoint is not None:
            return endpoint.conn  # type: ignore[no-any-return]
        now = self.clock()
        via = self.endpoints.siblings.get(node, node)
        view = self.registry.node(via, now=now)
        if view is None:
            raise RelayError(404, f"unknown node {node!r} (port {port})")
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
            raise RelayError(
                503,
                f"node {node!r}{through} is offline (last seen {seen}); port {port} is unavailable",
            )
        published = ", ".join(str(p) for p in self.endpoints.ports(node)) or "none"
        raise RelayError(
            403, f"port {port} of node {node!r} is not published (published ports: {published})"
        )

    async def relay(
        self, request: web.Request, node: str, port: int, path_qs: str, *, hop: bool = True
    ) -> web.StreamResponse:
        """Answer ``request`` from NODE:PORT; ``hop``: ask the owning gateway when the node
        is not here (False for a request that came from a peer)."""
        started = time.monotonic()
        response: web.StreamResponse
        try:
            if hop:  # a request from a peer was admitted by the gateway it came to
                self._admit(request)
            try:
                response = await self._relay(request, node, port, path_qs, started)
            except RelayError as exc:
                owner = self._owner(exc, node) if hop else None
                if owner is None:
                    raise
                assert self.peers is not None
                timeout = self._deadline(request) - (time.monotonic() - started)
                response = await self.peers.relay(
                    request,
                    owner,
                    node=node,
                    port=port,
                    path_qs=path_qs,
                    timeout=max(timeout, 0.001),
                )
            status = response.status
        except _BrokenOff as exc:
            response, status = exc.response, exc.status
        except RelayError as exc:
            response = web.Response(status=exc.status, text=f"{exc}\n", headers=exc.headers)
            status = exc.status
        if not response.prepared:  # a streamed answer was sandboxed before its head went
            sandbox(response.headers)
        self.requests[status] += 1
        self.self_metrics.observe_proxy(status, time.monotonic() - started)
        return response

    async def relay_path_form(
        self, request: web.Request, *, hop: bool = True
    ) -> web.StreamResponse:
        """A request of a ``{node}/{port}/{path}`` route (``/proxy/...``, and the peer
        listener's): 400 for a port that is not 1..65535, else :meth:`relay`."""
        port_text = request.match_info["port"]
        digits = port_text.isascii() and port_text.isdigit() and len(port_text) <= 5
        if not digits or not 1 <= int(port_text) <= 65535:  # isdigit alone takes '²'
            return web.Response(
                status=400, text=f"port {port_text[:20]!r} is not a number 1..65535\n"
            )
        path = "/" + request.match_info["path"]
        if request.query_string:
            path += "?" + request.query_string
        node = request.match_info["node"]
        return await self.relay(request, node, int(port_text), path, hop=hop)

    def _admit(self, request: web.Request) -> None:
        """RelayError unless the request may be relayed: its method is one of
        ``methods`` (405) and no other site's page sent it (403)."""
        if request.method not in self.methods:
            allowed = ", ".join(self.methods)
            raise RelayError(
                405,
                f"method {request.method[:20]!r} is not relayed to nodes; the gateway's "
                f"http.proxy_methods allows {allowed}",
                Allow=allowed,
            )
        why = cross_site(request)
        if why is not None:
            raise RelayError(
                403,
                f"cross-site request refused ({why}): the proxy relays only requests made "
                "by no page or by the gateway's own pages",
            )

    def _owner(self, exc: RelayError, node: str) -> tuple[str, str] | None:
        """Another gateway that owns ``node``, when this one does not have it."""
        if self.peers is None or exc.status not in (404, 503):
            return None
        return self.peers.owner(node)

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout - (time.monotonic() - started)
        body = await request.read() if request.can_read_body else b""
        try:
            outgoing = h11.Request(
                method=request.method.encode("ascii"),
                target=request_target(path_qs),
                headers=self._request_headers(request, node, port, len(body)),
            )
        except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
            raise RelayError(400, f"the request cannot be relayed to {node}:{port}: {exc}") from exc
        for _attempt in range(2):  # a pooled channel may have been closed by the upstream
            channel, reused = await self._channel(conn, node, port, deadline)
            try:
                async with asyncio.timeout_at(deadline):
                    channel.send(outgoing, body)
                    head = await channel.response()
            except TimeoutError as exc:
                channel.close()
                raise RelayError(504, f"{node}:{port} did not answer within {timeout:g}s") from exc
            except (UpstreamError, ConnectionError, asyncssh.Error) as exc:
                channel.close()
                if reused:
                    continue  # stale keep-alive channel: once more on a fresh one
                raise RelayError(502, f"{node}:{port} sent no valid HTTP response: {exc}") from exc
            return await self._stream(
                request, channel, head, node=node, port=port, deadline=deadline, timeout=timeout
            )
        raise RelayError(502, f"{node}:{port} closed the connection")

    async def _channel(
        self, conn: asyncssh.SSHServerConnection, node: str, port: int, deadline: float
    ) -> tuple[UpstreamChannel, bool]:
        """An idle keep-alive channel to NODE:PORT on this connection, or a new one."""
        idle = self._idle.get((node, port), [])
        while idle:
            channel = idle.pop()
            if channel.conn is conn and await channel.unpark():
                return channel, True
            channel.close()
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        try:
            async with asyncio.timeout(remaining):
                reader, writer = await conn.open_connection(node, port)
        except TimeoutError as exc:
            raise RelayError(504, f"timed out opening a channel to {node}:{port}") from exc
        except asyncssh.ChannelOpenError as exc:
            raise RelayError(502, f"{node}:{port} refused the connection: {exc.reason}") from exc
        except (OSError, asyncssh.Error) as exc:
            raise RelayError(502, f"the tunnel to {node}:{port} failed: {exc}") from exc
        return UpstreamChannel(conn, reader, writer), False

    async def _stream(
        self,
        request: web.Request,
        channel: UpstreamChannel,
        head: h11.Response,
        *,
        node: str,
        port: int,
        deadline: float,
        timeout: float,
    ) -> web.StreamResponse:
        headers = [
            (name.decode("latin-1"), value.decode("utf-8", errors="replace"))
            for name, value in head.headers.raw_items()
        ]
        drop = _DROP_RESPONSE | _connection_listed(headers)
        response = web.StreamResponse(
            status=head.status_code, reason=head.reason.decode("utf-8", errors="replace")
        )
        for name, value in headers:
            if name.lower() not in drop:
                response.headers.add(name, value)
        sandbox(response.headers)
        try:
            async with asyncio.timeout_at(deadline):
                await response.prepare(request)
                async for chunk in channel.body():
                    await response.write(chunk)
            await response.write_eof()
        except TimeoutError as exc:
            message = f"{node}:{port} did not finish its response within {timeout:g}s"
            raise self._broken_off(request, channel, response, 504, message) from exc
        except (UpstreamError, ConnectionError, asyncssh.Error) as exc:
            message = f"{node}:{port} broke off its response: {exc}"
            raise self._broken_off(request, channel, response, 502, message) from exc
        self._pool(node, port, channel)
        return response

    @staticmethod
    def _broken_off(
        request: web.Request,
        channel: UpstreamChannel,
        response: web.StreamResponse,
        status: int,
        message: str,
    ) -> RelayError:
        """Close the channel; once the head has gone out, close the client's connection
        too, so the body it got is an error and not a shorter scrape."""
        channel.close()
        if not response.prepared:
            return RelayError(status, message)
        if request.transport is not None:
            request.transport.close()
        return _BrokenOff(status, message, response)

    def _pool(self, node: str, port: int, channel: UpstreamChannel) -> None:
        key = (node, port)
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE_PER_ENDPOINT and channel.reusable():
            idle.append(channel)
            channel.park(lambda: self._unpool(key, channel))
        else:
            channel.close()

    def _unpool(self, key: tuple[str, int], channel: UpstreamChannel) -> None:
        """The upstream spoke or closed while the channel sat idle: it is done."""
        with suppress(ValueError):
            self._idle[key].remove(channel)
        channel.close()

    @staticmethod
    def _request_headers(
        request: web.Request, node: str, port: int, length: int
    ) -> list[tuple[bytes, bytes]]:
        drop = _DROP_REQUEST | _connection_listed(request.headers.items())
        headers = [(b"Host", f"{node}:{port}".encode("ascii", errors="replace"))]
        headers += [
            (header_bytes(name), header_bytes(value))
            for name, value in request.headers.items()
            if name.lower() not in drop
        ]
        if length:
            headers.append((b"Content-Length", str(length).encode()))
        return headers
