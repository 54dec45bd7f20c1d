"""The gateway's HTTP side: unified ``/metrics``, BIE ``/v1/collect``, the operator API.

``/api/*`` needs a bearer token from the config (401 without one, 403 with a wrong one,
each with a one-line JSON body). With no token configured the API stays closed and says
how to open it. ``/metrics`` and ``/v1/collect`` are open unless ``http.protect_metrics``.

Basic auth (``basic_auth_users`` of ``http.web_config_file``) is let in wherever a token
is; a wrong password or unknown user is a 401 with ``WWW-Authenticate: Basic``. The
forward proxy also takes the token as the Basic password of ``Proxy-Authorization``
(``proxy_url: http://prometheus:TOKEN@gateway:9410``). Refusals are counted by reason.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload
from yarl import URL

from cloud_gateway.exposition.body import Body
from cloud_gateway.exposition.shards import ShardError, parse_shard
from cloud_gateway.http.auth import AUTH_FAILURE_REASONS, authorised, page_authorised
from cloud_gateway.http.bie import bie_document
from cloud_gateway.http.fleet_documents import (
    entry_document,
    gateway_document,
    metrics_targets,
    sd_groups_elsewhere,
)
from cloud_gateway.http.models import (
    Gateway,
    GatewayList,
    NodeDetail,
    NodeList,
    NodeSummary,
    TargetGroup,
    gpu,
)
from cloud_gateway.http.openapi import document
from cloud_gateway.http.state import OTHER, STATE, HttpState, error_response, route_template
from cloud_gateway.http.ui import pages as ui
from cloud_gateway.listener import CLOSE_REASONS, ConnectionStats
from cloud_gateway.metrics import FamilySamples, fixed, one
from cloud_gateway.registry.store import NodeView
from cloud_gateway.registry.types import NODE_STATES
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.trust.cert_expiry import CertificateExpiry
from gpurelay.exposition import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    wants_gzip,
    wants_openmetrics,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("cloud_gateway.http")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if _is_absolute_form(request):  # forward-proxy form: GET http://NODE:PORT/...
        return await forward_proxy(request)
    path = request.path
    endpoint = route_template(request)
    state.requests[endpoint] = state.requests.get(endpoint, 0) + 1
    refusal = None
    if path in ("/api/v1/sd", "/api/v1/sd/metrics"):
        if state.protect_sd:
            tokens = state.tokens if state.sd_tokens is None else state.sd_tokens
            refusal = await authorised(
                request, tokens, what="service discovery", setting="http.sd_tokens or http.tokens"
            )
    elif path.startswith("/proxy/"):
        if state.protect_proxy:
            tokens = state.tokens if state.proxy_tokens is None else state.proxy_tokens
            refusal = await authorised(
                request, tokens, what="the proxy", setting="http.proxy_tokens or http.tokens"
            )
    elif path == "/ui" or path.startswith("/ui/"):
        refusal = await page_authorised(request, state.tokens)
    elif path.startswith("/api/") or (
        state.protect_metrics and path in ("/metrics", "/v1/collect")
    ):
        refusal = await authorised(request, state.tokens)
    if refusal is not None:
        return refusal
    return await handler(request)


@web.middleware
async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tells the listener's guard that this connection has a request in flight."""
    guard = request.app[STATE].connections
    if guard is None:
        return await handler(request)
    with guard.request(request.transport):
        return await handler(request)


def _is_absolute_form(request: web.Request) -> bool:
    """True for a proxy request line (``GET http://host:port/path``); aiohttp keeps the
    request target as sent in ``raw_path``."""
    target = request.raw_path
    return target.startswith(("http://", "https://")) or request.method == "CONNECT"


async def forward_proxy(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.requests["proxy"] = state.requests.get("proxy", 0) + 1
    url = URL(request.raw_path)
    if state.protect_proxy:
        tokens = state.tokens if state.proxy_tokens is None else state.proxy_tokens
        refusal = await authorised(
            request,
            tokens,
            what="the proxy",
            proxy=True,
            setting="http.proxy_tokens or http.tokens",
        )
        if refusal is not None:
            return refusal
    if request.method == "CONNECT" or url.scheme != "http" or not url.host:
        what = "CONNECT (https)" if request.method == "CONNECT" else repr(request.raw_path[:80])
        return web.Response(
            status=400, text=f"only plain http://NODE:PORT/ URLs are proxied, not {what}\n"
        )
    assert state.relay is not None
    return await state.relay.relay(request, url.host, url.port or 80, url.raw_path_qs)


async def path_proxy(request: web.Request) -> web.StreamResponse:
    proxy = request.app[STATE].relay
    assert proxy is not None
    return await proxy.relay_path_form(request)


async def service_discovery(request: web.Request) -> web.Response:
    """Prometheus http_sd: one target group per published endpoint of every online node."""
    state = request.app[STATE]
    now = state.clock()
    groups: list[TargetGroup] = []
    for view in state.registry.nodes(now):
        if view.state == "offline":
            continue
        for endpoint in state.endpoints.published_via(view.name):
            groups.append(
                {
                    "targets": [endpoint.target],
                    "labels": {
                        "node": endpoint.name,
                        "via": view.name,
                        "domain": view.domain or view.name,
                        "agent_version": view.agent_version,
                        "gpu_count": str(len(view.gpus)) if endpoint.name == view.name else "0",
                    },
                }
            )
    if state.directory is not None:
        groups += sd_groups_elsewhere(state.directory.elsewhere())
    groups.sort(key=lambda g: g["targets"][0])
    return web.json_response(groups)


async def metrics_discovery(request: web.Request) -> web.Response:
    """Prometheus http_sd of the gateways' own /metrics: ``?shards=N`` targets per live
    gateway (this one alone without a cluster), each scraping ``/metrics?shard=K&shards=N``."""
    state = request.app[STATE]
    try:
        shards = parse_shard({"shard": "0", "shards": request.query.get("shards", "1")})
    except ShardError as exc:
        return error_response(400, str(exc))
    assert shards is not None
    link = state.directory
    gateways = link.http_targets() if link is not None else []
    if not gateways:
        gateways = [(link.gateway if link is not None else "", request.host)]
    tls = state.connections is not None and state.connections.tls is not None
    scheme = "https" if tls else "http"
    return web.json_response(metrics_targets(gateways, shards[1], scheme=scheme))


class ChunksPayload(Payload):
    """A :class:`~cloud_gateway.exposition.body.Body` sent as it is kept: its shared chunks
    (gzip members when compressed) written one after another under one Content-Length,
    never joined into one copy of the body."""

    def __init__(self, body: Body, content_type: str) -> None:
        super().__init__(body, content_type=content_type)
        self._size = body.size
        self._chunks = body.chunks

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._chunks).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for chunk in self._chunks:
            await writer.write(chunk)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    om = wants_openmetrics(request.headers.get("Accept", ""))
    gz = wants_gzip(request.headers.get("Accept-Encoding", ""))
    if "shard" in request.query or "shards" in request.query:
        try:
            shard = parse_shard(request.query)
        except ShardError as exc:
            return error_response(400, str(exc))
        assert shard is not None
        body = await state.exposition.scrape_shard_async(*shard, openmetrics=om, gzip=gz)
    else:
        body = await state.exposition.scrape_async(openmetrics=om, gzip=gz)
    content_type = OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE
    headers = {"Content-Type": content_type, "Content-Length": str(body.size)}
    if gz:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=ChunksPayload(body, content_type), headers=headers)


async def bie_collect(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(bie_document(state.registry, state.clock()))


def node_document(
    view: NodeView,
    now: float,
    endpoints: EndpointTable | None = None,
    certificates: CertificateExpiry | None = None,
) -> NodeSummary:
    published = endpoints.published_via(view.name) if endpoints is not None else []
    expires, serial = certificates.of(view.name) if certificates else (None, None)
    return {
        "published": [e.target for e in published],
        "name": view.name,
        "state": view.state,
        "domain": view.domain or view.name,
        "gpu_count": len(view.gpus),
        "gpu_models": sorted({g.name for g in view.gpus}),
        "agent_version": view.agent_version,
        "backend": view.backend,
        "remote": view.remote,
        "connected_since": view.connected_since,
        "last_seen": view.last_seen,
        "last_seen_seconds_ago": None if view.last_seen is None else round(now - view.last_seen, 3),
        "last_batch_time": view.last_batch_time,
        "interval_seconds": view.interval_seconds,
        "series": view.series_count,
        "batches_received": view.batches_received,
        "bytes_received": view.bytes_received,
        "duplicate_batches": view.duplicates,
        "replayed_batches": view.replays_received,
        "connection_conflicts": view.connection_conflicts,
        "certificate_serial": serial,
        "certificate_expires": expires,
    }


def node_detail(
    view: NodeView, now: float, endpoints: EndpointTable, certificates: CertificateExpiry
) -> NodeDetail:
    return {
        **node_document(view, now, endpoints, certificates),
        "gpus": [gpu(g) for g in view.gpus],
        "recent_errors": [{"time": e.time, "message": e.message} for e in view.recent_errors],
        "last_disconnect_reason": view.last_disconnect_reason,
    }


async def list_nodes(request: web.Request) -> web.Response:
    state = request.app[STATE]
    wanted = request.query.get("state")
    if wanted is not None and wanted not in NODE_STATES:
        return error_response(400, f"state must be one of {', '.join(NODE_STATES)}, not {wanted!r}")
    domain = request.query.get("domain")
    now = state.clock()
    views = state.registry.nodes(now, state=wanted)
    if domain:
        views = [v for v in views if (v.domain or v.name) == domain]
    nodes = [node_document(v, now, state.endpoints, state.certificates) for v in views]
    link = state.directory
    if link is not None:
        clustered = link.cluster is not None  # one gateway names no owner
        for doc in nodes if clustered else ():
            doc["gateway"] = link.gateway
        for entry, owner in link.elsewhere():
            doc = entry_document(entry, owner, now, clustered=clustered)
            if (wanted is None or doc["state"] == wanted) and (
                not domain or doc["domain"] == domain
            ):
                nodes.append(doc)
    body: NodeList = {"now": now, "nodes": nodes}
    return web.json_response(body)


async def get_node(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["node"]
    now = state.clock()
    view = state.registry.node(name, now=now)
    link = state.directory
    clustered = link is not None and link.cluster is not None  # one gateway names no owner
    if view is None:
        for entry, owner in link.elsewhere() if link is not None else ():
            if entry.node == name:
                detail: NodeDetail = {
                    **entry_document(entry, owner, now, clustered=clustered),
                    "gpus": [gpu(g) for g in entry.facts.gpus],
                    "recent_errors": [],  # known on the owner only
                }
                return web.json_response(detail)
        return error_response(404, f"unknown node {name!r}")
    doc = node_detail(view, now, state.endpoints, state.certificates)
    if link is not None and clustered:
        doc["gateway"] = link.gateway
    return web.json_response(doc)


async def list_gateways(request: web.Request) -> web.Response:
    """The cluster's gateways (one gateway: itself alone)."""
    state = request.app[STATE]
    link = state.directory
    members = link.members() if link is not None else []
    if link is None or not members:
        me = link.gateway if link is not None else ""
        nodes = sum(1 for v in state.registry.nodes(state.clock()) if v.state != "offline")
        alone: Gateway = {
            "id": me,
            "advertise": "",
            "alive": True,
            "this": True,
            "heartbeat_age_seconds": 0.0,
            "up_seconds": None,
            "nodes": nodes,
        }
        gateways = [alone]
    else:
        gateways = [gateway_document(m, link.cfg.ttl_seconds, link.gateway) for m in members]
    body: GatewayList = {"gateways": gateways}
    return web.json_response(body)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.ready:
        return web.Response(status=503, text="not ready: starting or shutting down\n")
    cluster = state.directory.cluster if state.directory is not None else None
    if cluster is not None and cluster.fenced:  # the balancer must not send agents here
        return web.Response(status=503, text="not ready: fenced, the node directory is lost\n")
    return web.Response(text="ready\n")


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())


async def ui_fleet(request: web.Request) -> web.Response:
    return ui.fleet_page(request.app[STATE], request)


async def ui_node(request: web.Request) -> web.Response:
    return ui.node_page(request.app[STATE], request)


# Values of gpurelay_gateway_http_requests_total{endpoint}: make_app's route templates,
# "proxy" for the forward-proxy form, OTHER for paths that matched no route.
ENDPOINTS = (
    "/metrics",
    "/v1/collect",
    "/api/v1/nodes",
    "/api/v1/nodes/{node}",
    "/api/v1/gateways",
    "/healthz",
    "/health",
    "/readyz",
    "/openapi.json",
    "/api/v1/sd",
    "/api/v1/sd/metrics",
    "/proxy/{node}/{port}/{path}",
    "/ui",
    "/ui/nodes/{node}",
    "proxy",
    OTHER,
)


def families(state: HttpState, connections: ConnectionStats) -> list[FamilySamples]:
    """The HTTP port's own metrics: requests by route, refused credentials, connections."""
    return [
        fixed("gpurelay_gateway_http_requests_total", "endpoint", state.requests, ENDPOINTS),
        one("gpurelay_gateway_http_connections", connections.open),
        fixed(
            "gpurelay_gateway_http_connections_closed_total",
            "reason",
            connections.closed,
            CLOSE_REASONS,
            zeros=True,
        ),
        fixed(
            "gpurelay_gateway_http_auth_failures_total",
            "reason",
            state.auth_failures,
            AUTH_FAILURE_REASONS,
            zeros=True,
        ),
        one(
            "gpurelay_gateway_http_tls_handshake_failures_total", connections.tls_handshake_failures
        ),
    ]


def make_app(state: HttpState) -> web.Application:
    app = web.Application(middlewares=[track_requests, auth_middleware])
    app[STATE] = state
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/collect", bie_collect)
    app.router.add_get("/api/v1/nodes", list_nodes)
    app.router.add_get("/api/v1/nodes/{node}", get_node)
    app.router.add_get("/api/v1/gateways", list_gateways)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)  # dcgm-exporter's name for the same probe
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/api/v1/sd", service_discovery)
    app.router.add_get("/api/v1/sd/metrics", metrics_discovery)
    app.router.add_route("*", "/proxy/{node}/{port}/{path:.*}", path_proxy)
    app.router.add_get("/ui", ui_fleet)  # HTML for people (text/html in /openapi.json)
    app.router.add_get("/ui/nodes/{node}", ui_node)
    return app
