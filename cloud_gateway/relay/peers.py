"""One authenticated hop between gateways: a proxied scrape of a node that another gateway
of the cluster owns goes to that gateway's peer listener, which relays it through the
node's tunnel as if it had been asked directly.

- The peer listener (:func:`peer_app`) serves only
  ``/peer/v1/proxy/{node}/{port}/{path}``, and only to a peer that presents the cluster's
  shared token (``[cluster] peer_token_file``) as a bearer token; it never forwards again
  (one hop: two gateways that disagree about an owner cannot bounce a request).
- The client side (:class:`PeerClient`) is asked by the proxy when a node is not
  connected here; it finds the owner's address in the fleet view (``route``), sends the
  request with the scrape's remaining time, and streams the answer back with the owner's
  status and headers, adding no header of its own (the client's Accept-Encoding, or
  none, is what the owner sees). Errors name the node and the gateway: 502 when the
  owner cannot be reached, 504 when it does not answer in time.

The peer listener faces the network like the HTTP listener and is guarded the same way
(:class:`cloud_gateway.listener.ConnectionGuard`): at most ``PEER_MAX_CONNECTIONS``
connections (a new one makes room by closing the oldest idle one; all busy: 503), the
first request's headers within ``PEER_HEADER_TIMEOUT_SECONDS``, a kept-alive connection
closed after ``PEER_IDLE_SECONDS`` without a request, a request body within
``PEER_BODY_TIMEOUT_SECONDS`` (408), the token compared in constant time before anything
else is read. A peer gateway keeps a few connections per owner (aiohttp's pool); the cap
is far above what the scrapes of a fleet need, and a flood of silent or wrong-token
clients churns among itself without keeping a real scrape out."""

from __future__ import annotations

import asyncio
import hmac
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from cloud_gateway.listener import ConnectionGuard, GuardedSite
from cloud_gateway.relay.upstream import sandbox

if TYPE_CHECKING:
    from cloud_gateway.relay.relay import Relay

PEER_PREFIX = "/peer/v1/proxy"
PEER_MAX_CONNECTIONS = 256  # concurrent connections (one request in flight each)
PEER_HEADER_TIMEOUT_SECONDS = 5.0  # a new connection's first request's headers
PEER_IDLE_SECONDS = 30.0  # a kept-alive connection without a request
PEER_BODY_TIMEOUT_SECONDS = 5.0  # a request's body, once its headers are in
CHUNK = 64 * 1024
# Not passed on in either direction: hop-by-hop, and what only concerns one side.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authorization", "Proxy-Connection", "Authorization",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip
# aiohttp's client adds these when the request has none; the hop sends only what the
# client sent (an Accept-Encoding of its own would get the client a gzip body it never
# asked for: the answer is streamed through undecoded).
_NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = Callable[[str], "tuple[str, str] | None"]  # node -> (gateway id, host:port) or None


class PeerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeerClient:
    """Relays a request to the gateway that owns the node. ``tls``: the client context of
    ``[cluster] peer_tls_*`` (https, the peer's certificate checked against that CA and
    its advertise host); ``None``: plain http, for a private peer network."""

    def __init__(self, token: str, route: Route, *, tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.route = route
        self.tls = tls
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0

    def owner(self, node: str) -> tuple[str, str] | None:
        return self.route(node)

    async def relay(
        self,
        request: web.Request,
        owner: tuple[str, str],
        *,
        node: str,
        port: int,
        path_qs: str,
        timeout: float,
    ) -> web.StreamResponse:
        """``request`` answered by the gateway ``owner`` = (id, host:port)."""
        gateway, address = owner
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.tls if self.tls is not None else False)
            self._session = aiohttp.ClientSession(auto_decompress=False, connector=connector)
        scheme = "http" if self.tls is None else "https"
        url = f"{scheme}://{address}{PEER_PREFIX}/{node}/{port}{path_qs}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["Authorization"] = f"Bearer {self.token}"
        headers["X-Prometheus-Scrape-Timeout-Seconds"] = f"{timeout:.3f}"
        body = await request.read() if request.can_read_body else b""
        self.requests += 1
        where = f"node {node!r} is on gateway {gateway} ({address})"
        response = web.StreamResponse()
        try:
            async with asyncio.timeout(timeout):
                async with self._session.request(
                    request.method,
                    url,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    skip_auto_headers=_NOT_ADDED,
                ) as upstream:
                    response.set_status(upstream.status, upstream.reason)
                    for name, value in upstream.headers.items():
                        if name.lower() not in _HOP:
                            response.headers.add(name, value)
                    sandbox(response.headers)  # the owner did; a browser sees it here
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_chunked(CHUNK):
                        await response.write(chunk)
                    await response.write_eof()
        except TimeoutError:
            return self._failed(
                request, response, 504, f"{where}, which did not answer in {timeout:g}s"
            )
        except (aiohttp.ClientError, OSError) as exc:
            return self._failed(request, response, 502, f"{where}, which cannot be reached: {exc}")
        return response

    @staticmethod
    def _failed(
        request: web.Request, response: web.StreamResponse, status: int, message: str
    ) -> web.StreamResponse:
        if response.prepared:  # the head went out: break the client's connection off
            if request.transport is not None:
                request.transport.close()
            return response
        return web.Response(status=status, text=f"{message}\n")

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def peer_app(relay: Relay, token: str, guard: ConnectionGuard | None = None) -> web.Application:
    """The peer listener's application: the one route, behind the shared token."""
    expected = token.encode()

    async def hop(request: web.Request) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        # compare_digest always: its time does not depend on where a wrong token differs
        good = hmac.compare_digest(presented.strip().encode(), expected)
        if scheme.lower() != "bearer" or not good:
            return web.Response(status=401, text="peer token missing or wrong\n")
        if request.can_read_body:
            try:
                async with asyncio.timeout(PEER_BODY_TIMEOUT_SECONDS):
                    await request.read()  # kept by aiohttp for the relay
            except TimeoutError:
                return web.Response(
                    status=408,
                    text=f"request body not received within {PEER_BODY_TIMEOUT_SECONDS:g}s\n",
                    headers={"Connection": "close"},
                )
        return await relay.relay_path_form(request, hop=False)  # one hop, never two

    @web.middleware
    async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
        if guard is None:
            return await handler(request)
        with guard.request(request.transport):
            return await handler(request)

    app = web.Application(middlewares=[track])
    app.router.add_route("*", PEER_PREFIX + "/{node}/{port}/{path:.*}", hop)
    return app


def peer_guard(tls: ssl.SSLContext | None = None) -> ConnectionGuard:
    return ConnectionGuard(
        tls=tls,
        max_connections=PEER_MAX_CONNECTIONS,
        header_timeout=PEER_HEADER_TIMEOUT_SECONDS,
        name="peer",
        settings=("PEER_MAX_CONNECTIONS", "PEER_HEADER_TIMEOUT_SECONDS"),
    )


async def start_peer_listener(
    relay: Relay, token: str, host: str, port: int, *, tls: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, ConnectionGuard, int]:
    """The guarded peer listener, started: its runner (cleanup() stops it), its guard
    (stats), and the port it bound. ``tls``: the listener's context (https)."""
    guard = peer_guard(tls)
    runner = web.AppRunner(
        peer_app(relay, token, guard), access_log=None, keepalive_timeout=PEER_IDLE_SECONDS
    )
    await runner.setup()
    site = GuardedSite(runner, host, port, guard, listener=("peers", "cluster.peer_listen"))
    try:
        await site.start()
    except BaseException:  # ListenError: the address cannot be bound
        await runner.cleanup()
        raise
    return runner, guard, site.port
