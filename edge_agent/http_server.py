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
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from gpurelay.bie import collect_document
from gpurelay.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    render_openmetrics,
    render_text,
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


LATEST: web.AppKey[LatestSnapshot] = web.AppKey("latest", LatestSnapshot)
BASIC: web.AppKey[BasicAuth] = web.AppKey("basic_auth", BasicAuth)
HEALTH_PATHS = ("/healthz", "/health")  # /health: dcgm-exporter's name for the same probe
OPEN_PATHS = frozenset(HEALTH_PATHS)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _not_ready() -> web.Response:
    return web.Response(status=503, text="no collection has completed yet\n")


async def metrics(request: web.Request) -> web.Response:
    pub = request.app[LATEST]
    if pub.snapshot is None:
        return _not_ready()
    om = wants_openmetrics(request.headers.get("Accept", ""))
    gz = "gzip" in request.headers.get("Accept-Encoding", "")
    headers = {"Content-Type": OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE}
    if gz:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=pub.body(om, gz), headers=headers)


async def bie_collect(request: web.Request) -> web.Response:
    pub = request.app[LATEST]
    if pub.snapshot is None:
        return _not_ready()
    doc = collect_document(pub.snapshot.node, pub.snapshot.gpus)
    return web.json_response(doc, dumps=json.dumps)


async def healthz(request: web.Request) -> web.Response:
    pub = request.app[LATEST]
    if pub.snapshot is None:
        return _not_ready()
    age = pub.clock() - pub.snapshot.timestamp
    if age > pub.max_age:
        return web.Response(status=503, text=f"last collection was {age:.0f}s ago\n")
    return web.Response(text=f"ok: node {pub.snapshot.node}, last collection {age:.1f}s ago\n")


@web.middleware
async def basic_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every path but OPEN_PATHS needs a user of ``basic_auth_users``: 401 otherwise."""
    users = request.app.get(BASIC)
    if users is None or request.path in OPEN_PATHS:
        return await handler(request)
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    pair = parse_basic(value) if scheme.lower() == "basic" else None
    if pair is None or not await users.verify(*pair):
        return web.Response(
            status=401,
            text="basic auth required: wrong or missing user name or password\n",
            headers={"WWW-Authenticate": BASIC_CHALLENGE},
        )
    return await handler(request)


def make_app(published: LatestSnapshot, users: BasicAuth | None = None) -> web.Application:
    app = web.Application(middlewares=[basic_auth] if users else [])
    app[LATEST] = published
    if users:
        app[BASIC] = users
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/collect", bie_collect)
    for path in HEALTH_PATHS:
        app.router.add_get(path, healthz)
    return app


@dataclass(frozen=True)
class Listening:
    runner: web.AppRunner
    port: int  # the configured listener's bound port (TLS when the web config says so)
    # Where the tunnel reaches the exporter: ``port`` itself, or with a web config a plain
    # listener on 127.0.0.1 without basic auth (its own runner): the gateway has already
    # checked the scraper's credentials, SSH encrypts the path, and the gateway's proxy
    # speaks plain HTTP and passes no credentials on.
    local_port: int
    tunnel_runner: web.AppRunner | None = None

    async def close(self) -> None:
        if self.tunnel_runner is not None:
            await self.tunnel_runner.cleanup()
        await self.runner.cleanup()


async def _site(runner: web.AppRunner, host: str, port: int, ctx: ssl.SSLContext | None) -> int:
    site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ctx)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else port


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
    runner = web.AppRunner(make_app(published, users or None), access_log=None)
    await runner.setup()
    bound = await _site(runner, host, port, context)
    if web_config is None or not tunnel:
        return Listening(runner, bound, bound)
    plain = web.AppRunner(make_app(published), access_log=None)
    await plain.setup()
    local = await _site(plain, "127.0.0.1", 0, None)
    return Listening(runner, bound, local, plain)


async def start(published: LatestSnapshot, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving plain HTTP; returns the runner (for cleanup) and the bound port."""
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
