"""What the gateway's HTTP handlers share: :class:`HttpState` (on the aiohttp app under
:data:`STATE`), the JSON error body, and the route label of a request."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable

from aiohttp import web

from cloud_gateway.cluster.link import DirectoryLink
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.models import ErrorBody
from cloud_gateway.http.ui.history import RecentValues
from cloud_gateway.listener import ConnectionGuard
from cloud_gateway.registry.store import Registry
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.relay.relay import Relay
from cloud_gateway.trust.cert_expiry import CertificateExpiry
from gpurelay.web_config import BasicAuth

OTHER = "other"  # the endpoint label of every path that matched no route


@dataclasses.dataclass
class HttpState:
    registry: Registry
    exposition: Exposition
    tokens: frozenset[str]
    protect_metrics: bool = False
    clock: Callable[[], float] = time.time
    ready: bool = False
    requests: dict[str, int] = dataclasses.field(default_factory=dict)
    endpoints: EndpointTable = dataclasses.field(default_factory=EndpointTable)
    relay: Relay | None = None
    # None: same tokens as /api; () with protect_*=False: open.
    proxy_tokens: frozenset[str] | None = None
    sd_tokens: frozenset[str] | None = None
    protect_proxy: bool = True
    protect_sd: bool = True
    connections: ConnectionGuard | None = None  # the listener's, when it has one
    basic_auth: BasicAuth | None = None  # basic_auth_users of http.web_config_file
    auth_failures: Counter[str] = dataclasses.field(default_factory=Counter)
    directory: DirectoryLink | None = None  # the fleet beyond this gateway's registry
    certificates: CertificateExpiry = dataclasses.field(default_factory=CertificateExpiry)
    history: RecentValues = dataclasses.field(default_factory=RecentValues)  # /ui's charts


STATE: web.AppKey[HttpState] = web.AppKey("state", HttpState)


def error_response(status: int, message: str, **headers: str) -> web.Response:
    body: ErrorBody = {"error": message}
    return web.json_response(body, status=status, headers=headers)


def route_template(request: web.Request) -> str:
    """The route a request matched, as its template (``/api/v1/nodes/{node}``), or
    ``other``: a label value from a fixed set, whatever path a client sends."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else OTHER
