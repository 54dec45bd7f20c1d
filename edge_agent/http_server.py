"""The agent's local HTTP endpoints: ``/metrics``, ``/v1/collect``, ``/healthz`` (and
``/health``, its alias for probes written for dcgm-exporter).

Handlers only read the latest published snapshot; they never call NVML, so a slow or
hung GPU cannot make a scrape hang. Rendered bodies are cached per snapshot.

With ``web_config_file`` (the Prometheus web-config file, :mod:`gpurelay.web_config`) the
listener speaks TLS and/or asks for basic auth on every path but the probes (kubelet), as
node_exporter does. The tunnel then reaches the exporter on a second, plain listener on
loopback without basic auth (see :class:`Listening`).
"""

from __future__ import annotations

import gzip
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge_agent.httpd import Handler, HttpServer, Request, Response
from gpurelay.bie import collect_document
from gpurelay.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    render_openmetrics,
    render_text,
    wants_gzip,
    wants_openmetrics,
)
from gpurelay.model import Snapshot
from gpurelay.web_config import BASIC_CHALLENGE, BasicAuth, WebConfig, parse_basic


@dataclass
class LatestSnapshot:
    """The latest snapshot and bodies rendered from it (built once, served many times)."""

    snapshot: Snapshot | None = None
    max_age: float = 30.0
    clock: Callable[[], float] = time.time
    _bodies: dict[tuple[bool, bool], bytes] = field(default_factory=dict)

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._bodies = {}

    def body(self, openmetrics: bool, gzipped: bool) -> bytes:
        key = (openmetrics, gzipped)
        cached = self._bodies.get(key)
        if cached is None:
            assert self.snapshot is not None
            if gzipped:
                cached = gzip.compress(self.body(openmetrics, False), compresslevel=5)
            elif openmetrics:
                cached = render_openmetrics(self.snapshot)
            else:
                cached = render_text(self.snapshot)
            self._bodies[key] = cached
        return cached


HEALTH_PATHS = ("/healthz", "/health")  # /health: dcgm-exporter's name for the same probe
OPEN_PATHS = frozenset(HEALTH_PATHS)


def _not_ready() -> Response:
    return Response.text("no collection has completed yet\n", 503)


def make_app(published: LatestSnapshot, users: BasicAuth | None = None) -> HttpServer:
    """The endpoints over ``published``; with ``users``, basic auth on all but the probes."""

    async def metrics(request: Request) -> Response:
        if published.snapshot is None:
            return _not_ready()
        om = wants_openmetrics(request.header("Accept"))
        gz = wants_gzip(request.header("Accept-Encoding"))
        headers = {"Content-Type": OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE}
        if gz:
            headers["Content-Encoding"] = "gzip"
        return Response(200, published.body(om, gz), headers)

    async def bie_collect(_request: Request) -> Response:
        if published.snapshot is None:
            return _not_ready()
        doc = collect_document(published.snapshot.node, published.snapshot.gpus)
        return Response(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    async def healthz(_request: Request) -> Response:
        if published.snapshot is None:
            return _not_ready()
        age = published.clock() - published.snapshot.timestamp
        if age > published.max_age:
            return Response.text(f"last collection was {age:.0f}s ago\n", 503)
        return Response.text(
            f"ok: node {published.snapshot.node}, last collection {age:.1f}s ago\n"
        )

    async def basic_auth(request: Request, handler: Handler) -> Response:
        """Every path but OPEN_PATHS needs a user of ``basic_auth_users``: 401 otherwise."""
        assert users is not None
        if request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, value = request.header("Authorization").partition(" ")
        # a header value is Latin-1: parse_basic's base64 decoder raises on what is not ASCII
        pair = parse_basic(value) if scheme.lower() == "basic" and value.isascii() else None
        if pair is None or not await users.verify(*pair, source=request.peer or None):
            return Response.text(
                "basic auth required: wrong or missing user name or password\n",
                401,
                **{"WWW-Authenticate": BASIC_CHALLENGE},
            )
        return await handler(request)

    routes: dict[str, Handler] = {"/metrics": metrics, "/v1/collect": bie_collect}
    routes.update({path: healthz for path in HEALTH_PATHS})
    return HttpServer(routes, guard=basic_auth if users else None)


@dataclass(frozen=True)
class Listening:
    runner: HttpServer
    port: int  # the configured listener's bound port (TLS when the web config says so)
    # Where the tunnel reaches the exporter: ``port`` itself, or with a web config a plain
    # listener on 127.0.0.1 without basic auth (its own server): the gateway has already
    # checked the scraper's credentials, SSH encrypts the path, and the gateway's proxy
    # speaks plain HTTP and passes no credentials on.
    local_port: int
    tunnel_runner: HttpServer | None = None

    async def close(self) -> None:
        if self.tunnel_runner is not None:
            await self.tunnel_runner.cleanup()
        await self.runner.cleanup()


async def serve(
    published: LatestSnapshot,
    host: str,
    port: int,
    *,
    web_config: WebConfig | None = None,
    tunnel: bool = False,
) -> Listening:
    """Start serving (port 0 works); with a web config and ``tunnel``, also the plain
    loopback listener the tunnel uses (see :class:`Listening`)."""
    users = BasicAuth(web_config.basic_auth_users) if web_config else None
    context = web_config.ssl_context() if web_config else None
    server = make_app(published, users or None)
    bound = await server.start(host, port, context)
    if web_config is None or not tunnel:
        return Listening(server, bound, bound)
    plain = make_app(published)
    local = await plain.start("127.0.0.1", 0, None)
    return Listening(server, bound, local, plain)


async def start(published: LatestSnapshot, host: str, port: int) -> tuple[HttpServer, int]:
    """Start serving plain HTTP; returns the server (for cleanup) and the bound port."""
    listening = await serve(published, host, port)
    return listening.runner, listening.port


def listener_warning(host: str, *, tls: bool) -> str | None:
    """The startup warning for a listener beyond loopback without TLS, else None."""
    if tls:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (
        f"listen = {host!r} is not loopback and no TLS is configured: /metrics goes over "
        "the network in clear text to anyone who can reach it. Set web_config_file to a "
        "Prometheus web-config file with tls_server_config (and basic_auth_users), or "
        "listen on 127.0.0.1 and let Prometheus scrape through the gateway"
    )
