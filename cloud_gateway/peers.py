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
  status and headers. Errors name the node and the gateway: 502 when the owner cannot be
  reached, 504 when it does not answer in time."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from cloud_gateway.proxy import Proxy

PEER_PREFIX = "/peer/v1/proxy"
CHUNK = 64 * 1024
# Not passed on in either direction: hop-by-hop, and what only concerns one side.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authorization", "Proxy-Connection", "Authorization",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip

Route = Callable[[str], "tuple[str, str] | None"]  # node -> (gateway id, host:port) or None


class PeerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeerClient:
    def __init__(self, token: str, route: Route) -> None:
        self.token = token
        self.route = route
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
            self._session = aiohttp.ClientSession(auto_decompress=False)
        url = f"http://{address}{PEER_PREFIX}/{node}/{port}{path_qs}"
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
                    request.method, url, headers=headers, data=body, allow_redirects=False
                ) as upstream:
                    response.set_status(upstream.status, upstream.reason)
                    for name, value in upstream.headers.items():
                        if name.lower() not in _HOP:
                            response.headers.add(name, value)
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


def peer_app(proxy: Proxy, token: str) -> web.Application:
    """The peer listener's application: the one route, behind the shared token."""

    async def relay(request: web.Request) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), token.encode()
        ):
            return web.Response(status=401, text="peer token missing or wrong\n")
        return await proxy.relay_path_form(request, hop=False)  # one hop, never two

    app = web.Application()
    app.router.add_route("*", PEER_PREFIX + "/{node}/{port}/{path:.*}", relay)
    return app
