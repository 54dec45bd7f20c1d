"""The agent's local HTTP endpoints: ``/metrics``, ``/v1/collect``, ``/healthz``.

Handlers only read the latest published snapshot; they never call NVML, so a slow or
hung GPU cannot make a scrape hang. Rendered bodies are cached per snapshot.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
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


def make_app(published: LatestSnapshot) -> web.Application:
    app = web.Application()
    app[LATEST] = published
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/collect", bie_collect)
    app.router.add_get("/healthz", healthz)
    return app


async def start(published: LatestSnapshot, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (for cleanup) and the bound port (port 0 works)."""
    runner = web.AppRunner(make_app(published), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
